#!/usr/bin/env python
"""The band's CPU cost against its floor, measured the way the speed issue's targets are: ratios to
torch.clamp (scalar bounds) in one process, N = 2^22 float32, best median over 3 interleaved rounds, at 1
and at 2 threads (the better ratio counts: on a busy shared machine one of two threads gets descheduled
and the 2-thread clamp reads ~8 ms); and the fused loss against the eager canonical PPO loss
(64 x 8192, fwd+bwd). Exit status 0 when every target holds.

usage: python tools/perf_ratios.py   (bandpo_lut installed; run on a quiet machine, from outside the checkout or
with the development install). The project keeps this copy of the reviews' script so that the README's figures
name a file inside the repository.
"""
import statistics
import sys
import time

import torch

import bandpo_lut as bl

BARS = {"clip_p": 5.0, "clip_logp": 6.0, "clip_token": 12.0, "clip_tv": 5.0, "clip_chi2": 5.0, "clip_hellinger": 5.0}
LOSS_BAR = 0.5
torch.set_num_threads(2)
torch.manual_seed(0)
N = 1 << 22
logp = -torch.rand(N) * 10
p = logp.exp()
ratio = torch.exp(torch.randn(N) * 0.3)
dtok = torch.rand(N) * 0.09 + 0.01

def med(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

B, T = 64, 8192
lp = (-torch.rand(B, T) * 5).requires_grad_()
old = (lp.detach() + torch.randn(B, T) * 0.2).clamp(max=0)
adv = torch.randn(B, T)
mask = torch.rand(B, T) > 0.1

def eager_loss():
    r = torch.exp(lp - old)
    per_token = -torch.min(r * adv, torch.clamp(r, 0.8, 1.2) * adv)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()

def fused_loss():
    loss, _ = bl.policy_loss(lp, old, adv, mask, max_ratio=10.0, dual_clip=10.0)
    loss.backward()

def measure(threads):
  torch.set_num_threads(threads)
  t = {}
  for _ in range(3):
      for name, fn, reps in (
          ("clamp", lambda: torch.clamp(ratio, 0.8, 1.28), 30),
          ("clip_p", lambda: bl.clip(ratio, p, 0.05), 10),
          ("clip_logp", lambda: bl.clip(ratio, log_p_old=logp, delta=0.05), 10),
          ("clip_token", lambda: bl.clip(ratio, p, dtok), 5),
          ("clip_tv", lambda: bl.clip(ratio, p, 0.05, divergence="tv"), 5),
          ("clip_chi2", lambda: bl.clip(ratio, p, 0.05, divergence="chi2"), 5),
          ("clip_hellinger", lambda: bl.clip(ratio, p, 0.05, divergence="hellinger"), 5),
          ("eager_loss", eager_loss, 5),
          ("fused_loss", fused_loss, 5),
      ):
          t[name] = min(t.get(name, 1e9), med(fn, reps))
  return t

ts = {n: measure(n) for n in (1, 2)}
isa = "avx512" if "avx512f" in open("/proc/cpuinfo").read() else "avx2"
rat = {k: min(t[k] / t["clamp"] for t in ts.values()) for k in BARS}
loss_ratio = min(t["fused_loss"] / t["eager_loss"] for t in ts.values())
t = ts[2]
fails = [f"{k} {rat[k]:.1f}x > {b:.0f}x" for k, b in BARS.items() if rat[k] > b]
if loss_ratio > LOSS_BAR:
    fails.append(f"fused loss {loss_ratio:.2f}x eager > {LOSS_BAR}")
for f in fails:
    print("FAIL", f)
print(f"{isa}, clamp {ts[1]['clamp']*1e3:.2f} / {ts[2]['clamp']*1e3:.2f} ms (1/2 threads): "
      + ", ".join(f"{k[5:]} {v:.1f}x" for k, v in rat.items())
      + f"; loss {loss_ratio:.2f}x eager; {len(BARS) + 1 - len(fails)}/{len(BARS) + 1} hold")
sys.exit(0 if not fails else 1)
