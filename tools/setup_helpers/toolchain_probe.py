"""Refuse, before compiling, a C++ toolchain whose extensions crash when loaded next to torch.

Why: a GCC that links libstdc++ statically into shared objects (as a GCC installed under /opt/gcc did) built an
extension that segfaulted at import, inside iostream code resolved in the extension's own copy of libstdc++ while
torch had loaded the system's. Two C++ runtimes in one process cannot work for a torch extension in general:
C++ exceptions (c10::Error), std::string and locale state cross the boundary to libtorch.

The probe compiles and links a tiny shared object with the compiler and the C++ flags the build will use ($CXX
split as a shell would, so `ccache g++` and `g++ -static-libstdc++` are what they say; the flags the build
appends from CPPFLAGS, CFLAGS, CXXFLAGS and LDFLAGS, which could otherwise bring in what the probe refuses); it
formats numbers through std::ostringstream and throws and catches an exception. A fresh Python imports torch,
loads it and calls it. The build is refused when
  (1) the probe crashes or answers wrongly (the direct evidence), or
  (2) the probe does not need libstdc++.so while torch's libc10.so does: a second, static C++ runtime, the
      cause of the crash above, even where this probe happens to survive it.
Cost: one compile of a ~20-line file and one `import torch` in a subprocess (about 1-3 s); a compiler or a probe
that hangs is refused after `timeout` seconds. Linux only (ELF).
BANDPO_SKIP_TOOLCHAIN_PROBE=1 skips it (docs/build.md).
"""
from __future__ import annotations

import os
import shlex
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


# The environment variables whose flags setuptools adds to the build's compile and link commands (it puts them
# before the extension's own flags, as the probe does).
ENV_FLAGS = ("CPPFLAGS", "CFLAGS", "CXXFLAGS", "LDFLAGS")
SYSTEM_CXX = ("/usr/bin/g++", "/usr/bin/clang++")
LAUNCHERS = ("ccache", "sccache", "distcc", "icecc")
# A C++ driver's name -> its C driver's (the suffix a versioned or cross compiler carries is kept: g++-12 -> gcc-12).
_C_DRIVER = (("clang++", "clang"), ("g++", "gcc"), ("c++", "cc"))


def c_compiler_for(cxx_path: str) -> str | None:
    """The C driver beside a C++ driver (/usr/bin/clang++ -> /usr/bin/clang, x86_64-linux-gnu-g++-12 ->
    x86_64-linux-gnu-gcc-12); None when the name is not one of those drivers' or no such file exists."""
    folder, name = os.path.split(cxx_path)
    for cxx, cc in _C_DRIVER:
        head, sep, tail = name.rpartition(cxx)
        if sep and (not tail or tail.startswith("-")) and (not head or head.endswith("-")):
            candidate = os.path.join(folder, head + cc + tail)
            return candidate if os.path.isfile(candidate) else None
    return None


def _fix_hint(cxx_path: str, candidates=SYSTEM_CXX) -> str:
    system = [(c, c_compiler_for(c)) for c in candidates if Path(c).is_file()
              and os.path.realpath(c) != os.path.realpath(cxx_path)]
    system = [(cxx, cc) for cxx, cc in system if cc is not None]
    if system:
        how = f"CXX={system[0][0]} CC={system[0][1]} pip install --no-build-isolation ."
    else:
        how = "CXX=<a g++ that links libstdc++.so dynamically> CC=<its gcc> pip install --no-build-isolation ."
    return (f"Build with another compiler: {how}   "
            f"({SKIP_VAR}=1 skips this check, at your own risk.)")


def env_flags(env: dict) -> list[str]:
    """The flags of ENV_FLAGS in `env`, each variable split as a shell would (BuildConfigError if one cannot be)."""
    out = []
    for name in ENV_FLAGS:
        try:
            out += shlex.split(env.get(name, ""))
        except ValueError as exc:
            raise BuildConfigError(f"{name}={env[name]!r} cannot be split into flags ({exc})") from None
    return out


def compiler_command(env: dict) -> list[str]:
    """$CXX (else c++) split as a shell would, its program resolved on $PATH: ['ccache', 'g++'] for
    CXX='ccache g++', [g++, '-static-libstdc++'] for CXX='g++ -static-libstdc++'."""
    text = env.get("CXX", "c++")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise BuildConfigError(f"CXX={text!r} cannot be split into a command ({exc})") from None
    if not words:
        raise BuildConfigError(f"CXX={text!r} names no compiler")
    return [shutil.which(words[0], path=env.get("PATH")) or words[0], *words[1:]]


def probe_toolchain(env: dict, cxx_flags: list[str], link_flags: list[str], torch_lib_dir: Path,
                    cxx11_abi: bool, python: str = sys.executable, timeout: float = 300.0) -> str:
    """Compile, load and call the probe with the build's compiler ($CXX, else c++, as torch's build does) and
    flags. Returns a one-line summary for the build log; raises BuildConfigError when the build must stop."""
    if env_flag(env, SKIP_VAR):
        return f"toolchain probe: skipped ({SKIP_VAR}=1)"
    if not sys.platform.startswith("linux"):
        return "toolchain probe: not run (Linux only)"
    compiler = compiler_command(env)
    cxx_path = compiler[0]
    # The program that compiles: the one after a launcher (ccache, distcc) where CXX has one.
    driver = next((w for w in compiler if not w.startswith("-") and os.path.basename(w) not in LAUNCHERS),
                  cxx_path)
    driver = shutil.which(driver, path=env.get("PATH")) or driver
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=timeout).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        version = "version unknown"
    named = f"{' '.join(compiler)} ({version.strip()})" + "".join(
        f" with {name}={env[name]!r}" for name in ENV_FLAGS if env.get(name, "").strip())
    # Flags that are not for the probe's code: the CUDA define. The rest (-O3, -fopenmp, ...) as built.
    flags = env_flags(env) + [f for f in cxx_flags if not f.startswith("-DBANDPO_")]
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}", "-std=c++17", "-fPIC", "-shared"]
    with tempfile.TemporaryDirectory(prefix="bandpo_probe_") as tmp:
        src, lib = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text(PROBE_SOURCE, encoding="utf-8")
        cmd = [*compiler, *flags, str(src), "-o", str(lib), *link_flags]
        try:
            built = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildConfigError(f"the C++ compiler {named} could not be run: {exc}") from None
        if built.returncode != 0 or not lib.is_file():
            raise BuildConfigError(
                f"the C++ compiler {named} cannot compile and link a 20-line shared object with the build's "
                f"flags:\n  {shlex.join(cmd)}\n{built.stderr.strip()}\n{_fix_hint(driver)}")
        readelf = shutil.which("readelf", path=env.get("PATH"))
        ours = _uses_libstdcxx(needed_libraries(lib, readelf))
        torchs = _uses_libstdcxx(needed_libraries(torch_lib_dir / "libc10.so", readelf))
        static = ours is False and bool(torchs)
        why_static = ("it links libstdc++ statically into shared objects (the probe's NEEDED libraries lack "
                      "libstdc++.so, torch's libc10.so has it), so the extension would carry a second C++ "
                      "runtime next to torch's")
        try:
            ran = subprocess.run([python, "-c", RUNNER, str(lib)], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BuildConfigError(
                f"the C++ compiler {named} builds shared objects that hang next to torch: a probe built with it "
                f"did not answer within {timeout:g} s when loaded after `import torch` (the extension would do "
                f"the same at import, or the machine is too loaded to tell).\n{_fix_hint(driver)}") from None
        answer = ran.stdout.strip()
        if ran.returncode != 0 or answer != EXPECTED:
            how = (f"crashed (signal {-ran.returncode})" if ran.returncode < 0
                   else f"failed (exit {ran.returncode})" if ran.returncode else f"answered {answer!r}")
            raise BuildConfigError(
                f"the C++ compiler {named} builds shared objects that break next to torch: a probe built with "
                f"it (iostream formatting and an exception) {how} when loaded after `import torch`, expected "
                f"{EXPECTED!r}. The extension would do the same at import"
                + (f"; {why_static}" if static else "") + f".\n{ran.stderr.strip()[-2000:]}\n"
                f"{_fix_hint(driver)}")
        if static:
            raise BuildConfigError(
                f"the C++ compiler {named}: {why_static}, which crashed at import on such a build (iostreams) "
                f"and breaks C++ exceptions crossing into libtorch.\n{_fix_hint(driver)}")
    linkage = {True: "libstdc++ shared", False: "no libstdc++", None: "NEEDED not read (no readelf)"}[ours]
    return f"toolchain probe: {named} ok ({linkage})"
