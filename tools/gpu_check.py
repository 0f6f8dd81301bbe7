#!/usr/bin/env python3
"""GPU check of bandpo_lut: one command on a machine with a CUDA GPU, torch and nvcc (no network needed).

    python tools/gpu_check.py [--seed S] [--no-build] [--no-sanitizer] [--quick]

From the repository root it does what only a GPU machine can, and runs the test suite's CUDA half for the rest:
  1. builds and installs the extension for the local GPU only (TORCH_CUDA_ARCH_LIST from the device),
  2. prints ptxas register, spill and shared-memory figures of every kernel (nvcc -Xptxas -v per .cu file),
  3. runs the CUDA tests, `pytest -m cuda tests` (with --quick: `-m "cuda and not slow"`), in a fresh process that
     imports the installed build: every op against the pure-PyTorch reference and mpmath on the GPU (every
     divergence, dtype, δ mode and input), opcheck on every op, every layout bit-identical to contiguous, the fused
     loss in every setting, edge sizes (65,536 rows, long rows, 9 non-collapsible dims, more than 2^31 elements,
     dense tables that need shared memory above 48 KB or none), run-to-run determinism, a side stream, a CUDA-graph
     capture, torch.compile; the error measures and references are the tests' own,
  4. runs compute-sanitizer memcheck, racecheck and synccheck on a small workload where installed,
  5. prints a timing table against a device-to-device copy and torch.clamp, with pass/fail thresholds
     (clip, kl, scalar delta >= 60% of copy bandwidth at N = 2^26 on a datacenter GPU; the fused loss no
     slower than the eager PPO loss),
  6. checks bandpo_lut.fused_linear_policy_loss on CUDA (tools/gpu_check_fused_linear.py: against the unfused
     path, no host synchronisation, torch.compile) and prints its memory/time table against the unfused path
     and, where liger-kernel is installed, Liger's fused-linear GRPO loss (fails above 1/8 of the unfused
     path's extra memory at V = 131072),
and exits non-zero if anything failed. The random seed (sanitizer workload and timing inputs) is printed.
Budget: under eight minutes on an H100/H200 node (the build is most of it).
"""
from __future__ import annotations

import argparse
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
# 3: the CUDA tests

def cuda_tests(quick: bool) -> None:
    """pytest -m cuda over tests/, from tests/ (not the repository root, whose bandpo_lut is the source tree
    without the compiled extension): the tests import the build just installed."""
    marker = "cuda and not slow" if quick else "cuda"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, str(ROOT / "tests")]
    print(f"[tests] pytest -m {marker!r} tests", flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT / "tests")
    # exit 5: nothing collected, i.e. no test ran on the GPU: a failure here
    report(f"pytest -m {marker!r}", out.returncode == 0, f"{time.time() - t0:.0f} s, exit {out.returncode}")


# ---------------------------------------------------------------------------------------------------------
# 4: compute-sanitizer

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
    from bandpo_lut.cli.bench.command import canonical_ppo_loss

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


def fused_linear(seed: int) -> None:
    """Step 6: tools/gpu_check_fused_linear.py's checks and table; a crash is a failure, the summary still prints."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import gpu_check_fused_linear

        gpu_check_fused_linear.check(report, torch.Generator().manual_seed(seed))
    except Exception as err:
        import traceback

        traceback.print_exc()
        report(f"fused-linear checks raised {type(err).__name__}", False)


def finish() -> int:
    if FAILURES:
        print(f"\nSOME CHECKS FAILED ({len(FAILURES)}): " + "; ".join(FAILURES))
        return 1
    print("\nALL OK")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    ap.add_argument("--no-build", action="store_true", help="check the installed build as it is")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the CUDA tests without the slow ones (no 2^31-element case)")
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)      # under compute-sanitizer
    args = ap.parse_args()
    print(f"gpu_check: seed {args.seed} (rerun with --seed {args.seed})", flush=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    if args.workload:
        sanitizer_workload()
        return 0
    t0 = time.time()
    arch = local_arch()
    if not args.no_build:
        build(arch)
    ptxas_figures(arch)
    cuda_tests(args.quick)
    if not args.no_sanitizer:
        run_sanitizers(args.seed)
    timing(None)
    fused_linear(args.seed)
    print(f"\ngpu_check: {time.time() - t0:.0f} s in all, seed {args.seed}")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
