"""Build bandpo_lut's compiled extension `bandpo_lut._C`; the package's static metadata is in pyproject.toml.

Install torch first, then, from the repository root:

    pip install --no-build-isolation -v .

CPU-only or CPU+CUDA is decided from the toolchain (tools/setup_helpers/cuda.py: a CUDA toolkit found and a CUDA
torch; FORCE_CUDA / FORCE_ONLY_CPU; an nvcc whose major differs from torch's CUDA is refused;
TORCH_CUDA_ARCH_LIST), never from whether a GPU is visible. MAX_JOBS is read by torch's BuildExtension. The
decision is printed (pip shows it with -v) and recorded in the generated, untracked bandpo_lut/_build_config.py
and in a generated header (csrc/build_info.h). Before compiling, the C++ toolchain is probed
(tools/setup_helpers/toolchain_probe.py). docs/build.md has the user's view.

What this file computes, and pyproject.toml lists as dynamic: the torch pin (the extension only works with the
torch minor release it is built against).
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))  # the build helpers (tools/setup_helpers), not installed

from setup_helpers.build_facts import (  # noqa: E402
    build_facts,
    compiler_version,
    find_sources,
    read_version,
    render_build_config_h,
    render_build_config_py,
    write_if_changed,
)
from setup_helpers.common import BuildConfigError, major_of  # noqa: E402
from setup_helpers.cuda import decide_build, supplementary_cuda_includes  # noqa: E402
from setup_helpers.flags import extension_flags  # noqa: E402
from setup_helpers.toolchain_probe import probe_toolchain  # noqa: E402

PACKAGE = "bandpo_lut"
CSRC = ROOT / "csrc"
TABLES = ROOT / "tables"
BUILD_COMMAND = "pip install --no-build-isolation -v ."


def _say(lines: list[str]) -> None:
    bar = "=" * 78
    print("\n".join([bar] + [f"bandpo_lut setup: {line}" for line in lines] + [bar]), flush=True)


def _fail(exc: BuildConfigError):
    sys.exit(f"bandpo_lut setup: error: {exc}")


def main() -> None:
    from setuptools import find_packages, setup
    from setuptools.command.build_py import build_py

    try:
        import torch
    except ImportError:
        sys.exit("bandpo_lut setup: torch is not importable. Install torch first (`pip install torch`),\n"
                 f"then build without build isolation so the build sees it: {BUILD_COMMAND}")

    env = dict(os.environ)
    version = read_version(ROOT, PACKAGE)
    try:
        decision = decide_build(env, torch.version.cuda, getattr(torch.version, "hip", None))
    except BuildConfigError as exc:
        _fail(exc)

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
    sources = find_sources(ROOT, CSRC, decision["with_cuda"])
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
        f"tables: {len(list(TABLES.glob('*.bplut')))} tables/*.bplut, installed as {PACKAGE}/tables/data/",
    ]
    extra_includes: list[str] = []
    if decision["with_cuda"]:
        extra_includes = supplementary_cuda_includes(decision["cuda_home"], major_of(decision["nvcc_version"]))
        if extra_includes:
            report.append(f"toolkit lacks cusparse.h etc.; also searching {', '.join(extra_includes)}")
    _say(report)

    cxx_flags, nvcc_flags, link_flags = extension_flags(decision["with_cuda"], platform.machine(), sys.platform)
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

    class BuildPy(build_py):
        """Writes bandpo_lut/_build_config.py (untracked) before the package files are copied."""

        def run(self):
            write_if_changed(config_py_path, config_py)
            super().run()

    class BuildExt(BuildExtension):
        """Probes the C++ toolchain, writes the build-facts header into the build folder, then compiles with
        torch's BuildExtension."""

        def run(self):
            try:
                _say([probe_toolchain(env, cxx_flags, link_flags, Path(torch.__file__).parent / "lib",
                                      bool(torch._C._GLIBCXX_USE_CXX11_ABI))])
            except BuildConfigError as exc:
                _fail(exc)
            write_if_changed(config_py_path, config_py)  # also for build_ext --inplace / editable
            generated = Path(self.build_temp).resolve() / "generated"
            write_if_changed(generated / "bandpo_build_config.h", config_h)
            for extension in self.extensions:
                if str(generated) not in extension.include_dirs:
                    extension.include_dirs.append(str(generated))
            super().run()

    torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    setup(
        # The repository's top-level tables/ is the package `bandpo_lut.tables.data` (its .bplut files as package
        # data); an editable install or a checkout reads tables/ itself (bandpo_lut/tables/store.py, shipped_dir).
        packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]) + [f"{PACKAGE}.tables.data"],
        package_dir={f"{PACKAGE}.tables.data": "tables"},
        package_data={f"{PACKAGE}.tables.data": ["*.bplut"]},
        # The compiled extension only works with the torch minor release it was built against.
        install_requires=[f"torch=={torch_mm}.*", "mpmath>=1.3", "numpy", "tqdm", "matplotlib"],
        ext_modules=[ext],
        cmdclass={"build_py": BuildPy, "build_ext": BuildExt},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
