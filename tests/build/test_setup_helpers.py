"""The build decision (CUDA or CPU-only) and the build facts of tools/setup_helpers, without building anything.

The toolkits are fake folders with an `nvcc` shell script that prints the version asked for.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

# tools/ (not the repository root, whose bandpo_lut/ would shadow the installed package) holds setup_helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from setup_helpers import build_facts, cuda  # noqa: E402
from setup_helpers.common import BuildConfigError  # noqa: E402


def fake_toolkit(root: Path, release: str = "13.0", arches=(75, 80, 86, 89, 90, 100, 120)) -> Path:
    """A folder that looks like a CUDA toolkit whose nvcc reports `release`."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    listing = " ".join(f"compute_{a}" for a in arches)
    nvcc.write_text("#!/bin/sh\n"
                    'if [ "$1" = "--list-gpu-arch" ]; then echo ' + listing + "; exit 0; fi\n"
                    f'echo "Cuda compilation tools, release {release}, V{release}.1"\n')
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return root


def no_nvcc(*args, **kwargs):
    return None


def env(**kw):
    return {"PATH": "/nonexistent", **kw}


@pytest.fixture
def cuda13(tmp_path):
    return fake_toolkit(tmp_path / "cuda-13.0")


def test_cuda_build_when_toolkit_and_cuda_torch(cuda13):
    d = cuda.decide_build(env(CUDA_HOME=str(cuda13)), torch_cuda="13.0", which=no_nvcc)
    assert d["with_cuda"] and d["nvcc_version"] == "13.0" and d["cuda_home"] == cuda13
    assert d["arch_list"] == "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX" and d["arch_list_from"] == "default"


def test_cpu_build_for_cpu_torch_even_with_toolkit(cuda13):
    d = cuda.decide_build(env(CUDA_HOME=str(cuda13)), torch_cuda=None, which=no_nvcc)
    assert not d["with_cuda"] and "CPU-only build" in d["reason"]


def test_force_only_cpu_wins_over_toolkit(cuda13):
    d = cuda.decide_build(env(CUDA_HOME=str(cuda13), FORCE_ONLY_CPU="1"), torch_cuda="13.0", which=no_nvcc)
    assert not d["with_cuda"] and d["reason"] == "FORCE_ONLY_CPU=1"


def test_force_cuda_without_cuda_torch_is_an_error(cuda13):
    with pytest.raises(BuildConfigError, match="CPU-only build"):
        cuda.decide_build(env(CUDA_HOME=str(cuda13), FORCE_CUDA="1"), torch_cuda=None, which=no_nvcc)


def test_force_cuda_and_force_only_cpu_conflict():
    with pytest.raises(BuildConfigError, match="contradict"):
        cuda.decide_build(env(FORCE_CUDA="1", FORCE_ONLY_CPU="1"), torch_cuda="13.0", which=no_nvcc)


def test_nvcc_major_mismatch_is_refused(tmp_path):
    cuda12 = fake_toolkit(tmp_path / "cuda-12.4", release="12.4")
    with pytest.raises(BuildConfigError, match=r"nvcc 12\.4 .* torch's CUDA 13\.0"):
        cuda.decide_build(env(CUDA_HOME=str(cuda12)), torch_cuda="13.0", which=no_nvcc)


def test_nvcc_minor_difference_is_accepted(tmp_path):
    toolkit = fake_toolkit(tmp_path / "cuda-13.1", release="13.1")
    assert cuda.decide_build(env(CUDA_HOME=str(toolkit)), torch_cuda="13.0", which=no_nvcc)["with_cuda"]


def test_bad_cuda_home_is_an_error(tmp_path):
    with pytest.raises(BuildConfigError, match="is not a CUDA toolkit"):
        cuda.decide_build(env(CUDA_HOME=str(tmp_path)), torch_cuda="13.0", which=no_nvcc)


def test_no_toolkit_means_cpu_build_and_force_cuda_errors(monkeypatch):
    monkeypatch.setattr(cuda, "is_cuda_home", lambda path: False)  # hide any real /usr/local/cuda
    d = cuda.decide_build(env(), torch_cuda="13.0", which=no_nvcc)
    assert not d["with_cuda"] and "no toolkit" in d["reason"]
    with pytest.raises(BuildConfigError, match="no CUDA toolkit was found"):
        cuda.decide_build(env(FORCE_CUDA="1"), torch_cuda="13.0", which=no_nvcc)


def test_wrapper_script_on_path_is_followed(tmp_path, cuda13, monkeypatch):
    """An `nvcc` on PATH that is a wrapper script (as /usr/local/bin/nvcc here) leads to the toolkit."""
    wrapper_dir = tmp_path / "wrappers" / "bin"
    wrapper_dir.mkdir(parents=True)
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {cuda13}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    assert cuda.resolve_nvcc(str(wrapper)) == cuda13 / "bin" / "nvcc"
    real_is_cuda_home = cuda.is_cuda_home
    monkeypatch.setattr(cuda, "is_cuda_home",  # hide any real /usr/local/cuda
                        lambda p: p != Path("/usr/local/cuda") and real_is_cuda_home(p))
    home, how = cuda.find_cuda_home(env(PATH=str(wrapper_dir)))
    assert Path(os.path.realpath(home)) == Path(os.path.realpath(cuda13)) and "->" in how


def test_user_arch_list_is_honoured_and_checked(cuda13):
    d = cuda.decide_build(env(CUDA_HOME=str(cuda13), TORCH_CUDA_ARCH_LIST="9.0"), torch_cuda="13.0",
                           which=no_nvcc)
    assert d["arch_list"] == "9.0" and d["arch_list_from"] == "TORCH_CUDA_ARCH_LIST"
    with pytest.raises(BuildConfigError, match="cannot compile 6.1"):
        cuda.decide_build(env(CUDA_HOME=str(cuda13), TORCH_CUDA_ARCH_LIST="6.1;9.0"), torch_cuda="13.0",
                           which=no_nvcc)


def test_default_arch_list_follows_nvcc(tmp_path):
    old = fake_toolkit(tmp_path / "cuda-12.2", release="12.2", arches=(50, 60, 70, 75, 80, 86, 89, 90))
    d = cuda.decide_build(env(CUDA_HOME=str(old)), torch_cuda="12.1", which=no_nvcc)
    assert d["arch_list"] == "7.5;8.0;8.6;8.9;9.0+PTX"


def test_generated_files_are_deterministic_and_complete(cuda13):
    d = cuda.decide_build(env(CUDA_HOME=str(cuda13), TORCH_CUDA_ARCH_LIST="9.0"), torch_cuda="13.0",
                           which=no_nvcc)
    facts = build_facts.build_facts(d, "2.14.1+cu130", "13.0", "0.1.0", 'g++ "quoted" 12')
    py, h = build_facts.render_build_config_py(facts), build_facts.render_build_config_h(facts)
    assert py == build_facts.render_build_config_py(dict(facts)) and "do not edit" in py
    namespace: dict = {}
    exec(py, namespace)
    assert namespace["with_cuda"] is True and namespace["cuda_arch_list"] == "9.0"
    assert '#define BANDPO_BUILD_TORCH_VERSION "2.14.1+cu130"' in h
    assert '#define BANDPO_BUILD_WITH_CUDA 1' in h and '\\"quoted\\"' in h
    assert str(cuda13) not in py + h  # no machine paths in the record


def test_version_and_sources_are_read_from_the_tree(tmp_path):
    pkg, csrc = tmp_path / "bandpo_lut", tmp_path / "csrc"
    (csrc / "cuda").mkdir(parents=True)
    pkg.mkdir()
    (pkg / "_version.py").write_text('"""doc"""\n__version__ = "9.8.7"\n')
    for name in ("b.cpp", "a.cpp", "cuda/k.cu", "x.h"):
        (csrc / name).write_text("")
    assert build_facts.read_version(tmp_path) == "9.8.7"
    assert build_facts.find_sources(tmp_path, csrc, with_cuda=False) == ["csrc/a.cpp", "csrc/b.cpp"]
    assert build_facts.find_sources(tmp_path, csrc, with_cuda=True) == ["csrc/a.cpp", "csrc/b.cpp", "csrc/cuda/k.cu"]
    (pkg / "_version.py").write_text("version = 1\n")
    with pytest.raises(BuildConfigError, match="no __version__"):
        build_facts.read_version(tmp_path)
