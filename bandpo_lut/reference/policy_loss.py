"""Pure-PyTorch reference of the BandPO policy loss, its baselines and its clip metrics.

This is the specification the fused kernels are tested against: correct and readable, not fast.

Per token t (all tensors of shape (batch, T)), with A = advantages and the log-ratio clamped as
trainers do::

    d     = clamp(log_prob - old_log_prob, -20, 20)
    r     = exp(d)                                   # the ratio pi_new / pi_old
    p     = exp(old_log_prob)                        # p_old, the token's old probability
    lo,up = the ratio bounds of `clip` at p          # see below; up is capped by max_ratio
    loss  = max(-A*r, -A*clamp(r, lo, up))           # PPO's pessimistic surrogate
    if dual_clip = c:  loss = min(loss, -A*c) where A < 0   (dual-clip PPO)

Written out, ties resolved in favour of the unclipped branch (it is the one that keeps a gradient):

    A > 0:  clipped_upper = r > up        -> loss = -A*up   (no gradient)
    A < 0:  clipped_lower = r < lo        -> loss = -A*lo   (no gradient)
            dual_clipped  = r > c         -> loss = -A*c    (no gradient; only with dual_clip)
    else:                                    loss = -A*r    (gradient -A*r w.r.t. log_prob)

(A token with A < 0 cannot be both: lo <= 1 < c.)  The gradient of the log-ratio clamp is
1 on |log_prob - old_log_prob| <= 20 and zero outside (torch.clamp's up to torch 2.13).
Gradient flows to `log_prob` only.

`clip` chooses [lo, up]:
    "band"  BandPO: `bandpo_lut.reference.bounds(log_p_old=old_log_prob, delta=delta,
            divergence=divergence)`, upper capped by max_ratio.
    "fixed" PPO [1 - eps_low, 1 + eps_high], defaults 0.2 / 0.2 (DAPO's clip-higher: 0.2 / 0.28).
    "dcpo"  DCPO: lo = 1/2 + 1/2*sqrt(max(1 - 4*eps_low/p, 0)), up = 1/2 + 1/2*sqrt(1 + 4*eps_high/p),
            defaults eps_low = 0.16, eps_high = 0.2.
max_ratio (None or >= 1) caps the upper bound for every `clip` (for "fixed" it only matters when
max_ratio < 1 + eps_high).

`mode`:
    "clip"  as above.
    "mask"  DPPO-style: every token's loss *value* is the unclipped surrogate -A*r, but the tokens that
            "clip" would clip (clipped_upper, clipped_lower, dual_clipped: outside the band in the
            unsafe direction) contribute no gradient (their surrogate is detached).  Note that the
            per-token gradient is therefore identical to mode="clip"; only the reported loss differs.

Mask and aggregation.  `mask` (None = all tokens) may be bool, integer or floating; it is cast to
the compute dtype and used as a per-token weight w, so 0/1 masks mean what they say.  Values other
than 0/1 are *not* checked (that would need a host synchronisation): they act as weights, and must
be non-negative.  Tokens with w == 0 are ignored entirely: their inputs are replaced by 0 first, so
NaN/inf padding is harmless.  With S_b = sum_t w*loss and W_b = sum_t w on row b:
    "token-mean"          sum_b S_b / sum_b W_b                 (0 when sum_b W_b == 0)
    "token-sum"           sum_b S_b
    "seq-mean-token-mean" mean over non-empty rows (W_b > 0) of S_b / W_b
    "seq-mean-token-sum"  mean over non-empty rows (W_b > 0) of S_b
and an all-empty mask gives loss 0 with a zero gradient (never NaN).

NaN in any input of a counted token gives a NaN loss; so do NaN bounds, e.g. from a per-token
delta tensor outside the table's range (the table reader returns NaN there).

Dtypes.  Arithmetic is in the compute dtype: the promotion of the three inputs' dtypes, at least
float32 (bfloat16/float16 inputs are computed in float32).  The loss and all metrics are 0-dim
tensors of the compute dtype; the gradient reaches log_prob in its own dtype.

Metrics.  A dict of 0-dim tensors (no Python floats, no host synchronisation, fixed shapes, so the
function works under torch.compile(fullgraph=True)).  All are computed without gradient.  First the
raw *counts*, sums of w over the named tokens (for a 0/1 mask: numbers of tokens), each in COUNTS:

    n_tokens                 all tokens
    n_clipped                clipped_upper or clipped_lower        (dual clipping not included)
    n_clipped_upper          A > 0 and r > up
    n_clipped_lower          A < 0 and r < lo
    n_dual_clipped           A < 0 and r > dual_clip               (0 without dual_clip)
    n_lowprob_pos            p < 0.2 and A > 0
    n_clipped_upper_lowprob  p < 0.2 and A > 0 and r > up
    ppo_kl_sum               sum of w * (-d)  (d the clamped log-ratio: old_log_prob - log_prob)
    band_width_sum           sum of w * (up - lo) over tokens with a finite up
    n_band_finite            tokens with a finite up (up = +inf only at p = 0 when max_ratio is None)
    n_tokens_pXX_YY          tokens with p in the bucket       } buckets [0, .2), [.2, .4), [.4, .6),
    n_clipped_pXX_YY         clipped tokens (as n_clipped) in it }  [.6, .8), [.8, 1] (see BUCKETS)

Then the *fractions*, each a count divided by a count (FRACTIONS; 0 when the denominator is 0):

    ppo_kl                   ppo_kl_sum              / n_tokens
    clip_frac                n_clipped               / n_tokens
    clip_frac_upper          n_clipped_upper         / n_tokens
    clip_frac_lower          n_clipped_lower         / n_tokens
    dual_clip_frac           n_dual_clipped          / n_tokens
    clip_frac_upper_lowprob  n_clipped_upper_lowprob / n_lowprob_pos   (the paper's "clip-high rate
                                                                        of low-probability tokens")
    band_width_mean          band_width_sum          / n_band_finite
    clip_frac_pXX_YY         n_clipped_pXX_YY        / n_tokens_pXX_YY

Exact global fractions over micro-batches and ranks: sum (all-reduce) each count, then call
`metrics_from_counts(summed)`.  Probability thresholds (0.2, 0.4, ...) are compared in the compute
dtype (so in float32 "0.2" is float32(0.2)).  Counts are in the compute dtype: float32 counts are
exact up to 2**24 tokens per call.
"""
from __future__ import annotations

import math

import torch

from bandpo_lut.runtime.loss_spec import (  # noqa: F401
    AGGS,
    BUCKETS,
    CLIPS,
    COUNTS,
    DEFAULT_EPS,
    FRACTIONS,
    LOG_RATIO_CLAMP,
    LOWPROB,
    MODES,
    baseline_bounds,
    metrics_from_counts,
)
from bandpo_lut.runtime.loss_spec import check_args as _check_args
from bandpo_lut.runtime.loss_spec import safe_div as _safe_div


def _band_bounds(log_p_old: torch.Tensor, delta, divergence: str):
    """BandPO's bounds from the old log-probability (full accuracy for p near 1, where float32 p
    itself cannot get closer to 1 than 6e-8); imported lazily so that this module loads without
    the table reader."""
    from bandpo_lut.reference.bounds import bounds

    return bounds(log_p_old=log_p_old, delta=delta, divergence=divergence)


# ---------------------------------------------------------------------------------------------
# the loss


def ratio_bounds(log_p_old: torch.Tensor, *, clip: str = "band", delta=0.05,
                 divergence: str = "kl", max_ratio=None, eps_low=None, eps_high=None):
    """The [lo, up] of `clip` at p_old = exp(log_p_old) (no argument checks; policy_loss does them)."""
    p_old = torch.exp(log_p_old)
    if clip == "band":
        lo, up = _band_bounds(log_p_old, delta, divergence)
        lo, up = lo.to(p_old.dtype), up.to(p_old.dtype)
    else:
        lo, up = baseline_bounds(p_old, clip, eps_low, eps_high)
    if max_ratio is not None:
        up = torch.clamp(up, max=float(max_ratio))
    return lo, up


def policy_loss(log_prob, old_log_prob, advantages, mask=None, *, delta=0.05, divergence="kl",
                max_ratio=None, dual_clip=None, agg="token-mean", clip="band", mode="clip",
                eps_low=None, eps_high=None):
    """PPO-family policy loss with BandPO's band or a baseline clip; see the module docstring.

    Returns (loss, metrics): a 0-dim loss with gradient to `log_prob` only, and a dict of 0-dim
    metric tensors (FRACTIONS and COUNTS)."""
    eps_low, eps_high = _check_args(log_prob, old_log_prob, advantages, mask, delta, divergence,
                                    max_ratio, dual_clip, agg, clip, mode, eps_low, eps_high)
    dtype = torch.promote_types(torch.promote_types(log_prob.dtype, old_log_prob.dtype),
                                advantages.dtype)
    dtype = torch.promote_types(dtype, torch.float32)
    lp = log_prob.to(dtype)
    olp = old_log_prob.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    if mask is None:
        w = torch.ones_like(lp)
    else:
        w = mask.detach().to(dtype)
        # Ignored tokens get harmless inputs, so padding garbage (NaN, inf) cannot leak into the
        # loss or, through 0 * NaN, into the gradient.
        valid = w != 0
        zero = torch.zeros_like(lp)
        lp, olp, adv = torch.where(valid, lp, zero), torch.where(valid, olp, zero), \
            torch.where(valid, adv, zero)

    # The log-ratio clamp with an inclusive gradient (1 on [-20, 20], 0 outside), written out rather than
    # left to torch.clamp's autograd, whose value at exact ties changed in torch 2.14 (0 or 1/2 there).
    raw = lp - olp
    inside = (raw >= -LOG_RATIO_CLAMP) & (raw <= LOG_RATIO_CLAMP)
    d = torch.where(inside, raw, raw.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio = torch.exp(d)
    p_old = torch.exp(olp)
    lo, up = ratio_bounds(olp, clip=clip, delta=delta, divergence=divergence,
                          max_ratio=max_ratio, eps_low=eps_low, eps_high=eps_high)

    pos, neg = adv > 0, adv < 0
    r = ratio.detach()
    clipped_upper = pos & (r > up)
    clipped_lower = neg & (r < lo)
    if dual_clip is None:
        dual_clipped = torch.zeros_like(pos)
    else:
        dual_clipped = neg & (r > dual_clip)

    surrogate = -adv * ratio
    if mode == "clip":
        per_token = torch.where(clipped_lower, -adv * lo, surrogate)
        per_token = torch.where(clipped_upper, -adv * up, per_token)
        if dual_clip is not None:
            per_token = torch.where(dual_clipped, -adv * dual_clip, per_token)
    else:  # mask: same value as unclipped, no gradient from the tokens "clip" would clip
        no_grad = clipped_upper | clipped_lower | dual_clipped
        per_token = torch.where(no_grad, surrogate.detach(), surrogate)
    # NaN bounds (a per-token delta outside the table's range) must not pass for "not clipped".
    per_token = torch.where(torch.isnan(lo) | torch.isnan(up),
                            torch.full_like(per_token, math.nan), per_token)

    # where, not w * per_token: ignored tokens contribute exactly 0 even if their bounds are NaN.
    weighted = torch.where(w != 0, w * per_token, torch.zeros_like(per_token))
    loss = _aggregate(weighted, w, agg)
    counts = _counts(w, d.detach(), p_old, adv, r, lo, up, clipped_upper, clipped_lower,
                     dual_clipped)
    return loss, metrics_from_counts(counts)


def _aggregate(weighted: torch.Tensor, w: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce w*loss (batch, T) to a 0-dim loss; empty rows/masks give 0, never NaN."""
    if agg == "token-mean":
        return _safe_div(weighted.sum(), w.sum())
    if agg == "token-sum":
        return weighted.sum()
    row_sum, row_w = weighted.sum(dim=-1), w.sum(dim=-1)
    row_loss = _safe_div(row_sum, row_w) if agg == "seq-mean-token-mean" else row_sum
    n_rows = (row_w > 0).to(w.dtype).sum()
    # Empty rows have row_loss == 0 exactly (all their weights are 0), so summing over all rows
    # and dividing by the number of non-empty ones is the mean over non-empty rows.
    return _safe_div(row_loss.sum(), n_rows)


def _counts(w, d, p_old, adv, r, lo, up, clipped_upper, clipped_lower, dual_clipped) -> dict:
    """The COUNTS as 0-dim tensors: sums of w over the named token sets."""
    w = w.detach()

    def count(sel: torch.Tensor) -> torch.Tensor:
        return torch.where(sel, w, torch.zeros_like(w)).sum()

    clipped = clipped_upper | clipped_lower
    lowprob_pos = (p_old < LOWPROB) & (adv > 0)
    finite_up = torch.isfinite(up)
    width = torch.where(finite_up, up - lo, torch.zeros_like(up))
    out = {
        "n_tokens": w.sum(),
        "n_clipped": count(clipped),
        "n_clipped_upper": count(clipped_upper),
        "n_clipped_lower": count(clipped_lower),
        "n_dual_clipped": count(dual_clipped),
        "n_lowprob_pos": count(lowprob_pos),
        "n_clipped_upper_lowprob": count(lowprob_pos & clipped_upper),
        "ppo_kl_sum": (w * -d).sum(),
        "band_width_sum": (w * width).sum(),
        "n_band_finite": count(finite_up),
    }
    for suffix, edge_lo, edge_hi in BUCKETS:
        in_bucket = p_old >= edge_lo
        if edge_hi < 1.0:
            in_bucket = in_bucket & (p_old < edge_hi)
        out[f"n_tokens_{suffix}"] = count(in_bucket)
        out[f"n_clipped_{suffix}"] = count(in_bucket & clipped)
    return out
