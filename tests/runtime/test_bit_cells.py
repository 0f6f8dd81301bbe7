"""The scalar-δ KL band where a kernel reads cells in p's float bits (csrc/cpu/simd/bit_cells.h; the AVX2 kernel):
at every place where the cell arithmetic could go wrong, against mpmath. Those places are the cells' own edges (each
binade of x = min(p, 1 - p) and its 16 cells, an ulp either side, on the grid and in the upper bound's tail down to
the smallest normal float), p = 1/2 where the two sides meet, and x_lo, where the grid ends (|t| = 14, an ulp either
side; the cell that holds x_lo is fitted on its part above it, and below x_lo there the tails' pass takes over).
Each CPU variant this machine runs is forced in its own process, so the variants whose kernels read cells in t are
checked at the same points."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fresh_env, run_fresh

import bandpo_lut  # noqa: F401  (the compiled library must load before facts() is asked)
from bandpo_lut.runtime import _extension
from bandpo_lut.tables import accuracy, exact

ORDER = ["baseline", "avx2", "avx512"]
SUPPORTED = ORDER[: ORDER.index(_extension.facts()["cpu"]["isa"]) + 1]


def edge_points() -> np.ndarray:
    """float32 probabilities at the cells' edges, p = 1/2 and x_lo, on both sides (p <= 1/2 and p > 1/2)."""
    f32 = np.float32
    xs = []
    for e in [*range(-126, -21, 15), *range(-21, -1, 3)]:  # binades below the grid and on it: each cell's edges
        for j in range(16):
            edge = f32(math.ldexp(1.0 + j / 16.0, e))
            xs += [np.nextafter(edge, f32(0)), edge, np.nextafter(edge, f32(1))]
    x_lo = f32(1.0 / (1.0 + math.exp(14.0)))   # where |t| = 14
    xs += [np.nextafter(x_lo, f32(0)), x_lo, np.nextafter(x_lo, f32(1)), x_lo * f32(0.97), x_lo * f32(1.03)]
    xs = np.array(xs, dtype=np.float32)
    ps = np.concatenate([xs, f32(1) - xs[xs >= f32(2.0 ** -24)]])  # 1 - x exact for these
    half = f32(0.5)
    ps = np.concatenate([ps, [np.nextafter(half, f32(0)), half, np.nextafter(half, f32(1))]]).astype(np.float32)
    return np.unique(ps)


CHILD = r"""
import json, sys
import torch, bandpo_lut
from bandpo_lut.runtime import _extension
p, logp = (torch.tensor(v, dtype=torch.float32) for v in json.loads(sys.argv[1]))
out = {"variant": _extension.facts()["cpu"]["variant"]}
for delta in (1e-3, 0.05, 1.0):
    for log_input in (False, True):
        kw = {"log_p_old": logp} if log_input else {"p_old": p}
        lo, up = bandpo_lut.bounds(delta=delta, **kw)
        # in a long run too (whole vectors and blocks), each point with neighbours that are not its own
        reps = torch.cat([kw[k] for k in kw] * 9)
        lo9, up9 = bandpo_lut.bounds(delta=delta, **{next(iter(kw)): reps})
        same = torch.equal(lo9.view(9, -1), lo.expand(9, -1)) and torch.equal(up9.view(9, -1), up.expand(9, -1))
        out[f"{delta}/{int(log_input)}"] = [lo.double().tolist(), up.double().tolist(), same]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def truth():
    p = edge_points()
    logp = np.log(p.astype(np.float64)).astype(np.float32)  # the float32 log-probabilities given
    out = {}
    for delta in (1e-3, 0.05, 1.0):
        out[(delta, 0)] = accuracy.exact_bounds_f64(p.astype(np.float64), np.full(len(p), delta), "kl")
        # a log-probability's truth is at p = exp(log p) exactly, 1 - p = -expm1(log p)
        lo_up = [exact.bounds_from_logp(float(x), delta, "kl") for x in logp.astype(np.float64)]
        out[(delta, 1)] = (np.array([float(a) for a, _ in lo_up]), np.array([float(b) for _, b in lo_up]))
    return p, logp, out


@pytest.mark.parametrize("variant", SUPPORTED)
def test_cell_edges_half_and_grid_end_against_mpmath(tmp_path, truth, variant):
    p, logp, exact_bounds = truth
    env = fresh_env()
    env["BANDPO_LUT_CPU_VARIANT"] = variant
    inputs = json.dumps([p.astype(np.float64).tolist(), logp.astype(np.float64).tolist()])
    # from outside the checkout, so that the installed package is imported
    res = run_fresh(["-c", CHILD, inputs], cwd=tmp_path, env=env, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["variant"] == variant
    for (delta, log_input), (rlo, rup) in exact_bounds.items():
        lo, up, same = got[f"{delta}/{log_input}"]
        assert same, (variant, delta, log_input)
        eu, el = accuracy.float32_worst(np.array(lo), np.array(up), rlo, rup)
        assert eu <= 7e-7 and el <= 3e-7, (variant, delta, log_input, eu, el)


@pytest.mark.parametrize("delta", [1e-3, 0.05, 1.0])
def test_the_shipped_table_fits_cells_in_p_bits(delta):
    """The kernel reads cells in p's bits only where their fit is within 1e-7 (bit_cells.h; else it keeps cells in t,
    silently slower; the GPU's cells would be NaN): the shipped table must fit, here refitted in numpy as the header
    describes (16 cells per binade of x, cubics through 4 Chebyshev nodes, checked at 9 points per cell): from x_lo's
    cell to x = 1/2 the reference reader's spline (bandpo_lut.tables.gpu_cells, which `verify` runs), and below it, on
    the side p -> 0, the upper bound's tail form (the CPU's tail cells)."""
    from bandpo_lut.tables import gpu_cells, store

    table = store.get("kl")
    x_lo = gpu_cells.x_lo_of(table.t.max)
    e_first = math.frexp(x_lo)[1] - 1
    # below x_lo's cell, p -> 0: kl_tail_upper (bandpo_math.h) in float64
    tcells = np.arange((e_first + 126) * 16 + (math.frexp(x_lo)[0] * 32 - 16).__floor__())
    tx0 = np.ldexp(1.0 + (tcells % 16) / 16.0, -126 + tcells // 16)
    tw = np.ldexp(1.0 / 16.0, -126 + tcells // 16)
    rho0 = -math.expm1(-delta)
    def tail_q(x):
        t = np.log(x) - np.log1p(-x)
        pc = np.maximum(x, 1e-30)
        base = 1 + delta + math.log(rho0) - np.maximum(t, -1000)
        return rho0 + pc * math.exp(-delta) * (base + pc * math.exp(-delta) * base / rho0)
    tnodes = 0.5 - 0.5 * np.cos((2 * np.arange(4) + 1) * np.pi / 8)
    tq = tail_q(tx0[:, None] + tw[:, None] * tnodes)
    tc = np.linalg.solve(np.broadcast_to(tnodes[:, None] ** np.arange(4), (len(tx0), 4, 4)), tq[:, :, None])[:, :, 0]
    tchecks = np.arange(9) / 8.0
    tfit = (tchecks[:, None] ** np.arange(4) * tc[:, None, :]).sum(-1)
    tail_worst = float(np.max(np.abs(tfit / tail_q(tx0[:, None] + tw[:, None] * tchecks) - 1)))
    worst = gpu_cells.cells_fit_error(table, delta)
    assert worst <= 1e-7 and tail_worst <= 1e-7, (worst, tail_worst)


# The GPU kernels' element code for the cells in p's bits (csrc/kl_bit_cells.h), compiled for the host: their layout
# (both sides from x_lo's cell, the elements below it in the tails) is not the CPU kernels', so it is built and read
# by the same functions the device runs (tools/gpu_code_on_host.cpp: bit_grid_for without tail cells, fit_bit_cell,
# kl_bits_scalar_delta; fit_bit_patch and kl_bits_token_delta for a per-token δ).
SPECIALS = np.array([0.0, -0.0, 1.0, np.nan, 2.0 ** -149, 2.0 ** -127, 1.5, -0.1], dtype=np.float32)
LOG_SPECIALS = np.array([-np.inf, 0.0, 1e-3, np.nan, -103.0, -88.0, 0.5, -1e-30], dtype=np.float32)


@pytest.fixture(scope="module")
def gpu_code(tmp_path_factory, truth):
    """The shipped KL table, the GPU code built for the host (tools/gpu_code_on_host.py), and the points: the edge
    points, then the special inputs, as p and as log p."""
    import sys

    from bandpo_lut.tables import store

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from gpu_code_on_host import HostGpuCode

    p, logp, _ = truth
    table = store.get("kl")
    code = HostGpuCode(table, tmp_path_factory.mktemp("gpu_code"))
    return table, code, np.concatenate([p, SPECIALS]), np.concatenate([logp, LOG_SPECIALS])


def test_verify_refits_as_the_device_code_fits(gpu_code):
    """`bandpo-lut verify`'s numpy refit of the GPU's cells and patches (bandpo_lut.tables.gpu_cells) gives the fit
    errors the device code itself reports (fit_bit_cell per δ, fit_bit_patch over the table), compiled for the host."""
    from bandpo_lut.tables import gpu_cells

    table, code, xs, logxs = gpu_code
    deltas = gpu_cells.check_deltas(table)
    _, fits, _ = code.scalar(xs[:4], logxs[:4], deltas)
    assert [d for d, _ in fits] == pytest.approx(deltas, rel=1e-6)
    for (d, device_error) in fits:
        assert gpu_cells.cells_fit_error(table, d) == pytest.approx(device_error, rel=1e-2), d
    _, (device_error, d_cells), _ = code.token(xs[:4], logxs[:4], np.full(4, 0.05, dtype=np.float32))
    assert gpu_cells.uses_bit_patches(table) and d_cells == 161
    assert gpu_cells.patches_fit_error(table) == pytest.approx(device_error, rel=1e-2)


def check_specials(rows, n_edge, delta):
    """The special inputs' bounds as the CPU op gives them (its NaN, zero, rounding and saturation rules), the cap
    aside."""
    import torch

    for col, (name, values) in ((0, ("p_old", SPECIALS)), (2, ("log_p_old", LOG_SPECIALS))):
        d = delta if isinstance(delta, float) else torch.from_numpy(delta)
        lo_op, up_op = bandpo_lut.bounds(delta=d, max_ratio=math.inf, **{name: torch.from_numpy(values)})
        np.testing.assert_allclose(rows[n_edge:, col], lo_op.double().numpy(), rtol=1e-6, atol=0)
        np.testing.assert_allclose(rows[n_edge:, col + 1], up_op.double().numpy(), rtol=1e-6, atol=0)


def test_gpu_layout_element_code_against_mpmath(truth, gpu_code):
    """Every edge point, p and log p, δ in {1e-3, 0.05, 1}: within the accuracy bars; and the special inputs (0, -0,
    1, NaN, subnormal, outside [0, 1], log p in the rounding allowance) as the CPU op gives them."""
    p, _, exact_bounds = truth
    table, code, xs, logxs = gpu_code
    deltas = (1e-3, 0.05, 1.0)
    grid, fits, rows = code.scalar(xs, logxs, deltas)
    assert grid["x_tail_lo"] == math.inf  # no tail cells: those elements take the tails
    # both sides from x_lo's cell (x_lo: |t| = t_max, rounded up to a float) to x = 1/2's, 32 bytes a cell: within the
    # 48 KB of shared memory every GPU gives a kernel without opting in
    x_lo = np.float32(1.0 / (1.0 + math.exp(table.t.max)))
    if float(x_lo) < 1.0 / (1.0 + math.exp(table.t.max)):
        x_lo = np.nextafter(x_lo, np.float32(1))
    assert grid["x_lo"] == x_lo
    lo_key = int(x_lo.view(np.int32)) >> 19
    side_cells = grid["side_cells"]
    assert grid["first_key"] == lo_key and side_cells == (int(np.float32(0.5).view(np.int32)) >> 19) - lo_key + 1
    assert 2 * side_cells * 32 <= 48 * 1024, side_cells
    for (delta, fit), r in zip(fits, rows):
        assert fit <= 1e-7, (delta, fit)
        for log_input, (lo, up) in ((0, (r[:, 0], r[:, 1])), (1, (r[:, 2], r[:, 3]))):
            rlo, rup = exact_bounds[(delta, log_input)]
            eu, el = accuracy.float32_worst(lo[: len(p)], up[: len(p)], rlo, rup)
            assert eu <= 7e-7 and el <= 3e-7, (delta, log_input, eu, el)
        check_specials(r, len(p), delta)


@pytest.fixture(scope="module")
def token_truth(truth):
    """One per-token δ per edge point, log-uniform in the table's range (seed 0) with δ's own cell edges (16 per
    binade, an ulp either side) and the range's ends among them, then one per special input; and the mpmath truth of
    the edge points at them, as p and as log p."""
    from bandpo_lut.tables import store

    p, logp, _ = truth
    table = store.get("kl")
    rng = np.random.default_rng(0)
    n = len(p) + len(SPECIALS)
    d = np.exp(rng.uniform(math.log(table.delta_min), math.log(table.delta_max), n)).astype(np.float32)
    edges = [np.float32(math.ldexp(1.0 + j / 16.0, e)) for e in range(-10, 0) for j in range(16)]
    edges = [v for x in edges for v in (np.nextafter(x, np.float32(0)), x, np.nextafter(x, np.float32(1)))]
    edges = [v for v in edges if table.delta_min <= v <= table.delta_max]
    edges += [np.float32(table.delta_min), np.float32(table.delta_max)]
    d[rng.permutation(len(p))[: len(edges)]] = edges
    dd = d[: len(p)].astype(np.float64)
    out = {0: accuracy.exact_bounds_f64(p.astype(np.float64), dd, "kl")}
    lo_up = [exact.bounds_from_logp(float(x), float(di), "kl") for x, di in zip(logp.astype(np.float64), dd)]
    out[1] = (np.array([float(a) for a, _ in lo_up]), np.array([float(b) for _, b in lo_up]))
    return d, out


def test_gpu_layout_per_token_element_code_against_mpmath(truth, token_truth, gpu_code):
    """Per-token δ from the patches in the bits of p and δ (fit_bit_patch, kl_bits_token_delta): every edge point with
    its own δ (token_truth), p and log p, within the accuracy bars; the special inputs as the CPU op gives them."""
    p, _, _ = truth
    table, code, xs, logxs = gpu_code
    d, exact_token = token_truth
    _, (fit, d_cells), rows = code.token(xs, logxs, d)
    assert fit <= 1e-7, fit
    assert d_cells == (int(np.float32(table.delta_max).view(np.int32)) >> 19) - (
        int(np.float32(table.delta_min).view(np.int32)) >> 19) + 1
    for log_input in (0, 1):
        rlo, rup = exact_token[log_input]
        eu, el = accuracy.float32_worst(rows[: len(p), 2 * log_input], rows[: len(p), 2 * log_input + 1], rlo, rup)
        assert eu <= 7e-7 and el <= 3e-7, (log_input, eu, el)
    check_specials(rows, len(p), d[len(p):])


TOKEN_CHILD = r"""
import json, sys
import torch, bandpo_lut
from bandpo_lut.runtime import _extension
p, logp, d = (torch.tensor(v, dtype=torch.float32) for v in json.loads(sys.argv[1]))
out = {"variant": _extension.facts()["cpu"]["variant"]}
for log_input in (False, True):
    key = "log_p_old" if log_input else "p_old"
    x = logp if log_input else p
    lo, up = bandpo_lut.bounds(delta=d, **{key: x})
    # in long runs, each point among other neighbours each time (shuffled), in whole vectors and blocks
    same = True
    for seed in range(4):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).repeat(3)
        lo3, up3 = bandpo_lut.bounds(delta=d[perm], **{key: x[perm]})
        same &= torch.equal(lo3.view(torch.int32), lo[perm].view(torch.int32))
        same &= torch.equal(up3.view(torch.int32), up[perm].view(torch.int32))
    out[str(int(log_input))] = [lo.double().tolist(), up.double().tolist(), bool(same)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("variant", SUPPORTED)
def test_cpu_per_token_at_the_cell_edges_against_mpmath(tmp_path, truth, token_truth, variant):
    """The CPU op with a per-token δ (the AVX2 kernel reads patches in the bits of p and δ: csrc/cpu/simd/
    bit_patches.h; AVX-512 the t-cubic table, table_gather.h; the baseline loops the B-spline patches) at every edge
    point with its own δ (token_truth: δ's cell edges among them), p and log p, against mpmath within the accuracy
    bars; each point's bits the same among other neighbours in long runs (the tails' pass in some of their blocks, not
    in others)."""
    p, logp, _ = truth
    d, exact_token = token_truth
    env = fresh_env()
    env["BANDPO_LUT_CPU_VARIANT"] = variant
    inputs = json.dumps([p.astype(np.float64).tolist(), logp.astype(np.float64).tolist(),
                         d[: len(p)].astype(np.float64).tolist()])
    res = run_fresh(["-c", TOKEN_CHILD, inputs], cwd=tmp_path, env=env, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["variant"] == variant
    for log_input in (0, 1):
        lo, up, same = got[str(log_input)]
        assert same, (variant, log_input)
        rlo, rup = exact_token[log_input]
        eu, el = accuracy.float32_worst(np.array(lo), np.array(up), rlo, rup)
        assert eu <= 7e-7 and el <= 3e-7, (variant, log_input, eu, el)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_kernels_at_the_cell_edges_against_mpmath(truth, token_truth):
    """The CUDA kernels themselves (float32: the cells in p's bits and the per-token patches) at the same points:
    scalar δ and per-token δ, p and log p, within the accuracy bars, and each point's bits the same in a long run
    (whole vectors, blocks and the dense kernel) as alone."""
    import torch

    p, logp, exact_bounds = truth
    d, exact_token = token_truth
    cases = [(delta, li, delta, exact_bounds[(delta, li)]) for delta in (1e-3, 0.05, 1.0) for li in (0, 1)]
    dt = torch.from_numpy(d[: len(p)]).cuda()
    cases += [("per-token", li, dt, exact_token[li]) for li in (0, 1)]
    for label, log_input, delta, (rlo, rup) in cases:
        x = torch.from_numpy(logp if log_input else p).cuda()
        kw = {"log_p_old" if log_input else "p_old": x}
        lo, up = bandpo_lut.bounds(delta=delta, max_ratio=math.inf, **kw)
        eu, el = accuracy.float32_worst(lo.double().cpu().numpy(), up.double().cpu().numpy(), rlo, rup)
        assert eu <= 7e-7 and el <= 3e-7, (label, log_input, eu, el)
        reps = {k: v.repeat(9) for k, v in kw.items()}
        lo9, up9 = bandpo_lut.bounds(delta=delta.repeat(9) if torch.is_tensor(delta) else delta, max_ratio=math.inf,
                                     **reps)
        assert torch.equal(lo9.view(9, -1), lo.expand(9, -1)) and torch.equal(up9.view(9, -1), up.expand(9, -1))
