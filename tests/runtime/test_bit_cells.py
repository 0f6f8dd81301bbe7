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
    silently slower): the shipped table must fit, here refitted in numpy as the header describes (16 cells per
    binade of x, cubics through 4 Chebyshev nodes; from x_lo's cell to x = 1/2 the reference reader's spline, that
    cell on its part above x_lo; below it, on the side p -> 0, the upper bound's tail form), checked at 9 points per
    cell."""
    import torch

    from bandpo_lut.tables import store
    from bandpo_lut.tables.reader import _spline_eval

    table = store.get("kl")
    coef = table.coefficients("cpu", torch.float64)
    t_max = table.t.max
    x_lo = float(np.float32(1.0 / (1.0 + math.exp(t_max))))
    if x_lo < 1.0 / (1.0 + math.exp(t_max)):
        x_lo = float(np.nextafter(np.float32(x_lo), np.float32(1)))
    e_first = math.frexp(x_lo)[1] - 1
    cells = np.arange((-1 - e_first) * 16 + 1)
    x0 = np.ldexp(1.0 + (cells % 16) / 16.0, e_first + cells // 16)
    w = np.ldexp(1.0 / 16.0, e_first + cells // 16)
    f_lo = np.clip((x_lo - x0) / w, 0.0, None)
    used = f_lo < 1.0
    x0, w, f_lo = x0[used], w[used], f_lo[used]
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
    nodes = f_lo[:, None] + (1 - f_lo[:, None]) * (0.5 - 0.5 * np.cos((2 * np.arange(4) + 1) * np.pi / 8))
    checks = f_lo[:, None] + (1 - f_lo[:, None]) * np.arange(9) / 8.0
    worst = 0.0
    for side in (0, 1):
        def spline(f):
            x = x0[:, None] + w[:, None] * f
            t = np.clip((1 - 2 * side) * (np.log(x) - np.log1p(-x)), table.t.min, t_max)
            tt = torch.from_numpy(t.ravel())
            s = torch.full_like(tt, math.log(delta))
            return [_spline_eval(coef[k], table.t, table.s, tt, s).numpy().reshape(t.shape) for k in (0, 1)]
        at_nodes, at_checks = spline(nodes), spline(checks)
        vander = nodes[:, :, None] ** np.arange(4)
        for k in (0, 1):
            c = np.linalg.solve(vander, at_nodes[k][:, :, None])[:, :, 0]
            fit = (checks[:, :, None] ** np.arange(4) * c[:, None, :]).sum(-1)
            worst = max(worst, float(np.max(np.abs(fit / at_checks[k] - 1))))
    assert worst <= 1e-7 and tail_worst <= 1e-7, (worst, tail_worst)


# The GPU kernels' element code for the cells in p's bits (csrc/kl_bit_cells.h), compiled for the host: their layout
# (both sides from x_lo's cell, the elements below it in the tails) is not the CPU kernels', so it is built and read
# here by the same functions the device runs (bit_grid_for without tail cells, fit_bit_cell, kl_bits_scalar_delta).
GPU_LAYOUT_PROGRAM = r"""
#include "kl_bit_cells.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
using namespace bandpo;
static std::vector<float> read_floats(const char* path, size_t most) {
  std::vector<float> v(most);
  FILE* f = fopen(path, "rb");
  v.resize(fread(v.data(), sizeof(float), v.size(), f));
  fclose(f);
  return v;
}
int main(int argc, char** argv) {
  // argv: table file (float32 [2][nt + 2][ns + 2]), nt, ns, t_min, t_step, s_min, s_step, δ_min, δ_max, points file
  // (float32 pairs: p, its log-probability), then "scalar" and δ values, or "token" and a file of one δ per point
  TableView tb{};
  tb.nt = atoi(argv[2]); tb.ns = atoi(argv[3]);
  tb.t_min = atof(argv[4]); tb.t_step = atof(argv[5]); tb.s_min = atof(argv[6]); tb.s_step = atof(argv[7]);
  tb.delta_min = atof(argv[8]); tb.delta_max = atof(argv[9]);
  const std::vector<float> coef = read_floats(argv[1], 2 * static_cast<size_t>(tb.nt + 2) * (tb.ns + 2));
  tb.coef = coef.data();
  const std::vector<float> xs = read_floats(argv[10], 1 << 17);
  BitGrid g{};
  if (!bit_grid_for(tb, /*tail_cells=*/false, g)) return 4;
  printf("grid %d %d %.9g %.9g %.9g\n", g.first_key, g.side_cells, g.x_lo, g.x_cell, g.x_tail_lo);
  if (std::string(argv[11]) == "token") {
    std::vector<float> patches(2 * static_cast<size_t>(g.side_cells) * g.d_cells * kPatchValues);
    double worst = 0.0;
    for (int c = 0; c < 2 * g.side_cells; ++c) {
      for (int k = 0; k < g.d_cells; ++k) {
        const size_t at = (static_cast<size_t>(c) * g.d_cells + k) * kPatchValues;
        const double e = fit_bit_patch(tb, g, c, k, &patches[at]);
        worst = (e > worst || e != e) ? e : worst;
      }
    }
    printf("fit token %.3g %d\n", worst, g.d_cells);
    const std::vector<float> ds = read_floats(argv[12], 1 << 16);
    for (size_t i = 0; i + 1 < xs.size(); i += 2) {
      float lo, up, llo, lup;
      kl_bits_token_delta<false>(g, patches.data(), xs[i], ds[i / 2], lo, up);
      kl_bits_token_delta<true>(g, patches.data(), xs[i + 1], ds[i / 2], llo, lup);
      printf("%.9g %.9g %.9g %.9g\n", lo, up, llo, lup);
    }
    return 0;
  }
  for (int a = 12; a < argc; ++a) {
    const double delta = atof(argv[a]);
    double ws[4];
    const int js = delta_weights(tb, delta, ws);
    std::vector<double> cell_d(8 * static_cast<size_t>(tb.nt - 1));
    for (int k = 0; k < tb.nt - 1; ++k) collapse_cell(tb, k, js, ws, &cell_d[8 * static_cast<size_t>(k)]);
    std::vector<float> cells(16 * static_cast<size_t>(g.side_cells));
    double worst = 0.0;
    const DeltaConsts<double> dc = delta_consts<double>(delta);
    for (int c = 0; c < 2 * g.side_cells; ++c) {
      const double e = fit_bit_cell(tb, cell_d.data(), dc, g, c, &cells[8 * static_cast<size_t>(c)]);
      worst = (e > worst || e != e) ? e : worst;
    }
    printf("fit %.17g %.3g\n", delta, worst);
    const DeltaConsts<float> c = delta_consts<float>(static_cast<float>(delta));
    for (size_t i = 0; i + 1 < xs.size(); i += 2) {
      float lo, up, llo, lup;
      kl_bits_scalar_delta<false>(g, cells.data(), c, xs[i], lo, up);
      kl_bits_scalar_delta<true>(g, cells.data(), c, xs[i + 1], llo, lup);
      printf("%.9g %.9g %.9g %.9g\n", lo, up, llo, lup);
    }
  }
  return 0;
}
"""

SPECIALS = np.array([0.0, -0.0, 1.0, np.nan, 2.0 ** -149, 2.0 ** -127, 1.5, -0.1], dtype=np.float32)
LOG_SPECIALS = np.array([-np.inf, 0.0, 1e-3, np.nan, -103.0, -88.0, 0.5, -1e-30], dtype=np.float32)


@pytest.fixture(scope="module")
def gpu_layout(tmp_path_factory, truth):
    """The program built, the table and the points (edge points, then the special inputs) written: a function
    running it with its last arguments and returning its output's lines."""
    import shutil
    import subprocess

    from bandpo_lut.tables import store

    tmp = tmp_path_factory.mktemp("gpu_layout")
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler (the extension's build needs one)"
    p, logp, _ = truth
    points = np.stack([np.concatenate([p, SPECIALS]), np.concatenate([logp, LOG_SPECIALS])], axis=1)
    (tmp / "points.bin").write_bytes(np.ascontiguousarray(points, dtype=np.float32).tobytes())
    table = store.get("kl")
    (tmp / "table.bin").write_bytes(table.coefficients("cpu").numpy().astype(np.float32).tobytes())
    (tmp / "main.cpp").write_text(GPU_LAYOUT_PROGRAM)
    src = Path(__file__).resolve().parents[2] / "csrc"
    exe = tmp / "gpu_layout"
    subprocess.run([cxx, "-O2", "-std=c++17", f"-I{src}", str(tmp / "main.cpp"), "-o", str(exe)], check=True,
                   timeout=300)
    head = [str(exe), str(tmp / "table.bin"), str(table.t.n), str(table.s.n), repr(table.t.min), repr(table.t.step),
            repr(table.s.min), repr(table.s.step), repr(table.delta_min), repr(table.delta_max),
            str(tmp / "points.bin")]

    def run(*tail):
        out = subprocess.run([*head, *tail], check=True, capture_output=True, text=True, timeout=300)
        return out.stdout.splitlines()

    return table, tmp, run


def test_gpu_layout_element_code_against_mpmath(truth, gpu_layout):
    """Every edge point, p and log p, δ in {1e-3, 0.05, 1}: within the accuracy bars; and the special inputs (0, -0,
    1, NaN, subnormal, outside [0, 1], log p in the rounding allowance) as the CPU op gives them."""
    import torch

    p, logp, exact_bounds = truth
    table, _, run = gpu_layout
    deltas = (1e-3, 0.05, 1.0)
    lines = run("scalar", *map(repr, deltas))
    first_key, side_cells = (int(v) for v in lines[0].split()[1:3])
    assert float(lines[0].split()[5]) == math.inf  # no tail cells: those elements take the tails
    # both sides from x_lo's cell (x_lo: |t| = t_max, rounded up to a float) to x = 1/2's, 32 bytes a cell: within the
    # 48 KB of shared memory every GPU gives a kernel without opting in
    x_lo = np.float32(1.0 / (1.0 + math.exp(table.t.max)))
    if float(x_lo) < 1.0 / (1.0 + math.exp(table.t.max)):
        x_lo = np.nextafter(x_lo, np.float32(1))
    assert np.float32(lines[0].split()[3]) == x_lo
    lo_key = int(x_lo.view(np.int32)) >> 19
    assert first_key == lo_key and side_cells == (int(np.float32(0.5).view(np.int32)) >> 19) - lo_key + 1
    assert 2 * side_cells * 32 <= 48 * 1024, side_cells
    n = len(p) + len(SPECIALS)
    for k, delta in enumerate(deltas):
        fit = lines[1 + k * (n + 1)].split()
        assert float(fit[1]) == delta and float(fit[2]) <= 1e-7, fit
        rows = np.array([[float(v) for v in line.split()] for line in lines[2 + k * (n + 1): 2 + k * (n + 1) + n]])
        for log_input, (lo, up) in ((0, (rows[:, 0], rows[:, 1])), (1, (rows[:, 2], rows[:, 3]))):
            rlo, rup = exact_bounds[(delta, log_input)]
            eu, el = accuracy.float32_worst(lo[: len(p)], up[: len(p)], rlo, rup)
            assert eu <= 7e-7 and el <= 3e-7, (delta, log_input, eu, el)
        # the special inputs as the CPU op gives them (its NaN, zero, rounding and saturation rules), the cap aside
        for col, kw in ((0, {"p_old": SPECIALS}), (2, {"log_p_old": LOG_SPECIALS})):
            (name, values), = kw.items()
            lo_op, up_op = bandpo_lut.bounds(delta=delta, max_ratio=math.inf, **{name: torch.from_numpy(values)})
            np.testing.assert_allclose(rows[len(p):, col], lo_op.double().numpy(), rtol=1e-6, atol=0)
            np.testing.assert_allclose(rows[len(p):, col + 1], up_op.double().numpy(), rtol=1e-6, atol=0)


def test_gpu_layout_per_token_element_code_against_mpmath(truth, gpu_layout):
    """Per-token δ from the patches in the bits of p and δ (fit_bit_patch, kl_bits_token_delta): every edge point with
    its own δ, log-uniform in the table's range (seed 0) with both ends and δ's cell edges among them, p and log p,
    within the accuracy bars; the special inputs as the CPU op gives them."""
    import torch

    p, logp, _ = truth
    table, tmp, run = gpu_layout
    rng = np.random.default_rng(0)
    n = len(p) + len(SPECIALS)
    d = np.exp(rng.uniform(math.log(table.delta_min), math.log(table.delta_max), n)).astype(np.float32)
    # δ's own cell edges (16 per binade), an ulp either side, and the range's ends, on some of the points
    edges = [np.float32(math.ldexp(1.0 + j / 16.0, e)) for e in range(-10, 0) for j in range(16)]
    edges = [v for x in edges for v in (np.nextafter(x, np.float32(0)), x, np.nextafter(x, np.float32(1)))]
    edges = [v for v in edges if table.delta_min <= v <= table.delta_max]
    edges += [np.float32(table.delta_min), np.float32(table.delta_max)]
    d[rng.permutation(len(p))[: len(edges)]] = edges
    (tmp / "deltas.bin").write_bytes(d.tobytes())
    lines = run("token", str(tmp / "deltas.bin"))
    fit = lines[1].split()
    assert fit[:2] == ["fit", "token"] and float(fit[2]) <= 1e-7, fit
    assert int(fit[3]) == (int(np.float32(table.delta_max).view(np.int32)) >> 19) - (
        int(np.float32(table.delta_min).view(np.int32)) >> 19) + 1
    rows = np.array([[float(v) for v in line.split()] for line in lines[2: 2 + n]])
    dd = d[: len(p)].astype(np.float64)
    rlo, rup = accuracy.exact_bounds_f64(p.astype(np.float64), dd, "kl")
    eu, el = accuracy.float32_worst(rows[: len(p), 0], rows[: len(p), 1], rlo, rup)
    assert eu <= 7e-7 and el <= 3e-7, ("p", eu, el)
    lo_up = [exact.bounds_from_logp(float(x), float(di), "kl") for x, di in zip(logp.astype(np.float64), dd)]
    rlo = np.array([float(a) for a, _ in lo_up])
    rup = np.array([float(b) for _, b in lo_up])
    eu, el = accuracy.float32_worst(rows[: len(p), 2], rows[: len(p), 3], rlo, rup)
    assert eu <= 7e-7 and el <= 3e-7, ("log p", eu, el)
    ds = torch.from_numpy(d[len(p):])
    for col, kw in ((0, {"p_old": SPECIALS}), (2, {"log_p_old": LOG_SPECIALS})):
        (name, values), = kw.items()
        lo_op, up_op = bandpo_lut.bounds(delta=ds, max_ratio=math.inf, **{name: torch.from_numpy(values)})
        np.testing.assert_allclose(rows[len(p):, col], lo_op.double().numpy(), rtol=1e-6, atol=0)
        np.testing.assert_allclose(rows[len(p):, col + 1], up_op.double().numpy(), rtol=1e-6, atol=0)
