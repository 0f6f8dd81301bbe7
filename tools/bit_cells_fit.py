#!/usr/bin/env python
"""How well per-cell cubics in p's float bits carry the scalar-δ KL band: the cells that take t = logit p (a division
and a logarithm per element) out of the AVX2 kernel (csrc/cpu/simd/bit_cells.h, which fits them the same way and
checks each at 9 points), here at 64 points per cell and for other cell counts per binade.

The cells: x = min(p, 1 - p) (exact in float arithmetic for p >= 1/2), 2^K cells per binade of x, cell = x's
exponent and top K mantissa bits, fraction f = the remaining mantissa bits as a float in [0, 1) (exact); one side of
cells for p <= 1/2, one for p > 1/2. In each cell q_up and κ are cubics in f, here interpolated at 4 Chebyshev nodes
(float64) from the shipped KL table's spline at the fixed δ. Printed: the worst deviation, over 64 points per cell,
of those cubics from the spline itself, as the accuracy bars measure errors (upper: relative in q_up, clamped to
[p, 1]; lower: |ΔL|/(1 + |L|) with L = -(δ/p)κ = ln r_lo). The spline is what cells in t read, so this is the error
the cells add. Binades 2^-20 ... 2^-2 (x = 1/2 is the one point of binade 2^-1); the kernel's cells also cover x_lo's
binade (its cell above x_lo only) and, below the grid, the upper bound's tail form (tests/runtime/test_bit_cells.py).

usage: python tools/bit_cells_fit.py [--bits 4] [--deltas 1e-3 0.05 0.3 1]
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch

from bandpo_lut.tables import store
from bandpo_lut.tables.reader import _spline_eval

FIRST_BINADE, LAST_BINADE = -20, -2  # x in [2^-20, 2^-1): t = logit p within [-13.86, 13.86] on the table's grid
POINTS_PER_CELL = 64


def spline_at(table, coef, t: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The shipped spline's (q_up, κ) at t and the fixed δ, in float64."""
    tt = torch.from_numpy(t)
    s = torch.full_like(tt, math.log(delta))
    return (_spline_eval(coef[0], table.t, table.s, tt, s).numpy(),
            _spline_eval(coef[1], table.t, table.s, tt, s).numpy())


def worst_fit(bits: int, delta: float) -> tuple[float, float]:
    table = store.get("kl")
    coef = table.coefficients("cpu", torch.float64)
    nodes = 0.5 - 0.5 * np.cos((2 * np.arange(4) + 1) * np.pi / 8)  # Chebyshev nodes on [0, 1]
    inside = (np.arange(POINTS_PER_CELL) + 0.5) / POINTS_PER_CELL
    to_power = np.linalg.inv(np.vander(nodes, 4, increasing=True))  # values at the nodes -> power coefficients
    at_inside = np.vander(inside, 4, increasing=True)
    worst_up = worst_lo = 0.0
    for upper_side in (False, True):
        for e in range(FIRST_BINADE, LAST_BINADE + 1):
            width = 2.0 ** e / 2 ** bits
            for j in range(2 ** bits):
                x0 = 2.0 ** e + j * width

                def values(f):
                    x = x0 + width * f
                    p = 1 - x if upper_side else x
                    q, kappa = spline_at(table, coef, np.log(p) - np.log1p(-p), delta)
                    return p, q, kappa

                _, q_nodes, k_nodes = values(nodes)
                p, q, kappa = values(inside)
                q_fit = at_inside @ (to_power @ q_nodes)
                k_fit = at_inside @ (to_power @ k_nodes)
                worst_up = max(worst_up, float(np.max(np.abs(q_fit - q) / np.clip(q, p, 1.0))))
                L = delta / p * kappa
                worst_lo = max(worst_lo, float(np.max(delta / p * np.abs(k_fit - kappa) / (1 + np.abs(L)))))
    return worst_up, worst_lo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, nargs="+", default=[4], help="K: 2^K cells per binade (default 4)")
    ap.add_argument("--deltas", type=float, nargs="+", default=[1e-3, 0.05, 0.3, 1.0])
    a = ap.parse_args(argv)
    for bits in a.bits:
        if not 1 <= bits <= 10:
            ap.error(f"--bits: expected 1 ... 10, got {bits}")
    print("cubics in p's bits against the shipped KL spline (float64), worst over "
          f"{POINTS_PER_CELL} points per cell, binades 2^{FIRST_BINADE} ... 2^{LAST_BINADE}, both sides")
    print(f"{'K':>2s} {'cells':>6s} {'delta':>8s} {'upper (rel.)':>13s} {'lower |dL|/(1+|L|)':>19s}")
    for bits in a.bits:
        cells = 2 * (LAST_BINADE - FIRST_BINADE + 1) * 2 ** bits
        for delta in a.deltas:
            up, lo = worst_fit(bits, delta)
            print(f"{bits:2d} {cells:6d} {delta:8g} {up:13.2e} {lo:19.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
