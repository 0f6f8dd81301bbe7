"""`bandpo-lut verify FILE...`: check tables against mpmath and for monotonicity.

For each file: evaluates the table with `bandpo_lut.reference.bounds` (float64) at random off-grid
points (p over its whole float range, δ over the table's range) against the 40-digit mpmath roots, prints
the worst errors and where they occur, and checks on a dense grid (default 4000 values of p × 200 of δ)
that the upper bound never increases with p nor decreases with δ, and the lower bound the opposite,
beyond one unit in the last place (a NaN bound there is a violation; a file whose coefficients are not all
finite numbers does not load). A KL table is also refitted as the GPU reads it for float inputs
(`bandpo_lut.tables.gpu_cells`: cubics in p's float bits at six δ, and the per-token patches): a fit beyond 1e-7
would give NaN bounds there, and fails the file. Every file is reported, a bad one as FAILED with the reason (it does
not stop the others); exits 1 if any file fails to load, exceeds its tolerance or is not monotone.
`--tolerance` overrides the header's tolerance, 0 included (exact agreement in float64).
"""
from __future__ import annotations

import math
import sys

import numpy as np

from bandpo_lut.tables import accuracy, gpu_cells
from bandpo_lut.tables import store as tables
from bandpo_lut.tables.table_format import CHECKSUM_KEY, TableFormatError

# Upper ends of the size arguments: --points by time (each point is an mpmath root, ~ms: 10^6 is about an hour
# per table), the monotonicity grid by memory (checked in `run` against what is free, ~10 float64 arrays of
# dense_p x dense_delta).
MAX_POINTS = 1_000_000
MAX_DENSE = 10 ** 8


def monotonicity_violations(table, n_p: int, n_delta: int):
    """Counts of (upper up in p, lower down in p, upper down in δ, lower up in δ) beyond 1 ulp; a NaN bound
    counts as a violation on each side it has."""
    import torch

    from bandpo_lut.tables.reader import bounds
    t = np.linspace(-36.0, 36.0, n_p)
    p = 1.0 / (1.0 + np.exp(-t))
    hi = table.delta_max if table.delta_max_inclusive else math.nextafter(table.delta_max, 0)
    d = np.exp(np.linspace(math.log(table.delta_min), math.log(hi), n_delta))
    P = torch.from_numpy(np.repeat(p[None, :], n_delta, 0))
    D = torch.from_numpy(np.repeat(d[:, None], n_p, 1))
    lo, up = (x.numpy() for x in bounds(P, D, table.divergence.name, table=table))

    # Written as "not within one ulp" so that a NaN bound (which compares false either way) counts as a violation.
    def rises(a, axis):      # a[k+1] > a[k] by more than one ulp
        return int(np.sum(~(np.diff(a, axis=axis) <= np.spacing(np.abs(np.delete(a, 0, axis=axis))))))

    def falls(a, axis):
        return int(np.sum(~(-np.diff(a, axis=axis) <= np.spacing(np.abs(np.delete(a, -1, axis=axis))))))

    finite_up = np.where(np.isinf(up), np.finfo(np.float64).max, up)
    return rises(finite_up, 1), falls(lo, 1), falls(finite_up, 0), rises(lo, 0)


def measure(table, points: int, seed: int, t_max: float):
    """Worst errors of `table` (read in float64 by `bandpo_lut.reference.bounds`) against the mpmath roots at
    `points` random off-grid (p, δ): (upper max rel err, lower max err, index of each, p, δ). The generator
    stamps its tables' accuracy with this measurement, and `verify` repeats it."""
    import torch

    from bandpo_lut.tables.reader import bounds
    p, d = accuracy.sample_points(points, table.delta_min, table.delta_max, seed, t_max, table.delta_max_inclusive)
    lo, up = bounds(torch.from_numpy(p), torch.from_numpy(d), table.divergence.name, table=table)
    rlo, rup = accuracy.exact_bounds_f64(p, d, table.divergence.name)
    eu, el, iu, il = accuracy.worst(lo.numpy(), up.numpy(), rlo, rup)
    return eu, el, iu, il, p, d


def verify_file(path, points, seed, n_p, n_delta, tolerance=None, out=None) -> bool:
    out = out or sys.stdout
    try:
        table = tables.load(path)
    except (TableFormatError, OSError) as e:
        print(f"FAILED {path}: {e}", file=out)
        return False
    stated = (table.header.get("accuracy") or {}).get("tolerance", 1e-6)
    tol = float(stated if tolerance is None else tolerance)
    name = table.divergence.name
    eu, el, iu, il, p, d = measure(table, points, seed, table.t.max)
    mono = monotonicity_violations(table, n_p, n_delta)
    gpu = [(gpu_cells.cells_fit_error(table, dl), dl) for dl in gpu_cells.check_deltas(table)] \
        if gpu_cells.uses_bit_cells(table) else []
    gpu_worst = max(gpu, default=(0.0, None))
    patches = gpu_cells.patches_fit_error(table) if gpu_cells.uses_bit_patches(table) else None
    gpu_ok = gpu_worst[0] <= gpu_cells.TOLERANCE and (patches is None or patches <= gpu_cells.TOLERANCE)
    ok = eu <= tol and el <= tol and not any(mono) and gpu_ok
    h = table.header
    print(f"{'ok    ' if ok else 'FAILED'} {path}: divergence {name}, delta in [{table.delta_min:g}, "
          f"{table.delta_max:g}{']' if table.delta_max_inclusive else ')'}, grid {table.t.n}x{table.s.n}, "
          f"{h['storage_dtype']}, sha256 {h[CHECKSUM_KEY][:12]}", file=out)
    print(f"     {points} random points vs mpmath: upper max rel err {eu:.2e} (p={p[iu]:.6g}, delta={d[iu]:.4g}); "
          f"lower max err {el:.2e} (p={p[il]:.6g}, delta={d[il]:.4g}); tolerance {tol:g}", file=out)
    print(f"     monotone on {n_p}x{n_delta}: violations beyond 1 ulp: upper-in-p {mono[0]}, lower-in-p {mono[1]}, "
          f"upper-in-delta {mono[2]}, lower-in-delta {mono[3]}", file=out)
    def verdict(e):
        return "fits" if e <= gpu_cells.TOLERANCE else "MISSES (a GPU would give NaN bounds there)"
    if gpu:
        print(f"     GPU cells in p's bits (float inputs, scalar delta) at {len(gpu)} deltas: worst fit "
              f"{gpu_worst[0]:.2e} (delta={gpu_worst[1]:.4g}), {verdict(gpu_worst[0])}; bound {gpu_cells.TOLERANCE:g}",
              file=out)
    if patches is not None:
        print(f"     GPU patches in the bits of p and delta (float inputs, per-token delta): worst fit {patches:.2e}, "
              f"{verdict(patches)}; bound {gpu_cells.TOLERANCE:g}", file=out)
    return ok


