#!/usr/bin/env python3
"""GPU check of bandpo_lut: one command on a machine with a CUDA GPU, torch and nvcc (no network needed).

    python tools/gpu_check.py [--seed S] [--no-build] [--no-sanitizer] [--quick]

From the repository root it
  1. builds and installs the extension for the local GPU only (TORCH_CUDA_ARCH_LIST from the device),
  2. prints ptxas register, spill and shared-memory figures of every kernel (nvcc -Xptxas -v per .cu file),
  3. checks, in a fresh process outside the checkout: every op against the CPU op and the pure-PyTorch
     reference (every divergence x dtype incl. float16/bfloat16 x delta mode x p/log-p input); strided,
     transposed, permuted and broadcast operands bit-identical to contiguous; the float16 tie; edge sizes
     (65,536 rows, 9 and 26 non-collapsible dims, more than 2^31 elements, dense tables that need shared
     memory above 48 KB or none); repeat-run determinism; a side stream; a CUDA-graph capture,
  4. runs compute-sanitizer memcheck, racecheck and synccheck on a small workload where installed,
  5. prints a timing table against a device-to-device copy and torch.clamp, with pass/fail thresholds
     (clip, kl, scalar delta >= 60% of copy bandwidth at N = 2^26 on a datacenter GPU; the fused loss no
     slower than the eager PPO loss),
  6. checks bandpo_lut.fused_linear_policy_loss on CUDA (tools/gpu_check_fused_linear.py: against the unfused
     path, no host synchronisation, torch.compile) and prints its memory/time table against the unfused path
     and, where liger-kernel is installed, Liger's fused-linear GRPO loss (fails above 1/8 of the unfused
     path's extra memory at V = 131072),
and exits non-zero if anything failed. The random seed is printed (default fixed; --seed to change it).
Budget: under eight minutes on an H100/H200 node (the build is most of it).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SEED = 20261203
DATACENTER = re.compile(r"\b(A100|A800|H100|H800|H200|H20|GH200|B100|B200|GB200|B300|GB300)\b")
CLIP_BANDWIDTH_MIN = 0.60      # clip kl (scalar delta) bytes/s over device-to-device copy bytes/s, N = 2^26

FAILURES: list[str] = []
KEEP: list = []


def report(label: str, ok: bool, detail: str = "") -> bool:
    print(f"  {'ok  ' if ok else 'FAIL'} {label:70s} {detail}", flush=True)
    if not ok:
        FAILURES.append(label)
    return ok


# ---------------------------------------------------------------------------------------------------------
# 1-2: build for the local GPU, ptxas figures

def local_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build(arch: str) -> None:
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4)))
    print(f"[build] TORCH_CUDA_ARCH_LIST={arch} pip install --no-build-isolation --no-deps {ROOT}", flush=True)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", str(ROOT)],
                         env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-4000:])
        report("build", False)
        raise SystemExit(finish())
    report("build", True, f"{time.time() - t0:.0f} s")


def ptxas_figures(arch: str) -> None:
    """nvcc -Xptxas -v on each .cu with the extension's flags; one line per kernel."""
    from torch.utils import cpp_extension

    nvcc = Path(cpp_extension.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    if not nvcc.exists():
        nvcc = Path(shutil.which("nvcc") or "nvcc")
    sm = arch.replace(".", "")
    includes = [f"-I{p}" for p in cpp_extension.include_paths(device_type="cuda")] + [f"-I{ROOT / 'csrc'}"]
    flags = ["-std=c++20", "-O3", "-DBANDPO_WITH_CUDA=1", "-D__CUDA_NO_HALF_OPERATORS__",
             "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
             "--expt-relaxed-constexpr", f"-gencode=arch=compute_{sm},code=sm_{sm}", "-Xptxas", "-v",
             "-Xcompiler", "-fPIC", f"-I{sysconfig_include()}"]
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
            cmd = [str(nvcc), "-c", str(cu), "-o", str(Path(tmp) / (cu.name + ".o"))] + includes + flags
            procs.append((cu.name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        print(f"[ptxas] sm_{sm}: registers / spills / shared memory per kernel", flush=True)
        for name, proc in procs:
            text = proc.communicate()[0]
            if proc.returncode != 0:
                report(f"ptxas {name}", False, text[-2000:])
                continue
            kernel, spills = None, ""
            for line in text.splitlines():
                m = re.search(r"Compiling entry function '(\S+)'", line)
                if m:
                    kernel = demangle(m.group(1))
                m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
                if m and kernel:
                    spills = f"spill {m.group(1)}/{m.group(2)} B"
                m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?", line)
                if m and kernel:
                    smem = re.search(r"(\d+) bytes smem", line)
                    print(f"    {m.group(1):>4s} regs  {spills:18s} {smem.group(1) if smem else 0:>6} B smem  "
                          f"{name}: {kernel[:110]}")
                    kernel = None


def sysconfig_include() -> str:
    import sysconfig

    return sysconfig.get_paths()["include"]


def demangle(sym: str) -> str:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool:
        return sym
    try:
        name = subprocess.run([tool, sym], capture_output=True, text=True).stdout.strip()
        name = re.sub(r"^void |bandpo::|\(anonymous namespace\)::", "", name)
        return name.split("(", 1)[0]
    except OSError:
        return sym


# ---------------------------------------------------------------------------------------------------------
# 3: correctness (runs in a fresh process outside the checkout, against the installed build)

def rel_upper(a, b):
    import torch

    a, b = a.double().cpu(), b.double().cpu()
    e = (a - b).abs() / b.abs()
    agree = (torch.isinf(a) & (a == b)) | ((a == 0) & (b == 0)) | (torch.isnan(a) & torch.isnan(b))
    e = torch.where(agree, torch.zeros_like(e), e)
    return float(torch.nan_to_num(e, nan=math.inf).max()) if e.numel() else 0.0


def rel_lower(a, b, dtype):
    import torch

    a, b = a.double().cpu(), b.to(dtype).double().cpu()
    floor = 2 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    x = ((a - b).abs() - floor).clamp(min=0)
    e = torch.where(b == 0, x / floor, x / (b * (1 + b.log().abs())))
    e = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(e), e)
    return float(torch.nan_to_num(e, nan=math.inf).max()) if e.numel() else 0.0


def same(a, b) -> bool:
    """Bit for bit (NaN where the other has NaN)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a, nan=0.0),
                                                                       torch.nan_to_num(b, nan=0.0))


def closed_form_exact(name, x, log_in, delta):
    """tv, chi2 and squared Hellinger bands in float64 (NUMERICS.md), saturation by the exact tests. Hellinger's
    lower root without cancellation: with 1 - δ/2 = cos α, √p·cos α - √(1-p)·sin α =
    (p - sin²α)/(√p·cos α + √(1-p)·sin α), sin²α = δ - δ²/4."""
    import torch

    p = torch.exp(x) if log_in else x
    omp = -torch.expm1(x) if log_in else 1 - x
    delta = torch.as_tensor(delta, dtype=torch.float64)
    zero = torch.zeros_like(p)
    if name == "tv":
        up = torch.where(omp <= delta, 1 / p, 1 + delta / p)
        lo = torch.where(p <= delta, zero, (p - delta) / p)
    elif name == "chi2":
        w = torch.sqrt(delta * omp / p)
        up = torch.where(omp <= delta * p, 1 / p, 1 + w)
        lo = torch.where(p <= delta * omp, zero, (p - delta * omp) / (p * (1 + w)))
    else:
        ca, s2 = 1 - delta / 2, delta - delta * delta / 4
        a, b = torch.sqrt(p) * ca, torch.sqrt(omp) * torch.sqrt(s2)
        up = torch.where(torch.sqrt(p) >= ca, 1 / p, (a + b) ** 2 / p)
        diff = (p - s2) / (a + b)
        lo = torch.where(diff <= 0, zero, diff * diff / p)
    up = torch.where(omp == 0, torch.ones_like(up), up)
    lo = torch.where(p == 0, zero, lo)
    return lo, up


def check_bounds(g, quick: bool) -> None:
    import torch

    import bandpo_lut
    from bandpo_lut import tables
    from bandpo_lut.reference.bounds import bounds as ref_bounds

    print("[bounds] vs the float64 reference and the CPU op (every divergence x dtype x delta mode x input)")
    n = 20_000 if quick else 100_000
    t = torch.empty(n, dtype=torch.float64).uniform_(-25, 25, generator=g)
    p64 = torch.sigmoid(t)
    # δ away from the table's ends by more than bfloat16's rounding (a δ that rounds across an end is NaN)
    d64 = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1.02e-3), math.log(0.98), generator=g))
    # half types: one unit in the last place (the float32 result, rounded once, may land on either side of
    # the float64 reference's rounding)
    tol = {torch.float32: (1e-6, 2e-6), torch.float64: (1e-6, 1e-9),
           torch.bfloat16: (2 ** -7, 2 ** -7), torch.float16: (2 ** -10, 2 ** -10)}
    for name in tables.SHIPPED:
        for dtype, (tol_ref, tol_cpu) in tol.items():
            for per_token in (False, True):
                for log_in in (False, True):
                    x = (torch.log(p64) if log_in else p64).to(dtype)
                    d = d64.to(dtype) if per_token else 0.05
                    kw = "log_p_old" if log_in else "p_old"
                    lo_g, up_g = bandpo_lut.bounds(delta=d.cuda() if per_token else d, divergence=name,
                                                   **{kw: x.cuda()})
                    lo_c, up_c = bandpo_lut.bounds(delta=d, divergence=name, **{kw: x})
                    if name != "kl":   # the exact closed forms (the table readers are not exact at saturation)
                        lo_r, up_r = closed_form_exact(name, x.double(), log_in, d.double() if per_token else d)
                    else:
                        lo_r, up_r = ref_bounds(delta=d.double() if per_token else d, divergence=name,
                                                **{kw: x.double()})
                    e_ref = max(rel_upper(up_g, up_r.to(dtype)), rel_lower(lo_g, lo_r, dtype))
                    e_cpu = max(rel_upper(up_g, up_c), rel_lower(lo_g, lo_c.double(), dtype))
                    report(f"bounds {name} {str(dtype)[6:]} {'token' if per_token else 'scalar'} delta {kw}",
                           e_ref <= tol_ref and e_cpu <= tol_cpu, f"ref {e_ref:.2e}  cpu {e_cpu:.2e}")
        for dtype in tol:
            p = p64[:4096].to(dtype).cuda()
            ratio = (torch.rand(4096, generator=g, dtype=torch.float64) * 3).to(dtype).cuda()
            lo, up = bandpo_lut.bounds(p, 0.05, name)
            report(f"clip {name} {str(dtype)[6:]} == torch.clamp(ratio, *bounds)",
                   same(bandpo_lut.clip(ratio, p, 0.05, name), torch.clamp(ratio, lo, up)))
    tie = torch.tensor([0.0015544891357421875], dtype=torch.float16, device="cuda")
    up = bandpo_lut.bounds(tie, 0.05)[1].item()
    report("float16 tie p = 0.0015544891357421875 -> 35.75 or 35.78125", up in (35.75, 35.78125), f"{up!r}")


def check_layouts(g) -> None:
    import torch

    import bandpo_lut

    print("[layout] strided / transposed / permuted / broadcast operands give the contiguous bits")
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for name in ("kl", "tv", "hellinger"):
            p = torch.rand(33, 70, generator=g, dtype=torch.float64).to(dtype).cuda()
            r = (torch.rand(33, 70, generator=g, dtype=torch.float64) * 2).to(dtype).cuda()
            d = (torch.rand(33, 1, generator=g, dtype=torch.float64) * 0.3 + 0.01).to(dtype).cuda()
            for delta in (0.05, d):
                dd = delta.expand(33, 70).contiguous() if torch.is_tensor(delta) else delta
                ref_lo, ref_up = bandpo_lut.bounds(p, dd, name)
                ref_clip = bandpo_lut.clip(r, p, dd, name)
                variants = {"transposed": lambda x: x.t().contiguous().t(),
                            "strided": lambda x: torch.stack([x, x], -1)[..., 1],
                            "permuted": lambda x: x.t().contiguous().unsqueeze(0).expand(2, -1, -1)[1].t()}
                for vname, f in variants.items():
                    lo, up = bandpo_lut.bounds(f(p), dd if not torch.is_tensor(delta) else f(dd), name)
                    ok = same(lo, ref_lo) and same(up, ref_up) and same(bandpo_lut.clip(f(r), f(p), delta, name),
                                                                        ref_clip)
                    report(f"layout {vname} {name} {str(dtype)[6:]} {'token' if torch.is_tensor(delta) else 'scalar'}",
                           ok)
                lo, up = bandpo_lut.bounds(p, delta, name)   # broadcast (33, 1) delta, or scalar
                report(f"layout broadcast delta {name} {str(dtype)[6:]}", same(lo, ref_lo) and same(up, ref_up))
                rb = r[:1]                                     # a broadcast ratio row
                report(f"layout broadcast ratio {name} {str(dtype)[6:]}",
                       same(bandpo_lut.clip(rb, p, delta, name), bandpo_lut.clip(rb.expand(33, 70).contiguous(), p, dd,
                                                                                 name)))


def check_loss(g, quick: bool) -> None:
    import itertools

    import torch

    import bandpo_lut
    from bandpo_lut import tables
    from bandpo_lut.reference import policy_loss as spec

    print("[policy_loss] vs the reference and the CPU op; layouts; determinism")
    B, T = (8, 4099) if quick else (16, 8195)   # several warp tiles per row, a partial last tile
    old = torch.nn.functional.logsigmoid(torch.randn(B, T, generator=g, dtype=torch.float64) * 3)
    new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    new[0, :4] = old[0, :4] + torch.tensor([25.0, -25.0, 20.0, -20.0], dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.1
    mask[3] = False
    wmask = mask.double() * torch.rand(B, T, generator=g, dtype=torch.float64)

    def run(device, dtype, m, **kw):
        a = new.to(device=device, dtype=dtype).detach().clone().requires_grad_()
        loss, metrics = bandpo_lut.policy_loss(a, old.to(device=device, dtype=dtype),
                                               adv.to(device=device, dtype=dtype),
                                               None if m is None else m.to(device), **kw)
        loss.backward()
        return loss, metrics, a.grad

    def err(x, y):
        (l1, m1, g1), (l2, m2, g2) = x, y
        e = [abs(float(l1) - float(l2)) / max(abs(float(l2)), 1e-12),
             float((g1.double().cpu() - g2.double().cpu()).abs().max()) / max(float(g2.double().abs().max()), 1e-30)]
        e += [abs(float(m1[k]) - float(m2[k])) / max(abs(float(m2[k])), 1e-6) for k in m2]
        return max(e)

    def reference(dtype, m, **kw):
        a = new.to(dtype).detach().clone().requires_grad_()
        loss, metrics = spec.policy_loss(a, old.to(dtype), adv.to(dtype), m, **kw)
        loss.backward()
        return loss, metrics, a.grad

    settings = list(itertools.product(spec.CLIPS, spec.MODES, spec.AGGS, (None, 3.0)))
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-10)):
        for clip, mode, agg, dual in settings[:6] if quick else settings:
            kw = dict(clip=clip, mode=mode, agg=agg, dual_clip=dual, max_ratio=10.0)
            gpu, cpu, ref = run("cuda", dtype, mask, **kw), run("cpu", dtype, mask, **kw), reference(dtype, mask, **kw)
            e_ref, e_cpu = err(gpu, ref), err(gpu, cpu)
            report(f"loss {str(dtype)[6:]} {clip} {mode} {agg} dual={dual}", e_ref <= tol and e_cpu <= tol,
                   f"ref {e_ref:.1e}  cpu {e_cpu:.1e}")
    for name in tables.SHIPPED:
        for delta in (0.05, torch.linspace(0.01, 0.3, T, dtype=torch.float64)):
            kw = dict(divergence=name, delta=delta if not torch.is_tensor(delta) else delta.cuda(), max_ratio=10.0)
            kw_c = dict(kw, delta=delta)
            for m in (mask, wmask):
                gpu, cpu = run("cuda", torch.float64, m, **kw), run("cpu", torch.float64, m, **kw_c)
                ref = reference(torch.float64, m, **kw_c)
                e_ref, e_cpu = err(gpu, ref), err(gpu, cpu)
                report(f"loss band {name} {'token' if torch.is_tensor(delta) else 'scalar'} delta "
                       f"{'weights' if m is wmask else 'bool mask'}", e_ref <= 1e-10 and e_cpu <= 1e-10,
                       f"ref {e_ref:.1e}  cpu {e_cpu:.1e}")
    for dtype in (torch.bfloat16, torch.float16):
        gpu, cpu = run("cuda", dtype, mask), run("cpu", dtype, mask)
        report(f"loss {str(dtype)[6:]} inputs vs CPU op", err(gpu, cpu) <= 1e-5, f"{err(gpu, cpu):.1e}")
    # layouts: bit-identical forward and backward
    base = run("cuda", torch.float32, mask, agg="seq-mean-token-mean", delta=0.07)
    for vname, f in {"transposed": lambda x: x.t().contiguous().t(),
                     "strided": lambda x: torch.stack([x, x], -1)[..., 0]}.items():
        a = f(new.float().cuda()).detach().requires_grad_()
        loss, metrics = bandpo_lut.policy_loss(a, f(old.float().cuda()), f(adv.float().cuda()), f(mask.cuda()),
                                               agg="seq-mean-token-mean", delta=0.07)
        loss.backward()
        ok = same(loss, base[0]) and all(same(metrics[k], base[1][k]) for k in metrics) and same(a.grad, base[2])
        report(f"loss layout {vname} (forward and backward bits)", ok)
    # determinism: the same bits run to run
    for kw in (dict(), dict(mask=wmask), dict(delta=torch.full((B, 1), 0.1, dtype=torch.float64))):
        m = kw.pop("mask", mask)
        if "delta" in kw:
            kw["delta"] = kw["delta"].float().cuda()
        runs = [run("cuda", torch.float32, m, **kw) for _ in range(5)]
        ok = all(same(r[0], runs[0][0]) and same(r[2], runs[0][2]) and
                 all(same(r[1][k], runs[0][1][k]) for k in r[1]) for r in runs[1:])
        report(f"loss determinism, 5 runs {sorted(kw) or ''} {'weights' if m is wmask else ''}", ok)


def check_edges(g, quick: bool) -> None:
    import torch

    import bandpo_lut
    from bandpo_lut.reference import policy_loss as spec

    print("[edges] 65,536 rows; 9 and 26 non-collapsible dims; > 2^31 elements; dense tables")
    B, T = 65_536, 5
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    for agg in spec.AGGS:
        a, b = new.cuda().detach().clone().requires_grad_(), new.clone().requires_grad_()
        lg, mg = bandpo_lut.policy_loss(a, old.cuda(), adv.cuda(), agg=agg)
        lr, mr = spec.policy_loss(b, old, adv, agg=agg)
        lg.backward()
        lr.backward()
        e = max(abs(float(lg) - float(lr)) / max(abs(float(lr)), 1e-12),
                float((a.grad.cpu() - b.grad).abs().max() / b.grad.abs().max()))
        report(f"loss 65,536 rows {agg}", e <= 1e-10, f"{e:.1e}")
    for ndim in (9, 26):   # alternating broadcasts: no two dimensions coalesce
        ps = [2 if i % 2 else 1 for i in range(ndim)]
        ds = [1 if i % 2 else 2 for i in range(ndim)]
        p = torch.rand(ps, generator=g).cuda()
        d = (torch.rand(ds, generator=g) * 0.2 + 0.01).cuda()
        shape = torch.broadcast_shapes(p.shape, d.shape)
        lo, up = bandpo_lut.bounds(p, d)
        lo2, up2 = bandpo_lut.bounds(p.expand(shape).contiguous(), d.expand(shape).contiguous())
        report(f"bounds with {ndim} non-collapsible dims == contiguous", same(lo, lo2) and same(up, up2))
    if not quick:
        n = 2 ** 31 + 17   # more than 2^31 elements, float16, dense: 64-bit indices
        p = torch.rand(n, dtype=torch.float16, device="cuda")
        lo, up = bandpo_lut.bounds(p, 0.05)
        idx = torch.cat([torch.arange(64), torch.randint(0, n, (4096,), generator=g), torch.arange(n - 64, n)])
        lo_c, up_c = bandpo_lut.bounds(p[idx.cuda()].cpu(), 0.05)
        report("bounds on 2^31 + 17 float16 elements (dense) == CPU op at sampled positions",
               rel_upper(up[idx.cuda()], up_c) <= 2 ** -10 and rel_lower(lo[idx.cuda()], lo_c.double(),
                                                                         torch.float16) <= 2 ** -10)
        del lo, up
        rows = torch.rand(2 ** 16 + 1, 1, device="cuda", dtype=torch.float16)   # strided: split into 32-bit pieces
        cols = (torch.rand(1, 2 ** 15 + 3, device="cuda") * 0.2 + 0.01).half()
        lo, up = bandpo_lut.bounds(rows, cols)
        pick = [0, 1, 2 ** 15, 2 ** 16]
        ok = all(same(lo[i], bandpo_lut.bounds(rows[i:i + 1], cols)[0][0]) for i in pick)
        report("bounds broadcast to 2^31 + ... elements (strided, split) == row by row", ok)
        del lo, up, p
        torch.cuda.empty_cache()
    # dense tables: the shipped KL table stretched along t (a valid table of more cells), CPU op vs GPU op
    prep = bandpo_lut.api.table_args("kl")
    coef, grid = prep.coefficients, list(prep.grid)
    for factor, what in ((4, "cells of 57/115 KB (float/double): shared memory opted in above 48 KB"),
                         (16, "cells of 229/459 KB: opted-in shared memory / global memory")):
        nt = (coef.shape[1] - 3) * factor + 1
        dense = torch.nn.functional.interpolate(coef.unsqueeze(0), size=(nt + 2, coef.shape[2]), mode="bilinear",
                                                align_corners=True)[0].contiguous()
        g2 = list(grid)
        g2[1] = grid[1] / factor
        KEEP.append(dense)   # cell caches are keyed by the table's address: keep it from being reused
        p = torch.sigmoid(torch.empty(50_000, dtype=torch.float64).uniform_(-15, 15, generator=g))
        for dtype in (torch.float32, torch.float64):
            x = p.to(dtype)
            lo_c, up_c = torch.ops.bandpo_lut.bounds(x, None, 0.05, dense, g2, 0, False, math.inf)
            lo_g, up_g = torch.ops.bandpo_lut.bounds(x.cuda(), None, 0.05, dense.cuda(), g2, 0, False, math.inf)
            e = max(rel_upper(up_g, up_c), rel_lower(lo_g, lo_c.double(), dtype))
            report(f"dense table x{factor} ({nt - 1} cells) {str(dtype)[6:]}: {what}", e <= 2e-6, f"{e:.1e}")


def check_streams_and_graphs(g) -> None:
    import torch

    import bandpo_lut

    print("[streams, graphs] a side stream; CUDA-graph capture with a cached and an uncached delta")
    p = torch.rand(1 << 20, generator=g).cuda()
    r = (torch.rand(1 << 20, generator=g) * 2).cuda()
    want = bandpo_lut.clip(r.cpu(), p.cpu(), 0.0731)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = bandpo_lut.clip(r, p, 0.0731)          # a new delta: collapsed on the side stream
    b = bandpo_lut.clip(r, p, 0.0731)              # the default stream reuses it (waits on its event)
    torch.cuda.current_stream().wait_stream(side)
    report("side stream, then default stream, same new delta", rel_upper(a, want) <= 2e-6 and same(a, b))
    lp = torch.nn.functional.logsigmoid(torch.randn(8, 1000, generator=g)).cuda()
    olp = (lp + torch.randn(8, 1000, generator=g).cuda() * 0.1).clamp(max=0)
    adv = torch.randn(8, 1000, generator=g).cuda()
    for delta, what in ((0.05, "cached"), (0.0917, "uncached")):
        static_lp = lp.clone().requires_grad_()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):   # warm-up outside the capture (autograd, allocator), not of the delta
            for _ in range(2):
                bandpo_lut.policy_loss(static_lp, olp, adv, delta=0.05)[0].backward()
        torch.cuda.current_stream().wait_stream(s)
        static_lp.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_clip = bandpo_lut.clip(r, p, delta)
            loss, metrics = bandpo_lut.policy_loss(static_lp, olp, adv, delta=delta)
            loss.backward()
        for step in range(2):
            with torch.no_grad():
                static_lp.copy_(lp + 0.01 * step)
            static_lp.grad.zero_()
            graph.replay()
            torch.cuda.synchronize()
            e_lp = (lp + 0.01 * step).clone().requires_grad_()
            e_loss, e_metrics = bandpo_lut.policy_loss(e_lp, olp, adv, delta=delta)
            e_loss.backward()
            ok = same(loss, e_loss) and same(static_lp.grad, e_lp.grad) and same(out_clip, bandpo_lut.clip(r, p, delta))
            ok &= all(same(metrics[k], e_metrics[k]) for k in metrics)
            report(f"CUDA graph replay {step}, {what} delta (clip, loss, gradient == eager)", ok)


def check_compile(g) -> None:
    import torch

    import bandpo_lut

    print("[torch.compile]")
    lp = torch.nn.functional.logsigmoid(torch.randn(4, 300, generator=g)).cuda()
    olp, adv = (lp - 0.05).clamp(max=0), torch.randn(4, 300, generator=g).cuda()
    f = torch.compile(lambda a, b, c: bandpo_lut.policy_loss(a, b, c, max_ratio=10.0), fullgraph=True)
    a1, a2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    l1, _ = f(a1, olp, adv)
    l2, _ = bandpo_lut.policy_loss(a2, olp, adv, max_ratio=10.0)
    l1.backward()
    l2.backward()
    report("torch.compile(fullgraph=True) policy_loss == eager", same(l1, l2) and same(a1.grad, a2.grad))


def sanitizer_workload() -> None:
    """A small run of every kernel (for compute-sanitizer)."""
    import torch

    import bandpo_lut

    g = torch.Generator().manual_seed(1)
    p = torch.rand(3000, generator=g).cuda()
    for name in ("kl", "tv", "chi2", "hellinger"):
        for dtype in (torch.float32, torch.float64, torch.float16):
            x = p.to(dtype)
            bandpo_lut.bounds(x, 0.05, name)
            bandpo_lut.bounds(x, torch.full_like(x, 0.1), name)
            bandpo_lut.clip(x * 2, x[:1], 0.05, name)
            bandpo_lut.bounds(x.view(60, 50).t(), 0.05, name)
    lp = torch.nn.functional.logsigmoid(torch.randn(5, 700, generator=g)).cuda().requires_grad_()
    for kw in (dict(), dict(delta=torch.full((5, 1), 0.1).cuda()), dict(clip="dcpo"), dict(agg="seq-mean-token-mean")):
        loss, _ = bandpo_lut.policy_loss(lp, (lp.detach() - 0.1).clamp(max=0), torch.randn(5, 700).cuda(),
                                         torch.rand(5, 700).cuda() > 0.3, **kw)
        loss.backward()
    torch.cuda.synchronize()


def run_sanitizers(seed: int) -> None:
    from torch.utils import cpp_extension

    tool = shutil.which("compute-sanitizer") or str(Path(cpp_extension.CUDA_HOME or "/usr/local/cuda") / "bin" /
                                                     "compute-sanitizer")
    if not Path(tool).exists():
        print("[sanitizer] compute-sanitizer not installed: skipped")
        return
    for check in ("memcheck", "racecheck", "synccheck"):
        t0 = time.time()
        cmd = [tool, "--tool", check, "--error-exitcode", "3", "--kernel-regex", "kns=bandpo",
               sys.executable, str(Path(__file__).resolve()), "--workload", "--seed", str(seed)]
        out = subprocess.run(cmd, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=240)
        summary = re.findall(r"ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: \d+ hazards?.*", out.stdout + out.stderr)
        report(f"compute-sanitizer {check}", out.returncode == 0, f"{time.time() - t0:.0f} s  {' '.join(summary)}")
        if out.returncode != 0:
            print((out.stdout + out.stderr)[-3000:])


# ---------------------------------------------------------------------------------------------------------
# 5: timing

def timed(fn, reps=20):
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def timing(g) -> None:
    import torch

    import bandpo_lut
    from bandpo_lut.bench import canonical_ppo_loss

    N = 2 ** 26
    p = torch.sigmoid(torch.randn(N, device="cuda") * 3)
    r = torch.exp(torch.randn(N, device="cuda") * 0.3)
    dt = torch.full((N,), 0.05, device="cuda")
    out = torch.empty_like(r)
    # (label, ms, bytes moved)
    rows = [("device-to-device copy", timed(lambda: out.copy_(r)), 8 * N),
            ("torch.clamp(ratio, 0.8, 1.28)", timed(lambda: torch.clamp(r, 0.8, 1.28)), 8 * N)]
    for name in ("kl", "tv", "chi2", "hellinger"):
        rows.append((f"clip {name}, scalar delta", timed(lambda: bandpo_lut.clip(r, p, 0.05, name)), 12 * N))
    rows.append(("clip kl, per-token delta", timed(lambda: bandpo_lut.clip(r, p, dt)), 16 * N))
    rows.append(("bounds kl, scalar delta", timed(lambda: bandpo_lut.bounds(p, 0.05)), 12 * N))
    B, T = 256, 8192
    lp = torch.nn.functional.logsigmoid(torch.randn(B, T, device="cuda") * 2)
    olp, adv = (lp + torch.randn(B, T, device="cuda") * 0.1).clamp(max=0), torch.randn(B, T, device="cuda")
    mask = torch.rand(B, T, device="cuda") > 0.1
    a = lp.clone().requires_grad_()

    def fused():
        bandpo_lut.policy_loss(a, olp, adv, mask, max_ratio=10.0)[0].backward()

    def eager():
        canonical_ppo_loss(a, olp, adv, mask)[0].backward()

    loss_rows = [("eager PPO loss (256x8192), fwd+bwd", timed(eager, 10)),
                 ("bandpo_lut.policy_loss (256x8192), fwd+bwd", timed(fused, 10))]
    copy_ms = rows[0][1]
    copy_bw = rows[0][2] / copy_ms
    print(f"\n[timing] N = 2^26 float32 on {torch.cuda.get_device_name()}")
    print(f"  {'what':44s} {'ms':>9s} {'x copy':>7s} {'GB/s':>8s} {'of copy BW':>10s}")
    for label, ms, nbytes in rows:
        print(f"  {label:44s} {ms:9.4f} {ms / copy_ms:7.2f} {nbytes / ms / 1e6:8.0f} {nbytes / ms / copy_bw:10.0%}")
    for label, ms in loss_rows:
        print(f"  {label:44s} {ms:9.4f} {ms / loss_rows[0][1]:7.2f}x eager")
    name = torch.cuda.get_device_name()
    frac = rows[2][2] / rows[2][1] / copy_bw
    if DATACENTER.search(name):
        report(f"clip kl (scalar delta) >= {CLIP_BANDWIDTH_MIN:.0%} of copy bandwidth", frac >= CLIP_BANDWIDTH_MIN,
               f"{frac:.0%}")
    else:
        print(f"  (not a datacenter GPU: the bandwidth threshold is reported, not enforced: {frac:.0%})")
    report("fused loss no slower than the eager PPO loss", loss_rows[1][1] <= loss_rows[0][1],
           f"{loss_rows[1][1] / loss_rows[0][1]:.2f}x")


# ---------------------------------------------------------------------------------------------------------

def finish() -> int:
    if FAILURES:
        print(f"\nSOME CHECKS FAILED ({len(FAILURES)}): " + "; ".join(FAILURES))
        return 1
    print("\nALL OK")
    return 0


def checks(seed: int, quick: bool) -> int:
    import torch

    import bandpo_lut

    info = bandpo_lut.build_info()
    print(f"device {torch.cuda.get_device_name()}; bandpo_lut {bandpo_lut.__version__} at {bandpo_lut.__file__}, "
          f"built with CUDA {info.get('cuda_version')} for {info.get('cuda_arch_list')}; torch {torch.__version__}; "
          f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for step in (check_bounds, check_layouts, check_loss, check_edges, check_streams_and_graphs, check_compile):
        t0 = time.time()
        try:
            if step in (check_bounds, check_loss, check_edges):
                step(g, quick)
            else:
                step(g)
        except Exception as err:   # a crash is a failure of that step; the others still run
            import traceback

            traceback.print_exc()
            report(f"{step.__name__} raised {type(err).__name__}", False)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    import gpu_check_fused_linear  # tools/: the fused-linear loss's checks and its timing/memory table

    try:
        gpu_check_fused_linear.check(report, g)
    except Exception as err:
        import traceback

        traceback.print_exc()
        report(f"fused-linear checks raised {type(err).__name__}", False)
    timing(g)
    gpu_check_fused_linear.timing(report)
    return finish()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    ap.add_argument("--no-build", action="store_true", help="check the installed build as it is")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer points and settings, no 2^31-element case")
    ap.add_argument("--checks-only", action="store_true", help=argparse.SUPPRESS)   # the child process
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)      # under compute-sanitizer
    args = ap.parse_args()
    print(f"gpu_check: seed {args.seed} (rerun with --seed {args.seed})", flush=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 1
    if args.workload:
        sanitizer_workload()
        return 0
    if args.checks_only:
        return checks(args.seed, args.quick)
    t0 = time.time()
    arch = local_arch()
    if not args.no_build:
        build(arch)
    ptxas_figures(arch)
    # The checks run in a fresh process outside the checkout, so that they import the installed build.
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--checks-only", "--seed", str(args.seed)] +
                           (["--quick"] if args.quick else []), cwd=tempfile.gettempdir())
    if child.returncode != 0:
        FAILURES.append("checks")
    if not args.no_sanitizer:
        run_sanitizers(args.seed)
    print(f"\ngpu_check: {time.time() - t0:.0f} s in all, seed {args.seed}")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
