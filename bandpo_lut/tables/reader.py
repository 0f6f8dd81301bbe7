"""Pure-PyTorch reader of the bound tables: `bounds(p_old, delta, divergence) -> (lower, upper)`.

This is the independent implementation the compiled kernels are tested against, so it favours clarity
over speed: everything is evaluated in float64 on the input's device, following only what the table's
header describes:

1. t = logit(p) and s = log δ; inside the grid, a tensor-product cubic B-spline gives the stored values
   (q_up = p·r_up, and κ = -p·ln(r_lo)/δ or q_lo = p·r_lo);
2. the exact saturation tests pick 1/p and 0 where the whole simplex edge fits in the region, so the
   tabulated continued roots never smear the kinks;
3. beyond the grid in t: the upper bound for p > sigmoid(t_max) and the lower bound for
   p < sigmoid(t_min) are at their simplex limits to float64 precision (checked by the generator);
   the upper bound for small p and the lower bound for p near 1 come from the closed form where the
   divergence has one, else from Newton steps on the exact equation started at the p → 0 / p → 1 limit;
4. the header's Newton refinement steps (for divergences whose lower bound crosses zero at saturation)
   are applied to the exact equation in q.

NaN in gives NaN out; a tensor δ outside the table's range gives NaN (a Python-number δ raises); whether a tensor
δ's entry is inside is decided in its own dtype (an entry that rounds across a range end there is that end).
A log-probability in (0, LOG_PROB_ROUNDING] is rounding and reads as 0 (p = 1); above it, NaN.
"""
from __future__ import annotations

import math

import torch

from bandpo_lut.tables import divergences as _div
from bandpo_lut.tables import store as _tables

_NEWTON_TAIL_STEPS = 4

# A log-probability a hair above 0 comes from rounding (a log-softmax of large logits, bfloat16 storage,
# an inference engine's arithmetic) and means p = 1: every value in (0, 2^-9] has exp(x) round to 1 in
# bfloat16. Above 2^-9 it is not a log-probability: NaN. The compiled kernels apply the same rule
# (csrc/bandpo_math.h, kLogProbRounding); 2^-9 is exact in every floating dtype.
LOG_PROB_ROUNDING = 2.0 ** -9


def _spline_eval(coef: torch.Tensor, ax_t, ax_s, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Tensor-product uniform cubic B-spline at (t, s), both already inside the grid."""
    def cell(ax, x):
        xf = (x - ax.min) / ax.step
        i = torch.clamp(torch.floor(xf), 0, ax.n - 2)
        u = xf - i
        w = torch.stack([(1 - u) ** 3, 3 * u ** 3 - 6 * u ** 2 + 4, -3 * u ** 3 + 3 * u ** 2 + 3 * u + 1, u ** 3]) / 6
        return i.long(), w

    it, wt = cell(ax_t, t)
    js, ws = cell(ax_s, s)
    ncols = coef.shape[1]
    flat = coef.reshape(-1)
    out = torch.zeros_like(t)
    for a in range(4):
        for b in range(4):
            out = out + wt[a] * ws[b] * flat[(it + a) * ncols + (js + b)]
    return out


def _newton_q(div, p, omp, q, delta, steps, lo, hi):
    """Newton steps in q on D_f(Bern(q)‖Bern(p)) = δ, kept inside [lo, hi]."""
    m = _div.torch_math()
    for _ in range(steps):
        g = div.g(p, omp, q, m) - delta
        dg = div.dg_dq(p, omp, q, m)
        step = torch.where(torch.isfinite(g) & torch.isfinite(dg) & (dg != 0), g / dg, torch.zeros_like(q))
        q = torch.minimum(torch.maximum(q - step, lo), hi)
    return q


def _as_tensor_delta(delta, like: torch.Tensor, table) -> torch.Tensor:
    if isinstance(delta, torch.Tensor):
        if delta.is_complex() or not delta.is_floating_point():
            raise TypeError(f"delta: expected a floating tensor, got {delta.dtype}")
        # The range is decided in δ's own dtype, against the ends as that dtype rounds them: an entry that rounds
        # across an end (bfloat16's 9.995e-4 for 1e-3) is that end; the δ read is then moved onto the range.
        ends = torch.tensor([table.delta_min, table.delta_max], dtype=torch.float64).to(delta.dtype)
        inside = (delta >= ends[0]) & ((delta <= ends[1]) if table.delta_max_inclusive else (delta < ends[1]))
        d = delta.to(dtype=torch.float64).clamp(table.delta_min, table.delta_max)
        return torch.where(inside, d, torch.full_like(d, math.nan)).to(like.device)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise TypeError(f"delta: expected a Python number or a tensor, got {type(delta).__name__}")
    table.check_delta(float(delta))
    return torch.tensor(float(delta), dtype=torch.float64, device=like.device)


@torch.no_grad()
def bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, table=None):
    """Ratio bounds (lower, upper) of the band for old probabilities `p_old` (or `log_p_old`).

    Args:
        p_old: tensor of probabilities in [0, 1] (float32 or float64, any device).
        delta: trust-region radius, a Python number or a tensor broadcastable to p_old.
        divergence: registry name ("kl", "tv", "chi2", ... see `bandpo_lut.tables.divergences.names()`).
        log_p_old: alternatively, log-probabilities (≤ 0, or ≤ LOG_PROB_ROUNDING, read as 0); keeps full
            accuracy for p near 1.
        table: a `bandpo_lut.tables.store.Table` to read instead of the shipped one.
    Returns:
        (lower, upper) in the input's dtype, broadcast to the common shape. p = 0 gives (0, inf).
    """
    if (p_old is None) == (log_p_old is None):
        raise ValueError("p_old / log_p_old: give exactly one of them")
    x = p_old if p_old is not None else log_p_old
    arg = "p_old" if p_old is not None else "log_p_old"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg}: expected a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{arg}: expected float32 or float64, got {x.dtype}")
    div = _div.get(divergence)
    table = table or _tables.get(divergence)
    if table.divergence is not div:
        raise ValueError(f"table: it is for {table.divergence.name!r}, not {divergence!r}")
    out_dtype = x.dtype
    x64 = x.to(torch.float64)
    d = _as_tensor_delta(delta, x64, table)
    if p_old is not None:
        p = x64
        omp = 1 - p
    else:
        x64 = torch.where((x64 > 0) & (x64 <= LOG_PROB_ROUNDING), torch.zeros_like(x64), x64)
        p = torch.exp(x64)
        omp = -torch.expm1(x64)
    p, omp, d = torch.broadcast_tensors(p, omp, d)
    p, omp, d = p.contiguous(), omp.contiguous(), d.contiguous()
    bad = torch.isnan(p) | torch.isnan(d) | (p < 0) | (p > 1)
    # Placeholders where the input is invalid, so that no index is computed from NaN; restored at the end.
    p = torch.where(bad, torch.full_like(p, 0.5), p)
    omp = torch.where(bad, torch.full_like(omp, 0.5), omp)
    d = torch.where(bad, torch.full_like(d, 0.05), d)

    m = _div.torch_math()
    t = torch.log(p) - torch.log(omp)
    s = torch.log(d)
    tc = torch.clamp(t, table.t.min, table.t.max)
    sc = torch.clamp(s, table.s.min, table.s.max)
    coef = table.coefficients(p.device, torch.float64)
    q_up_tab = _spline_eval(coef[0], table.t, table.s, tc, sc)
    v_lo_tab = _spline_eval(coef[1], table.t, table.s, tc, sc)
    pol_up, pol_lo = table.polish_steps
    zero, one = torch.zeros_like(p), torch.ones_like(p)
    interior = (p > 0) & (omp > 0)
    ps = torch.where(interior, p, 0.5 * one)       # safe p, 1-p for the formulas below
    omps = torch.where(interior, omp, 0.5 * one)

    # ---- upper bound, as q = p·r ------------------------------------------------------------------
    q_up = torch.clamp(q_up_tab, min=ps, max=one)
    small = t < table.t.min
    if div.closed_form is not None:
        q_tail = div.closed_form(ps, omps, d, m)[1]
    else:
        start = div.upper_q_at_p0(d, m) if div.upper_q_at_p0 is not None else q_up
        q_tail = _newton_q(div, ps, omps, torch.where(small, start, q_up), d, _NEWTON_TAIL_STEPS, ps, one)
    q_up = torch.where(small, q_tail, q_up)
    if pol_up:
        q_up = _newton_q(div, ps, omps, q_up, d, pol_up, ps, one)
    q_up = torch.clamp(q_up, min=ps, max=one)
    # Within 1e-12 of the simplex edge (far below the table's accuracy) the bound is 1/p: without this
    # snap, float64 rounding noise of the spline (~4e-16) would make r_up jitter by 2 ulp across δ.
    q_up = torch.where(q_up > 1 - 1e-12, one, q_up)
    sat_up = (t > table.t.max) | div.upper_saturated(ps, omps, d, m) if div.f_at_zero is not None \
        else (t > table.t.max)
    upper = torch.where(sat_up, 1 / ps, q_up / ps)
    upper = torch.where(p == 0, torch.full_like(p, math.inf), upper)
    upper = torch.where(omp == 0, one, upper)

    # ---- lower bound ------------------------------------------------------------------------------
    big = t > table.t.max
    if div.lower_value == "kappa":
        lower = torch.exp(-(d / ps) * v_lo_tab)
        q_lo = lower * ps
    else:
        q_lo = torch.clamp(v_lo_tab, min=zero, max=ps)
    if div.closed_form is not None:
        q_tail = div.closed_form(ps, omps, d, m)[0]
    else:
        start = div.lower_r_at_p1(d, m) * ps
        q_tail = _newton_q(div, ps, omps, torch.where(big, start, q_lo), d, _NEWTON_TAIL_STEPS, zero, ps)
    q_lo = torch.where(big, q_tail, q_lo)
    if pol_lo:
        q_lo = torch.where(big, q_lo, _newton_q(div, ps, omps, q_lo, d, pol_lo, zero, ps))
    if div.closed_form is not None:
        # Near saturation the lower bound is tiny and a Newton step in q (absolute precision) loses its
        # relative accuracy: below r = 1e-2 the closed form, written without cancellation, is used.
        q_lo = torch.where(q_lo < 1e-2 * ps, div.closed_form(ps, omps, d, m)[0], q_lo)
    q_lo = torch.clamp(q_lo, min=zero, max=ps)
    if div.lower_value == "kappa":
        # κ keeps relative precision of tiny bounds, which q = p·r (underflowing) would lose.
        lower = torch.where(big, q_lo / ps, lower)
    else:
        lower = q_lo / ps
    if div.lower_gap is not None:
        # The sign of the gap, not the generic test: that one, p·f(0) + (1-p)·f(1/(1-p)) ≤ δ in float64,
        # rounds to "saturated" a few ulp above p* (chi2, δ = 1/3, p = 0.25 gave 0 for 2.8e-17).
        sat_lo = (t < table.t.min) | (div.lower_gap(ps, omps, d, m) <= 0)
    elif div.f_at_zero is not None:
        sat_lo = (t < table.t.min) | div.lower_saturated(ps, omps, d, m)
    else:
        sat_lo = torch.zeros_like(p, dtype=torch.bool)
    lower = torch.where(sat_lo, zero, lower)
    lower = torch.where(p == 0, zero, lower)
    lower = torch.where(omp == 0, div.lower_r_at_p1(d, m) * one, lower)

    nan = torch.full_like(p, math.nan)
    lower = torch.where(bad, nan, lower).to(out_dtype)
    upper = torch.where(bad, nan, upper).to(out_dtype)
    return lower, upper
