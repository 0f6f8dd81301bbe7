"""The build-time toolchain probe (tools/setup_helpers/toolchain_probe.py): a compiler whose shared objects crash
next to torch, or carry a static copy of libstdc++, is refused before the build compiles anything; the
system g++ passes. The bad compilers are wrapper scripts around the real g++."""
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
from setup_helpers.toolchain_probe import SKIP_VAR, probe_toolchain  # noqa: E402

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


def probe(cxx: str, **env):
    cxx_flags, _, link_flags = extension_flags(False, "x86_64" if os.uname().machine == "x86_64" else "other",
                                               sys.platform)
    return probe_toolchain({**os.environ, "CXX": cxx, **env}, cxx_flags, link_flags,
                           Path(torch.__file__).parent / "lib", bool(torch._C._GLIBCXX_USE_CXX11_ABI))


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
