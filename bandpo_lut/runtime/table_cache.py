"""The table cache: what every caller of the compiled ops passes besides its own arguments (the table's
coefficients and grid, a number δ in the form the ops take it).

How a table reaches the compiled ops, in any context a user may call them from first (eager, under
torch.compile with or without fullgraph/dynamic, torch.export, a FakeTensorMode):
  * `_table_meta` loads the table file (I/O, numpy, locks: nothing Dynamo can trace) and builds the
    coefficient tensors. Dynamo calls it for real at trace time and treats its result as a constant,
    because it carries the marker of `torch.compiler.assume_constant_result` (set here directly:
    importing that decorator would import torch._dynamo with the package, ~2 s).
  * The tensors are built with every dispatch mode switched off, so that a cache filled during tracing
    holds real tensors, never FakeTensors, and later eager calls are unaffected.
  * `table_for` reads them as attributes of `_SLOTS`, not from the dict, so that one compiled frame may read
    tables first loaded during its own trace (see `_Slots`).
  * They are marked static for Dynamo, so that dynamic=True never makes a table size symbolic (a batch
    dimension equal to a table size must not couple the two).
  * A scalar δ that Dynamo turns into a symbolic float (a δ schedule under torch.compile) reaches the
    op as a 0-dim float64 CPU tensor, read on the host by the kernel, made as `zeros(()) + δ`: an
    arithmetic op, which Dynamo's float tensorification keeps symbolic (torch.scalar_tensor(δ) would make
    inductor and aot_eager guard on the value: one graph per δ). One graph serves every value.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from bandpo_lut.tables import checks
from bandpo_lut.tables import store as _tables


def _constant_result(fn):
    fn._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets
    return fn


class TableMeta(NamedTuple):
    """What the ops need to know of a table besides its coefficients (plain constants, so that Dynamo can
    take them as the result of `_table_meta`)."""
    divergence: str
    grid: tuple          # the ops' grid argument, in the order of the facts' grid_fields (csrc/table_grid.h)
    delta_min: float
    delta_max: float
    delta_max_inclusive: bool
    source: str


def check_delta(delta, meta: TableMeta) -> None:
    """Raise a clear error for a number δ outside the table's range (a symbolic δ only adds range guards)."""
    checks.check_delta(delta, meta.divergence, meta.delta_min, meta.delta_max, meta.delta_max_inclusive, meta.source)


_COEFFICIENTS: dict = {}   # (divergence or None, device string) -> real float32 coefficient tensor (or placeholder)


class _Slots:
    """The same tensors as `_COEFFICIENTS`, one attribute per key (`_slot_name`): what `table_for` reads.
    Dynamo takes a snapshot of a dict's keys at the dict's first read in a frame, so a key that `_table_meta`
    adds later in the same frame (a second divergence, or a baseline clip next to the band, in one compiled
    function) would be missing from it (KeyError); an attribute is looked up on the object when it is read."""


_SLOTS = _Slots()


def _slot_name(divergence: str | None, device: str) -> str:
    return f"{divergence}@{device}"


def _real_tensor_scope():
    # Ordinary tensors whatever the first call's context: no dispatch mode (FakeTensorMode, export/make_fx's
    # proxies), no inference mode, no jit tracer (see tables.ordinary_tensor_scope).
    return _tables.ordinary_tensor_scope()


def _mark_static(t: torch.Tensor) -> torch.Tensor:
    # torch._dynamo.mark_static(t), without importing torch._dynamo: the attributes Dynamo reads.
    t._dynamo_static_indices = set(range(t.dim()))
    t._has_dynamo_dim_marking = True
    return t


@_constant_result
def _table_meta(divergence: str | None, device: str) -> TableMeta:
    """Load `divergence`'s table and put what the kernels read of it on `device` (once per process and device):
    the coefficients of a table-read divergence; an empty (2, 0, 0) placeholder for a closed form, which takes
    only the δ range from the header. divergence=None: no table at all (the loss's baseline clips)."""
    from bandpo_lut.runtime import _extension
    facts = _extension.facts()
    key = (divergence, device)
    if divergence is None:
        meta = TableMeta("none", (0.0,) * len(facts["grid_fields"]), 0.0, 0.0, False, "no table: a baseline clip")
    else:
        table = _tables.get(divergence)
        fields = {"t_min": table.t.min, "t_step": table.t.step, "s_min": table.s.min, "s_step": table.s.step,
                  "delta_min": table.delta_min, "delta_max": table.delta_max,
                  "delta_max_inclusive": 1.0 if table.delta_max_inclusive else 0.0}
        grid = tuple(fields[name] for name in facts["grid_fields"])   # the order of csrc/table_grid.h
        meta = TableMeta(divergence, grid, table.delta_min, table.delta_max, table.delta_max_inclusive, table.source)
    if key not in _COEFFICIENTS:
        with _real_tensor_scope():
            read = divergence is not None and divergence not in facts["closed_form_divergences"]
            coefficients = (table.coefficients(device) if read  # float32, like the placeholder (whatever the default)
                            else torch.empty(2, 0, 0, dtype=torch.float32, device=device))
            _COEFFICIENTS[key] = _mark_static(coefficients)
            setattr(_SLOTS, _slot_name(divergence, device), coefficients)
    return meta


def table_for(divergence: str | None, prob: torch.Tensor) -> tuple[TableMeta, torch.Tensor]:
    """The table's constants and the coefficient tensor the kernels read on prob's device (see `_table_meta`),
    in the form the current context needs (a real tensor; its fake counterpart when prob is a FakeTensor
    outside Dynamo)."""
    device = str(prob.device)
    meta = _table_meta(divergence, device)
    coefficients = getattr(_SLOTS, _slot_name(divergence, device))
    if not torch.compiler.is_compiling():
        fake_mode = getattr(prob, "fake_mode", None)   # a FakeTensor: use the mode's (memoised) fake copy
        if fake_mode is not None:
            coefficients = fake_mode.from_tensor(coefficients, static_shapes=True)
    return meta, coefficients


def scalar_delta(delta, meta: TableMeta) -> tuple[torch.Tensor | None, float]:
    """A number δ as the ops take it, checked against the table's range. Eager: a float (the op's
    scalar argument). Under torch.compile: a 0-dim float64 CPU tensor, which the kernels read on the host,
    because a float argument of a custom op is specialised (one graph per value) while a tensor is an input
    (a δ schedule that Dynamo makes a symbolic float then runs one graph for every value). Both give the
    same bits."""
    if torch.compiler.is_compiling():
        check_delta(delta, meta)     # a symbolic δ gets range guards only, not a guard on its value
        # Not torch.scalar_tensor(delta): that specialises δ under inductor/aot_eager (see the module docstring).
        return torch.zeros((), dtype=torch.float64) + delta, 0.0
    delta = float(delta)
    check_delta(delta, meta)
    return None, delta


class TableArgs(NamedTuple):
    """A table as the ops take it (for tests and tools that call the ops directly)."""
    coefficients: torch.Tensor
    grid: list


def table_args(divergence: str, device="cpu") -> TableArgs:
    """The `table` and `grid` arguments of the ops for a shipped divergence on `device` (for a closed form, `table`
    is the empty placeholder the kernels take)."""
    meta, coefficients = table_for(divergence, torch.empty(0, device=device))
    return TableArgs(coefficients, list(meta.grid))
