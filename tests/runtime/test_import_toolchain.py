"""What runs when `bandpo_lut._C` is imported, whatever the toolchain.

A GCC that links libstdc++ statically into `_C.so` (the GPU image's /opt/gcc) gives the library its own copy of
the iostream/locale machinery next to the libstdc++.so.6 that libtorch loads; the first ostream write in
`PyInit__C` (the facts JSON) segfaulted there. That toolchain is not on the CPU machines and no flag of their
GCC 12 reproduces the crash, so the regression is checked twice: here, by what the import code references (it must
not touch iostream or locale at all, so there is nothing to crash in), and on the GPU machine by
tools/gpu_check.py, which builds with that compiler and imports."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sysconfig

import pytest
import torch
from helpers import REPO, fresh_env

from bandpo_lut.runtime import _extension, loss_spec
from bandpo_lut.tables import divergences

# Symbols of the iostream/locale machinery (demangled). std::to_chars and std::string are not among them.
IOSTREAM_SYMBOL = re.compile(r"ostream|istream|stringstream|stringbuf|basic_ios|ios_base|std::locale|num_put|"
                             r"__ostream_insert")


@pytest.mark.slow
def test_the_import_code_references_no_iostream(tmp_path):
    """csrc/extension_module.cpp (PyInit__C and the facts JSON it builds, csrc/facts.h, with the CPU variant check
    that may raise at import) compiled as the build compiles it but at -O0, so that every inline function the import
    reaches is emitted with its references: neither its own symbols nor the ones it needs may be iostream's or
    locale's. Before the fix: std::ostringstream, ostream::operator<<(int/double), ios_base::precision and c10::str's
    ostream formatting of the multi-argument TORCH_CHECK messages."""
    cxx = os.environ.get("CXX", "c++")      # what setup.py compiles with
    if shutil.which(cxx) is None or shutil.which("nm") is None:
        pytest.fail(f"needs the C++ compiler {cxx!r} and nm (binutils), as the build does")
    from torch.utils import cpp_extension

    obj = tmp_path / "extension_module.o"
    cmd = [cxx, "-std=c++20", "-O0", "-fPIC", "-c", str(REPO / "csrc" / "extension_module.cpp"), "-o", str(obj),
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           "-I" + str(REPO / "csrc"),   # as setup.py: csrc/ files include each other from the csrc root
           "-I" + sysconfig.get_paths()["include"], *("-I" + p for p in cpp_extension.include_paths())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert any("to_chars" in s for s in symbols), "the facts' numbers are written with std::to_chars"
    assert [s for s in symbols if IOSTREAM_SYMBOL.search(s)] == []


def test_facts_json_is_the_documented_object():
    """The JSON text itself (written without iostreams: numbers by std::to_chars, shortest round-trip) parses to
    exactly the object its Python owners describe, the numbers bit for bit."""
    text = _extension.load().facts_json
    facts = json.loads(text)
    assert list(facts) == ["build", "divergences", "closed_form_divergences", "grid_fields", "loss", "cpu"]
    build = facts["build"]
    assert build["torch_version"] == torch.__version__                      # built against the running torch
    assert build["package_version"] == importlib.metadata.version("bandpo-lut")
    assert build["with_cuda"] == (build["cuda_version"] is not None)
    assert facts["divergences"] == {name: divergences.get(name).compiled_id for name in divergences.names()
                                    if divergences.get(name).compiled_id is not None}
    assert facts["closed_form_divergences"] == [n for n in facts["divergences"]
                                                if divergences.get(n).closed_form is not None]
    assert facts["grid_fields"] == ["t_min", "t_step", "s_min", "s_step", "delta_min", "delta_max",
                                    "delta_max_inclusive"]          # the order documented in csrc/table_grid.h
    assert facts["loss"] == {
        "clip": loss_spec.CLIP_ID, "mode": loss_spec.MODE_ID, "agg": loss_spec.AGG_ID,
        "n_counts": len(loss_spec.COUNTS), "n_metrics": len(loss_spec.METRICS),
        "log_ratio_clamp": loss_spec.LOG_RATIO_CLAMP, "lowprob": loss_spec.LOWPROB,
        "bucket_edges": [lo for _, lo, _ in loss_spec.BUCKETS],
        "fractions": [list(f) for f in loss_spec.FRACTION_INDICES]}
    assert type(facts["loss"]["lowprob"]) is float and facts["loss"]["lowprob"] == 0.2   # not 0.20000000000000001's
    # neighbour: shortest round-trip text reads back the very double
    assert set(facts["cpu"]) == {"isa", "variant"}
    assert facts["cpu"]["isa"] in {"avx512", "avx2", "baseline"}
    assert facts["cpu"]["variant"] == facts["cpu"]["isa"] or os.environ.get("BANDPO_LUT_CPU_VARIANT", "auto") != "auto"


@pytest.mark.subprocess
def test_a_bad_cpu_variant_is_reported_in_the_facts_at_import(fresh):
    """The one error path that runs at import (BANDPO_LUT_CPU_VARIANT misspelt): the import succeeds and the facts
    carry the message, which names the variable and the value (written as one C string, no ostream)."""
    code = ("import json, torch; from bandpo_lut.runtime import _extension; "
            "print(json.dumps(json.loads(_extension.load().facts_json)['cpu']))")
    proc = fresh(["-c", code], env=fresh_env(BANDPO_LUT_CPU_VARIANT="avx9000"), check=True)
    cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "variant" not in cpu
    assert "BANDPO_LUT_CPU_VARIANT='avx9000'" in cpu["variant_error"]
    assert "auto, avx512, avx2, baseline" in cpu["variant_error"], cpu
