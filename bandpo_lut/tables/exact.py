"""The exact band: roots of g_f(p, r) = δ with mpmath, for tables and tests.

Working precision defaults to 50 significant digits (`DPS`); roots are converged to a relative
tolerance of 10^-(DPS-5). The unknown is chosen per bound so that the root is well scaled whatever p is:

* upper bound: w = logit(q), q = p·r ∈ (p, 1): finite for every divergence, including KL where q → 1
  exponentially fast as p → 1;
* lower bound: ℓ = -ln r ∈ (0, ∞): the KL lower bound is about exp(-δ/p - 1), far below any float for
  p ≪ δ, while ℓ ≈ δ/p stays representable;
* continued roots past saturation (only for divergences whose f is analytic for u < 0): q itself.

Saturation is decided with the exact tests of `Divergence.upper_saturated` / `lower_saturated`.
"""
from __future__ import annotations

import mpmath

from bandpo_lut.tables import divergences as _div

DPS = 50
MP = _div.MP


def _bracketed_root(h, a, b, ha, hb, rtol):
    """Root of h in [a, b] with a sign change, by Ridders' method.

    Each iteration at least halves the bracket (so a bracket spanning hundreds of orders of magnitude
    in h, as for χ² at p = 1e-300, still converges) and converges quadratically near the root.
    """
    if ha == 0:
        return a
    if hb == 0:
        return b
    x_prev = None
    for _ in range(300):
        m = (a + b) / 2
        hm = h(m)
        s = mpmath.sqrt(hm * hm - ha * hb)
        if s == 0:
            return m
        x = m + (m - a) * (1 if ha > hb else -1) * hm / s
        hx = h(x)
        if hx == 0:
            return x
        if (hm < 0) != (hx < 0):
            a, ha, b, hb = m, hm, x, hx
        elif (ha < 0) != (hx < 0):
            b, hb = x, hx
        else:
            a, ha = x, hx
        if a > b:
            a, b, ha, hb = b, a, hb, ha
        if abs(b - a) <= rtol * abs(x) or (x_prev is not None and abs(x - x_prev) <= rtol * abs(x)):
            return x
        x_prev = x
    raise ArithmeticError("exact: root finding did not converge")


def _tol():
    return mpmath.mpf(10) ** (-(mpmath.mp.dps - 5))


def _expand_around(h, x0, step, lo_limit=None):
    """A sign-change bracket [a, b] around the guess x0 (h increasing), widening geometrically."""
    a, b = x0 - step, x0 + step
    if lo_limit is not None and a < lo_limit:
        a = lo_limit
    ha, hb = h(a), h(b)
    while ha > 0 or hb < 0:
        step *= 4
        if ha > 0:
            b, hb = a, ha
            a = x0 - step if lo_limit is None else max(x0 - step, lo_limit)
            ha = h(a)
        else:
            a, ha = b, hb
            b = x0 + step
            hb = h(b)
    return a, b, ha, hb


def upper_q(div, p, delta, continued=False, guess=None):
    """q_up = p·r_up for 0 < p < 1. Saturated: 1 (r = 1/p), or the continued root if `continued`.

    `guess` (a nearby q, e.g. from the neighbouring table node) only narrows the initial bracket.
    """
    p, d = mpmath.mpf(p), mpmath.mpf(delta)
    omp = 1 - p
    if div.upper_saturated(p, omp, d, MP):
        if not continued or div.continuation == "none":
            return mpmath.mpf(1)
        if div.continuation == "closed_form":
            return div.closed_form(p, omp, d, MP)[1]
        def h(q):
            return div.g(p, omp, q, MP) - d

        a, b = mpmath.mpf(1), mpmath.mpf(2)
        while h(b) < 0:
            a, b = b, 2 * b
        return _bracketed_root(h, a, b, h(a), h(b), _tol())
    # Root in w = logit(q): q = 1/(1 + e^-w), 1 - q = 1/(1 + e^w); both computed without cancellation.
    def h(w):
        q = 1 / (1 + mpmath.exp(-w))
        return p * div.f(q / p, MP) + omp * div.f((1 / (1 + mpmath.exp(w))) / omp, MP) - d

    w_p = mpmath.log(p) - mpmath.log(omp)
    if guess is not None and 0 < guess < 1 and guess > p:
        w0 = mpmath.log(guess) - mpmath.log(1 - mpmath.mpf(guess))
        a, b, ha, hb = _expand_around(h, w0, mpmath.mpf("1e-3") * (1 + abs(w0)), lo_limit=w_p)
    else:
        a, ha, step = w_p, -d, mpmath.mpf(1)
        b = a + step
        hb = h(b)
        while hb < 0:
            a, ha, step = b, hb, 2 * step
            b = a + step
            hb = h(b)
    w = _bracketed_root(h, a, b, ha, hb, _tol())
    return 1 / (1 + mpmath.exp(-w))


def lower_ell(div, p, delta, guess=None):
    """ℓ = -ln r_lo for an unsaturated lower bound, 0 < p < 1 (`guess`: a nearby ℓ)."""
    p, d = mpmath.mpf(p), mpmath.mpf(delta)
    omp = 1 - p

    def h(ell):
        q = p * mpmath.exp(-ell)
        return p * div.f(mpmath.exp(-ell), MP) + omp * div.f((1 - q) / omp, MP) - d

    if guess is not None and guess > 0:
        g0 = mpmath.mpf(guess)
        a, b, ha, hb = _expand_around(h, g0, mpmath.mpf("1e-3") * g0, lo_limit=mpmath.mpf(0))
    else:
        a, ha = mpmath.mpf(0), -d
        b = max(mpmath.mpf(1), 2 * d / p)
        hb = h(b)
        while hb < 0:
            a, ha, b = b, hb, 8 * b
            hb = h(b)
    return _bracketed_root(h, a, b, ha, hb, _tol())


def lower_q(div, p, delta, continued=False):
    """q_lo = p·r_lo for 0 < p < 1. Saturated: 0, or the continued (negative) root if `continued`."""
    p, d = mpmath.mpf(p), mpmath.mpf(delta)
    omp = 1 - p
    if div.lower_saturated(p, omp, d, MP):
        if not continued or div.continuation == "none":
            return mpmath.mpf(0)
        if div.continuation == "closed_form":
            return div.closed_form(p, omp, d, MP)[0]
        def h(q):   # decreasing in q; Ridders takes either sign order
            return div.g(p, omp, q, MP) - d

        a, b = mpmath.mpf(-1), mpmath.mpf(0)
        while h(a) < 0:
            a = 2 * a
        return _bracketed_root(h, a, b, h(a), h(b), _tol())
    return p * mpmath.exp(-lower_ell(div, p, delta))


def bounds(p, delta, divergence="kl", dps=DPS):
    """Exact (r_lo, r_up) as mpf for p in [0, 1], including saturation and the limits at p = 0 and 1."""
    div = _div.get(divergence) if isinstance(divergence, str) else divergence
    with mpmath.workdps(dps):
        p, d = mpmath.mpf(p), mpmath.mpf(delta)
        if not (0 <= p <= 1):
            raise ValueError(f"p_old: expected a probability in [0, 1], got {p}")
        if not d > 0:
            raise ValueError(f"delta: expected a positive radius, got {d}")
        if p == 0:
            return mpmath.mpf(0), mpmath.inf
        if p == 1:
            return mpmath.mpf(div.lower_r_at_p1(d, MP)), mpmath.mpf(1)
        return lower_q(div, p, d) / p, upper_q(div, p, d) / p


def bounds_from_logp(log_p, delta, divergence="kl", dps=DPS):
    """Exact (r_lo, r_up) for p = exp(log_p), evaluated from the log-probability without rounding p."""
    with mpmath.workdps(dps):
        lp = mpmath.mpf(log_p)
        if lp > 0:
            raise ValueError(f"log_p_old: expected a log-probability <= 0, got {lp}")
        return bounds(mpmath.exp(lp), delta, divergence, dps)
