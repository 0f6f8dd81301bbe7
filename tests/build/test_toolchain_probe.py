"""The build-time toolchain probe (tools/setup_helpers/toolchain_probe.py): a compiler whose shared objects crash
or hang next to torch, or carry a static copy of libstdc++ (from the compiler, $CXX's own flags, $LDFLAGS or
$CXXFLAGS), is refused before the build compiles anything; the system g++ passes, also behind a launcher
(CXX='ccache g++'). The bad compilers are wrapper scripts around the real g++."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))  # not the repository root: its bandpo_lut/ would shadow the installed one
from setup_helpers.common import BuildConfigError  # noqa: E402
from setup_helpers.flags import extension_flags  # noqa: E402
from setup_helpers.toolchain_probe import SKIP_VAR, _fix_hint, c_compiler_for, probe_toolchain  # noqa: E402

GXX = shutil.which("g++")
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe is for ELF toolchains (Linux)"),
    pytest.mark.skipif(GXX is None, reason="needs g++"),
]


def wrapper(tmp_path: Path, name: str, extra: str) -> str:
    """A `c++` that runs the real g++ with `extra` appended (extra sources or flags)."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\nexec {GXX} "$@" {extra}\n')
    path.chmod(0o755)
    return str(path)


def probe(cxx: str, timeout: float = 300.0, **env):
    cxx_flags, _, link_flags = extension_flags(False, "x86_64" if os.uname().machine == "x86_64" else "other",
                                               sys.platform)
    base = {k: v for k, v in os.environ.items() if k not in ("CPPFLAGS", "CFLAGS", "CXXFLAGS", "LDFLAGS")}
    return probe_toolchain({**base, "CXX": cxx, **env}, cxx_flags, link_flags, Path(torch.__file__).parent / "lib",
                           bool(torch._C._GLIBCXX_USE_CXX11_ABI), timeout=timeout)


def test_system_gxx_passes():
    summary = probe(GXX)
    assert "ok" in summary and GXX in summary and "libstdc++ shared" in summary


def test_compiler_whose_shared_objects_crash_is_refused(tmp_path):
    crash = tmp_path / "crash_at_load.cpp"  # a load-time segfault, as the static-libstdc++ extension had
    crash.write_text("#include <csignal>\n__attribute__((constructor)) static void boom() { std::raise(SIGSEGV); }\n")
    cxx = wrapper(tmp_path, "crashing-g++", str(crash))
    with pytest.raises(BuildConfigError) as info:
        probe(cxx)
    message = str(info.value)
    assert "crashed (signal 11)" in message and cxx in message  # names the compiler by path ...
    assert "g++" in message.split(cxx, 1)[1].split(")", 1)[0]  # ... and its --version line
    assert "CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation ." in message or \
        not Path("/usr/bin/g++").is_file()


@pytest.mark.slow
def test_compiler_linking_libstdcxx_statically_is_refused(tmp_path):
    cxx = wrapper(tmp_path, "static-g++", "-static-libstdc++")
    # Here (GCC 12) such a probe loads but its ostringstream writes nothing next to torch's libstdc++: refused by
    # the run; and were it to answer right, by its NEEDED libraries.
    with pytest.raises(BuildConfigError, match="links libstdc\\+\\+ statically") as info:
        probe(cxx)
    assert cxx in str(info.value) and SKIP_VAR in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["LDFLAGS", "CXXFLAGS"])
def test_static_libstdcxx_from_the_flag_variables_is_refused(variable):
    """setuptools appends $LDFLAGS and $CXXFLAGS to the build's commands: the probe must see them too, or
    LDFLAGS=-static-libstdc++ passes it and the build links a second C++ runtime."""
    with pytest.raises(BuildConfigError, match="links libstdc\\+\\+ statically") as info:
        probe(GXX, **{variable: "-O2  -static-libstdc++"})
    assert f"{variable}='-O2  -static-libstdc++'" in str(info.value)       # says where the flag came from


@pytest.mark.slow
def test_cxx_with_a_flag_is_split_as_a_shell_would(tmp_path):
    """CXX='g++ -static-libstdc++' is refused for linking statically, not as a compiler that cannot be run."""
    with pytest.raises(BuildConfigError, match="links libstdc\\+\\+ statically") as info:
        probe(f"{GXX} -static-libstdc++")
    assert "could not be run" not in str(info.value)


def test_cxx_behind_a_launcher_passes(tmp_path):
    """CXX='ccache g++' (a launcher, then the compiler, found on PATH): the build runs it, so the probe must."""
    launcher = tmp_path / "ccache"                  # a stand-in for ccache: runs the command it is given
    launcher.write_text('#!/bin/sh\nexec "$@"\n')
    launcher.chmod(0o755)
    path = os.pathsep.join([str(tmp_path), os.path.dirname(GXX), os.environ.get("PATH", "")])
    summary = probe(f"ccache {os.path.basename(GXX)}", PATH=path)
    assert "ok" in summary and f"{launcher} {os.path.basename(GXX)}" in summary, summary


@pytest.mark.slow
def test_a_probe_that_hangs_is_refused_after_the_timeout(tmp_path):
    """A shared object that hangs when loaded: the build stops with a refusal, not a TimeoutExpired traceback."""
    hang = tmp_path / "hang_at_load.cpp"
    hang.write_text("#include <unistd.h>\n__attribute__((constructor)) static void wait() { sleep(600); }\n")
    cxx = wrapper(tmp_path, "hanging-g++", str(hang))
    with pytest.raises(BuildConfigError, match="did not answer within 20 s") as info:
        probe(cxx, timeout=20)
    assert cxx in str(info.value) and SKIP_VAR in str(info.value)


def _touch_executable(path: Path) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("cxx, cc", [("clang++", "clang"), ("g++", "gcc"), ("c++", "cc"), ("g++-12", "gcc-12"),
                                     ("clang++-17", "clang-17"), ("x86_64-linux-gnu-g++", "x86_64-linux-gnu-gcc")])
def test_the_c_compiler_is_derived_from_the_cxx_name(cxx, cc, tmp_path):
    _touch_executable(tmp_path / cc)
    assert c_compiler_for(str(tmp_path / cxx)) == str(tmp_path / cc)


def test_the_hint_names_only_a_c_compiler_that_exists(tmp_path):
    clangxx = _touch_executable(tmp_path / "clang++")
    gxx = _touch_executable(tmp_path / "g++")             # no gcc beside it: never suggested
    assert c_compiler_for(gxx) is None
    hint = _fix_hint("/opt/broken/bin/g++", candidates=(gxx, clangxx))
    assert "CXX=<a g++" in hint                            # clang++ has no clang either
    clang = _touch_executable(tmp_path / "clang")
    hint = _fix_hint("/opt/broken/bin/g++", candidates=(gxx, clangxx))
    assert f"CXX={clangxx} CC={clang} pip install" in hint, hint
    assert "clangcc" not in hint


def test_compiler_that_cannot_link_is_refused(tmp_path):
    cxx = wrapper(tmp_path, "broken-g++", "-lno_such_library_bandpo")
    with pytest.raises(BuildConfigError, match="cannot compile and link"):
        probe(cxx)


def test_skip_variable_skips_the_probe(tmp_path):
    cxx = wrapper(tmp_path, "broken-g++", "-lno_such_library_bandpo")
    assert "skipped" in probe(cxx, **{SKIP_VAR: "1"})


@pytest.mark.slow
@pytest.mark.subprocess
def test_setup_py_refuses_before_compiling(tmp_path):
    """What a user sees: setup.py stops with the probe's message, before any source is compiled."""
    cxx = wrapper(tmp_path, "static-g++", "-static-libstdc++")
    env = {**os.environ, "CXX": cxx, "FORCE_ONLY_CPU": "1"}
    env.pop(SKIP_VAR, None)
    proc = subprocess.run([sys.executable, str(REPO / "setup.py"), "build_ext", "--build-temp", str(tmp_path / "t"),
                           "--build-lib", str(tmp_path / "l")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    assert "bandpo_lut setup: error:" in proc.stderr and "links libstdc++ statically" in proc.stderr
    assert not list((tmp_path / "t").rglob("*.o")), "compiled before refusing"
