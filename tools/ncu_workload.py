"""What `ncu` profiles for the bandwidth targets: each op of `bandpo-lut bench`'s band rows once at N = 2^26 float32,
then `policy_loss` forward and backward at 512 x 8192, inside cudaProfilerStart/Stop (run it under
`ncu --profile-from-start off`; tools/gpu_session.sh's `ncu` step does) and each inside an NVTX range named for
its bench row.

    ncu --clock-control none --profile-from-start off --nvtx ... python tools/ncu_workload.py [--n N]

Every op runs once before the profiled region (the cell cache, the table upload, cuBLAS-free warm-up), so that
only the steady-state kernels are profiled. --device cpu runs the same calls without profiler or NVTX (the
plumbing's dry run).
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import bandpo_lut


def workloads(n: int, batch: int, tokens: int, device: torch.device):
    """(bench row label, call) of each profiled op, on inputs drawn like the bench's."""
    g = torch.Generator().manual_seed(0)
    p = torch.sigmoid(torch.randn(n, generator=g) * 3).to(device)
    ratio = torch.exp(torch.randn(n, generator=g) * 0.3).to(device)
    log_p = torch.log(p)
    delta_t = torch.full((n,), 0.05, device=device)
    lp = torch.nn.functional.logsigmoid(torch.randn(batch, tokens, generator=g) * 3).to(device)
    olp = (lp + torch.randn(batch, tokens, generator=g).to(device) * 0.1).clamp(max=0)
    adv = torch.randn(batch, tokens, generator=g).to(device)
    mask = (torch.rand(batch, tokens, generator=g) > 0.1).to(device)
    a = lp.clone().requires_grad_()
    state = {}

    def loss_fwd():
        state["loss"] = bandpo_lut.policy_loss(a, olp, adv, mask, max_ratio=10.0)[0]

    def loss_bwd():
        a.grad = None
        state["loss"].backward()

    return [("bandpo_lut.clip kl, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05)),
            ("bandpo_lut.clip kl, log_p_old, scalar delta", lambda: bandpo_lut.clip(ratio, log_p_old=log_p)),
            ("bandpo_lut.clip kl, per-token delta", lambda: bandpo_lut.clip(ratio, p, delta_t)),
            ("bandpo_lut.clip tv, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05, "tv")),
            ("bandpo_lut.clip chi2, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05, "chi2")),
            ("bandpo_lut.clip hellinger, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05, "hellinger")),
            ("bandpo_lut.bounds kl, scalar delta", lambda: bandpo_lut.bounds(p, 0.05)),
            (f"bandpo_lut.policy_loss ({batch}x{tokens}) forward", loss_fwd),
            (f"bandpo_lut.policy_loss ({batch}x{tokens}) backward", loss_bwd)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2 ** 26, help="elements of the band rows (default 2^26)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device is available")
    calls = workloads(a.n, a.batch, a.tokens, device)
    for _, call in calls:          # warm-up, outside the profiled region
        call()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
    for label, call in calls:
        with torch.cuda.nvtx.range(label) if cuda else contextlib.nullcontext():
            call()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.stop()
    print(f"ncu_workload: {len(calls)} ops {'profiled' if cuda else 'run (no profiler)'} on {device}: "
          + "; ".join(label for label, _ in calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
