"""The mpmath reference solver against closed forms, limits and the identities of the band equation."""
from __future__ import annotations

import math

import mpmath
import pytest

from bandpo_lut.tables import divergences, exact

mpmath.mp.dps = 50
P_VALUES = ["1e-300", "1e-12", "1e-6", "0.001", "0.02", "0.3", "0.5", "0.77", "0.99", "0.999999", "0.9999999999"]
DELTAS = ["0.001", "0.05", "0.3", "1"]


def clamped_closed_form(div, p, d):
    q_lo, q_up = div.closed_form(p, 1 - p, d, divergences.MP)
    lo = mpmath.mpf(0) if div.lower_saturated(p, 1 - p, d, divergences.MP) else q_lo / p
    up = 1 / p if div.upper_saturated(p, 1 - p, d, divergences.MP) else q_up / p
    return lo, up


@pytest.mark.parametrize("name", ["tv", "chi2", "hellinger"])
def test_solver_matches_closed_forms(name):
    div = divergences.get(name)
    for ps in P_VALUES:
        for ds in DELTAS:
            p, d = mpmath.mpf(ps), mpmath.mpf(ds)
            if name == "tv" and d >= 1:
                continue
            lo, up = exact.bounds(p, d, name)
            clo, cup = clamped_closed_form(div, p, d)
            assert abs(up - cup) <= mpmath.mpf(10) ** -40 * cup, (name, ps, ds)
            assert abs(lo - clo) <= mpmath.mpf(10) ** -40 * max(clo, 1), (name, ps, ds)  # at the kink lo ~ 0


def test_tv_and_chi2_textbook_forms():
    """The forms quoted in the docs: tv r = 1 ± δ/p, chi2 r = 1 ± sqrt(δ(1-p)/p), clamped to [0, 1/p]."""
    for p in (0.01, 0.2, 0.6, 0.97):
        for d in (0.01, 0.05, 0.2):
            lo, up = exact.bounds(p, d, "tv")
            assert float(up) == pytest.approx(min(1 + d / p, 1 / p), rel=1e-14)
            assert float(lo) == pytest.approx(max(1 - d / p, 0.0), rel=1e-14, abs=1e-40)
            w = math.sqrt(d * (1 - p) / p)
            lo, up = exact.bounds(p, d, "chi2")
            assert float(up) == pytest.approx(min(1 + w, 1 / p), rel=1e-13)
            assert float(lo) == pytest.approx(max(1 - w, 0.0), rel=1e-12, abs=1e-40)


@pytest.mark.parametrize("name", divergences.names())
def test_roots_solve_the_equation(name):
    div = divergences.get(name)
    for ps in ["1e-9", "0.05", "0.4", "0.93"]:
        p, d = mpmath.mpf(ps), mpmath.mpf("0.05")
        lo, up = exact.bounds(p, d, name)
        for r, sat in ((up, up == 1 / p), (lo, lo == 0)):
            if not sat:
                assert abs(div.g(p, 1 - p, r * p, divergences.MP) - d) < mpmath.mpf(10) ** -35
        assert lo <= 1 <= up <= 1 / p


def test_kl_limits_and_asymptotes():
    d = mpmath.mpf("0.05")
    # p·r_up -> 1 - e^-δ as p -> 0
    for p in ("1e-10", "1e-14"):
        _, up = exact.bounds(p, d, "kl")
        assert abs(mpmath.mpf(p) * up - (1 - mpmath.exp(-d))) < 1e-8
    # r_lo -> e^-δ as p -> 1; and exactly at p = 1
    lo, _ = exact.bounds(1 - mpmath.mpf("1e-12"), d, "kl")
    assert abs(lo - mpmath.exp(-d)) < 1e-9
    assert exact.bounds(1, d, "kl") == (mpmath.exp(-d), 1)
    # r_lo ≈ exp(-δ/p - 1) for p ≪ δ (astronomically small, still solved in log space)
    p = mpmath.mpf("1e-6")
    lo, _ = exact.bounds(p, d, "kl")
    assert abs(mpmath.log(lo) - (-d / p - 1)) / (d / p) < 1e-4
    assert exact.bounds(0, d, "kl") == (0, mpmath.inf)


def test_lower_mirrors_upper_at_one_minus_p():
    """Relabelling the outcomes: q_lo(p) = 1 - q_up(1 - p)."""
    for name in ("kl", "chi2", "reverse_kl"):
        div = divergences.get(name)
        for p in ("0.1", "0.5", "0.8"):
            p = mpmath.mpf(p)
            q_lo = exact.lower_q(div, p, mpmath.mpf("0.05"))
            q_up = exact.upper_q(div, 1 - p, mpmath.mpf("0.05"))
            assert abs(q_lo - (1 - q_up)) < mpmath.mpf(10) ** -40


def test_saturation_thresholds():
    d = 0.05
    assert exact.bounds(1 - d + 1e-9, d, "tv")[1] == 1 / mpmath.mpf(1 - d + 1e-9)
    assert exact.bounds(1 - d - 1e-6, d, "tv")[1] < 1 / mpmath.mpf(1 - d - 1e-6)
    assert exact.bounds(d * 0.999, d, "tv")[0] == 0
    assert exact.bounds(d / (1 + d) * 0.999, d, "chi2")[0] == 0
    assert exact.bounds(d / (1 + d) * 1.001, d, "chi2")[0] > 0
    assert exact.bounds(1 / (1 + d) * 1.0001, d, "chi2")[1] == 1 / mpmath.mpf(1 / (1 + d) * 1.0001)


def test_continued_roots_match_closed_forms():
    for name in ("tv", "chi2"):
        div = divergences.get(name)
        p, d = mpmath.mpf("0.99"), mpmath.mpf("0.05")
        assert abs(exact.upper_q(div, p, d, continued=True) - div.closed_form(p, 1 - p, d, divergences.MP)[1]) < 1e-40
        p = mpmath.mpf("0.001")
        assert abs(exact.lower_q(div, p, d, continued=True) - div.closed_form(p, 1 - p, d, divergences.MP)[0]) < 1e-40


def test_bad_inputs():
    with pytest.raises(ValueError, match="p_old"):
        exact.bounds(1.5, 0.05)
    with pytest.raises(ValueError, match="delta"):
        exact.bounds(0.5, 0)
    with pytest.raises(ValueError, match="unknown divergence"):
        exact.bounds(0.5, 0.05, "nope")
