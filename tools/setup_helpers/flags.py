"""The compiler and linker flags of the extension, in one place: setup.py builds with them and the toolchain
probe (toolchain_probe.py) compiles with the same C++ ones, so it tests what the build will do."""
from __future__ import annotations


def extension_flags(with_cuda: bool, machine: str, platform: str) -> tuple[list[str], list[str], list[str]]:
    """(C++ flags, nvcc flags, link flags) for `platform.machine()` and `sys.platform`.

    C++ standard: left to torch (C++20 for torch 2.13/2.14, whose headers refuse C++17).
    No --use_fast_math: the bounds must be accurate. No flag may contain "arch" (torch then
    skips its TORCH_CUDA_ARCH_LIST handling), which is why the build facts travel in a header.
    -fno-trapping-math: lets GCC if-convert the branch-free float loops (csrc/cpu) and vectorise them;
    it changes no result (NaN and inf semantics are kept), only assumptions about FP exception flags.
    -fno-math-errno: sqrt (the closed forms, csrc/cpu/simd/closed_form_cpu.h) becomes one vector instruction instead
    of a libm call kept for errno on negative input, which blocks vectorisation; results are unchanged.
    -mprefer-vector-width=512: GCC's generic tuning vectorises 256 bits wide even in the AVX-512 clone
    (csrc/cpu/band_cpu.h); 512 is what the clone is for. x86 only; code for other ISAs is unaffected.
    -fopenmp: at::parallel_for is inlined from torch's headers into our code, and parallelises only
    when the extension itself is compiled with OpenMP (torch's CPU builds use the same libgomp).
    -Werror=switch: a `switch` over an enum (csrc/divergence.h) that misses an enumerator does not compile,
    so a new divergence cannot fall through to another one's math.
    """
    cxx_flags = ["-O3", "-fno-trapping-math", "-fno-math-errno", "-Werror=switch"]
    if machine.lower() in ("x86_64", "amd64"):
        cxx_flags.append("-mprefer-vector-width=512")  # an x86 option; other compilers' targets refuse it
    link_flags = []
    if platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    nvcc_flags = ["-O3", "-lineinfo"]
    if with_cuda:
        cxx_flags.append("-DBANDPO_WITH_CUDA=1")
        nvcc_flags.append("-DBANDPO_WITH_CUDA=1")
    return cxx_flags, nvcc_flags, link_flags
