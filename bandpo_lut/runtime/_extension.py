"""Loading the compiled extension `bandpo_lut._C`, and what it was built with.

Importing bandpo_lut never compiles anything and never loads the library; `load()` does, once, on
first use. It refuses, with an ImportError that says what to do, a library that is missing (a source
checkout that was never built) or that does not fit the running torch: another torch minor release
(torch's C++ ABI changes between them), or a CUDA build under a torch without CUDA or with another
CUDA major version.

What the library was built with comes from the library itself (the "build" entry of `_C.facts_json`,
compiled in from the BANDPO_BUILD_* macros; see csrc/build_info.h) and, when the library cannot be loaded,
from `bandpo_lut/_build_config.py`, which setup.py writes beside it in the same build. `facts()` gives the
whole of `_C.facts_json` (csrc/facts.h): the one way C++ facts reach Python.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

BUILD_COMMAND = "pip install --no-build-isolation -v ."
DEV_BUILD_COMMAND = "pip install --no-build-isolation --use-pep517 -v -e ."
_FIELDS = ("package_version", "with_cuda", "cuda_version", "torch_version", "torch_cuda_version",
           "cuda_arch_list", "cxx_compiler")

_module: ModuleType | None = None
_facts: dict | None = None


def _major_minor(version: str | None) -> tuple[int, ...] | None:
    """(2, 14) from "2.14.1+cu130"; None when there is no such prefix."""
    parts = (version or "").split("+")[0].split(".")
    try:
        return tuple(int(p) for p in parts[:2])
    except ValueError:
        return None


def _major(version: str | None) -> int | None:
    mm = _major_minor(version)
    return mm[0] if mm else None


def _recorded_config() -> dict | None:
    """The facts in bandpo_lut/_build_config.py (written by setup.py), or None if there is none."""
    try:
        config = importlib.import_module("bandpo_lut._build_config")
    except ImportError:
        return None
    return {name: getattr(config, name, None) for name in _FIELDS}


def _compiled_config(module: ModuleType) -> dict | None:
    """The facts compiled into the library, or None for a library built outside setup.py."""
    try:
        facts = json.loads(getattr(module, "facts_json", "null") or "null")
    except ValueError:
        return None
    facts = facts.get("build") if isinstance(facts, dict) else None
    if not isinstance(facts, dict) or facts.get("generated") is False:
        return None
    return {name: facts.get(name) for name in _FIELDS}


def _installed_copy(here: Path) -> Path | None:
    """The folder of another bandpo_lut, one with a compiled _C, that the source tree `here` shadows; None if
    there is none. Looked for in the metadata of every installed distribution of bandpo_lut, then in every
    entry of sys.path: the first metadata found is not enough, since a checkout's own bandpo_lut.egg-info
    (left by a development build) is on the path first and names the checkout itself."""
    candidates = []
    try:
        from importlib.metadata import distributions
        candidates += [Path(d.locate_file("bandpo_lut")) for d in distributions(name="bandpo_lut")]
    except (ImportError, TypeError, OSError, ValueError):
        pass
    candidates += [Path(entry or ".") / "bandpo_lut" for entry in sys.path if isinstance(entry, str)]
    for folder in candidates:
        try:
            folder = folder.resolve()
            if folder != here and any(folder.glob("_C.*")):
                return folder
        except OSError:
            continue
    return None


def _mismatches(built: dict, torch) -> list[str]:
    """Why a library built with `built` cannot serve the running torch (empty if it can)."""
    problems = []
    built_mm, running_mm = _major_minor(built.get("torch_version")), _major_minor(torch.__version__)
    if built_mm and running_mm and built_mm != running_mm:
        problems.append(f"it was built against torch {built['torch_version']}, but torch {torch.__version__} "
                        "is running (the C++ ABI differs between torch minor releases)")
    if built.get("with_cuda"):
        if torch.version.cuda is None:
            problems.append(f"it is a CUDA build (CUDA {built.get('cuda_version')}), but the running torch "
                            f"{torch.__version__} has no CUDA")
        elif _major(built.get("cuda_version")) not in (None, _major(torch.version.cuda)):
            problems.append(f"it was built with CUDA {built.get('cuda_version')}, but the running torch uses "
                            f"CUDA {torch.version.cuda}")
    return problems


def _rebuild_advice() -> str:
    return ("(Re)build it from the repository root, with the torch you mean to use installed in this "
            f"environment: {BUILD_COMMAND}  (development install: {DEV_BUILD_COMMAND}). setup.py prints "
            "whether it makes a CUDA or a CPU-only build; FORCE_ONLY_CPU=1 forces CPU-only.")


def load() -> ModuleType:
    """Load bandpo_lut._C (which registers the torch.ops.bandpo_lut ops) and return it; cached.

    Raises ImportError when the library is missing, fails to load, or does not fit the running torch.
    """
    global _module
    if _module is not None:
        return _module
    import torch  # first: the library links against libtorch, found through the loaded torch

    try:
        spec = importlib.util.find_spec("bandpo_lut._C")
    except ImportError:
        spec = None
    recorded = _recorded_config()
    if spec is None:
        here = Path(__file__).resolve().parent
        installed = _installed_copy(here)
        if installed is not None:
            raise ImportError(
                f"bandpo_lut was imported from the source tree {here}, which has no compiled extension, "
                f"instead of the installed copy in {installed}: the current directory (or PYTHONPATH) "
                "shadows it. Run from outside the checkout, or install in development mode "
                f"({DEV_BUILD_COMMAND}).")
        raise ImportError(
            f"bandpo_lut's compiled extension bandpo_lut._C is missing from {here}: a source tree "
            "that was never built (or whose build failed), so the compiled ops are unavailable. "
            + _rebuild_advice())

    try:
        module = importlib.import_module("bandpo_lut._C")
    except ImportError as exc:
        problems = _mismatches(recorded, torch) if recorded else []
        why = ("It does not fit this environment: " + "; ".join(problems) + ". ") if problems else ""
        raise ImportError(
            f"bandpo_lut's compiled extension {spec.origin} failed to load ({exc}). {why}"
            + _rebuild_advice()) from exc

    built = _compiled_config(module) or recorded
    problems = _mismatches(built, torch) if built else []
    if problems:
        raise ImportError(f"bandpo_lut's compiled extension {module.__file__} does not fit this environment: "
                          + "; ".join(problems) + ". " + _rebuild_advice())
    _module = module
    return module


def facts() -> dict:
    """The compiled library's facts (csrc/facts.h), parsed once: "build", "divergences" ({name: id}),
    "closed_form_divergences", "grid_fields" (the order of the ops' grid argument) and "loss" (the fused
    loss's option ids, sizes and thresholds). Loads the library (ImportError like `load()`)."""
    global _facts
    module = load()   # every call, like load()'s other users: a library that cannot load is refused each time
    if _facts is None:
        text = getattr(module, "facts_json", None)
        if text is None:
            raise ImportError(f"bandpo_lut's compiled extension {module.__file__} predates this source (it has no "
                              "facts_json). " + _rebuild_advice())
        _facts = json.loads(text)
    return _facts


def build_info() -> dict:
    """What the compiled extension was built with, what is running now, and whether a GPU is usable.

    Keys: package_version, with_cuda, cuda_version (nvcc's at build time, None if CPU-only),
    cuda_arch_list, cxx_compiler, torch_version_built, torch_cuda_version_built,
    torch_version_running, torch_cuda_version_running, extension_path, gpu_available (torch sees a
    CUDA GPU now), cuda_kernels_usable (a CUDA build and a GPU), cpu_isa (the CPU's vector ISA), cpu_variant
    (the CPU kernel variant every CPU op runs in this process, BANDPO_LUT_CPU_VARIANT as read at import; an
    invalid setting's message instead). Raises ImportError like `load()`.
    """
    module = load()
    import torch

    built = _compiled_config(module) or _recorded_config() or dict.fromkeys(_FIELDS)
    cpu = facts().get("cpu", {})   # the variant the kernels run: both read once, at import (csrc/cpu/cpu_variant.h)
    gpu = bool(torch.cuda.is_available())
    return {
        "package_version": built["package_version"],
        "with_cuda": bool(built["with_cuda"]),
        "cuda_version": built["cuda_version"],
        "cuda_arch_list": built["cuda_arch_list"],
        "cxx_compiler": built["cxx_compiler"],
        "torch_version_built": built["torch_version"],
        "torch_cuda_version_built": built["torch_cuda_version"],
        "torch_version_running": torch.__version__,
        "torch_cuda_version_running": torch.version.cuda,
        "extension_path": module.__file__,
        "gpu_available": gpu,
        "cuda_kernels_usable": gpu and bool(built["with_cuda"]),
        "cpu_isa": cpu.get("isa"),
        "cpu_variant": cpu.get("variant") or cpu.get("variant_error"),
    }
