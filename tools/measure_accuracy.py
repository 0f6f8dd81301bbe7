"""Accuracy of the compiled bounds against 40-digit mpmath over a large random sample (the README's figures).

    python tools/measure_accuracy.py --points 100000 [--divergence kl ...] [--workers 2] [--seed 2026]
                                     [--device cuda | --gpu-code-on-host] [--truth FILE [--replace-other]]

Points: `bandpo_lut.tables.accuracy.sample_points` (60% with |logit p| ≤ 14, a fifth in each tail, δ log-uniform over
the table's range); inputs float32, δ per token (float32) and, separately, the scalar δ = 0.05. The truth is
mpmath's root at exactly the float32 values used, rounded to float64. Errors: upper |r - r*|/r*; lower
|r - r*|/(r*(1 + |ln r*|)) (a float evaluation of r = e^-L carries L's rounding), with a floor of two float32
subnormal spacings. mpmath costs ~1-6 ms a point: 10^5 points of the four divergences take ~15 minutes of one core.

--device cuda: the bounds are computed on the GPU, and each line also gives the CPU's errors on the same points and
how many of the GPU's bounds differ from the CPU's (and by how much, relative): the GPU within the CPU's bars.
--gpu-code-on-host: KL only; the bounds from the GPU kernels' element code compiled for the host with the GPU's
layout (tools/gpu_code_on_host.py: the cells in p's bits, the per-token patches), for a machine without a GPU; each
line also gives the CPU op's errors on the same points.
--truth FILE: an .npz of the mpmath truth, one entry per divergence and δ: an entry it holds for these points is
read, one it lacks is computed and added (saved entry by entry, so an interrupted run keeps its work), one it holds
for other points (another seed or --points, or a numpy that draws other points) is refused, or with
--replace-other computed again and replaced. The truth does not depend on the device: a GPU session
carries the file instead of spending a minute of 16 cores on mpmath.
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


def entry_digest(p: torch.Tensor, d, label: str) -> str:
    """sha256 of one entry's points (float32 p, the δ: per-token float32 values or the scalar) and mpmath's digits:
    what its stored truth must have been computed for."""
    h = hashlib.sha256(f"dps={DPS};{label}".encode())
    h.update(p.numpy().tobytes())
    h.update(d.numpy().tobytes() if isinstance(d, torch.Tensor) else repr(float(d)).encode())
    return h.hexdigest()


def load_truth(path: Path) -> dict:
    """The arrays of a truth file (f"{divergence}/{label}/lo|up|digest"), empty where it does not exist; SystemExit
    naming --truth where it is not one."""
    if not path.exists():
        return {}
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as err:
        sys.exit(f"measure_accuracy: --truth {path}: not a truth file of this script ({err})")


def stored_truth(truth: dict, key: str, digest: str, path: Path, replace_other: bool = False):
    """(lo, up) of `key` when the file holds it for these points, None when it holds no such entry (or one for other
    points, with replace_other: then it is computed again and replaced); else SystemExit when it holds the entry for
    other points (another seed or --points): nothing is replaced that was not asked for."""
    if key + "/digest" not in truth:
        return None
    if str(truth[key + "/digest"]) != digest:
        if replace_other:
            print(f"({key}: {path} holds it for other points: computed again)")
            return None
        sys.exit(f"measure_accuracy: --truth {path} holds {key} for other points (another --seed or --points); "
                 "give a new path to compute this sample's")
    return truth[key + "/lo"], truth[key + "/up"]


def save_truth(path: Path, truth: dict) -> None:
    """Written beside the target and renamed into place: never a half-written file under its name."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    try:
        np.savez(tmp, **truth)
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
    ap.add_argument("--gpu-code-on-host", action="store_true",
                    help="KL: the GPU kernels' element code compiled for the host (tools/gpu_code_on_host.py)")
    ap.add_argument("--truth", type=Path, default=None,
                    help="an .npz of the mpmath truth: read when it exists (same sample only), else written")
    ap.add_argument("--replace-other", action="store_true",
                    help="entries --truth holds for other points are computed again and replaced (default: refused)")
    a = ap.parse_args(argv)
    if a.points < 1 or a.workers < 1:
        ap.error("--points and --workers must be >= 1")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device is available")
    if a.gpu_code_on_host and (device.type != "cpu" or a.divergence != ["kl"]):
        ap.error("--gpu-code-on-host: with --divergence kl only, on the default --device cpu")
    if a.truth is not None and a.truth.is_dir():
        ap.error(f"--truth {a.truth}: is a folder; name a file")
    samples = {name: points(name, a.points, a.seed) for name in a.divergence}
    truth = load_truth(a.truth) if a.truth is not None else {}
    on_gpu = device.type != "cpu"
    host_code = None
    if a.gpu_code_on_host:
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_code_on_host import HostGpuCode

        host_code = HostGpuCode(tables.get("kl"), Path(tempfile.mkdtemp(prefix="gpu_code_on_host")))
        device = "the GPU kernels' code compiled for the host"
    print(f"compiled bounds, float32 in, on {device}, vs mpmath ({DPS} digits); {a.points} random points each; "
          f"seed {a.seed}" + (f"; truth file {a.truth}" if a.truth is not None else ""))
    print(f"{'divergence':10s} {'delta':>10s} {'upper max rel':>14s} {'lower max':>10s}"
          + (f" {'cpu upper':>10s} {'cpu lower':>10s} {'lo != cpu':>10s} {'max rel':>8s} {'up != cpu':>10s} "
             f"{'max rel':>8s}" if on_gpu or host_code else "") + "  truth")
    for name, (p32, d32) in samples.items():
        for label, dd in (("per-token", d32), (f"{DELTA_SCALAR}", DELTA_SCALAR)):
            key, digest = f"{name}/{label}", entry_digest(p32, dd, label)
            stored = stored_truth(truth, key, digest, a.truth, a.replace_other) if a.truth is not None else None
            if stored is not None:
                (rlo, rup), source = stored, "read"
            else:
                d_exact = d32.double().numpy() if label == "per-token" else np.full(a.points, DELTA_SCALAR)
                rlo, rup = exact_parallel(p32.double().numpy(), d_exact, name, a.workers)
                source = "computed"
                if a.truth is not None:   # saved entry by entry: an interrupted run keeps what it computed
                    truth.update({key + "/lo": rlo, key + "/up": rup, key + "/digest": np.array(digest)})
                    save_truth(a.truth, truth)
                    source += ", saved"
            if host_code is not None:
                logp = np.full(a.points, np.nan, dtype=np.float32)  # p inputs only, as the op's rows
                rows = (host_code.token(p32.numpy(), logp, d32.numpy())[2] if label == "per-token"
                        else host_code.scalar(p32.numpy(), logp, [DELTA_SCALAR])[2][0])
                lo, up = torch.from_numpy(rows[:, 0]).float(), torch.from_numpy(rows[:, 1]).float()  # no cap
            else:
                lo, up = (t.cpu() for t in bandpo_lut.bounds(p32.to(device), dd.to(device) if label == "per-token"
                                                              else dd, name))
            eu, el = accuracy.float32_worst(lo.numpy(), up.numpy(), rlo, rup)
            line = f"{name:10s} {label:>10s} {eu:14.2e} {el:10.2e}"
            if on_gpu or host_code is not None:
                clo, cup = bandpo_lut.bounds(p32, dd, name)
                ceu, cel = accuracy.float32_worst(clo.numpy(), cup.numpy(), rlo, rup)
                (nlo, glo), (nup, gup) = relative_gap(lo, clo), relative_gap(up, cup)
                line += f" {ceu:10.2e} {cel:10.2e} {nlo:10d} {glo:8.1e} {nup:10d} {gup:8.1e}"
            print(f"{line}  {source}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
