"""Error measures and sample points shared by the generator, `verify`, the benchmarks and the tests.

Upper bound: relative error |r - r*|/r*. Lower bound: |r - r*| / (r*·(1 + |ln r*|)): a tiny bound
r* = e^-L is evaluated from L in finite precision, so its relative error scales with L; this is the
conditioning of any float evaluation, not slack in the tables. The truth r* is the mpmath root rounded
to float64 (bounds below the float range compare as 0).
"""
from __future__ import annotations

import math

import mpmath
import numpy as np

from bandpo_lut.tables import exact


def upper_error(ours: float, ref: float) -> float:
    if math.isinf(ref) or math.isinf(ours):
        return 0.0 if ours == ref else math.inf
    return abs(ours - ref) / ref


def lower_error(ours: float, ref: float) -> float:
    if ref == 0.0:
        return 0.0 if ours == 0.0 else (math.inf if ours > 1e-300 else 0.0)
    return abs(ours - ref) / (ref * (1.0 + abs(math.log(ref))))


def sample_points(n: int, delta_min: float, delta_max: float, seed: int, t_max: float = 14.0,
                  delta_max_inclusive: bool = True):
    """Random off-grid (p, δ): most with |logit p| ≤ t_max, a fifth in each tail (p < 1e-8 and
    1 - p < 1e-6 included), δ log-uniform in the range. Returns float64 numpy arrays."""
    rng = np.random.default_rng(seed)
    kind = rng.random(n)
    t = np.where(kind < 0.6, rng.uniform(-t_max, t_max, n),
                 np.where(kind < 0.8, rng.uniform(-40.0, -t_max, n), rng.uniform(t_max, 36.0, n)))
    p = 1.0 / (1.0 + np.exp(-t))
    hi = delta_max if delta_max_inclusive else np.nextafter(delta_max, 0)
    delta = np.exp(rng.uniform(math.log(delta_min), math.log(hi), n))
    return p, delta


def exact_bounds_f64(p: np.ndarray, delta: np.ndarray, divergence: str, dps: int = 40):
    """mpmath bounds at each (p, δ) (exactly those float64 values), rounded to float64."""
    lo = np.empty(len(p))
    up = np.empty(len(p))
    for i, (pi, di) in enumerate(zip(p.tolist(), delta.tolist())):
        a, b = exact.bounds(pi, di, divergence, dps=dps)
        lo[i], up[i] = float(a), (math.inf if b == mpmath.inf else float(b))
    return lo, up


def worst(ours_lo, ours_up, ref_lo, ref_up):
    """(max upper error, max lower error, index of each), ignoring nothing: NaN counts as infinite."""
    eu = np.array([upper_error(a, b) if not math.isnan(a) else math.inf for a, b in zip(ours_up, ref_up)])
    el = np.array([lower_error(a, b) if not math.isnan(a) else math.inf for a, b in zip(ours_lo, ref_lo)])
    return float(eu.max(initial=0)), float(el.max(initial=0)), int(eu.argmax()) if len(eu) else -1, \
        int(el.argmax()) if len(el) else -1


def float32_worst(lo, up, ref_lo, ref_up):
    """(max upper error, max lower error) of bounds computed in float32: the truth rounded to float32 first,
    and a lower bound within two float32 subnormal spacings of it counts as exact (no float32 can do better
    at the bottom of its range). NaN counts as infinite, as in `worst`."""
    tiny = 2 * float(np.finfo(np.float32).tiny) * float(np.finfo(np.float32).eps)
    with np.errstate(over="ignore"):   # a truth beyond float32's range rounds to inf, as the float32 bound does
        rlo = np.asarray(ref_lo, dtype=np.float64).astype(np.float32).astype(np.float64)
        rup = np.asarray(ref_up, dtype=np.float64).astype(np.float32).astype(np.float64)
    lo, up = np.asarray(lo, dtype=np.float64), np.asarray(up, dtype=np.float64)
    lo = np.where(np.abs(lo - rlo) <= tiny, rlo, lo)
    eu, el, _, _ = worst(lo, up, rlo, rup)
    return eu, el
