"""The import paths of 0.1, before the package was split by concern: `import bandpo_lut.loss`,
`from bandpo_lut.divergences import ...` and the like keep working for one release (they go in 0.3), each with a
DeprecationWarning that names the new path. `bandpo_lut/__init__.py` installs the finder; nothing else uses it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> where it lives now
MOVED = {
    "bandpo_lut.api": "bandpo_lut.runtime.band",
    "bandpo_lut._ops": "bandpo_lut.runtime._ops",
    "bandpo_lut._extension": "bandpo_lut.runtime._extension",
    "bandpo_lut.table_cache": "bandpo_lut.runtime.table_cache",
    "bandpo_lut.loss_spec": "bandpo_lut.runtime.loss_spec",
    "bandpo_lut.loss": "bandpo_lut.runtime.loss",
    "bandpo_lut.fused_linear": "bandpo_lut.runtime.fused_linear",
    "bandpo_lut.checks": "bandpo_lut.tables.checks",
    "bandpo_lut.divergences": "bandpo_lut.tables.divergences",
    "bandpo_lut.exact": "bandpo_lut.tables.exact",
    "bandpo_lut.table_format": "bandpo_lut.tables.table_format",
    "bandpo_lut.accuracy": "bandpo_lut.tables.accuracy",
    "bandpo_lut.generate": "bandpo_lut.tables.generate",
    "bandpo_lut.verify": "bandpo_lut.tables.verify",
    "bandpo_lut.info": "bandpo_lut.cli.info",
    "bandpo_lut.plot": "bandpo_lut.cli.plot",
    "bandpo_lut.demo": "bandpo_lut.cli.demo.command",
    "bandpo_lut.demo_tasks": "bandpo_lut.cli.demo.tasks",
    "bandpo_lut.demo_tasks_report": "bandpo_lut.cli.demo.report",
    "bandpo_lut.bench": "bandpo_lut.cli.bench.command",
    "bandpo_lut.bench_fused_linear": "bandpo_lut.cli.bench.fused_linear",
}


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for the names in MOVED (the regular finders come first and know none of them): the module
    is the one at the new path, the same object, so its state (the table cache, registered ops) is shared."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in bandpo_lut 0.3", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__   # importlib sets __spec__ to this alias spec: exec_module puts it back
        return module

    def exec_module(self, module):
        # the module at the new path is already executed; keep its own spec (pickling and reload read it)
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
