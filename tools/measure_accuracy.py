"""Accuracy of the compiled bounds against 40-digit mpmath over a large random sample (the README's figures).

    python tools/measure_accuracy.py --points 100000 [--divergence kl ...] [--workers 2] [--seed 2026]
                                     [--device cuda] [--truth FILE]

Points: `bandpo_lut.tables.accuracy.sample_points` (60% with |logit p| ≤ 14, a fifth in each tail, δ log-uniform over
the table's range); inputs float32, δ per token (float32) and, separately, the scalar δ = 0.05. The truth is
mpmath's root at exactly the float32 values used, rounded to float64. Errors: upper |r - r*|/r*; lower
|r - r*|/(r*(1 + |ln r*|)) (a float evaluation of r = e^-L carries L's rounding), with a floor of two float32
subnormal spacings. mpmath costs ~1-6 ms a point: 10^5 points of the four divergences take ~15 minutes of one core.

--device cuda: the bounds are computed on the GPU, and each line also gives the CPU's errors on the same points and
how many of the GPU's bounds differ from the CPU's (and by how much, relative): the GPU within the CPU's bars.
--truth FILE: the mpmath truth is read from FILE (an .npz this script wrote for the same points: seed, count,
divergences and the points' digest must match, else it refuses), or computed and written there when FILE does not
exist: the truth does not depend on the device, so a GPU session carries it instead of spending minutes on mpmath.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np
import torch

import bandpo_lut
from bandpo_lut.tables import accuracy
from bandpo_lut.tables import store as tables

DPS = 40          # mpmath's working digits for the truth
DELTA_SCALAR = 0.05


def _truth(job):
    p, d, name = job
    return accuracy.exact_bounds_f64(p, d, name, dps=DPS)


def exact_parallel(p, d, name, workers):
    chunks = [(pc, dc, name) for pc, dc in zip(np.array_split(p, workers * 8), np.array_split(d, workers * 8))]
    with mp.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_truth, chunks)
    return np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])


def points(name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 sample of one divergence: (p, per-token δ)."""
    table = tables.get(name)
    p, d = accuracy.sample_points(n, table.delta_min, table.delta_max, seed,
                                  delta_max_inclusive=table.delta_max_inclusive)
    return torch.from_numpy(p).float(), torch.from_numpy(d).float()


def sample_digest(samples: dict) -> str:
    """sha256 of every divergence's float32 points, in order: what a truth file must have been computed for."""
    h = hashlib.sha256(f"dps={DPS};scalar={DELTA_SCALAR}".encode())
    for name, (p, d) in samples.items():
        h.update(name.encode())
        h.update(p.numpy().tobytes())
        h.update(d.numpy().tobytes())
    return h.hexdigest()


def load_truth(path: Path, digest: str) -> dict | None:
    """The truth arrays of `path` (key f"{name}/{label}/lo|up"), None where it does not exist; SystemExit naming
    --truth where it holds another sample."""
    if not path.exists():
        return None
    try:
        with np.load(path) as data:
            stored = str(data["digest"])
            truth = {k: data[k] for k in data.files if k != "digest"}
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"measure_accuracy: --truth {path}: not a truth file of this script ({err})")
    if stored != digest:
        sys.exit(f"measure_accuracy: --truth {path} holds the truth of another sample (seed, --points or "
                 "--divergence differ); give a new path to compute this one's")
    return truth


def save_truth(path: Path, truth: dict, digest: str) -> None:
    """Written beside the target and renamed into place: never a half-written file under its name."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    try:
        np.savez(tmp, digest=np.array(digest), **truth)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(how many elements differ, the largest |a - b| / |b| among them; inf beside inf counts as equal)."""
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    differ = int((~same).sum())
    if not differ:
        return 0, 0.0
    gap = ((a - b).abs() / b.abs())[~same]
    return differ, float(gap.max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--divergence", nargs="+", default=list(tables.SHIPPED), choices=list(tables.SHIPPED))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--device", default="cpu", help="where the bounds are computed (cpu or cuda)")
    ap.add_argument("--truth", type=Path, default=None,
                    help="an .npz of the mpmath truth: read when it exists (same sample only), else written")
    a = ap.parse_args(argv)
    if a.points < 1 or a.workers < 1:
        ap.error("--points and --workers must be >= 1")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device is available")
    if a.truth is not None and a.truth.is_dir():
        ap.error(f"--truth {a.truth}: is a folder; name a file")
    samples = {name: points(name, a.points, a.seed) for name in a.divergence}
    digest = sample_digest(samples)
    truth = load_truth(a.truth, digest) if a.truth is not None else None
    computed = {}
    on_gpu = device.type != "cpu"
    print(f"compiled bounds, float32 in, on {device}, vs mpmath ({DPS} digits); {a.points} random points each; "
          f"seed {a.seed}; truth {'read from ' + str(a.truth) if truth is not None else 'computed here'}")
    print(f"{'divergence':10s} {'delta':>10s} {'upper max rel':>14s} {'lower max':>10s}"
          + (f" {'cpu upper':>10s} {'cpu lower':>10s} {'lo != cpu':>10s} {'max rel':>8s} {'up != cpu':>10s} "
             f"{'max rel':>8s}" if on_gpu else ""))
    for name, (p32, d32) in samples.items():
        for label, dd in (("per-token", d32), (f"{DELTA_SCALAR}", DELTA_SCALAR)):
            key = f"{name}/{label}"
            if truth is not None:
                rlo, rup = truth[key + "/lo"], truth[key + "/up"]
            else:
                d_exact = d32.double().numpy() if label == "per-token" else np.full(a.points, DELTA_SCALAR)
                rlo, rup = exact_parallel(p32.double().numpy(), d_exact, name, a.workers)
                computed[key + "/lo"], computed[key + "/up"] = rlo, rup
            lo, up = (t.cpu() for t in bandpo_lut.bounds(p32.to(device), dd.to(device) if label == "per-token"
                                                          else dd, name))
            eu, el = accuracy.float32_worst(lo.numpy(), up.numpy(), rlo, rup)
            line = f"{name:10s} {label:>10s} {eu:14.2e} {el:10.2e}"
            if on_gpu:
                clo, cup = bandpo_lut.bounds(p32, dd, name)
                ceu, cel = accuracy.float32_worst(clo.numpy(), cup.numpy(), rlo, rup)
                (nlo, glo), (nup, gup) = relative_gap(lo, clo), relative_gap(up, cup)
                line += f" {ceu:10.2e} {cel:10.2e} {nlo:10d} {glo:8.1e} {nup:10d} {gup:8.1e}"
            print(line, flush=True)
    if a.truth is not None and truth is None:
        save_truth(a.truth, computed, digest)
        print(f"(the truth written to {a.truth}: pass it again with --truth to skip mpmath)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
