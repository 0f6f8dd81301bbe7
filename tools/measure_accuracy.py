"""Accuracy of the compiled bounds against 40-digit mpmath over a large random sample (the README's figures).

    python tools/measure_accuracy.py --points 100000 [--divergence kl ...] [--workers 2] [--seed 2026]

Points: `bandpo_lut.tables.accuracy.sample_points` (60% with |logit p| ≤ 14, a fifth in each tail, δ log-uniform over
the table's range); inputs float32, δ per token (float32) and, separately, the scalar δ = 0.05. The truth is
mpmath's root at exactly the float32 values used, rounded to float64. Errors: upper |r - r*|/r*; lower
|r - r*|/(r*(1 + |ln r*|)) (a float evaluation of r = e^-L carries L's rounding), with a floor of two float32
subnormal spacings. mpmath costs ~6 ms a KL point: 10^5 points take ~5 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

import numpy as np
import torch

import bandpo_lut
from bandpo_lut.tables import accuracy
from bandpo_lut.tables import store as tables


def _truth(job):
    p, d, name = job
    return accuracy.exact_bounds_f64(p, d, name)


def exact_parallel(p, d, name, workers):
    chunks = [(pc, dc, name) for pc, dc in zip(np.array_split(p, workers * 8), np.array_split(d, workers * 8))]
    with mp.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_truth, chunks)
    return np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--divergence", nargs="+", default=list(tables.SHIPPED), choices=list(tables.SHIPPED))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2026)
    a = ap.parse_args(argv)
    if a.points < 1 or a.workers < 1:
        ap.error("--points and --workers must be >= 1")
    print(f"compiled bounds, float32 in, vs mpmath (40 digits); {a.points} random points each; seed {a.seed}")
    print(f"{'divergence':10s} {'delta':>10s} {'upper max rel':>14s} {'lower max':>10s}")
    for name in a.divergence:
        table = tables.get(name)
        p, d = accuracy.sample_points(a.points, table.delta_min, table.delta_max, a.seed,
                                      delta_max_inclusive=table.delta_max_inclusive)
        p32, d32 = torch.from_numpy(p).float(), torch.from_numpy(d).float()
        for label, dd in (("per-token", d32), ("0.05", 0.05)):
            lo, up = bandpo_lut.bounds(p32, dd, name)
            d_exact = d32.double().numpy() if label == "per-token" else np.full(a.points, 0.05)
            rlo, rup = exact_parallel(p32.double().numpy(), d_exact, name, a.workers)
            eu, el = accuracy.float32_worst(lo.numpy(), up.numpy(), rlo, rup)
            print(f"{name:10s} {label:>10s} {eu:14.2e} {el:10.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
