"""The closed-form divergences (tv, chi2, hellinger) from float32 p, computed in float32
(csrc/bandpo_math.h closed_form_bounds): within a few ulp of the exact bound at the float32 input, also where the
lower bound rests on a cancelling difference (near saturation), against an exact-gap float64 reference that is
itself checked against mpmath."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import bandpo_lut
from bandpo_lut.tables import exact

NAMES = ("tv", "chi2", "hellinger")
# Largest error asserted, in float32 ulps of the exact value (an ulp: the float spacing at it, 2^-23 relative at
# the bottom of a binade, 2^-24 at the top). From the error analysis in csrc/bandpo_math.h: tv's bounds are two or
# three roundings; chi2's lower bound adds a square root and a product to the gap's (exact to rounding however
# small, see closed_gap); hellinger's squares a quotient, doubling its relative error. Measured maxima over
# 7·10^5 points per divergence (35 scalar δ): tv 1.4 / 1.9 ulp (lower / upper), chi2 4.0 / 1.5, hellinger 6.1 / 2.9;
# all below 5e-7 relative (the ops' accuracy bar, tests/runtime/test_band.py, is 1e-6).
ULPS = {"tv": (2.5, 2.0), "chi2": (2.0, 5.0), "hellinger": (3.5, 7.5)}   # (upper, lower)


# ---- the reference: closed forms in float64 with the gap p - δ(1 - x) summed exactly ------------------------

def _two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    """a = hi + lo with hi on 26 bits (Veltkamp), so that hi·hi, hi·lo and hi·p, lo·p (p a float32) are exact."""
    c = 134217729.0 * a
    hi = c - (c - a)
    return hi, a - hi


def _exact_sum(terms):
    s, err = terms[0], np.zeros_like(terms[0])
    for t in terms[1:]:
        s, e = _two_sum(s, t)
        err = err + e
    return s + err


def gap(name, p, d):
    """p - δ(1 - x) (tv x = 0, chi2 x = p, hellinger x = δ/4), rounded once from its exact value (p float32)."""
    dh, dl = _split(d)
    if name == "tv":
        return _exact_sum([p, -d])
    if name == "chi2":
        return _exact_sum([p, -d, p * dh, p * dl])
    return _exact_sum([p, -d, dh * dh / 4, dh * dl / 2, dl * dl / 4])


def reference(name, p, d):
    """(lo, up) in float64 for float64 arrays p (holding float32 values) and d."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g = gap(name, p, d)
        if name == "tv":
            up = np.minimum(1 + d / p, 1 / p)
            lo = g / p
        elif name == "chi2":
            w = np.sqrt(d * (1 - p) / p)
            up = np.minimum(1 + w, 1 / p)
            lo = g / (p * (1 + w))
        else:
            ca, s2 = 1 - d / 2, d * (1 - d / 4)
            v = np.sqrt(s2 * (1 - p) / p)
            up = np.where(np.sqrt(p) >= ca, 1 / p, (ca + v) ** 2)
            lo = (g / (p * (ca + v))) ** 2
    lo = np.where((g <= 0) | (p == 0), 0.0, lo)
    up = np.where(p == 1, 1.0, np.where(p == 0, np.inf, up))
    return lo, up


def ulp_error(ours: torch.Tensor, ref: np.ndarray) -> np.ndarray:
    """|ours - ref| in float32 ulps of ref; 0 where both are inf, inf where only one is (or ours is NaN)."""
    ours = ours.double().numpy()
    with np.errstate(over="ignore"):
        ref32 = ref.astype(np.float32)   # inf where the exact value rounds beyond float32's range
    both_inf = np.isinf(ours) & np.isinf(ref32)
    e = np.floor(np.log2(np.maximum(np.abs(ref), 2.0 ** -126)))
    with np.errstate(invalid="ignore"):
        err = np.abs(ours - ref) / np.exp2(e - 23)
    err = np.where(both_inf, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


# ---- the points ----------------------------------------------------------------------------------------------

def saturation_points(name, d):
    """p* of the lower bound and p of the upper bound's switch, for float64 δ."""
    if name == "tv":
        return d, 1 - d
    if name == "chi2":
        return d / (1 + d), 1 / (1 + d)
    return d * (1 - d / 4), (1 - d / 2) ** 2


def near(x, g, ulps=48, rel=24):
    """float32 values around each x: within ±ulps float32 steps, and at relative offsets ±2^-1 .. ±2^-rel."""
    x32 = torch.tensor(x, dtype=torch.float64).float()
    steps = torch.arange(-ulps, ulps + 1, dtype=torch.float64)
    up = torch.nextafter(x32, torch.tensor(math.inf))
    spacing = (up - x32).double()
    around = (x32.double()[:, None] + steps[None, :] * spacing[:, None]).float()
    factors = torch.exp2(-torch.arange(1, rel + 1, dtype=torch.float64))
    factors = torch.cat([factors, -factors]) * (1 + 0.5 * torch.rand(2 * rel, generator=g, dtype=torch.float64))
    relative = (torch.tensor(x, dtype=torch.float64)[:, None] * (1 + factors[None, :])).float()
    return torch.cat([around.flatten(), relative.flatten()])


EXTREMES = [0.0, 1.4e-45, 1e-40, 2e-38, 1e-30, 1e-12, 3e-8, 0.5, 1 - 2 ** -23, 1 - 2 ** -24, 1.0]


def delta_range(name):
    # the closed forms' range: [1e-3, 1], 1 excluded for tv (tables/*.bplut)
    return 1e-3, (1.0 if name != "tv" else float(np.nextafter(1.0, 0.0)))


def points_scalar(name, d, g):
    lo_sat, up_sat = saturation_points(name, d)
    t = torch.empty(20000, dtype=torch.float64).uniform_(-30, 30, generator=g)
    p = torch.cat([torch.sigmoid(t).float(), torch.tensor(EXTREMES), near([lo_sat, up_sat], g)])
    return p.clamp(0, 1)


# ---- tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_scalar_delta_within_ulps_of_exact(name):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    dmin, dmax = delta_range(name)
    # δ: the default, the range ends, and doubles that are not float32 values (their saturation point moves off
    # float32's grid: the case closed_gap's pair form exists for)
    deltas = [0.05, dmin, dmax, 0.1, 1 / 3] + torch.exp(torch.empty(5, dtype=torch.float64).uniform_(
        math.log(dmin), math.log(dmax), generator=g)).tolist()
    worst_lo = worst_up = 0.0
    count = 0
    for d in deltas:
        p = points_scalar(name, d, g)
        lo, up = bandpo_lut.bounds(p, d, name)
        rlo, rup = reference(name, p.double().numpy(), np.full(p.shape, d))
        el, eu = ulp_error(lo, rlo), ulp_error(up, rup)
        assert eu.max() <= ULPS[name][0], (d, p[eu.argmax()].item(), eu.max())
        assert el.max() <= ULPS[name][1], (d, p[el.argmax()].item(), el.max(), rlo[el.argmax()])
        worst_lo, worst_up = max(worst_lo, el.max()), max(worst_up, eu.max())
        count += p.numel()
    assert count >= 10 ** 5 // len(NAMES)
    print(f"{name}: {count} points, worst lower {worst_lo:.2f} ulp, upper {worst_up:.2f} ulp")


@pytest.mark.parametrize("name", NAMES)
def test_per_token_delta_within_ulps_of_exact(name):
    g = torch.Generator().manual_seed(7 + sum(map(ord, name)))
    dmin, dmax = delta_range(name)
    n = 4000
    d = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(dmin), math.log(dmax), generator=g)).float()
    d[:2] = torch.tensor([dmin, dmax], dtype=torch.float64).float()
    if name == "tv":   # 1 excluded: the largest float32 below it
        d[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    d64 = d.double().numpy()
    lo_sat, up_sat = saturation_points(name, d64)
    # each δ at random p, and at floats around its two saturation points (16 steps and 8 relative offsets each)
    t = torch.empty(n, dtype=torch.float64).uniform_(-30, 30, generator=g)
    p = torch.cat([torch.sigmoid(t).float(), near(lo_sat.tolist(), g, 8, 8), near(up_sat.tolist(), g, 8, 8)])
    per = (p.numel() - n) // (2 * n)   # points per δ in each near() block, laid out δ-major
    dd = torch.cat([d, d.repeat_interleave(per), d.repeat_interleave(per)])
    p = p.clamp(0, 1)
    lo, up = bandpo_lut.bounds(p, dd, name)
    rlo, rup = reference(name, p.double().numpy(), dd.double().numpy())
    el, eu = ulp_error(lo, rlo), ulp_error(up, rup)
    assert p.numel() >= 10 ** 5 // len(NAMES)
    assert eu.max() <= ULPS[name][0], (dd[eu.argmax()].item(), p[eu.argmax()].item(), eu.max())
    assert el.max() <= ULPS[name][1], (dd[el.argmax()].item(), p[el.argmax()].item(), el.max())


@pytest.mark.parametrize("name", NAMES)
def test_delta_moved_onto_a_range_end_is_that_end(name):
    """With bfloat16 operands, a δ that is the range's lower end as bfloat16 rounds it (bf16(1e-3) < 1e-3) stands
    for 1e-3, the double: its bounds are the scalar δ = 1e-3 ones to the bit. The same value as a float32 δ (with
    float32 p) is below float32's rounding of the end: out of range, NaN."""
    g = torch.Generator().manual_seed(11)
    lo_sat, _ = saturation_points(name, 1e-3)
    p = torch.cat([near([lo_sat], g), torch.rand(1000, generator=g)]).clamp(0, 1)
    d16 = torch.full(p.shape, 1e-3, dtype=torch.bfloat16)
    assert d16[0].item() < 1e-3
    lo, up = bandpo_lut.bounds(p.bfloat16(), d16, name)
    lo_s, up_s = bandpo_lut.bounds(p.bfloat16(), 1e-3, name)
    assert not torch.isnan(lo).any() and torch.equal(lo, lo_s) and torch.equal(up, up_s)
    lo_out, up_out = bandpo_lut.bounds(p, d16.float(), name)
    assert torch.isnan(lo_out).all() and torch.isnan(up_out).all()


def test_reference_agrees_with_mpmath():
    """The exact-gap float64 reference against mpmath's closed forms (bandpo_lut.tables.exact), near saturation too."""
    g = torch.Generator().manual_seed(3)
    for name in NAMES:
        for d in (0.05, 1e-3, 0.7):
            lo_sat, up_sat = saturation_points(name, d)
            p = torch.cat([near([lo_sat, up_sat], g, ulps=4, rel=4), torch.rand(6, generator=g)])
            p = p[(p > 0) & (p < 1)].double().numpy()
            rlo, rup = reference(name, p, np.full(p.shape, d))
            for i, pi in enumerate(p.tolist()):
                mlo, mup = (float(v) for v in exact.bounds(pi, d, name))
                assert rup[i] == pytest.approx(mup, rel=1e-14), (name, d, pi)
                assert rlo[i] == pytest.approx(mlo, rel=1e-12, abs=1e-300), (name, d, pi)


@pytest.mark.parametrize("name", NAMES)
def test_float64_inputs_keep_double_precision(name):
    g = torch.Generator().manual_seed(5)
    p = points_scalar(name, 0.05, g).double()
    lo, up = bandpo_lut.bounds(p, 0.05, name)
    rlo, rup = reference(name, p.numpy(), np.full(p.shape, 0.05))
    ok = rup > 0
    assert np.allclose(up.numpy()[ok], rup[ok], rtol=1e-14, atol=0)
    assert np.allclose(lo.numpy(), rlo, rtol=1e-12, atol=1e-300)
