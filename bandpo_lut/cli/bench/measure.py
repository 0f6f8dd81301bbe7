"""How `bandpo-lut bench` measures memory: one workload's peak extra memory, in a child process of its own.

A leaf (the standard library, and torch where a measurement runs): `command` and `fused_linear` start their
children through `run_child`, and the child (`bandpo_lut.cli.bench.child`) measures with `peak_extra_bytes`.

CPU: the resident-set high-water mark (VmHWM of /proc/self/status), reset through /proc/self/clear_refs just
before the step, minus the resident size then; MALLOC_MMAP_THRESHOLD_ (set by `run_child`) keeps every large
allocation in its own mapping, so that what the step allocates and frees shows in the peak (glibc would
otherwise recycle warm-up memory unseen). Linux only. CUDA: torch.cuda.max_memory_allocated minus the allocated
size before the step (the caching allocator's accounting).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CLEAR_REFS = "/proc/self/clear_refs"


def cpu_peak_measurable() -> bool:
    """Whether the CPU peak can be measured here (Linux /proc)."""
    return os.path.exists(CLEAR_REFS)


def status_bytes(key: str) -> int:
    """A `VmXXX:` line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra_bytes(fn, device) -> int:
    """Peak memory one call of `fn()` adds on `device` beyond what was held before it (see the module's
    docstring for how each device is read)."""
    import torch

    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        with open(CLEAR_REFS, "w") as fh:
            fh.write("5")
        before = status_bytes("VmRSS:")
    fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else status_bytes("VmHWM:")
    return peak - before


def child_env(**extra) -> dict:
    """The environment of a measuring child process: this one's, with this bandpo_lut's parent folder first on
    PYTHONPATH (the child runs in an empty temporary folder, never the home folder, which may be unset or
    absent, nor the current one, where a source checkout would shadow the package), plus `extra`."""
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([parent, *paths]), **extra)


def run_child(workload: str, args: list, threads: int):
    """Run `python -m bandpo_lut.cli.bench.child WORKLOAD ARGS` (args as JSON) with `threads` threads, in an
    empty temporary folder; returns the JSON value its last stdout line holds. Raises
    subprocess.CalledProcessError (its stderr kept) or OSError when the child fails."""
    env = child_env(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-m", "bandpo_lut.cli.bench.child", workload, json.dumps(args),
                              str(threads)], capture_output=True, text=True, check=True, cwd=cwd, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])
