#!/usr/bin/env python
"""A sha256 over the output bits of a fixed, seeded set of results, per CPU kernel variant: the check that a
change meant to leave numerics alone (a restructure, a new dispatcher) did leave them alone.

The set: `bounds` (lower and upper) and `clip` for every divergence, dtype (float32, float64, bfloat16, float16),
p and log-p input, scalar and per-token δ, with and without max_ratio; `policy_loss` (loss, metric vector, gradient)
for every clip kind, mode and aggregation in float32, plus the band in the other dtypes and with per-token δ; and
`fused_linear_policy_loss` in float32 (loss, metrics, both gradients). Inputs are seeded and include the edges
(p = 0 and 1, subnormals, 1 - 2^-24, NaN, out of the domain); lengths are odd so that partial blocks run.

Each variant this CPU runs is forced in its own process (BANDPO_LUT_CPU_VARIANT, read once per process).
Prints the number of results, one digest per variant and an overall digest (over the per-variant ones, in the
order baseline, avx2, avx512). Compare two commits by running this on each build.

usage: python tools/bits_digest.py [--dump DIR]   (--dump: one line per result and digest, to find what moved)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ORDER = ["baseline", "avx2", "avx512"]

CHILD = r"""
import hashlib, json, sys
import torch
import bandpo_lut
from bandpo_lut.runtime import _extension

torch.set_num_threads(1)
lines = []
total = hashlib.sha256()

def put(name, t):
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode() + raw.numpy().tobytes()).hexdigest()
    total.update(h.encode())
    lines.append(f"{name} {h}")

g = torch.Generator().manual_seed(20261204)
N = 3001
p64 = torch.rand(N, generator=g, dtype=torch.float64)
p64[: N // 5] = torch.exp(-torch.rand(N // 5, generator=g, dtype=torch.float64) * 40)   # deep tail
p64[N // 5: 2 * N // 5] = 1 - torch.exp(-torch.rand(N // 5, generator=g, dtype=torch.float64) * 30)
edges = [0.0, 1.0, 1e-45, 1e-39, 1 - 2 ** -24, 0.5, 2 ** -126, 1e-30, float("nan"), 1.5, -0.25, 1e-7]
p64[-len(edges):] = torch.tensor(edges, dtype=torch.float64)
ratio64 = torch.exp(torch.randn(N, generator=g, dtype=torch.float64) * 1.5)
d64 = 0.01 + 0.5 * torch.rand(N, generator=g, dtype=torch.float64)

for div in ("kl", "tv", "chi2", "hellinger"):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        p = p64.to(dtype)
        for log_input in (False, True):
            kw = {"log_p_old": torch.log(p)} if log_input else {"p_old": p}
            for per_token in (False, True):
                delta = d64.to(dtype) if per_token else 0.05
                for max_ratio in (None, 10.0):
                    name = (f"{div}/{dtype}/{'logp' if log_input else 'p'}/"
                            f"{'tok' if per_token else 'scalar'}/{max_ratio}")
                    lo, up = bandpo_lut.bounds(delta=delta, divergence=div, max_ratio=max_ratio, **kw)
                    put("bounds.lo/" + name, lo)
                    put("bounds.up/" + name, up)
                    put("clip/" + name, bandpo_lut.clip(ratio64.to(dtype), delta=delta, divergence=div,
                                                        max_ratio=max_ratio, **kw))

B, T = 5, 701
olp64 = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp_min(1e-12)) * 2
lp64 = olp64 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
adv64 = torch.randn(B, T, generator=g, dtype=torch.float64)
mask = torch.rand(B, T, generator=g) > 0.2
mask[1, 300:] = False
dl64 = 0.01 + 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64)

def loss_case(name, dtype, **kw):
    lp = lp64.to(dtype, copy=True).requires_grad_(True)
    loss, metrics = bandpo_lut.policy_loss(lp, olp64.to(dtype), adv64.to(dtype), mask, **kw)
    loss.backward()
    put("loss/" + name, loss)
    put("metrics/" + name, torch.stack(list(metrics.values())))
    put("grad/" + name, lp.grad)

for clip in ("band", "fixed", "dcpo"):
    for mode in ("clip", "mask"):
        for agg in ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"):
            extra = {"max_ratio": 10.0, "dual_clip": 10.0} if clip == "band" else {"dual_clip": 3.0}
            loss_case(f"{clip}/{mode}/{agg}", torch.float32, clip=clip, mode=mode, agg=agg, **extra)
for dtype in (torch.float64, torch.bfloat16, torch.float16):
    loss_case(f"band/{dtype}", dtype, max_ratio=10.0, dual_clip=10.0)
for dtype in (torch.float32, torch.float64):
    for div in ("kl", "tv", "chi2", "hellinger"):
        loss_case(f"band-token-delta/{div}/{dtype}", dtype, delta=dl64.to(dtype), divergence=div)

H, V, Tf = 48, 400, 53
hidden = torch.randn(2, Tf, H, generator=g)
weight = torch.randn(V, H, generator=g) * 0.2
ids = torch.randint(0, V, (2, Tf), generator=g)
folp = -torch.rand(2, Tf, generator=g) * 6
fadv = torch.randn(2, Tf, generator=g)
for chunk in (None, 17):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, metrics = bandpo_lut.fused_linear_policy_loss(h, w, ids, folp, fadv, chunk_size=chunk, max_ratio=10.0,
                                                        dual_clip=10.0)
    loss.backward()
    put(f"fused/{chunk}/loss", loss)
    put(f"fused/{chunk}/metrics", torch.stack(list(metrics.values())))
    put(f"fused/{chunk}/grad_hidden", h.grad)
    put(f"fused/{chunk}/grad_weight", w.grad)

print(json.dumps({"variant": _extension.facts()["cpu"]["variant"], "n": len(lines), "digest": total.hexdigest(),
                  "lines": lines}))
"""


def run_variant(variant: str) -> dict:
    env = dict(os.environ, BANDPO_LUT_CPU_VARIANT=variant)
    # From outside the checkout, so that the installed package (and its compiled library) is what runs.
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=Path.home() if Path.home().is_dir() else "/",
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bits_digest.py: the {variant} run failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["variant"] != variant:
        sys.exit(f"bits_digest.py: asked for {variant}, the library ran {out['variant']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", type=Path, help="write DIR/<variant>.txt: one line per result and its digest")
    args = ap.parse_args()
    probe = subprocess.run([sys.executable, "-c", "import bandpo_lut; from bandpo_lut.runtime import _extension; "
                            "print(_extension.facts()['cpu']['isa'])"], env={k: v for k, v in os.environ.items()
                                                                           if k != "BANDPO_LUT_CPU_VARIANT"},
                           cwd="/", capture_output=True, text=True, check=True)
    isa = probe.stdout.strip().splitlines()[-1]
    overall = hashlib.sha256()
    for variant in ORDER[: ORDER.index(isa) + 1]:
        out = run_variant(variant)
        overall.update(out["digest"].encode())
        print(f"{variant:9s} results={out['n']} sha256={out['digest']}")
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{variant}.txt").write_text("\n".join(out["lines"]) + "\n")
    print(f"overall   sha256={overall.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
