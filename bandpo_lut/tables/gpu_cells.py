"""Whether a KL table's scalar-δ band fits the GPU's cells in p's float bits, refitted here in numpy.

On a GPU, float inputs read the scalar-δ KL band from cubics in x (p, or 1 - p on the other side) over 16 cells per
binade, from the cell of x_lo = 1/(1 + e^t_max) to x = 1/2, each through 4 Chebyshev nodes of the table's spline at
that δ and checked at 9 points (csrc/kl_bit_cells.h, fitted on the device once per δ). A cell whose fit misses
TOLERANCE is NaN there (the device cannot tell the host without a synchronisation), so its elements' bounds are NaN;
the CPU, which checks on the host, reads the table's cells in t instead. `bandpo-lut verify` runs this check so that a
regenerated table that the GPU cannot read this way is known before it is used. The shipped table fits within ~2e-8.
"""
from __future__ import annotations

import math

import numpy as np

TOLERANCE = 1e-7          # csrc/kl_bit_cells.h kBitCellsTolerance
CELLS_PER_BINADE = 16     # BitGrid::kBits = 4


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


def cells_fit_error(table, delta: float) -> float:
    """The worst relative error of the cells' cubics against the table's spline at their 9 check points, both sides,
    at `delta` (float64). Cell c of side s covers x in [x0, x0 + w) (x0 = (1 + (c mod 16)/16)·2^e); x_lo's own cell
    is fitted on its part above x_lo."""
    import torch

    from bandpo_lut.tables.reader import _spline_eval

    coef = table.coefficients("cpu", torch.float64)
    t_min, t_max = table.t.min, table.t.max
    x_lo = x_lo_of(t_max)
    e_first = math.frexp(x_lo)[1] - 1
    cells = np.arange((-1 - e_first) * CELLS_PER_BINADE + 1)
    x0 = np.ldexp(1.0 + (cells % CELLS_PER_BINADE) / CELLS_PER_BINADE, e_first + cells // CELLS_PER_BINADE)
    w = np.ldexp(1.0 / CELLS_PER_BINADE, e_first + cells // CELLS_PER_BINADE)
    f_lo = np.clip((x_lo - x0) / w, 0.0, None)
    used = f_lo < 1.0
    x0, w, f_lo = x0[used], w[used], f_lo[used]
    chebyshev = 0.5 - 0.5 * np.cos((2 * np.arange(4) + 1) * np.pi / 8)
    nodes = f_lo[:, None] + (1 - f_lo[:, None]) * chebyshev
    checks = f_lo[:, None] + (1 - f_lo[:, None]) * np.arange(9) / 8.0
    worst = 0.0
    for side in (0, 1):
        def spline(f, side=side):
            x = x0[:, None] + w[:, None] * f
            t = np.clip((1 - 2 * side) * (np.log(x) - np.log1p(-x)), t_min, t_max)
            tt = torch.from_numpy(t.ravel())
            s = torch.full_like(tt, math.log(delta))
            return [_spline_eval(coef[k], table.t, table.s, tt, s).numpy().reshape(t.shape) for k in (0, 1)]

        at_nodes, at_checks = spline(nodes), spline(checks)
        vander = nodes[:, :, None] ** np.arange(4)
        for k in (0, 1):
            c = np.linalg.solve(vander, at_nodes[k][:, :, None])[:, :, 0]
            fit = (checks[:, :, None] ** np.arange(4) * c[:, None, :]).sum(-1)
            with np.errstate(invalid="ignore", divide="ignore"):
                err = np.abs(fit / at_checks[k] - 1)
            worst = max(worst, float(np.max(np.where(np.isnan(err), np.inf, err))))
    return worst


def check_deltas(table) -> list[float]:
    """The δ verify checks: five log-spaced over the table's range (its upper end just inside when exclusive), and
    the paper's 0.05 where the range holds it."""
    hi = table.delta_max if table.delta_max_inclusive else math.nextafter(table.delta_max, 0)
    deltas = {float(d) for d in np.geomspace(table.delta_min, hi, 5)}
    if table.delta_min <= 0.05 <= hi:
        deltas.add(0.05)
    return sorted(deltas)
