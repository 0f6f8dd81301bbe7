"""The f-divergence registry: everything the solver, the generator and the readers know about a divergence.

For an old probability p and a ratio r, the band's constraint is

    g_f(p, r) = p·f(r) + (1-p)·f((1-r·p)/(1-p)) = δ,

which is exactly D_f(Bernoulli(q) ‖ Bernoulli(p)) with q = p·r. Every function here is written once,
generically over a small math namespace (`MP` for mpmath, `TORCH` for torch tensors), so the same
expression feeds the 40-digit reference solver and the float64 PyTorch reader.

Adding a divergence takes a few lines: its f and f' (and, if known, a closed form for the two roots);
see `register`. The limits below are what the tables' tails and the tests rely on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mpmath


class _MathNS:
    """The few functions the divergence expressions use, bound to one numeric library."""

    def __init__(self, log, log1p, exp, expm1, sqrt, abs_, where):
        self.log, self.log1p, self.exp, self.expm1, self.sqrt, self.abs = log, log1p, exp, expm1, sqrt, abs_
        self.where = where


MP = _MathNS(mpmath.log, mpmath.log1p, mpmath.exp, mpmath.expm1, mpmath.sqrt, mpmath.fabs,
             lambda c, a, b: a if c else b)


def _torch_ns():
    import torch

    return _MathNS(torch.log, torch.log1p, torch.exp, torch.expm1, torch.sqrt, torch.abs, torch.where)


@dataclass(frozen=True)
class Divergence:
    """One f-divergence. Functions take a math namespace `m` last (see `MP`, `torch_math()`)."""

    name: str
    formula: str                      # f(u) as text, recorded in table headers
    f_at_zero: Optional[float]        # f(0); None for +∞ (the bounds never saturate)
    f: Callable                       # f(u, m)
    df: Callable                      # f'(u, m)
    # How the generator tabulates nodes where a bound is saturated, so that the kink is not smeared:
    #   "f": f is analytic for u < 0, so the root continues past the simplex edge (tv, chi2);
    #   "closed_form": the closed form's analytic continuation is tabulated (hellinger);
    #   "none": never saturates (kl) or has no smooth continuation (reverse_kl: saturated nodes hold
    #   the clamped value and the reader's Newton polish repairs the kink).
    continuation: str
    # Stored value of the lower bound: "kappa" = -p·ln(r_lo)/δ (bounded and smooth when the lower bound
    # never saturates, i.e. f(0) = ∞; r_lo = exp(-(δ/p)·κ) keeps full relative precision down to
    # underflow), or "q" = p·r_lo, the continued root, which crosses zero at saturation.
    lower_value: str
    # Newton steps on the exact equation that the readers apply after the table lookup, per bound.
    polish_upper: int = 0
    polish_lower: int = 0
    # Closed form of the continued roots (q_lo, q_up) = p·(r_lo, r_up), unclamped: (p, 1-p, δ, m).
    closed_form: Optional[Callable] = None
    # A positive multiple of p - p*, p* the point where the lower bound saturates, free of cancellation:
    # (p, 1-p, δ, m). In float arithmetic its sign decides the lower saturation (the generic test
    # `lower_saturated` rounds the wrong way within a few ulp of p*, where the bound is tiny but not 0).
    lower_gap: Optional[Callable] = None
    # lim_{p→0} p·r_up (None when it is 0, i.e. r_up grows slower than c/p) and lim_{p→1} r_lo.
    upper_q_at_p0: Optional[Callable] = None
    lower_r_at_p1: Optional[Callable] = None
    # Whether a generated table's δ range includes its top end (False where the band is trivial at δ = 1,
    # which the default range reaches: tv, whose distance is at most 1). Recorded in the table's header.
    delta_max_inclusive: bool = True
    # Kernel id (csrc/divergence.h, enum Divergence; the compiled list reaches Python as
    # `bandpo_lut.runtime._extension.facts()["divergences"]`), or None when only the pure-PyTorch reader supports it.
    compiled_id: Optional[int] = None
    description: str = ""

    # --- the band equation -------------------------------------------------------------------------
    def g(self, p, one_minus_p, q, m):
        """D_f(Bern(q) ‖ Bern(p)) = p·f(q/p) + (1-p)·f((1-q)/(1-p))."""
        return p * self.f(q / p, m) + one_minus_p * self.f((1 - q) / one_minus_p, m)

    def dg_dq(self, p, one_minus_p, q, m):
        return self.df(q / p, m) - self.df((1 - q) / one_minus_p, m)

    def upper_saturated(self, p, one_minus_p, delta, m):
        """Whole edge up to r = 1/p inside the region: p·f(1/p) + (1-p)·f(0) ≤ δ."""
        if self.f_at_zero is None:
            return False
        return p * self.f(1 / p, m) + one_minus_p * self.f_at_zero <= delta

    def lower_saturated(self, p, one_minus_p, delta, m):
        """Whole edge down to r = 0 inside the region: p·f(0) + (1-p)·f(1/(1-p)) ≤ δ."""
        if self.f_at_zero is None:
            return False
        return p * self.f_at_zero + one_minus_p * self.f(1 / one_minus_p, m) <= delta


REGISTRY: dict[str, Divergence] = {}


def register(div: Divergence) -> Divergence:
    """Add a divergence to the registry (validating its declared options)."""
    if div.name in REGISTRY:
        raise ValueError(f"divergence {div.name!r} is already registered")
    if div.continuation not in ("f", "closed_form", "none"):
        raise ValueError(f"continuation must be 'f', 'closed_form' or 'none', got {div.continuation!r}")
    if div.lower_value not in ("kappa", "q"):
        raise ValueError(f"lower_value must be 'kappa' or 'q', got {div.lower_value!r}")
    if div.continuation == "closed_form" and div.closed_form is None:
        raise ValueError("continuation='closed_form' needs a closed_form")
    REGISTRY[div.name] = div
    return div


def get(name: str) -> Divergence:
    """The registered divergence called `name`; a clear error otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"divergence: expected a name (str), got {type(name).__name__}")
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"divergence: unknown divergence {name!r}; known: {sorted(REGISTRY)}") from None


def names() -> list[str]:
    return sorted(REGISTRY)


def compiled_names() -> list[str]:
    """The divergences with a compiled kernel (the ones `bounds`, `clip` and a training loss can use)."""
    return [n for n in names() if REGISTRY[n].compiled_id is not None]


# --- the divergences ---------------------------------------------------------------------------------

def _two_product(a, b):
    """a·b = hi + lo exactly (Veltkamp–Dekker; in mpmath's precision lo is simply 0)."""
    hi = a * b
    split = 134217729.0  # 2^27 + 1

    def halves(x):
        t = split * x
        high = t - (t - x)
        return high, x - high

    ah, al = halves(a)
    bh, bl = halves(b)
    return hi, ((ah * bh - hi) + ah * bl + al * bh) + al * bl


def _gap(p, d, one_minus_x):
    """p - δ·x, written (p - δ) + δ·(1 - x): near saturation p is within a factor 2 of δ, so p - δ is exact
    (Sterbenz) and the product enters exactly: one rounding, no cancellation."""
    hi, lo = _two_product(d, one_minus_x)
    return ((p - d) + hi) + lo


def _chi2_closed(p, omp, d, m):
    # q = p ± √(δp(1-p)); the lower root as p·(p - δ(1-p))/(p + w), free of the cancellation of p - w
    # near saturation (p ≈ δ(1-p)), where the bound is tiny.
    w = m.sqrt(d * p * omp)
    return p * _gap(p, d, p) / (p + w), p + w


def _tv_closed(p, omp, d, m):
    return p - d, p + d


def _hellinger_closed(p, omp, d, m):
    # Bhattacharyya coefficient √(pq) + √((1-p)(1-q)) = 1 - δ/2 = cos α; with √p = cos θ the roots are
    # √q = cos(θ ∓ α) = √p·cos α ± √(1-p)·sin α.
    # The lower root as ((p - sin²α)/(a + b))², since a² - b² = p - sin²α: free of the cancellation of
    # a - b near saturation (p ≈ sin²α), where the bound is tiny.
    c = 1 - d / 2
    s2 = d * (1 - d / 4)
    a, b = m.sqrt(p) * c, m.sqrt(omp * s2)
    return (_gap(p, d, d / 4) / (a + b)) ** 2, (a + b) ** 2


KL = register(Divergence(
    name="kl", f_at_zero=None, formula="f(u) = -log(u) + u - 1", compiled_id=0,
    description="KL(pi_old || pi_new), the paper's default; no closed form, never saturates",
    f=lambda u, m: -m.log(u) + u - 1,
    df=lambda u, m: 1 - 1 / u,
    continuation="none", lower_value="kappa",
    upper_q_at_p0=lambda d, m: -m.expm1(-d),          # -log(1 - q) = δ
    lower_r_at_p1=lambda d, m: m.exp(-d),             # -log r = δ
))

TV = register(Divergence(
    name="tv", f_at_zero=0.5, formula="f(u) = |u - 1| / 2", compiled_id=1,
    description="total variation: r = 1 ± δ/p",
    f=lambda u, m: m.abs(u - 1) / 2,
    df=lambda u, m: m.where(u > 1, 0.5, -0.5),
    continuation="f", lower_value="q", polish_upper=2, polish_lower=2, delta_max_inclusive=False,
    closed_form=_tv_closed,
    lower_gap=lambda p, omp, d, m: p - d,             # exact near p* = δ (Sterbenz)
    upper_q_at_p0=lambda d, m: d,
    lower_r_at_p1=lambda d, m: 1 - d,
))

CHI2 = register(Divergence(
    name="chi2", f_at_zero=1.0, formula="f(u) = (u - 1)^2", compiled_id=2,
    description="Pearson chi-squared: r = 1 ± sqrt(δ(1-p)/p)",
    f=lambda u, m: (u - 1) ** 2,
    df=lambda u, m: 2 * (u - 1),
    continuation="f", lower_value="q", polish_upper=2, polish_lower=2,
    closed_form=_chi2_closed,
    lower_gap=lambda p, omp, d, m: _gap(p, d, p),     # p - δ(1-p) = (1+δ)·(p - δ/(1+δ))
    upper_q_at_p0=None,                               # r_up ~ sqrt(δ/p): p·r_up → 0
    lower_r_at_p1=lambda d, m: 1 + 0 * d,
))

HELLINGER = register(Divergence(
    name="hellinger", f_at_zero=1.0, formula="f(u) = (sqrt(u) - 1)^2", compiled_id=3,
    description="squared Hellinger (2·(1 - Bhattacharyya)); closed form via angles",
    f=lambda u, m: (m.sqrt(u) - 1) ** 2,
    df=lambda u, m: 1 - 1 / m.sqrt(u),
    continuation="closed_form", lower_value="q", polish_upper=2, polish_lower=2,
    closed_form=_hellinger_closed,
    lower_gap=lambda p, omp, d, m: _gap(p, d, d / 4),  # p - sin²α = p - δ(1 - δ/4)
    upper_q_at_p0=lambda d, m: d * (1 - d / 4),       # sin²α
    lower_r_at_p1=lambda d, m: (1 - d / 2) ** 2,      # cos²α
))

REVERSE_KL = register(Divergence(
    name="reverse_kl", f_at_zero=1.0, formula="f(u) = u*log(u) - u + 1", compiled_id=None,
    description="KL(pi_new || pi_old); saturates on both sides, no smooth continuation",
    f=lambda u, m: u * m.log(u) - u + 1,
    df=lambda u, m: m.log(u),
    continuation="none", lower_value="q", polish_upper=3, polish_lower=3,
    upper_q_at_p0=None,
    lower_r_at_p1=lambda d, m: 1 + 0 * d,
))


def torch_math() -> _MathNS:
    """The namespace for torch tensors (imported lazily: the registry itself needs only mpmath)."""
    global _TORCH
    if _TORCH is None:
        _TORCH = _torch_ns()
    return _TORCH


_TORCH = None
