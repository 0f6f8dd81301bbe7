#!/usr/bin/env python3
"""GPU check: on a machine with a CUDA device and an installed CUDA build of bandpo_lut (builds nothing).

Checks, on fresh random data, the CUDA ops against the pure-PyTorch reference (float64) and the CPU op,
for kl/tv/chi2, scalar and per-token δ, float32 and float64, p and log-p inputs; the fused loss against
the reference loss; then times clip against a device-to-device copy, torch.clamp and the 50-step
bisection, and prints one table. Exit status 1 if any check fails.

    python tools/gpu_check.py [--n 16777216]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def rel_upper(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    e = (a - b).abs() / b
    e = torch.where(torch.isinf(a) & (a == b), torch.zeros_like(e), e)
    return float(torch.nan_to_num(e, nan=math.inf).max())


def rel_lower(a, b, dtype):
    a, b = a.double().cpu(), b.to(dtype).double().cpu()
    floor = 2 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    x = ((a - b).abs() - floor).clamp(min=0)
    e = torch.where(b == 0, x / floor, x / (b * (1 + b.log().abs())))
    return float(torch.nan_to_num(e, nan=math.inf).max())


def timed(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2 ** 24)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 1
    import bandpo_lut
    from bandpo_lut.bench import kl_bisection
    from bandpo_lut.reference.bounds import bounds as ref_bounds
    from bandpo_lut.reference.policy_loss import policy_loss as ref_loss

    info = bandpo_lut.build_info()
    print(f"device {torch.cuda.get_device_name()}; bandpo_lut {bandpo_lut.__version__} built with CUDA "
          f"{info.get('cuda_version')} for {info.get('cuda_arch_list')}; torch {torch.__version__}")
    ok = True
    g = torch.Generator().manual_seed(int(time.time()))
    n = 200_000
    t = torch.empty(n, dtype=torch.float64).uniform_(-25, 25, generator=g)
    p64 = torch.sigmoid(t)
    d64 = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-3), math.log(0.999), generator=g))
    print(f"{'check':52s} {'vs reference':>14s} {'vs CPU op':>12s}")
    for name in ("kl", "tv", "chi2"):
        for dtype in (torch.float32, torch.float64):
            for per_token in (False, True):
                for log_in in (False, True):
                    x = (torch.log(p64) if log_in else p64).to(dtype)
                    d = d64.to(dtype) if per_token else 0.05
                    kw = "log_p_old" if log_in else "p_old"
                    lo_g, up_g = bandpo_lut.bounds(delta=d.cuda() if per_token else d, divergence=name,
                                                   **{kw: x.cuda()})
                    lo_c, up_c = bandpo_lut.bounds(delta=d, divergence=name, **{kw: x})
                    lo_r, up_r = ref_bounds(delta=d.double() if per_token else d, divergence=name,
                                            **{kw: x.double()})
                    e_ref = max(rel_upper(up_g, up_r.to(dtype)), rel_lower(lo_g, lo_r, dtype))
                    e_cpu = max(rel_upper(up_g, up_c), rel_lower(lo_g, lo_c.double(), dtype))
                    good = e_ref <= 1e-6 and e_cpu <= 2e-6
                    ok &= good
                    label = f"bounds {name} {str(dtype)[6:]} {'token' if per_token else 'scalar'} δ {kw}"
                    print(f"{label:52s} {e_ref:14.2e} {e_cpu:12.2e} {'ok' if good else 'FAIL'}")
    B, T = 16, 4096
    old = torch.nn.functional.logsigmoid(torch.randn(B, T, generator=g) * 3)
    new = old + torch.randn(B, T, generator=g) * 0.2
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.1
    for clip in ("band", "fixed", "dcpo"):
        a = new.cuda().requires_grad_()
        lg, mg = bandpo_lut.policy_loss(a, old.cuda(), adv.cuda(), mask.cuda(), clip=clip, max_ratio=10, dual_clip=3)
        lg.backward()
        b = new.clone().requires_grad_()
        lr, mr = ref_loss(b, old, adv, mask, clip=clip, max_ratio=10, dual_clip=3)
        lr.backward()
        e = max([abs(float(lg) - float(lr)) / max(abs(float(lr)), 1e-12),
                 float((a.grad.cpu() - b.grad).abs().max()) / float(b.grad.abs().max())] +
                [abs(float(mg[k]) - float(mr[k])) / max(abs(float(mr[k])), 1e-6) for k in mr])
        good = e <= 1e-5
        ok &= good
        print(f"{'policy_loss ' + clip + ' (loss, grad, metrics)':52s} {e:14.2e} {'':12s} {'ok' if good else 'FAIL'}")

    N = args.n
    p = torch.sigmoid(torch.randn(N, device="cuda") * 3)
    r = torch.exp(torch.randn(N, device="cuda") * 0.3)
    dt = torch.full((N,), 0.05, device="cuda")
    out = torch.empty_like(r)
    rows = [("device-to-device copy", timed(lambda: out.copy_(r))),
            ("torch.clamp(ratio, 0.8, 1.28)", timed(lambda: torch.clamp(r, 0.8, 1.28))),
            ("bandpo_lut.clip kl, scalar delta", timed(lambda: bandpo_lut.clip(r, p, 0.05))),
            ("bandpo_lut.clip kl, per-token delta", timed(lambda: bandpo_lut.clip(r, p, dt))),
            ("bandpo_lut.clip chi2, scalar delta", timed(lambda: bandpo_lut.clip(r, p, 0.05, "chi2"))),
            ("kl bisection, 50 steps", timed(lambda: torch.clamp(r, *kl_bisection(p, 0.05)), reps=3))]
    copy_t = rows[0][1]
    print(f"\nN = {N}, float32\n{'what':40s} {'ms':>10s} {'x copy':>8s}")
    for name, ms in rows:
        print(f"{name:40s} {ms:10.4f} {ms / copy_t:8.2f}")
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
