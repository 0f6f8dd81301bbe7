"""Build and install bandpo_lut and its compiled extension `bandpo_lut._C`.

Install torch first, then, from the repository root:

    pip install --no-build-isolation -v .

CPU-only or CPU+CUDA is decided from the toolchain, never from whether a GPU is visible (a GPU-less
build machine must still produce a CUDA build):

* CUDA build when a CUDA toolkit is found AND the installed torch is a CUDA build
  (`torch.version.cuda` is set); otherwise a CPU-only build.
* The toolkit is, in order: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`, or the `nvcc` on PATH
  (symlinks and one-line wrapper scripts are followed). A candidate needs `bin/nvcc` and
  `cuda_runtime.h`.
* `FORCE_CUDA=1` demands a CUDA build (error if impossible); `FORCE_ONLY_CPU=1` builds CPU-only.
* An nvcc whose major version differs from torch's CUDA major version is refused.
* `TORCH_CUDA_ARCH_LIST` (default: DEFAULT_ARCHES that this nvcc supports, last one +PTX) and
  `MAX_JOBS` (parallel compile jobs; torch's BuildExtension reads it) are honoured.

The decision is printed (pip shows it with -v) and recorded twice: in the generated, untracked
`bandpo_lut/_build_config.py`, and as macros (`BANDPO_BUILD_*`, see csrc/build_info.h) in a header
generated into the build folder, so the compiled library can report what it was built with.

The detection helpers below take their inputs as arguments (environment, torch's versions, a
command runner) so that they can be tested without building; `.ci/test_setup.py` does that.
Nothing runs on import: the build happens only when this file is run as a script.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE = "bandpo_lut"
CSRC = ROOT / "csrc"
TABLES = ROOT / "tables"

# Default TORCH_CUDA_ARCH_LIST, filtered by what the nvcc in use can compile (CUDA 13 dropped
# everything below 7.5). 9.0 is the H100/H200 target; the last entry also gets PTX for newer GPUs.
DEFAULT_ARCHES = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")

BUILD_COMMAND = "pip install --no-build-isolation -v ."


class BuildConfigError(Exception):
    """The build cannot go ahead as configured; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# Detection helpers (pure functions of their arguments, testable without a build)
# --------------------------------------------------------------------------------------------

def env_flag(env: dict, name: str) -> bool:
    """True when env[name] is set to 1/true/yes/on (case-insensitive)."""
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def read_version(root: Path = ROOT) -> str:
    """`__version__` from bandpo_lut/_version.py, read as text (importing the package would need torch)."""
    text = (root / PACKAGE / "_version.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not match:
        raise BuildConfigError(f"no __version__ = '...' line in {PACKAGE}/_version.py")
    return match.group(1)


def major_of(version: str | None) -> int | None:
    """Leading integer of a version string ("13.0" -> 13, "2.14.1+cu130" -> 2), None if absent."""
    match = re.match(r"\s*(\d+)", version or "")
    return int(match.group(1)) if match else None


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


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


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


def compiler_version(env: dict, run=_run) -> str:
    """First line of `$CXX --version` (torch's extensions compile with $CXX, default c++)."""
    cxx = env.get("CXX", "c++")
    try:
        return run([cxx, "--version"]).splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return cxx


def build_facts(decision: dict, torch_version: str, torch_cuda: str | None, package_version: str,
                cxx_compiler: str) -> dict:
    """The facts recorded in _build_config.py and compiled into the library (no paths, no dates:
    the same inputs give the same files)."""
    return {
        "package_version": package_version,
        "with_cuda": bool(decision["with_cuda"]),
        "cuda_version": decision["nvcc_version"],
        "torch_version": torch_version,
        "torch_cuda_version": torch_cuda,
        "cuda_arch_list": decision["arch_list"],
        "cxx_compiler": cxx_compiler,
    }


def render_build_config_py(facts: dict) -> str:
    lines = [
        "# Generated by setup.py when bandpo_lut._C was built; do not edit (not tracked by git).",
        '"""What the compiled extension bandpo_lut._C was built with; read by bandpo_lut.runtime._extension."""',
        f"package_version = {facts['package_version']!r}",
        f"with_cuda = {facts['with_cuda']!r}",
        f"cuda_version = {facts['cuda_version']!r}  # nvcc's release; None in a CPU-only build",
        f"torch_version = {facts['torch_version']!r}",
        f"torch_cuda_version = {facts['torch_cuda_version']!r}  # torch.version.cuda at build time",
        f"cuda_arch_list = {facts['cuda_arch_list']!r}  # TORCH_CUDA_ARCH_LIST used; None if CPU-only",
        f"cxx_compiler = {facts['cxx_compiler']!r}",
    ]
    return "\n".join(lines) + "\n"


def _c_string(value) -> str:
    """A C string literal for value (None -> ""), ASCII only."""
    text = "" if value is None else str(value)
    text = text.encode("ascii", "replace").decode("ascii")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_build_config_h(facts: dict) -> str:
    rows = [
        ("BANDPO_BUILD_PACKAGE_VERSION", _c_string(facts["package_version"])),
        ("BANDPO_BUILD_WITH_CUDA", "1" if facts["with_cuda"] else "0"),
        ("BANDPO_BUILD_CUDA_VERSION", _c_string(facts["cuda_version"])),
        ("BANDPO_BUILD_TORCH_VERSION", _c_string(facts["torch_version"])),
        ("BANDPO_BUILD_TORCH_CUDA_VERSION", _c_string(facts["torch_cuda_version"])),
        ("BANDPO_BUILD_CUDA_ARCH_LIST", _c_string(facts["cuda_arch_list"])),
        ("BANDPO_BUILD_CXX_COMPILER", _c_string(facts["cxx_compiler"])),
        ("BANDPO_BUILD_INFO_JSON", _c_string(json.dumps(facts, sort_keys=True))),
    ]
    body = "\n".join(f"#define {name} {value}" for name, value in rows)
    return ("/* Generated by setup.py for this build; do not edit. Included by csrc/build_info.h.\n"
            "   Empty strings stand for \"none\" (e.g. no CUDA version in a CPU-only build). */\n"
            "#pragma once\n#define BANDPO_BUILD_CONFIG_GENERATED 1\n" + body + "\n")


def write_if_changed(path: Path, text: str) -> None:
    """Write atomically, and only when the content changes (keeps ninja from rebuilding)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def find_sources(with_cuda: bool) -> list[str]:
    """csrc/**/*.cpp always, csrc/**/*.cu in a CUDA build; sorted, relative to ROOT."""
    patterns = ["**/*.cpp"] + (["**/*.cu"] if with_cuda else [])
    found = sorted({p for pattern in patterns for p in CSRC.glob(pattern) if p.is_file()})
    return [p.relative_to(ROOT).as_posix() for p in found]


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


# --------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------

def _say(lines: list[str]) -> None:
    bar = "=" * 78
    print("\n".join([bar] + [f"bandpo_lut setup: {line}" for line in lines] + [bar]), flush=True)


def main() -> None:
    from setuptools import find_packages, setup

    try:
        import torch
    except ImportError:
        sys.exit("bandpo_lut setup: torch is not importable. Install torch first (`pip install torch`),\n"
                 f"then build without build isolation so the build sees it: {BUILD_COMMAND}")

    env = dict(os.environ)
    version = read_version()
    try:
        decision = decide_build(env, torch.version.cuda, getattr(torch.version, "hip", None))
    except BuildConfigError as exc:
        sys.exit(f"bandpo_lut setup: error: {exc}")

    if decision["with_cuda"]:
        # torch.utils.cpp_extension guesses CUDA_HOME at import time (from the first nvcc on PATH,
        # which may be a wrapper script); make it use the toolkit chosen here.
        os.environ["CUDA_HOME"] = str(decision["cuda_home"])
        if decision["arch_list_from"] == "default":
            os.environ["TORCH_CUDA_ARCH_LIST"] = decision["arch_list"]
    import torch.utils.cpp_extension as cpp_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    if decision["with_cuda"]:
        cpp_extension.CUDA_HOME = str(decision["cuda_home"])

    facts = build_facts(decision, torch.__version__, torch.version.cuda, version, compiler_version(env))
    sources = find_sources(decision["with_cuda"])
    if not sources:
        sys.exit(f"bandpo_lut setup: error: no C++ sources under {CSRC}")

    report = [
        f"bandpo_lut {version}: {'CPU+CUDA' if decision['with_cuda'] else 'CPU-only'} build "
        f"({decision['reason']})",
        f"torch {torch.__version__}, torch CUDA {torch.version.cuda}",
    ]
    if decision["with_cuda"]:
        report += [
            f"CUDA toolkit {decision['cuda_home']} (found by {decision['cuda_home_how']}), "
            f"nvcc {decision['nvcc_version']}",
            f"TORCH_CUDA_ARCH_LIST={decision['arch_list']} ({decision['arch_list_from']})",
        ]
    report += [
        f"compiler: {facts['cxx_compiler']}",
        f"ninja: {'yes' if cpp_extension.is_ninja_available() else 'NO (slow, serial build; pip install ninja)'}"
        f", MAX_JOBS={env.get('MAX_JOBS', 'unset (ninja default)')}",
        f"sources: {len(sources)} ({sum(s.endswith('.cu') for s in sources)} .cu); "
        f"tables: {len(list(TABLES.glob('*.bplut')))} tables/*.bplut, installed as {PACKAGE}/tables/",
    ]
    extra_includes: list[str] = []
    if decision["with_cuda"]:
        extra_includes = supplementary_cuda_includes(decision["cuda_home"], major_of(decision["nvcc_version"]))
        if extra_includes:
            report.append(f"toolkit lacks cusparse.h etc.; also searching {', '.join(extra_includes)}")
    _say(report)

    # C++ standard: left to torch (C++20 for torch 2.13/2.14, whose headers refuse C++17).
    # No --use_fast_math: the bounds must be accurate. No flag may contain "arch" (torch then
    # skips its TORCH_CUDA_ARCH_LIST handling), which is why the build facts travel in a header.
    # -fno-trapping-math: lets GCC if-convert the branch-free float loops (csrc/cpu) and vectorise them;
    # it changes no result (NaN and inf semantics are kept), only assumptions about FP exception flags.
    # -fno-math-errno: sqrt (the closed forms, csrc/cpu/simd/closed_form_cpu.h) becomes one vector instruction
    # instead of a libm call kept for errno on negative input, which blocks vectorisation; results are unchanged.
    # -mprefer-vector-width=512: GCC's generic tuning vectorises 256 bits wide even in the AVX-512 variant
    # (BANDPO_CPU_VARIANTS, csrc/macros.h); 512 is what that variant is for. x86 only; code for other ISAs is
    # unaffected.
    # -fopenmp: at::parallel_for is inlined from torch's headers into our code, and parallelises only
    # when the extension itself is compiled with OpenMP (torch's CPU builds use the same libgomp).
    # -Werror=switch: a `switch` over an enum (csrc/divergence.h) that misses an enumerator does not compile,
    # so a new divergence cannot fall through to another one's math.
    cxx_flags = ["-O3", "-fno-trapping-math", "-fno-math-errno", "-Werror=switch"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        cxx_flags.append("-mprefer-vector-width=512")  # an x86 option; other compilers' targets refuse it
    link_flags = []
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    nvcc_flags = ["-O3", "-lineinfo"]
    if decision["with_cuda"]:
        cxx_flags.append("-DBANDPO_WITH_CUDA=1")
        nvcc_flags.append("-DBANDPO_WITH_CUDA=1")
    ext_kwargs = dict(
        name=f"{PACKAGE}._C",
        sources=sources,
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags} if decision["with_cuda"] else {"cxx": cxx_flags},
        extra_link_args=link_flags,
    )
    ext = CUDAExtension(**ext_kwargs) if decision["with_cuda"] else CppExtension(**ext_kwargs)
    ext.include_dirs += extra_includes  # after torch's and the toolkit's own include dirs

    config_py = render_build_config_py(facts)
    config_h = render_build_config_h(facts)
    config_py_path = ROOT / PACKAGE / "_build_config.py"

    from setuptools.command.build_py import build_py

    # Tables are copied by BuildPy rather than declared as a package "bandpo_lut.tables.store", which
    # would collide with the module bandpo_lut/tables/store.py.
    class BuildPy(build_py):
        """Writes bandpo_lut/_build_config.py (untracked) before the package files are copied, and
        ships the repository's top-level tables/*.bplut as bandpo_lut/tables/*.bplut."""

        def run(self):
            write_if_changed(config_py_path, config_py)
            super().run()
            if getattr(self, "editable_mode", False):
                return  # an editable install reads <repo>/tables directly
            target = Path(self.build_lib) / PACKAGE / "tables"
            for table in sorted(TABLES.glob("*.bplut")):
                target.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(table), str(target / table.name))

    class BuildExt(BuildExtension):
        """Writes the build-facts header into the build folder, then compiles with torch's BuildExtension."""

        def run(self):
            write_if_changed(config_py_path, config_py)  # also for build_ext --inplace / editable
            generated = Path(self.build_temp).resolve() / "generated"
            write_if_changed(generated / "bandpo_build_config.h", config_h)
            for extension in self.extensions:
                if str(generated) not in extension.include_dirs:
                    extension.include_dirs.append(str(generated))
            super().run()

    torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    setup(
        name="bandpo_lut",
        version=version,
        description="BandPO trust-region ratio bounds by table lookup, for PPO-family losses",
        license="Apache-2.0",
        python_requires=">=3.10",
        packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
        # The compiled extension only works with the torch minor release it was built against.
        install_requires=[f"torch=={torch_mm}.*", "mpmath>=1.3", "numpy", "tqdm", "matplotlib"],
        extras_require={"plot": ["matplotlib"], "test": ["pytest", "matplotlib"]},
        # verl.plugins: verl (>= 0.9) imports it at `import verl`, so that verl's driver refuses
        # loss_mode=bandpo without the _target_ line (bandpo_lut/integrations/verl_plugin.py)
        entry_points={"console_scripts": ["bandpo-lut = bandpo_lut.cli:main"],
                      "verl.plugins": ["bandpo_lut = bandpo_lut.integrations.verl_plugin"]},
        ext_modules=[ext],
        cmdclass={"build_py": BuildPy, "build_ext": BuildExt},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
