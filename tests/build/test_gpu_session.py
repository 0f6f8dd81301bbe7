"""The GPU session's plumbing, on the CPU: `tools/gpu_session.sh --dry-run` runs its steps in order, each under a
time limit that leaves the later ones their share of the budget, with a log per step and a summary; and
`tools/gpu_check.py` reads a build refused by the toolchain probe as the probe's finding (its message quoted), which
setup.py prints as a real refusal (a compiler whose shared objects crash next to torch)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_session.sh"
GXX = shutil.which("g++")


def session(tmp_path, *args, timeout=120):
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=timeout,
                       env=fresh_env(OUT=out, PYTHON=sys.executable), cwd=tmp_path)
    return r, out


def summary(stdout: str) -> list[list[str]]:
    tail = stdout[stdout.rindex("== gpu_session summary"):].splitlines()
    head = next(i for i, line in enumerate(tail) if line.split()[:3] == ["step", "result", "s"])
    return [line.split() for line in tail[head + 1:] if line.strip()]


def test_dry_run_runs_the_chosen_steps_in_order_with_a_log_each(tmp_path):
    r, out = session(tmp_path, "--steps", "ncu,check,build,env")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert [row[0] for row in summary(r.stdout)] == ["env", "build", "check", "ncu"]     # the script's order
    assert all(row[1:3] == ["exit", "0"] for row in summary(r.stdout)), r.stdout[-2000:]
    for step in ("env", "build", "check", "ncu"):
        assert (out / f"{step}.log").stat().st_size > 0, step
    assert "ncu_workload: 9 ops run (no profiler) on cpu" in (out / "ncu.log").read_text()
    assert (out / "session.log").read_text() == r.stdout        # everything printed is also in OUT
    # the plan of each gpu_check call: both compilers, default first; then the checks on the installed build
    build, check = (out / "build.log").read_text(), (out / "check.log").read_text()
    assert "--compilers default,system" in r.stdout and "(--build-only: nothing more)" in build, build
    assert "1. no build" in check and "(no ptxas figures)" in check and "at most 60 s each" in check, check


def test_a_step_that_cannot_get_its_least_time_is_skipped_saying_how_to_rerun_it(tmp_path):
    r, out = session(tmp_path, "--steps", "env,bench-fl", "--budget", "60")
    assert r.returncode == 1
    # env's limit leaves bench-fl its 80 s at the least: with 60 s in all, env cannot start, bench-fl is skipped
    rows = summary(r.stdout)
    assert [row[:3] for row in rows] == [["env", "skipped", "(budget)"], ["bench-fl", "skipped", "(budget)"]], rows
    assert "(rerun with --steps bench-fl)" in r.stdout and not (out / "bench-fl.log").exists()


@pytest.mark.parametrize("args, message", [(["--steps", "env,nope"], "--steps: unknown step 'nope'"),
                                           (["--budget", "9m"], "--budget: expected whole seconds, got '9m'"),
                                           (["--nope"], "unknown argument --nope")])
def test_bad_arguments_are_refused_before_any_step(tmp_path, args, message):
    r, out = session(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr and not out.exists(), r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="here a CUDA build would be made and measured")
def test_steps_that_need_the_cuda_build_build_it_first_once(tmp_path):
    """Without the CUDA build installed (a fresh machine, or --steps without build), the first step that needs it
    builds it with the system compiler first, once; on a machine without a GPU every one of them says so and the
    session fails (exit 1), each step's own exit status in the summary."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), "--steps", "accuracy,bench"], capture_output=True, text=True, timeout=120,
                       env=fresh_env(OUT=out, PYTHON=sys.executable), cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert r.stdout.count("no CUDA build of bandpo_lut is installed: building with the system compiler first") == 1
    rows = summary(r.stdout)
    assert [row[0] for row in rows] == ["build", "accuracy", "bench"], rows
    assert all(row[1] == "exit" and row[2] != "0" for row in rows), rows
    assert "gpu_check: no CUDA device" in (out / "build.log").read_text()
    assert "no CUDA device is available" in (out / "accuracy.log").read_text()


@pytest.mark.slow
def test_dry_run_of_accuracy_and_both_benches_with_the_session_flags(tmp_path):
    """The measuring steps, the commands of the GPU session at tiny sizes on the CPU: the accuracy truth is written for the
    next session to carry, the benches' JSON has float32 and bfloat16 fused-linear rows and says why Liger is
    missing."""
    r, out = session(tmp_path, "--steps", "accuracy,bench,bench-fl", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert [row[0] for row in summary(r.stdout)] == ["accuracy", "bench", "bench-fl"]
    assert (out / "accuracy_truth.npz").is_file()
    assert re.search(r"^kl\s+per-token\s+\d", (out / "accuracy.log").read_text(), re.M)
    assert json.loads((out / "bench.json").read_text())["rows"]
    fl = json.loads((out / "bench_fused_linear.json").read_text())
    assert [(row["dtype"], row["head"]) for row in fl["fused_linear_rows"]] == [
        ("float32", "frozen"), ("float32", "trained"), ("bfloat16", "frozen"), ("bfloat16", "trained")]
    assert "on cpu" in fl["liger_missing"]


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_gpu_check_reads_setup_py_refusal_as_the_toolchain_probe_finding(tmp_path):
    """A compiler whose shared objects crash when loaded next to torch: setup.py refuses it before compiling
    anything; gpu_check recognises the refusal (a finding to quote, not a failed build) and keeps its message,
    which names the compiler."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    crash = tmp_path / "crash_at_load.cpp"
    crash.write_text("#include <csignal>\n__attribute__((constructor)) static void boom() { std::raise(SIGSEGV); }\n")
    cxx = tmp_path / "crashing-g++"
    cxx.write_text(f'#!/bin/sh\nexec {GXX} "$@" {crash}\n')
    cxx.chmod(0o755)
    env = fresh_env(CXX=cxx, FORCE_ONLY_CPU="1")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "temp"),
                        "--build-lib", str(tmp_path / "lib")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    refusal = gpu_check.probe_refusal(r.returncode, out)
    assert r.returncode != 0 and refusal is not None, out[-3000:]
    assert refusal.startswith("bandpo_lut setup: error: the C++ compiler") and str(cxx) in refusal, refusal
    assert not (tmp_path / "lib").exists()                         # refused before anything was built
    assert gpu_check.probe_refusal(1, "error: command 'g++' failed") is None        # another failure is a failure
    assert gpu_check.probe_refusal(0, out) is None


@pytest.mark.slow
def test_measure_accuracy_truth_file_is_read_refused_for_other_points_or_replaced_when_asked(tmp_path):
    """The accuracy step's mpmath truth: computed and saved on the first run (mpmath's values at the sample's
    float32 points), read on the next (no mpmath), refused for another sample (exit 1, naming --truth and the
    entry), recomputed in place only with --replace-other."""
    import numpy as np
    import torch

    from bandpo_lut.tables import accuracy
    from bandpo_lut.tables import store as tables

    truth = tmp_path / "truth.npz"

    def run(*args):
        return subprocess.run([sys.executable, str(REPO / "tools" / "measure_accuracy.py"), "--points", "30",
                               "--divergence", "tv", "--workers", "1", "--truth", str(truth), *args],
                              capture_output=True, text=True, timeout=120, env=fresh_env(), cwd=tmp_path)

    first = run()
    assert first.returncode == 0 and first.stdout.count("computed, saved") == 2, first.stdout + first.stderr
    t = tables.get("tv")
    p, d = accuracy.sample_points(30, t.delta_min, t.delta_max, 2026, delta_max_inclusive=t.delta_max_inclusive)
    p32 = torch.from_numpy(p).float().double().numpy()
    d32 = torch.from_numpy(d).float().double().numpy()
    with np.load(truth) as data:
        lo, up = accuracy.exact_bounds_f64(p32[:5], d32[:5], "tv")
        assert np.array_equal(data["tv/per-token/lo"][:5], lo) and np.array_equal(data["tv/per-token/up"][:5], up)
    again = run()
    assert again.returncode == 0 and again.stdout.count(" read") == 2
    assert again.stdout.replace("read", "X") == first.stdout.replace("computed, saved", "X")   # the same errors
    other = run("--seed", "7")
    assert other.returncode == 1 and f"--truth {truth} holds tv/per-token for other points" in other.stderr
    replaced = run("--seed", "7", "--replace-other")
    assert replaced.returncode == 0 and replaced.stdout.count("computed again") == 2, replaced.stdout
    assert run("--seed", "7").stdout.count(" read") == 2
