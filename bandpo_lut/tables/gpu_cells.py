"""Whether a KL table fits the GPU's cells in p's float bits and its per-token patches, refitted here in numpy.

On a GPU, float inputs read the scalar-δ KL band from cubics in x (p, or 1 - p on the other side) over 16 cells per
binade, from the cell of x_lo = 1/(1 + e^t_max) to x = 1/2, each through 4 Chebyshev nodes of the table's spline at
that δ and checked at 9 points (csrc/kl_bit_cells.h fit_bit_cell, fitted on the device once per δ); a per-token δ
reads bicubics in the fractions of x's cell and of δ's cell (16 per binade of δ), through 4 × 4 nodes, checked at
7 × 7 points (fit_bit_patch, once per table). A cell or patch whose fit misses TOLERANCE is NaN there (the device
cannot tell the host without a synchronisation), so its elements' bounds are NaN; the CPU, which checks on the host,
reads the table another way instead. `bandpo-lut verify` runs these checks so that a regenerated table the GPU cannot
read this way is known before it is used. The shipped table: cells within 1.6e-8 at verify's δ, patches 4.4e-8 (the
device code compiled for the host gives the same figures: tests/runtime/test_bit_cells.py).
"""
from __future__ import annotations

import math

import numpy as np

TOLERANCE = 1e-7          # csrc/kl_bit_cells.h kBitCellsTolerance
CELLS_PER_BINADE = 16     # BitGrid::kBits = 4
PATCH_BYTES = 32 * 4      # kPatchValues floats
MAX_PATCH_BYTES = 256.0 * 1024 * 1024   # kMaxPatchBytes
CHEBYSHEV = 0.5 - 0.5 * np.cos((2 * np.arange(4) + 1) * np.pi / 8)   # chebyshev_node4: every fit's nodes in [0, 1]


def x_lo_of(t_max: float) -> float | None:
    """The float32 x_lo of bit_grid_for (x where |t| = t_max, rounded up to a float), or None where the GPU keeps the
    cells in t (x_lo out of (1e-30, 1/4))."""
    x = float(np.float32(1.0 / (1.0 + math.exp(t_max))))
    if x < 1.0 / (1.0 + math.exp(t_max)):
        x = float(np.nextafter(np.float32(x), np.float32(1)))
    return x if 1e-30 < x < 0.25 else None


def uses_bit_cells(table) -> bool:
    """Whether the GPU reads this table's scalar-δ band from cells in p's bits: a KL table whose t grid is symmetric
    (bit_grid_for), with x_lo in range."""
    return (table.divergence.name == "kl" and table.t.n >= 2 and table.t.min < 0 and table.t.max == -table.t.min
            and x_lo_of(table.t.max) is not None)


def uses_bit_patches(table) -> bool:
    """Whether the GPU reads a per-token δ's band from patches in the bits of p and δ (bit_patch_grid): a table that
    uses bit cells, whose δ range is within the normal floats and whose patches take at most 256 MB."""
    if not uses_bit_cells(table):
        return False
    d_lo, d_hi = float(np.float32(table.delta_min)), float(np.float32(table.delta_max))
    if not (np.finfo(np.float32).tiny <= d_lo <= d_hi < 1e30):
        return False
    side_cells = _key(0.5) - _key(x_lo_of(table.t.max)) + 1
    return 2.0 * side_cells * (_key(d_hi) - _key(d_lo) + 1) * PATCH_BYTES <= MAX_PATCH_BYTES


def _lagrange(nodes: np.ndarray, at: np.ndarray) -> np.ndarray:
    """L[a, i]: the Lagrange basis of `nodes` (i) at the points `at` (a): interpolation through the nodes is L @ y."""
    out = np.ones((len(at), len(nodes)))
    for i, xi in enumerate(nodes):
        for j, xj in enumerate(nodes):
            if j != i:
                out[:, i] *= (at - xj) / (xi - xj)
    return out


def _key_span(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the cell of each key (a float32's bits >> 19) begins, and its width: 1/16 of its binade."""
    start = (keys.astype(np.int32) << 19).view(np.float32).astype(np.float64)
    width = ((keys.astype(np.int32) >> 4) << 23).view(np.float32).astype(np.float64) / CELLS_PER_BINADE
    return start, width


def _key(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.int32)[0] >> 19)


def _x_cells(table):
    """The cells of x (each side), from x_lo's to x = 1/2's: their start x0, width w and the fraction f_lo where their
    fitted part begins (x_lo inside x_lo's cell, else 0): bit_cell_place."""
    x_lo = x_lo_of(table.t.max)
    x0, w = _key_span(np.arange(_key(x_lo), _key(0.5) + 1))
    return x0, w, np.maximum(0.0, (x_lo - x0) / w)


def _t_of(table, side: int, x: np.ndarray) -> np.ndarray:
    """t = logit of the side's p (x on side 0, 1 - x on side 1), clamped to the grid: bit_cell_t."""
    return np.clip((1 - 2 * side) * (np.log(x) - np.log1p(-x)), table.t.min, table.t.max)


def _worst(fit: np.ndarray, truth: np.ndarray) -> float:
    """The largest |fit / truth - 1|; inf where it is NaN (a damaged table)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(fit / truth - 1)
    return float(np.max(np.where(np.isnan(err), np.inf, err)))


def cells_fit_error(table, delta: float) -> float:
    """The scalar-δ cells (fit_bit_cell): for each cell of x, both sides, the cubics through 4 Chebyshev nodes of the
    table's spline at `delta`; returns their worst relative error at 9 check points, both bounds (float64)."""
    import torch

    from bandpo_lut.tables.reader import _spline_eval

    coef = table.coefficients("cpu", torch.float64)
    x0, w, f_lo = _x_cells(table)
    unit = np.concatenate([CHEBYSHEV, np.arange(9) / 8.0])   # the nodes, then the checks, in [0, 1]
    lagrange = _lagrange(CHEBYSHEV, np.arange(9) / 8.0)
    f = f_lo[:, None] + (1 - f_lo[:, None]) * unit
    worst = 0.0
    for side in (0, 1):
        tt = torch.from_numpy(_t_of(table, side, x0[:, None] + w[:, None] * f).ravel())
        s = torch.full_like(tt, math.log(delta))
        for plane in (0, 1):
            v = _spline_eval(coef[plane], table.t, table.s, tt, s).numpy().reshape(f.shape)
            worst = max(worst, _worst(v[:, :4] @ lagrange.T, v[:, 4:]))
    return worst


def patches_fit_error(table) -> float:
    """The per-token δ's patches (fit_bit_patch): for each cell of x (both sides) and each cell of δ in its float bits
    (from δ_min's cell to δ_max's, each over its part of the range), the bicubics through 4 × 4 Chebyshev nodes of the
    table's spline in (t, log δ); returns their worst relative error at 7 × 7 check points, both bounds (inf for a NaN
    value). One array per table, whatever the δ."""
    import torch

    from bandpo_lut.tables.reader import _spline_eval

    coef = table.coefficients("cpu", torch.float64)
    x0, w, f_lo = _x_cells(table)
    d_lo, d_hi = float(np.float32(table.delta_min)), float(np.float32(table.delta_max))
    d0, dw = _key_span(np.arange(_key(d_lo), _key(d_hi) + 1))
    g_lo = np.maximum(0.0, (d_lo - d0) / dw)
    g_hi = np.minimum(1.0, (d_hi - d0) / dw)
    g_hi = np.where(g_hi - g_lo < 1.0 / 1024, 1.0, g_hi)   # δ_max at its cell's start: the spline is flat past it
    unit = np.concatenate([CHEBYSHEV, np.arange(7) / 6.0])   # the nodes, then the checks, in [0, 1]
    lagrange = _lagrange(CHEBYSHEV, np.arange(7) / 6.0)      # (7 checks, 4 nodes), the same for every cell
    f = f_lo[:, None] + (1 - f_lo[:, None]) * unit            # (cells of x, 11)
    worst = 0.0
    for side in (0, 1):
        t = _t_of(table, side, x0[:, None] + w[:, None] * f)
        tt = torch.from_numpy(np.repeat(t[:, :, None], len(unit), 2).ravel())
        for k in range(len(d0)):
            gd = g_lo[k] + (g_hi[k] - g_lo[k]) * unit                           # (11,)
            s = np.clip(np.log(d0[k] + dw[k] * gd), table.s.min, table.s.max)
            ss = torch.from_numpy(np.broadcast_to(s, t.shape + (len(unit),)).ravel().copy())
            for plane in (0, 1):
                v = _spline_eval(coef[plane], table.t, table.s, tt, ss).numpy().reshape(t.shape + (len(unit),))
                fit = np.einsum("ai,cij,bj->cab", lagrange, v[:, :4, :4], lagrange)   # [cell, f, g]
                worst = max(worst, _worst(fit, v[:, 4:, 4:]))
    return worst


def check_deltas(table) -> list[float]:
    """The δ verify checks: five log-spaced over the table's range (its upper end just inside when exclusive), and
    the paper's 0.05 where the range holds it."""
    hi = table.delta_max if table.delta_max_inclusive else math.nextafter(table.delta_max, 0)
    deltas = {float(d) for d in np.geomspace(table.delta_min, hi, 5)}
    if table.delta_min <= 0.05 <= hi:
        deltas.add(0.05)
    return sorted(deltas)
