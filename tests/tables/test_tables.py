"""Tables: deterministic generation, the shipped tables' size, accuracy and monotonicity through the pure-PyTorch
reader against mpmath, the reference reader's special values. The file format and its refusals:
test_tables_integrity.py; the exact solver: test_tables_exact.py; generate/verify on the command line: test_cli.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import SMALL_KL, rel_error_lower, rel_error_upper

from bandpo_lut.reference.bounds import bounds as ref_bounds
from bandpo_lut.tables import accuracy
from bandpo_lut.tables import store as tables
from bandpo_lut.tables.generate import generate
from bandpo_lut.tables.verify import monotonicity_violations


@pytest.mark.slow
def test_generation_is_deterministic(small_blob):
    assert generate("kl", **SMALL_KL) == small_blob


def test_delta_outside_range_is_refused():
    with pytest.raises(ValueError, match=r"delta: 2.0 is outside"):
        ref_bounds(torch.tensor([0.5]), 2.0, "kl")
    with pytest.raises(ValueError, match="outside"):
        ref_bounds(torch.tensor([0.5]), 1.0, "tv")          # tv's range excludes 1
    with pytest.raises(ValueError, match="outside"):
        ref_bounds(torch.tensor([0.5]), 1e-4, "chi2")
    lo, up = ref_bounds(torch.tensor([0.5, 0.5]), torch.tensor([0.05, 5.0]), "kl")   # tensor: NaN, no sync
    assert not torch.isnan(lo[0]) and torch.isnan(lo[1]) and torch.isnan(up[1])


def test_shipped_tables_are_small():
    for name in tables.SHIPPED:
        path = tables.shipped_path(name)
        assert path.stat().st_size <= 512 * 1024, path


@pytest.mark.slow
@pytest.mark.parametrize("name", tables.SHIPPED)
def test_shipped_tables_accuracy_against_mpmath(name):
    table = tables.get(name)
    p, d = accuracy.sample_points(400, table.delta_min, table.delta_max, seed=777, t_max=table.t.max,
                                  delta_max_inclusive=table.delta_max_inclusive)
    p[:8] = [1e-9, 3e-12, 1e-300, 0.0, 1.0, 1 - 1e-7, 1 - 3e-10, 0.5]   # whole range, with the edges
    lo, up = ref_bounds(torch.from_numpy(p), torch.from_numpy(d), name)
    rlo, rup = accuracy.exact_bounds_f64(p, d, name)
    eu = rel_error_upper(up, torch.from_numpy(rup))
    el = rel_error_lower(lo, torch.from_numpy(rlo))
    assert eu.max() <= 2e-7, (name, p[eu.argmax()], d[eu.argmax()])
    assert el.max() <= 2e-7, (name, p[el.argmax()], d[el.argmax()])
    # float32 inputs: same reader, results rounded to float32
    lo32, up32 = ref_bounds(torch.from_numpy(p).float(), torch.from_numpy(d), name)
    rlo32, rup32 = accuracy.exact_bounds_f64(p.astype(np.float32).astype(np.float64), d, name)
    assert lo32.dtype == torch.float32
    assert rel_error_upper(up32, torch.from_numpy(rup32)).max() <= 2e-7
    assert rel_error_lower(lo32, torch.from_numpy(rlo32), torch.float32).max() <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", tables.SHIPPED)
def test_shipped_tables_are_monotone(name):
    assert monotonicity_violations(tables.get(name), 4000, 200) == (0, 0, 0, 0)


def test_reference_log_p_old_keeps_accuracy_near_one():
    lp = torch.tensor([-1e-12, -1e-9, -3e-8, -1e-5, 0.0, -math.inf], dtype=torch.float64)
    lo, up = ref_bounds(log_p_old=lp, delta=0.05, divergence="kl")
    for i, v in enumerate(lp.tolist()):
        import mpmath

        from bandpo_lut.tables import exact
        rlo, rup = exact.bounds_from_logp(v, 0.05, "kl") if v > -math.inf else (0, mpmath.inf)
        assert float(lo[i]) == pytest.approx(float(rlo), rel=2e-7, abs=0)
        assert float(up[i]) == pytest.approx(float(rup), rel=2e-7)


def test_reference_special_values():
    p = torch.tensor([0.0, 1.0, math.nan, -0.1, 1.5], dtype=torch.float64)
    lo, up = ref_bounds(p, 0.05, "kl")
    assert lo[0] == 0 and math.isinf(up[0])
    assert float(lo[1]) == pytest.approx(math.exp(-0.05), rel=1e-12) and up[1] == 1
    assert torch.isnan(lo[2:]).all() and torch.isnan(up[2:]).all()
    with pytest.raises(ValueError, match="exactly one"):
        ref_bounds(p, 0.05, log_p_old=p)
    with pytest.raises(TypeError, match="float32 or float64"):
        ref_bounds(torch.tensor([1, 2]), 0.05)


def _lower_truth(divergence: str, p: float, d: float):
    """r_lo from the closed form in mpmath (60 digits) at the float64 values p and δ taken exactly: 0 once saturated."""
    import mpmath
    with mpmath.workdps(60):
        p, d = mpmath.mpf(p), mpmath.mpf(d)
        if divergence == "tv":
            r = 1 - d / p
        elif divergence == "chi2":
            r = 1 - mpmath.sqrt(d * (1 - p) / p)
        else:  # hellinger: √q = √p·cos α - √(1-p)·sin α, cos α = 1 - δ/2
            root = mpmath.sqrt(p) * (1 - d / 2) - mpmath.sqrt((1 - p) * d * (1 - d / 4))
            r = root ** 2 / p if root > 0 else mpmath.mpf(0)
        return max(r, mpmath.mpf(0))


@pytest.mark.parametrize("name", ["tv", "chi2", "hellinger"])
def test_reference_lower_bound_near_saturation_against_mpmath(name):
    """Within a few ulp of the lower saturation point p* the bound is tiny but not 0: the reference gives it to
    a relative 1e-12, and exactly 0 where it is saturated (the generic float64 test gave chi2 δ = 1/3,
    p = 0.25 a bound of 0 for 2.8e-17)."""
    import mpmath
    points = [(1 / 3, 0.25)] if name == "chi2" else []
    for d in [1e-3, 0.05, 0.2, 1 / 3, 0.5, 0.9]:
        with mpmath.workdps(60):
            md = mpmath.mpf(d)
            star = {"tv": md, "chi2": md / (1 + md), "hellinger": md * (1 - md / 4)}[name]
        p0 = float(star)
        for k in range(-4, 5):
            points.append((d, p0 + k * math.ulp(p0)))
        points += [(d, p0 * (1 + 1e-12)), (d, p0 * (1 + 1e-8)), (d, p0 * (1 + 1e-4))]
    delta = torch.tensor([d for d, _ in points], dtype=torch.float64)
    p = torch.tensor([q for _, q in points], dtype=torch.float64)
    lo, _ = ref_bounds(p, delta, name)
    for (d, q), got in zip(points, lo.tolist()):
        truth = _lower_truth(name, q, d)
        if truth == 0:
            assert got == 0, (name, d, q, got)
        else:
            assert abs(got - truth) <= 1e-12 * truth, (name, d, q, got, float(truth))


def test_float32_worst_rounds_the_truth_and_counts_nan():
    """The error measure of the float32 accuracy figures (bench, tools/measure_accuracy.py)."""
    worst32 = accuracy.float32_worst
    ref_lo, ref_up = np.array([0.5 + 1e-9, 1e-46, 0.25]), np.array([1.0, 3.0, 4e40])
    # truth rounded to float32 (0.5, 0, 4e40 -> inf): exact; an upper bound 10% high
    eu, el = worst32([0.5, 0.0, 0.25], [1.1, 3.0, float("inf")], ref_lo, ref_up)
    assert el == 0.0 and math.isclose(eu, 0.1, rel_tol=1e-12)
    # NaN anywhere (not only first) is infinitely wrong
    assert worst32([0.5, 0.0, 0.25], [1.0, 3.0, float("nan")], ref_lo, ref_up)[0] == math.inf
    assert worst32([0.5, float("nan"), 0.25], [1.0, 3.0, float("inf")], ref_lo, ref_up)[1] == math.inf
    # a lower bound off by more than the subnormal floor is measured, relative to r*(1 + |ln r*|)
    _, el = worst32([0.5, 0.0, 0.26], [1.0, 3.0, float("inf")], ref_lo, ref_up)
    assert math.isclose(el, 0.01 / (0.25 * (1 + math.log(4))), rel_tol=1e-6)


def test_gpu_cells_fit_catches_a_spline_the_cubics_cannot_follow(monkeypatch):
    """gpu_cells refits the GPU's cells in p's bits from the table's spline: the shipped table fits within 1e-7 at
    every δ verify checks; the same table with one row of the upper bound's spline coefficients raised by 1e-3 (a
    B-spline bump: its third derivative jumps at the knots, which one cubic over a cell spanning a knot cannot follow)
    misses, in the scalar-δ cells and in the per-token patches, and `verify` says so and fails the file (its accuracy
    and monotonicity checks stubbed out here)."""
    import io

    from bandpo_lut.tables import gpu_cells
    from bandpo_lut.tables import verify as verify_mod

    table = tables.get("kl")
    assert gpu_cells.uses_bit_cells(table)
    deltas = gpu_cells.check_deltas(table)
    assert 0.05 in deltas and deltas[0] == table.delta_min and len(deltas) == 6
    assert max(gpu_cells.cells_fit_error(table, d) for d in deltas) <= gpu_cells.TOLERANCE

    bumped = table.coefficients("cpu", torch.float64).clone()
    j = int(np.argmin(np.abs(table.t.min + np.arange(table.t.n) * table.t.step - (-6.0)))) + 1   # near p = 2.5e-3
    bumped[0, j, :] *= 1 + 1e-3

    class Bumped:   # the table, but for its coefficients
        def __init__(self, base):
            self.base = base

        def __getattr__(self, name):
            return getattr(self.base, name)

        def coefficients(self, device, dtype=None):
            return bumped.to(device=device, dtype=dtype or torch.float32)

    bad = Bumped(table)
    assert gpu_cells.cells_fit_error(bad, 0.05) > gpu_cells.TOLERANCE
    assert gpu_cells.uses_bit_patches(bad)   # (its patches' fit: verify's second line below)
    monkeypatch.setattr(verify_mod.tables, "load", lambda path: bad)
    monkeypatch.setattr(verify_mod, "measure", lambda *a: (0.0, 0.0, 0, 0, np.zeros(1), np.zeros(1)))
    monkeypatch.setattr(verify_mod, "monotonicity_violations", lambda *a: (0, 0, 0, 0))
    out = io.StringIO()
    assert not verify_mod.verify_file("bumped.bplut", 10, 0, 10, 10, out=out)
    text = out.getvalue()
    assert text.startswith("FAILED bumped.bplut") and text.count("MISSES (a GPU would give NaN bounds there)") == 2
    monkeypatch.setattr(verify_mod.tables, "load", lambda path: table)
    out = io.StringIO()
    assert verify_mod.verify_file("shipped.bplut", 10, 0, 10, 10, out=out)
    assert "at 6 deltas" in out.getvalue() and out.getvalue().count(", fits;") == 2, out.getvalue()
