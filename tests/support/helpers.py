"""Shared test helpers (imported as `from helpers import ...`): the device list, float-aware error measures, a small
generated table, and the one fresh-process runner (`run_fresh`, `fresh_env`; tests/conftest.py wraps it as `fresh`)."""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Every device a test runs on: the CUDA one is marked `cuda` and skipped without a GPU. Tests take the `device`
# fixture (tests/conftest.py), which is parametrised over this list; parametrize("device", ALL_DEVICES) is the same.
ALL_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]


def clamp_ties_included(x: torch.Tensor, lo, up) -> torch.Tensor:
    """torch.clamp(x, lo, up) whose derivative is 1 on [lo, up], ends included, and 0 outside and where x or a
    bound is NaN: the rule of a scalar-bound clamp, which PPO trainers use and bandpo_lut.clip follows on every
    torch version. (torch.clamp with TENSOR bounds gives 0 at an exact tie from torch 2.14 on.)"""
    inside = (x >= lo) & (x <= up)
    return torch.where(inside, x, torch.clamp(x, lo, up).detach())


def rel_error_upper(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|r - r*| / r*, with inf == inf counting as exact; NaN counts as infinitely wrong."""
    ours, ref = ours.double().cpu(), ref.double().cpu()
    same_inf = torch.isinf(ours) & torch.isinf(ref) & (ours == ref)
    err = (ours - ref).abs() / ref
    err = torch.where(same_inf, torch.zeros_like(err), err)
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


def rel_error_lower(ours: torch.Tensor, ref: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """|r - r*| / (r*(1 + |ln r*|)) against the truth rounded to `dtype`; an absolute floor of two
    subnormal spacings of `dtype` (no float can do better at the bottom of its range)."""
    ours = ours.double().cpu()
    ref = ref.to(dtype).double().cpu()
    floor = 2 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    excess = ((ours - ref).abs() - floor).clamp(min=0)
    err = torch.where(ref == 0, excess / floor, excess / (ref * (1 + ref.log().abs())))
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


# A small but valid kl table (the tail rules need |logit p| >= ~10 for δ >= 0.05): seconds of mpmath, made once
# per test session for every module that needs one.
SMALL_KL = dict(t_max=10.0, t_density=4, delta_min=0.05, delta_max=0.5, s_nodes=6, ghost=6, dps=30,
                dtype="float32", accuracy_points=20, workers=1, progress=False)


@functools.cache
def small_kl_blob() -> bytes:
    from bandpo_lut.tables.generate import generate

    return generate("kl", **SMALL_KL)


# ---- fresh processes: how a user meets the package (first call under compile/export/trace, a CLI run) ----
# The child imports the same bandpo_lut as this test process, wherever it is installed; no empty PYTHONPATH
# entry (which would put the child's working directory on its path).

def fresh_env(**extra) -> dict:
    """os.environ with the tested package's parent first on PYTHONPATH, one BLAS/OpenMP thread, plus `extra`."""
    import bandpo_lut

    parent = str(Path(bandpo_lut.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_fresh(argv, *, cwd, timeout: float = 600, env: dict | None = None,
              check: bool = False) -> subprocess.CompletedProcess:
    """Run `python ARGV...` in a fresh interpreter (text output captured). `argv` is e.g. ["-c", code] or
    ["-m", "bandpo_lut.cli", "info"]. With check=True a non-zero exit fails the test with both streams."""
    proc = subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env or fresh_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"python {' '.join(map(str, argv))[:200]} exited {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


# ---- trainers installed apart (tools/install_test_needs.sh): SkyRL and OpenRLHF, each in a folder of its own ----
REPO = Path(__file__).resolve().parents[2]


def apart_env(env_var: str, default_folder: str, package: str, *, first: bool) -> dict:
    """fresh_env with a trainer's folder on PYTHONPATH: `first` where its packages must shadow the venv's (SkyRL's
    ray 2.51 over verl's 2.60; with a non-editable install the venv's site-packages is fresh_env's first entry),
    last where they must not (OpenRLHF's deepspeed, which transformers would otherwise import). The folder holds no
    bandpo_lut, so the child tests the package this process imported. $ENV_VAR overrides the folder; a folder
    without `package` fails the test, naming the command that installs it."""
    site = Path(os.environ.get(env_var, REPO / default_folder))
    if not (site / package).is_dir():
        pytest.fail(f"{package} is not installed in {site}: run `bash tools/install_test_needs.sh` at the "
                    f"repository root (or set {env_var}; BANDPO_SKIP_INTEGRATIONS=1 skips this module)")
    env = fresh_env(**{env_var: site})
    paths = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(site), *paths] if first else [*paths, str(site)])
    return env


def run_check_script(name: str, env: dict, cwd) -> dict:
    """Run tests/support/NAME (a trainer plug-in's checks, plugin_checks.py) in a fresh interpreter; its JSON
    results."""
    import json

    proc = run_fresh([REPO / "tests" / "support" / name], cwd=cwd, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])
