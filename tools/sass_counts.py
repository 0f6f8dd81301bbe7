#!/usr/bin/env python3
"""SASS instruction counts per element of the CUDA element kernels (sm_90, float32, KL), without a GPU.

    python tools/sass_counts.py [--arch 90] [--keep DIR | --listings DIR]

Compiles csrc/cuda/band_cuda.cu and csrc/cuda/loss_cuda.cu (the files that hold the element kernels) to
cubins with nvcc directly, with the flags setup.py gives the extension (-O3 -lineinfo, torch's
COMMON_NVCC_FLAGS, C++20, torch's CUDA include paths), `-cubin` for one architecture and no linking (about a
minute per file), disassembles them with `cuobjdump -sass` and prints, for the float32 KL instantiations:

  * total: every SASS instruction of the kernel (prologue, loops, epilogue, out-of-line subroutines);
  * loop:  the static size of its element loop, found as the widest backward branch (`BRA` to a lower
           address; the loop is the range from its target to the branch) that holds a MUFU instruction (the
           element math's exponential and reciprocal; the loss kernels' count reductions, loops of warp
           shuffles, hold none), minus any loop nested inside it
           (reported as `inner`; the dense band kernel's scalar remainder, fewer than 4 elements, runs after
           its loop and is not counted);
  * path:  the instructions on the heaviest way once through that loop body (every branch may go either
           way; nested loops weigh 0): an upper bound of what one iteration issues, whichever branches its
           elements take. Code a CALL runs (the IEEE division's slow path, out-of-line tails) lies outside;
  * no-call path: the same, avoiding the branches that lead to a CALL: an iteration whose elements need no
           slow path and no tail (|logit p| <= t_max, the common case);
  * /elem: each divided by the elements one iteration computes (the dense band kernel: 4 float32 per
           thread; the loss kernels: kMaxK = 4 tokens per lane and tile, all present and weighted).

The static loop counts code that an element skips (branches on the input kind, on the divergence before
the kernels were instantiated per divergence family, tails), so the path columns are the ones that say
what an element costs; NOPs (alignment padding) are never counted.

Needs nvcc (CUDA 12/13, $CUDA_HOME/bin or /usr/local/cuda/bin or PATH), cuobjdump (the same places, or the
copy that ships with Triton) and a CUDA build of torch (for its headers); exits 2 naming what is missing.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("band_cuda.cu", "loss_cuda.cu")
VEC = 4  # float32 elements per dense-kernel iteration (band_cuda.cu vec_size) = loss tokens per lane (kMaxK)

# (label, file, demangled-name pattern). The patterns accept the kernels with or without the trailing
# compile-time divergence path (`(DivPath)1` = kTable, the KL instantiation; band_element.h) and, for the band, the
# input kind (`(ProbInput)1` = p, `(ProbInput)2` = log p; a tree whose band kernels take either at run time matches
# the p rows with its one kernel, which then holds both ways), so the same rows match the code before and after
# those parameters were introduced. The band's scalar-δ rows take the cells staged in shared memory: in t
# (CellsMode 1, kCellsShared) or, since the float kernels read them, in p's bits (3, kCellsBits). The per-token rows
# read the table (0, kCellsNone: a float kernel's fallback since the rows "cells in p's bits", CellsMode 4,
# kCellsBitsToken, were added). Rows marked optional are left out where no kernel matches.
_D = r"(, \(DivPath\)1)?"
_P = r"(, \(ProbInput\)1)?"
_L = r", \(ProbInput\)2"
KERNELS = (
    ("band bounds, scalar δ (shared cells)", "band_cuda.cu", rf"band_dense_kernel<float, false, [13]{_D}{_P}>", False),
    ("band bounds, per-token δ", "band_cuda.cu", rf"band_dense_kernel<float, false, 0{_D}{_P}>", False),
    ("band clip, scalar δ (shared cells)", "band_cuda.cu", rf"band_dense_kernel<float, true, [13]{_D}{_P}>", False),
    ("band clip, per-token δ", "band_cuda.cu", rf"band_dense_kernel<float, true, 0{_D}{_P}>", False),
    ("band clip from log p, scalar δ", "band_cuda.cu", rf"band_dense_kernel<float, true, [13]{_D}{_L}>", True),
    ("band clip from log p, per-token δ", "band_cuda.cu", rf"band_dense_kernel<float, true, 0{_D}{_L}>", True),
    ("band bounds, per-token δ (bit cells)", "band_cuda.cu", rf"band_dense_kernel<float, false, 4{_D}{_P}>", True),
    ("band clip, per-token δ (bit cells)", "band_cuda.cu", rf"band_dense_kernel<float, true, 4{_D}{_P}>", True),
    ("band clip from log p, per-token (bits)", "band_cuda.cu", rf"band_dense_kernel<float, true, 4{_D}{_L}>", True),
    ("loss fwd, scalar δ (shared cells)", "loss_cuda.cu", rf"loss_tokens_kernel<float, 1, false{_D}>", False),
    ("loss fwd, per-token δ", "loss_cuda.cu", rf"loss_tokens_kernel<float, 0, false{_D}>", False),
    ("loss bwd, scalar δ (shared cells)", "loss_cuda.cu", rf"loss_grad_kernel<float, 1{_D}>", False),
    ("loss bwd, per-token δ", "loss_cuda.cu", rf"loss_grad_kernel<float, 0{_D}>", False),
)


def fail(msg: str) -> None:
    print(f"sass_counts: error: {msg}", file=sys.stderr)
    sys.exit(2)


def find_tool(name: str) -> Path:
    """A CUDA binary: $CUDA_HOME/bin, /usr/local/cuda/bin, PATH, then Triton's bundled copy (cuobjdump)."""
    dirs = [Path(os.environ[v]) / "bin" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs.append(Path("/usr/local/cuda/bin"))
    for d in dirs:
        if (d / name).is_file():
            return d / name
    found = shutil.which(name)
    if found:
        return Path(found)
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if bundled.is_file():
            return bundled
    except ImportError:
        pass
    fail(f"`{name}` not found (looked in $CUDA_HOME/bin, /usr/local/cuda/bin, PATH and Triton's bundled "
         f"binaries); install the CUDA toolkit or set CUDA_HOME")
    raise AssertionError  # unreachable


def compile_flags(nvcc: Path, arch: str) -> list[str]:
    """setup.py's nvcc flags for the extension, for one architecture, as a cubin."""
    os.environ.setdefault("CUDA_HOME", str(nvcc.parent.parent))  # before torch reads it (its include paths)
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        fail("torch is not importable: run this with a CUDA build of torch (e.g. /work/venv-cuda/bin/python)")
    if torch.version.cuda is None:
        fail(f"torch {torch.__version__} is a CPU-only build; its headers lack the CUDA parts the kernels include")
    includes = [f"-I{ROOT / 'csrc'}"] + [f"-I{p}" for p in cpp_extension.include_paths(device_type="cuda")]
    # Headers torch's CUDA headers need but a minimal toolkit lacks, and the extension's nvcc flags: what setup.py
    # takes from tools/setup_helpers.
    sys.path.insert(0, str(ROOT / "tools"))
    from setup_helpers.common import major_of
    from setup_helpers.cuda import supplementary_cuda_includes
    from setup_helpers.flags import extension_flags

    includes += [f"-I{p}" for p in supplementary_cuda_includes(nvcc.parent.parent, major_of(torch.version.cuda))]
    _, nvcc_flags, _ = extension_flags(True, "", sys.platform)
    return ["-cubin", f"-arch=sm_{arch}", *nvcc_flags, "-std=c++20",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *cpp_extension.COMMON_NVCC_FLAGS, *includes]


def compile_cubin(nvcc: Path, flags: list[str], name: str, out_dir: Path) -> Path:
    out = out_dir / (name + ".cubin")
    proc = subprocess.run([str(nvcc), *flags, "-o", str(out), str(ROOT / "csrc" / "cuda" / name)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"nvcc failed on {name}:\n{proc.stderr[-4000:]}")
    return out


INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Mangled kernel name -> [(address, instruction text)] from `cuobjdump -sass`."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = INSTR.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return out


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool:
        fail("c++filt not found (binutils): needed to demangle the kernel names")
    text = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    clean = [drop_arguments(re.sub(r"^void |bandpo::|\(anonymous namespace\)::", "", t)) for t in text]
    return dict(zip(names, clean))


def drop_arguments(name: str) -> str:
    """`f<float, (DivPath)1>(BandParams, ...)` -> `f<float, (DivPath)1>`: cut at the first '(' outside <>."""
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            return name[:i]
    return name


BRANCH = re.compile(r"(?:@!?U?P\w+\s+)?BRA\b")


def branch_target(text: str) -> int | None:
    """Target of a branch: `BRA 0x150`, `@!P0 BRA 0x150`, `BRA.U !UP0, 0x150`, `BRA.DIV UR4, 0x150`."""
    if not BRANCH.match(text):
        return None
    return int(re.findall(r"0x([0-9a-f]+)", text)[-1], 16)


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) address of every loop: a branch back to a lower address closes one."""
    found = []
    for addr, text in code:
        target = branch_target(text)
        if target is not None and target < addr:
            found.append((target, addr))
    return found


def merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or nested address ranges merged (each address counted once)."""
    merged: list[tuple[int, int]] = []
    for r in sorted(ranges):
        if merged and r[0] <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], r[1]))
        else:
            merged.append(r)
    return merged


def longest_path(body: list[tuple[int, str]], inner: list[tuple[int, int]], calls: bool) -> int:
    """Instructions on the heaviest way once through a loop body (forward edges only: the loop's own back
    edge and those of nested loops are cut, and nested loops' instructions weigh 0). Every instruction
    reached counts, predicated-off ones included (they issue); the code a CALL runs lies outside the body.
    calls=False: the heaviest way that makes no call, i.e. avoids the branches into out-of-line slow paths
    (the IEEE division's, the KL tails'): what an element that needs none of them issues at most."""
    index = {a: k for k, (a, _) in enumerate(body)}
    never = -(10**9)
    best = [0] * (len(body) + 1)  # best[k]: heaviest path from instruction k to leaving the body
    for k in range(len(body) - 1, -1, -1):
        addr, text = body[k]
        if not calls and re.match(r"(?:@!?U?P\w+\s+)?CALL\b", text):
            best[k] = never
            continue
        weight = 0 if text.startswith("NOP") or any(a <= addr <= b for a, b in inner) else 1
        target = branch_target(text)
        unconditional = target is not None and not text.startswith("@")
        nexts = [] if (unconditional or text.startswith("EXIT") or text.startswith("RET")) else [k + 1]
        if target is not None and target > addr and target in index:
            nexts.append(index[target])  # forward branch inside the body; anything else leaves it
        best[k] = weight + max((best[n] for n in nexts), default=0)
    return best[0]


def count(code: list[tuple[int, str]], lo: int, hi: int) -> int:
    """Instructions in [lo, hi], NOPs (alignment padding) excluded."""
    return sum(1 for a, t in code if lo <= a <= hi and not t.startswith("NOP"))


def measure(code: list[tuple[int, str]]) -> tuple[int, int, int, int, int]:
    """(total, element-loop body without nested loops, nested loops, heaviest path once through the body,
    the same without calls)."""
    total = sum(1 for _, t in code if not t.startswith("NOP"))
    found = loops(code)
    if not found:  # no loop: the whole kernel is one element's work
        return total, total, 0, longest_path(code, [], True), longest_path(code, [], False)
    # The element loop: the widest that does element math (a MUFU: every element takes an exponential and an
    # approximate reciprocal). The loss kernels also loop over warp shuffles to reduce their counts, which can
    # be the wider loop.
    math = [r for r in found if any(r[0] <= a <= r[1] and t.startswith("MUFU") for a, t in code)] or found
    lo, hi = max(math, key=lambda r: r[1] - r[0])
    inner = merged_ranges([r for r in found if lo <= r[0] and r[1] <= hi and r != (lo, hi)])
    inner_n = sum(count(code, a, b) for a, b in inner)
    body = [(a, t) for a, t in code if lo <= a <= hi]
    paths = longest_path(body, inner, True), longest_path(body, inner, False)
    return total, count(code, lo, hi) - inner_n, inner_n, *paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90", help="SM version to compile for (default 90: H100/H200)")
    parser.add_argument("--keep", type=Path, help="keep the cubins and SASS listings in this folder")
    parser.add_argument("--listings", type=Path, help="count the SASS listings a --keep run left in this folder "
                        "instead of compiling")
    args = parser.parse_args()
    nvcc = find_tool("nvcc")
    if args.listings:
        missing = [name for name in FILES if not (args.listings / (name + ".sass")).is_file()]
        if missing:
            fail(f"--listings {args.listings}: no {', '.join(m + '.sass' for m in missing)} (made by --keep)")
        kernels = {name: functions((args.listings / (name + ".sass")).read_text()) for name in FILES}
    else:
        kernels = compile_and_list(nvcc, args)
    report(nvcc, args.arch, kernels)
    return 0


def compile_and_list(nvcc: Path, args) -> dict[str, dict[str, list[tuple[int, str]]]]:
    cuobjdump = find_tool("cuobjdump")
    flags = compile_flags(nvcc, args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=len(FILES)) as pool:
            cubins = dict(zip(FILES, pool.map(lambda f: compile_cubin(nvcc, flags, f, out_dir), FILES)))
        kernels: dict[str, dict[str, list[tuple[int, str]]]] = {}
        for name, cubin in cubins.items():
            proc = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True)
            if proc.returncode != 0:
                fail(f"cuobjdump -sass failed on {cubin}:\n{proc.stderr[-2000:]}")
            if args.keep:
                (out_dir / (name + ".sass")).write_text(proc.stdout)
            kernels[name] = functions(proc.stdout)
    return kernels


def report(nvcc: Path, arch: str, kernels: dict[str, dict[str, list[tuple[int, str]]]]) -> None:
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"SASS sm_{arch}, {nvcc} ({version[-1] if version else '?'}), tree {git.stdout.strip() or '?'}; "
          "float32, KL; NOPs not counted")
    print(f"| {'kernel':36s} | {'instantiation':48s} | total | loop | inner | path | no-call path "
          "| loop/elem | path/elem | no-call/elem |")
    print(f"|{'-' * 38}|{'-' * 50}|------:|-----:|------:|-----:|-------------:|----------:|----------:"
          "|-------------:|")
    missing = []
    for label, file, pattern, optional in KERNELS:
        names = demangle(list(kernels[file]))
        hits = [m for m, d in names.items() if re.fullmatch(pattern, d)]
        if optional and not hits:
            continue
        if len(hits) != 1:
            missing.append(f"{label}: {len(hits)} kernels match {pattern!r}")
            continue
        total, loop, inner, path, hot = measure(kernels[file][hits[0]])
        print(f"| {label:36s} | {names[hits[0]]:48s} | {total:5d} | {loop:4d} | {inner:5d} | {path:4d} "
              f"| {hot:12d} | {loop / VEC:9.1f} | {path / VEC:9.1f} | {hot / VEC:12.1f} |")
    if missing:
        fail("; ".join(missing))


if __name__ == "__main__":
    sys.exit(main())
