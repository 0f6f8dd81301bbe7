#!/usr/bin/env python3
"""GPU check of bandpo_lut: one command on a machine with a CUDA GPU, torch and nvcc (no network needed).

    python tools/gpu_check.py [--out DIR] [--compilers system,default] [--seed S] [--no-build] [--build-only]
                              [--no-ptxas] [--no-sanitizer] [--sanitizer-timeout S] [--tests-timeout S] [--quick]
                              [--dry-run]

From the repository root it does what only a GPU machine can, and runs the test suite's CUDA half for the rest:
  1. builds and installs the extension for the local GPU only (TORCH_CUDA_ARCH_LIST from the device), once per
     compiler of --compilers (default `system,default`: CXX=/usr/bin/g++ CC=/usr/bin/gcc when that is not the
     default compiler already, then the environment's own CXX or `c++`), and imports each build in a fresh process
     (a GCC that links libstdc++ statically made `import bandpo_lut` segfault); a compiler that the build's
     toolchain probe refuses is reported with the probe's message (a finding, not a failure); the last build (by
     default the default compiler's, what a user's `pip install` gets) stays installed for the steps below, which
     run only if it built and imports (--build-only stops here),
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
  6. torch.compile(fullgraph=True) and a CUDA-graph capture of clip and policy_loss on the GPU (a Python and a
     host 0-dim δ; replays with new inputs), against eager,
  7. checks bandpo_lut.fused_linear_policy_loss on CUDA (tools/gpu_check_fused_linear.py: against the unfused
     path, no host synchronisation, torch.compile) and, where liger-kernel is installed, that Liger's fused-linear
     GRPO loss computes what the bench compares it as; the memory/time table is `bandpo-lut bench --device cuda
     --fused-linear` (tools/gpu_session.sh runs both),
and exits non-zero if anything failed. The random seed (sanitizer workload and timing inputs) is printed.
Everything printed, the subprocesses' output included, is also written to DIR/gpu_check.log (DIR: --out, else $OUT
when set), with one log per step beside it (build-<compiler>.log, pytest.log, sanitizer-<tool>.log, ...).
--dry-run prints the plan (steps, commands, compilers) without a GPU and runs nothing.
Budget (H200, MAX_JOBS=16): two builds ~140 s, ptxas ~30 s, all CUDA tests ~90 s, sanitizers ~90 s, compile and
graph ~20 s, timing and fused linear ~40 s: about 7 minutes.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SEED = 20261203
DATACENTER = re.compile(r"\b(A100|A800|H100|H800|H200|H20|GH200|B100|B200|GB200|B300|GB300)\b")
CLIP_BANDWIDTH_MIN = 0.60      # clip kl (scalar delta) bytes/s over device-to-device copy bytes/s, N = 2^26

FAILURES: list[str] = []
LOG_DIR: Path | None = None    # --out / $OUT: where the logs go
SYSTEM_CXX, SYSTEM_CC = "/usr/bin/g++", "/usr/bin/gcc"
PROBE_REFUSAL = "bandpo_lut setup: error: the C++ compiler"    # how setup.py reports the toolchain probe's refusal


class Tee:
    """sys.stdout/sys.stderr also written to a log file."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.stream.write(text)
        self.log.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def isatty(self):
        return False


def start_log(folder: Path) -> None:
    global LOG_DIR
    LOG_DIR = folder
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "gpu_check.log", "a", buffering=1)   # noqa: SIM115 (open for the whole run)
    sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)


def run_logged(cmd, log_name: str, *, env=None, cwd=None, timeout=None, echo=True) -> tuple[int, str]:
    """Run `cmd`, its stdout and stderr merged, streamed to this process's (teed) stdout when `echo` and to
    LOG_DIR/log_name; returns (exit status, output). A timeout kills it and returns 124."""
    print(f"    $ {' '.join(map(str, cmd))}" + (f"   [log: {log_name}]" if LOG_DIR else ""), flush=True)
    log = open(LOG_DIR / log_name, "w") if LOG_DIR else None   # noqa: SIM115
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=cwd, bufsize=1)
    lines, killed = [], threading.Event()

    def kill():
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill) if timeout else None   # also when the child prints nothing
    if timer:
        timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
            if log:
                log.write(line)
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
        if log:
            log.close()
    if killed.is_set():
        print(f"    [gpu_check: killed after {timeout} s]")
        rc = 124
    return rc, "".join(lines)


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


def compiler_envs(names: list[str]) -> list[tuple[str, dict]]:
    """(name, environment) per compiler to build with: `default` is the environment as it is (its CXX/CC or the
    `c++` on PATH, what a user's `pip install` gets); `system` is /usr/bin/g++ and /usr/bin/gcc, skipped when that
    is the default compiler already and `default` is built too."""
    out = []
    for name in names:
        if name == "default":
            out.append(("default", dict(os.environ)))
        elif name == "system":
            default = shutil.which(os.environ.get("CXX", "c++"))
            if "default" in names and default and Path(default).resolve() == Path(SYSTEM_CXX).resolve():
                print(f"[build] the default compiler is {SYSTEM_CXX}: no separate system build")
                continue
            out.append(("system", dict(os.environ, CXX=SYSTEM_CXX, CC=SYSTEM_CC)))
        else:
            raise SystemExit(f"gpu_check: --compilers: unknown compiler {name!r} (default, system)")
    return out


def compiler_line(env: dict) -> str:
    cxx = env.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return f"{cxx} (not found)"


def probe_refusal(rc: int, out: str) -> str | None:
    """The toolchain probe's refusal in a failed build's output (setup.py's message, from its start), else None."""
    if rc == 0 or PROBE_REFUSAL not in out:
        return None
    return out[out.find(PROBE_REFUSAL):].strip()


def build(arch: str, name: str, env: dict) -> bool:
    env = dict(env, TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4)))
    print(f"[build {name}] {compiler_line(env)}; TORCH_CUDA_ARCH_LIST={arch} MAX_JOBS={env['MAX_JOBS']}", flush=True)
    t0 = time.time()
    cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--force-reinstall",
           str(ROOT)]
    rc, out = run_logged(cmd, f"build-{name}.log", env=env, cwd=tempfile.gettempdir(), echo=False)
    if rc != 0 and "externally-managed-environment" in out:     # a distribution's Python outside a venv (PEP 668)
        rc, out = run_logged(cmd + ["--break-system-packages"], f"build-{name}.log", env=env,
                             cwd=tempfile.gettempdir(), echo=False)
    probe = [line.strip() for line in out.splitlines() if "toolchain probe:" in line]
    refusal = probe_refusal(rc, out)
    if refusal:
        # What the toolchain probe is for: a compiler whose build would break at import is refused with a message
        # naming it and the fix. A finding to quote, not a failure (the next compiler's build must import).
        print(f"    the toolchain probe refused the {name} compiler:\n      " +
              "\n      ".join(refusal.splitlines()[:12]))
        report(f"build with the {name} compiler refused by the toolchain probe", True, f"{time.time() - t0:.0f} s")
        return False
    if rc != 0:
        print(out[-4000:])
    elif probe:
        print(f"    {probe[-1]}")
    return report(f"build with the {name} compiler", rc == 0, f"{time.time() - t0:.0f} s")


# The import a user does first, in a fresh process, then one op on the CPU and the facts (what once crashed
# with a statically linked libstdc++).
IMPORT_CHECK = """
import json, pathlib, torch, bandpo_lut
from bandpo_lut.runtime import _extension
lo, up = bandpo_lut.bounds(torch.tensor([0.3]), 0.05)
assert 0 < lo.item() < 1 < up.item(), (lo, up)
print(json.dumps(dict(build=_extension.facts()["build"], so=_extension.load().__file__)))
"""


def import_check(name: str, env: dict) -> bool:
    """The build just installed imports and runs (exit -11 was the segfault); prints whether its _C links
    libstdc++ dynamically and how many iostream symbols it defines itself (a static libstdc++ defines them)."""
    rc, out = run_logged([sys.executable, "-c", IMPORT_CHECK], f"import-{name}.log", env=env,
                         cwd=tempfile.gettempdir(), timeout=120)
    detail = "segfault (exit -11)" if rc == -11 else f"exit {rc}"
    ok = report(f"import bandpo_lut built with the {name} compiler", rc == 0, detail)
    m = re.search(r'"so": "([^"]+)"', out)
    if m and shutil.which("readelf") and shutil.which("nm"):
        so = m.group(1)
        needed = re.findall(r"\[(lib[^\]]+)\]", subprocess.run(["readelf", "-d", so], capture_output=True,
                                                                 text=True).stdout)
        defined = subprocess.run(["nm", "-D", "-C", "--defined-only", so], capture_output=True, text=True).stdout
        n_ios = sum(1 for line in defined.splitlines() if re.search(r"basic_ostream|ios_base|std::locale", line))
        print(f"    {Path(so).name}: NEEDED {', '.join(needed)}; iostream/locale symbols defined in it: {n_ios}")
    return ok


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

def cuda_tests(quick: bool, timeout: float | None = None) -> None:
    """pytest -m cuda over tests/, from tests/ (not the repository root, whose bandpo_lut is the source tree
    without the compiled extension): the tests import the build just installed."""
    marker = "cuda and not slow" if quick else "cuda"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, str(ROOT / "tests")]
    print(f"[tests] pytest -m {marker!r} tests", flush=True)
    t0 = time.time()
    # The trainers' test modules need verl/TRL/SkyRL/OpenRLHF, which a GPU image lacks (a missing one is a collection
    # error there, by design); none of them holds a CUDA case.
    env = dict(os.environ, BANDPO_SKIP_INTEGRATIONS="1")
    rc, out = run_logged(cmd, "pytest.log", cwd=ROOT / "tests", timeout=timeout, env=env)
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    # exit 5: nothing collected, i.e. no test ran on the GPU: a failure here
    report(f"pytest -m {marker!r}", rc == 0, f"{time.time() - t0:.0f} s, exit {rc}: {summary[:80]}")


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
            bandpo_lut.bounds(x, torch.tensor(0.07, dtype=torch.float64), name)    # a host 0-dim δ
    lp = torch.nn.functional.logsigmoid(torch.randn(5, 700, generator=g)).cuda().requires_grad_()
    for kw in (dict(), dict(delta=torch.full((5, 1), 0.1).cuda()), dict(clip="dcpo"), dict(agg="seq-mean-token-mean")):
        loss, _ = bandpo_lut.policy_loss(lp, (lp.detach() - 0.1).clamp(max=0), torch.randn(5, 700).cuda(),
                                         torch.rand(5, 700).cuda() > 0.3, **kw)
        loss.backward()
    torch.cuda.synchronize()


def run_sanitizers(seed: int, timeout: float = 240) -> None:
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
        rc, out = run_logged(cmd, f"sanitizer-{check}.log", cwd=tempfile.gettempdir(), timeout=timeout, echo=False)
        summary = re.findall(r"ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: \d+ hazards?.*", out)
        report(f"compute-sanitizer {check}", rc == 0, f"{time.time() - t0:.0f} s  {' '.join(summary)}")
        if rc != 0:
            print(out[-3000:])


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


def compile_and_graph() -> None:
    """Step 6: torch.compile(fullgraph=True) and a CUDA-graph capture of clip and policy_loss (fwd+bwd) on the GPU,
    with a Python δ and a host 0-dim δ, against eager; the graph replayed with new inputs copied in."""
    import torch

    import bandpo_lut

    g = torch.Generator().manual_seed(6)
    p = torch.rand(4096, generator=g).cuda()
    r = (torch.rand(4096, generator=g) * 2).cuda()
    lp = torch.nn.functional.logsigmoid(torch.randn(8, 300, generator=g)).cuda()
    olp, adv = (lp - 0.1).clamp(max=0), torch.randn(8, 300, generator=g).cuda()
    host = torch.tensor(0.07, dtype=torch.float64)

    def loss_and_grad(lp, delta):
        a = lp.detach().clone().requires_grad_()
        loss, _ = bandpo_lut.policy_loss(a, olp, adv, delta=delta, max_ratio=10.0)
        loss.backward()
        return loss.detach(), a.grad

    try:
        clip_c = torch.compile(lambda r, p, d: bandpo_lut.clip(r, p, d), fullgraph=True)
        for delta in (0.05, host):
            ok = torch.equal(clip_c(r, p, delta), bandpo_lut.clip(r, p, delta))
            report(f"torch.compile(fullgraph) clip, delta {type(delta).__name__}, equal to eager", ok)
        loss_c = torch.compile(lambda a, d: bandpo_lut.policy_loss(a, olp, adv, delta=d, max_ratio=10.0)[0],
                               fullgraph=True)
        for delta in (0.05, host):
            a = lp.detach().clone().requires_grad_()
            got = loss_c(a, delta)
            got.backward()
            want, want_grad = loss_and_grad(lp, delta)
            ok = torch.allclose(got, want, rtol=1e-6, atol=0) and torch.allclose(a.grad, want_grad, rtol=1e-6, atol=0)
            report(f"torch.compile(fullgraph) policy_loss fwd+bwd, delta {type(delta).__name__}", ok)
        # CUDA graph: static inputs, captured once, replayed with new values copied in
        static_r, static_lp = r.clone(), lp.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):      # warm up (the cell cache) outside the capture, as torch advises
            for _ in range(2):
                bandpo_lut.clip(static_r, p, 0.05)
                loss_and_grad(static_lp, 0.05)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = bandpo_lut.clip(static_r, p, 0.05)
            static_a = static_lp.detach().clone().requires_grad_()
            static_loss, _ = bandpo_lut.policy_loss(static_a, olp, adv, delta=0.05, max_ratio=10.0)
            static_loss.backward()
        for k in range(3):
            static_r.copy_(r * (0.5 + 0.25 * k))
            static_lp.copy_((lp * (1 + 0.1 * k)).clamp(max=0))
            graph.replay()
            torch.cuda.synchronize()
            want_loss, want_grad = loss_and_grad(static_lp, 0.05)
            ok = (torch.equal(static_out, bandpo_lut.clip(static_r, p, 0.05)) and torch.equal(static_loss, want_loss)
                  and torch.equal(static_a.grad, want_grad))
            report(f"CUDA graph replay {k}: clip and policy_loss equal to eager", ok)
    except Exception as err:
        import traceback

        traceback.print_exc()
        report(f"compile/graph checks raised {type(err).__name__}", False)


def fused_linear(seed: int) -> None:
    """Step 7: tools/gpu_check_fused_linear.py's checks; a crash is a failure, the summary still prints."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import gpu_check_fused_linear

        gpu_check_fused_linear.check(report, torch.Generator().manual_seed(seed))
        gpu_check_fused_linear.check_liger(report, torch.Generator().manual_seed(seed))
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


def plan(args, arch: str) -> None:
    """--dry-run: what would run, in order."""
    print("[plan]")
    if args.no_build:
        print("  1. no build: the installed bandpo_lut is checked; import check in a fresh process")
    else:
        for name, env in compiler_envs(args.compilers):
            print(f"  1. build with {name}: CXX={env.get('CXX', '(unset: c++)')} CC={env.get('CC', '(unset: cc)')}"
                  f" ({compiler_line(env)}), TORCH_CUDA_ARCH_LIST={arch}; then the import check in a fresh process")
    if args.build_only:
        print("  (--build-only: nothing more)")
        print(f"  logs: {LOG_DIR if LOG_DIR else '(none: give --out DIR or set $OUT)'}")
        return
    print("  2. ptxas figures of csrc/cuda/*.cu" if not args.no_ptxas else "  2. (no ptxas figures)")
    print(f"  3. pytest -m {'cuda and not slow' if args.quick else 'cuda'!r} tests (log: pytest.log"
          + (f", at most {args.tests_timeout:g} s)" if args.tests_timeout else ")"))
    print(f"  4. compute-sanitizer memcheck, racecheck, synccheck on --workload, at most {args.sanitizer_timeout:g} s "
          "each" if not args.no_sanitizer else "  4. (no sanitizer)")
    print("  5. timing table   6. torch.compile and CUDA-graph capture   7. fused linear")
    print(f"  logs: {LOG_DIR if LOG_DIR else '(none: give --out DIR or set $OUT)'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="folder for gpu_check.log and the per-step logs (default: $OUT when set)")
    ap.add_argument("--compilers", type=lambda v: [c for c in v.split(",") if c], default=["system", "default"],
                    help="compilers to build with, comma-separated, the last one's build stays installed: default "
                         "(the environment's CXX / c++), system (CXX=/usr/bin/g++ CC=/usr/bin/gcc); "
                         "default: system,default")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    ap.add_argument("--no-build", action="store_true", help="check the installed build as it is")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--sanitizer-timeout", type=float, default=240, help="seconds per sanitizer run (default 240)")
    ap.add_argument("--tests-timeout", type=float, default=None, help="seconds for the CUDA tests (default: none)")
    ap.add_argument("--no-ptxas", action="store_true", help="skip the ptxas figures (they need no GPU: "
                                                             "tools/sass_counts.py and nvcc -Xptxas -v give them)")
    ap.add_argument("--build-only", action="store_true", help="build(s) and import check(s), then stop")
    ap.add_argument("--quick", action="store_true", help="the CUDA tests without the slow ones (no 2^31-element case)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the compilers found; run nothing")
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)      # under compute-sanitizer
    args = ap.parse_args()
    if args.out and not args.workload:
        start_log(args.out)
    print(f"gpu_check: seed {args.seed} (rerun with --seed {args.seed})", flush=True)
    import torch

    if args.dry_run:
        plan(args, local_arch() if torch.cuda.is_available() else "(the GPU's)")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    if args.workload:
        sanitizer_workload()
        return 0
    t0 = time.time()
    arch = local_arch()
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, Python {sys.version.split()[0]}")
    if args.no_build:
        installed = import_check("installed", dict(os.environ))
    else:
        installed = False
        for name, env in compiler_envs(args.compilers):
            installed = build(arch, name, env) and import_check(name, env)
    if not installed or args.build_only:
        # the last build did not build or import: the steps below would test an older build, or none
        print(f"\ngpu_check: {time.time() - t0:.0f} s" + ("" if installed else "; the installed build is not the "
                                                         "last one built, or does not import: stopped here"))
        if not installed:
            report("the last build is installed and imports", False)
        return finish()
    if not args.no_ptxas:
        ptxas_figures(arch)
    cuda_tests(args.quick, args.tests_timeout)
    if not args.no_sanitizer:
        run_sanitizers(args.seed, args.sanitizer_timeout)
    timing(None)
    compile_and_graph()
    fused_linear(args.seed)
    print(f"\ngpu_check: {time.time() - t0:.0f} s in all, seed {args.seed}")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
