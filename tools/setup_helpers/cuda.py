"""CUDA or CPU-only: the build decision, from the toolchain (never from whether a GPU is visible).

* CUDA build when a CUDA toolkit is found AND the installed torch is a CUDA build (`torch.version.cuda`
  is set); otherwise a CPU-only build.
* The toolkit is, in order: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`, or the `nvcc` on PATH
  (symlinks and one-line wrapper scripts are followed). A candidate needs `bin/nvcc` and `cuda_runtime.h`.
* `FORCE_CUDA=1` demands a CUDA build (error if impossible); `FORCE_ONLY_CPU=1` builds CPU-only.
* An nvcc whose major version differs from torch's CUDA major version is refused.
* `TORCH_CUDA_ARCH_LIST` (default: DEFAULT_ARCHES that this nvcc supports, last one +PTX) is honoured.

Every function takes its inputs as arguments (environment, torch's versions, a `which` and a command
runner), so tests/build/test_setup_helpers.py checks the decision without a toolkit or a build.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from .common import BuildConfigError, env_flag, major_of
from .common import run as _run

# Default TORCH_CUDA_ARCH_LIST, filtered by what the nvcc in use can compile (CUDA 13 dropped
# everything below 7.5). 9.0 is the H100/H200 target; the last entry also gets PTX for newer GPUs.
DEFAULT_ARCHES = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")


def is_cuda_home(path: Path) -> bool:
    """A CUDA toolkit root: bin/nvcc plus the runtime header (in include/ or targets/*/include/)."""
    if not (path / "bin" / "nvcc").is_file():
        return False
    if (path / "include" / "cuda_runtime.h").is_file():
        return True
    return any(path.glob("targets/*/include/cuda_runtime.h"))


def resolve_nvcc(nvcc: str) -> Path:
    """The real nvcc behind `nvcc`: symlinks resolved, and a small wrapper script such as
    `#!/bin/sh\\nexec /usr/local/cuda-13.0/bin/nvcc "$@"` followed to the nvcc it runs."""
    path = Path(os.path.realpath(nvcc))
    for _ in range(4):  # wrappers of wrappers, but never loop forever
        try:
            head = path.read_bytes()[:4096] if path.stat().st_size < 65536 else b""
        except OSError:
            return path
        if not head.startswith(b"#!"):
            return path
        targets = [Path(os.path.realpath(m.decode()))
                   for m in re.findall(rb"(/[^\s\"'`;|&<>$]*/bin/nvcc)\b", head)]
        targets = [t for t in targets if t.is_file() and t != path]
        if not targets:
            return path
        path = targets[0]
    return path


def find_cuda_home(env: dict, which=shutil.which) -> tuple[Path | None, str]:
    """(toolkit root or None, how it was found). Raises if CUDA_HOME/CUDA_PATH names a non-toolkit."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = env.get(var)
        if value:
            if is_cuda_home(Path(value)):
                return Path(value), f"${var}"
            raise BuildConfigError(
                f"{var}={value} is not a CUDA toolkit (needs bin/nvcc and include/cuda_runtime.h). "
                f"Point {var} at the toolkit root, unset it, or set FORCE_ONLY_CPU=1 for a CPU-only build.")
    default = Path("/usr/local/cuda")
    if is_cuda_home(default):
        return default, "/usr/local/cuda"
    nvcc = which("nvcc", path=env.get("PATH"))
    if nvcc:
        real = resolve_nvcc(nvcc)
        home = real.parent.parent
        if is_cuda_home(home):
            how = "nvcc on PATH" if real == Path(os.path.realpath(nvcc)) else f"nvcc on PATH ({nvcc} -> {real})"
            return home, how
    return None, "no toolkit: no $CUDA_HOME/$CUDA_PATH, no /usr/local/cuda/bin/nvcc, no usable nvcc on PATH"


def nvcc_version(cuda_home: Path, run=_run) -> str:
    """nvcc's release, "13.0", parsed from `nvcc --version` ("... release 13.0, V13.0.88")."""
    out = run([str(cuda_home / "bin" / "nvcc"), "--version"])
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise BuildConfigError(f"cannot read a version from `{cuda_home}/bin/nvcc --version`:\n{out}")
    return f"{match.group(1)}.{match.group(2)}"


def nvcc_arches(cuda_home: Path, run=_run) -> set[str] | None:
    """Compute capabilities nvcc can compile ("7.5", "9.0", "12.1", ...), from --list-gpu-arch;
    None when this nvcc cannot list them."""
    try:
        out = run([str(cuda_home / "bin" / "nvcc"), "--list-gpu-arch"])
    except (OSError, subprocess.CalledProcessError):
        return None
    nums = re.findall(r"compute_(\d+)", out)
    return {f"{n[:-1]}.{n[-1]}" for n in nums} or None


def default_arch_list(supported: set[str] | None) -> str:
    """DEFAULT_ARCHES restricted to what nvcc supports, the last one with +PTX."""
    arches = [a for a in DEFAULT_ARCHES if supported is None or a in supported]
    if not arches:
        raise BuildConfigError(
            f"this nvcc supports none of {';'.join(DEFAULT_ARCHES)}; set TORCH_CUDA_ARCH_LIST")
    arches[-1] += "+PTX"
    return ";".join(arches)


def check_arch_list(arch_list: str, supported: set[str] | None) -> None:
    """Refuse numeric entries ("8.6", "9.0a", "12.0+PTX") that nvcc cannot compile. Named or
    special entries ("Hopper", "native") are left to torch."""
    if supported is None:
        return
    bad = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+\.\d+)[af]?(\+PTX)?", entry)
        if match and match.group(1) not in supported:
            bad.append(entry)
    if bad:
        raise BuildConfigError(
            f"TORCH_CUDA_ARCH_LIST={arch_list!r}: this nvcc cannot compile {', '.join(bad)} "
            f"(it supports {';'.join(sorted(supported, key=lambda a: tuple(map(int, a.split('.')))))})")


def decide_build(env: dict, torch_cuda: str | None, torch_hip: str | None = None,
                 which=shutil.which, run=_run) -> dict:
    """Decide CPU-only or CPU+CUDA. Returns a dict with with_cuda, reason, cuda_home, cuda_home_how,
    nvcc_version, arch_list (None unless CUDA) and arch_list_from ("TORCH_CUDA_ARCH_LIST"/"default").
    Raises BuildConfigError for impossible or inconsistent requests."""
    force_cuda, force_cpu = env_flag(env, "FORCE_CUDA"), env_flag(env, "FORCE_ONLY_CPU")
    cpu = dict(with_cuda=False, cuda_home=None, cuda_home_how=None, nvcc_version=None,
               arch_list=None, arch_list_from=None)
    if force_cuda and force_cpu:
        raise BuildConfigError("FORCE_CUDA=1 and FORCE_ONLY_CPU=1 contradict each other; set one.")
    if force_cpu:
        return dict(cpu, reason="FORCE_ONLY_CPU=1")
    if torch_hip:
        if force_cuda:
            raise BuildConfigError(f"FORCE_CUDA=1, but torch is a ROCm build (HIP {torch_hip}); "
                                   "ROCm is not supported.")
        return dict(cpu, reason=f"torch is a ROCm build (HIP {torch_hip}), not supported")
    if torch_cuda is None:
        if force_cuda:
            raise BuildConfigError(
                "FORCE_CUDA=1, but the installed torch is a CPU-only build (torch.version.cuda is None). "
                "Install a CUDA build of torch first (e.g. `pip install torch`), or drop FORCE_CUDA.")
        return dict(cpu, reason="the installed torch is a CPU-only build (torch.version.cuda is None)")
    home, how = find_cuda_home(env, which=which)
    if home is None:
        if force_cuda:
            raise BuildConfigError(
                f"FORCE_CUDA=1, but no CUDA toolkit was found ({how}). "
                "Install the CUDA toolkit matching torch's CUDA "
                f"{torch_cuda}, or set CUDA_HOME to its root.")
        return dict(cpu, reason=f"torch has CUDA {torch_cuda} but {how}")
    version = nvcc_version(home, run=run)
    if major_of(version) != major_of(torch_cuda):
        raise BuildConfigError(
            f"nvcc {version} (from {how}: {home}) does not match the installed torch's CUDA {torch_cuda}: "
            "the major versions must agree. Point CUDA_HOME at a CUDA "
            f"{major_of(torch_cuda)}.x toolkit, install the torch build for CUDA {version}, "
            "or set FORCE_ONLY_CPU=1 for a CPU-only build.")
    supported = nvcc_arches(home, run=run)
    user_list = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if user_list:
        check_arch_list(user_list, supported)
        arch_list, arch_from = user_list, "TORCH_CUDA_ARCH_LIST"
    else:
        arch_list, arch_from = default_arch_list(supported), "default"
    reason = "FORCE_CUDA=1" if force_cuda else f"CUDA toolkit found and torch has CUDA {torch_cuda}"
    return dict(with_cuda=True, reason=reason, cuda_home=home, cuda_home_how=how,
                nvcc_version=version, arch_list=arch_list, arch_list_from=arch_from)


def supplementary_cuda_includes(cuda_home: Path, cuda_major: int | None) -> list[str]:
    """Headers torch's CUDA headers need (cusparse.h, cublas_v2.h, ... via ATen/cuda/CUDAContext.h)
    but a minimal toolkit lacks: take them from torch's own nvidia-* wheels, searched after the
    toolkit's include dir so the toolkit's own headers win."""
    if (cuda_home / "include" / "cusparse.h").is_file():
        return []
    try:
        import nvidia  # namespace package of the nvidia-* wheels torch depends on
    except ImportError:
        return []
    found = []
    for base in map(Path, getattr(nvidia, "__path__", [])):
        candidates = [base / f"cu{cuda_major}" / "include"] + sorted(base.glob("*/include"))
        found += [str(c) for c in candidates if (c / "cusparse.h").is_file() or (c / "cublas_v2.h").is_file()]
    return list(dict.fromkeys(found))
