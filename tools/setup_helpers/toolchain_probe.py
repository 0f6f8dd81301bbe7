"""Refuse, before compiling, a C++ toolchain whose extensions crash when loaded next to torch.

Why: a GCC that links libstdc++ statically into shared objects (as a GCC installed under /opt/gcc did) built an
extension that segfaulted at import, inside iostream code resolved in the extension's own copy of libstdc++ while
torch had loaded the system's. Two C++ runtimes in one process cannot work for a torch extension in general:
C++ exceptions (c10::Error), std::string and locale state cross the boundary to libtorch.

The probe compiles and links a tiny shared object with the compiler and the C++ flags the build will use; it
formats numbers through std::ostringstream and throws and catches an exception. A fresh Python imports torch,
loads it and calls it. The build is refused when
  (1) the probe crashes or answers wrongly (the direct evidence), or
  (2) the probe does not need libstdc++.so while torch's libc10.so does: a second, static C++ runtime, the
      cause of the crash above, even where this probe happens to survive it.
Cost: one compile of a ~20-line file and one `import torch` in a subprocess (about 1-3 s). Linux only (ELF).
BANDPO_SKIP_TOOLCHAIN_PROBE=1 skips it (docs/build.md).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import BuildConfigError, env_flag

SKIP_VAR = "BANDPO_SKIP_TOOLCHAIN_PROBE"
EXPECTED = "12345 0.25 probe-exception"

PROBE_SOURCE = r"""
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

// Formats through iostreams (locale, num_put) and throws/catches: what crashed in a static-libstdc++ build.
extern "C" int bandpo_toolchain_probe(char* out, int size) {
  std::string caught;
  try {
    throw std::runtime_error("probe-exception");
  } catch (const std::exception& e) {
    caught = e.what();
  }
  std::ostringstream text;
  text << 12345L << ' ' << 0.25 << ' ' << caught;
  const std::string s = text.str();
  std::strncpy(out, s.c_str(), static_cast<size_t>(size) - 1);
  out[size - 1] = '\0';
  return static_cast<int>(s.size());
}
"""

# Run in a fresh interpreter: torch first (it loads its libstdc++ and libgomp), then the probe, as an import
# of the extension would.
RUNNER = r"""
import ctypes, sys
import torch  # noqa: F401
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(256)
lib.bandpo_toolchain_probe(buf, 256)
print(buf.value.decode())
"""


def needed_libraries(path: Path, readelf: str | None) -> list[str] | None:
    """The DT_NEEDED entries of an ELF file, or None when they cannot be read (no readelf)."""
    if readelf is None:
        return None
    try:
        out = subprocess.run([readelf, "-d", str(path)], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def _uses_libstdcxx(needed: list[str] | None) -> bool | None:
    return None if needed is None else any(n.startswith("libstdc++.so") for n in needed)


def _fix_hint(cxx_path: str) -> str:
    system = [c for c in ("/usr/bin/g++", "/usr/bin/clang++") if Path(c).is_file()
              and os.path.realpath(c) != os.path.realpath(cxx_path)]
    if system:
        cc = system[0].replace("g++", "gcc").replace("clang++", "clang")
        how = f"CXX={system[0]} CC={cc} pip install --no-build-isolation ."
    else:
        how = "CXX=<a g++ that links libstdc++.so dynamically> CC=<its gcc> pip install --no-build-isolation ."
    return (f"Build with another compiler: {how}   "
            f"({SKIP_VAR}=1 skips this check, at your own risk.)")


def probe_toolchain(env: dict, cxx_flags: list[str], link_flags: list[str], torch_lib_dir: Path,
                    cxx11_abi: bool, python: str = sys.executable, timeout: float = 300.0) -> str:
    """Compile, load and call the probe with the build's compiler ($CXX, else c++, as torch's build does) and
    flags. Returns a one-line summary for the build log; raises BuildConfigError when the build must stop."""
    if env_flag(env, SKIP_VAR):
        return f"toolchain probe: skipped ({SKIP_VAR}=1)"
    if not sys.platform.startswith("linux"):
        return "toolchain probe: not run (Linux only)"
    cxx = env.get("CXX", "c++")
    cxx_path = shutil.which(cxx, path=env.get("PATH")) or cxx
    try:
        version = subprocess.run([cxx_path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        version = "version unknown"
    named = f"{cxx_path} ({version.strip()})"
    # Flags that are not for the probe's code: the CUDA define. The rest (-O3, -fopenmp, ...) as built.
    flags = [f for f in cxx_flags if not f.startswith("-DBANDPO_")]
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}", "-std=c++17", "-fPIC", "-shared"]
    with tempfile.TemporaryDirectory(prefix="bandpo_probe_") as tmp:
        src, lib = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text(PROBE_SOURCE, encoding="utf-8")
        cmd = [cxx_path, *flags, str(src), "-o", str(lib), *link_flags]
        try:
            built = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildConfigError(f"the C++ compiler {named} could not be run: {exc}") from None
        if built.returncode != 0 or not lib.is_file():
            raise BuildConfigError(
                f"the C++ compiler {named} cannot compile and link a 20-line shared object with the build's "
                f"flags:\n  {' '.join(cmd)}\n{built.stderr.strip()}\n{_fix_hint(cxx_path)}")
        readelf = shutil.which("readelf", path=env.get("PATH"))
        ours = _uses_libstdcxx(needed_libraries(lib, readelf))
        torchs = _uses_libstdcxx(needed_libraries(torch_lib_dir / "libc10.so", readelf))
        static = ours is False and bool(torchs)
        why_static = ("it links libstdc++ statically into shared objects (the probe's NEEDED libraries lack "
                      "libstdc++.so, torch's libc10.so has it), so the extension would carry a second C++ "
                      "runtime next to torch's")
        ran = subprocess.run([python, "-c", RUNNER, str(lib)], capture_output=True, text=True, timeout=timeout)
        answer = ran.stdout.strip()
        if ran.returncode != 0 or answer != EXPECTED:
            how = (f"crashed (signal {-ran.returncode})" if ran.returncode < 0
                   else f"failed (exit {ran.returncode})" if ran.returncode else f"answered {answer!r}")
            raise BuildConfigError(
                f"the C++ compiler {named} builds shared objects that break next to torch: a probe built with "
                f"it (iostream formatting and an exception) {how} when loaded after `import torch`, expected "
                f"{EXPECTED!r}. The extension would do the same at import"
                + (f"; {why_static}" if static else "") + f".\n{ran.stderr.strip()[-2000:]}\n"
                f"{_fix_hint(cxx_path)}")
        if static:
            raise BuildConfigError(
                f"the C++ compiler {named}: {why_static}, which crashed at import on such a build (iostreams) "
                f"and breaks C++ exceptions crossing into libtorch.\n{_fix_hint(cxx_path)}")
    linkage = {True: "libstdc++ shared", False: "no libstdc++", None: "NEEDED not read (no readelf)"}[ours]
    return f"toolchain probe: {named} ok ({linkage})"
