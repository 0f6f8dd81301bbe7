"""The public compiled API: `bounds` and `clip` (validation here, math in csrc/).

How a table reaches the compiled ops, in any context a user may call them from first (eager, under
torch.compile with or without fullgraph/dynamic, torch.export, a FakeTensorMode):
  * `_table_meta` loads the table file (I/O, numpy, locks: nothing Dynamo can trace) and builds the
    coefficient tensors. Dynamo calls it for real at trace time and treats its result as a constant,
    because it carries the marker of `torch.compiler.assume_constant_result` (set here directly:
    importing that decorator would import torch._dynamo with the package, ~2 s).
  * The tensors are built with every dispatch mode switched off, so that a cache filled during tracing
    holds real tensors, never FakeTensors, and later eager calls are unaffected.
  * They are marked static for Dynamo, so that dynamic=True never makes a table size symbolic (a batch
    dimension equal to a table size must not couple the two).
  * A scalar δ that Dynamo turns into a symbolic float (a δ schedule under torch.compile) reaches the
    op as a 0-dim float64 CPU tensor, read on the host by the kernel: one graph serves every value.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import divergences as _div
from . import tables as _tables

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _constant_result(fn):
    fn._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets
    return fn


class TableMeta(NamedTuple):
    """What the ops need to know of a table besides its coefficients (plain constants, so that Dynamo can
    take them as the result of `_table_meta`)."""
    divergence: str
    grid: tuple          # the ops' grid argument, in the order of bandpo_lut._C.grid_fields (csrc/table_grid.h)
    delta_min: float
    delta_max: float
    delta_max_inclusive: bool
    source: str


def check_delta(delta, meta: TableMeta) -> None:
    """Raise a clear error for a number δ outside the table's range (a symbolic δ only adds range guards)."""
    hi_ok = delta <= meta.delta_max if meta.delta_max_inclusive else delta < meta.delta_max
    if not (meta.delta_min <= delta and hi_ok):   # NaN is refused too
        close = "]" if meta.delta_max_inclusive else ")"
        raise ValueError(f"delta: {float(delta)!r} is outside the {meta.divergence!r} table's range "
                         f"[{meta.delta_min:g}, {meta.delta_max:g}{close} ({meta.source})")


_COEFFICIENTS: dict = {}   # (divergence or None, device string) -> real float32 coefficient tensor (or placeholder)


def _real_tensor_scope():
    # Every dispatch mode off (FakeTensorMode, the proxy modes of export/make_fx): tensors built here are real.
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


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
    from . import _extension
    ext = _extension.load()
    key = (divergence, device)
    if divergence is None:
        meta = TableMeta("none", (0.0,) * len(ext.grid_fields), 0.0, 0.0, False, "no table: a baseline clip")
    else:
        table = _tables.get(divergence)
        fields = {"t_min": table.t.min, "t_step": table.t.step, "s_min": table.s.min, "s_step": table.s.step,
                  "delta_min": table.delta_min, "delta_max": table.delta_max,
                  "delta_max_inclusive": 1.0 if table.delta_max_inclusive else 0.0}
        grid = tuple(fields[name] for name in ext.grid_fields)   # the order of csrc/table_grid.h
        meta = TableMeta(divergence, grid, table.delta_min, table.delta_max, table.delta_max_inclusive, table.source)
    if key not in _COEFFICIENTS:
        with _real_tensor_scope():
            read = divergence is not None and divergence not in ext.closed_form_divergences
            coefficients = (table.coefficients(device) if read  # float32, like the placeholder (whatever the default)
                            else torch.empty(2, 0, 0, dtype=torch.float32, device=device))
            _COEFFICIENTS[key] = _mark_static(coefficients)
    return meta


def table_for(divergence: str | None, prob: torch.Tensor) -> tuple[TableMeta, torch.Tensor]:
    """The table's constants and the coefficient tensor the kernels read on prob's device (see `_table_meta`),
    in the form the current context needs (a real tensor; its fake counterpart when prob is a FakeTensor
    outside Dynamo)."""
    device = str(prob.device)
    meta = _table_meta(divergence, device)
    coefficients = _COEFFICIENTS[(divergence, device)]
    if not torch.compiler.is_compiling():
        fake_mode = getattr(prob, "fake_mode", None)   # a FakeTensor: use the mode's (memoised) fake copy
        if fake_mode is not None:
            coefficients = fake_mode.from_tensor(coefficients, static_shapes=True)
    return meta, coefficients


def _ops():
    from . import _ops as ops_module  # loads the extension and registers fake kernels/autograd once
    return ops_module.ops


def check_tensor(name: str, x) -> None:
    """The one check of a floating tensor argument, shared by every entry point."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a floating tensor (float32, float64, float16 or bfloat16), got {x.dtype}")


def compiled_divergence(divergence) -> _div.Divergence:
    """The registry entry of a divergence that has a compiled kernel, or a clear error."""
    div = _div.get(divergence)
    if div.compiled_id is None:
        raise ValueError(f"divergence: {divergence!r} has no compiled kernel; compiled: "
                         f"{[n for n in _div.names() if _div.get(n).compiled_id is not None]} "
                         f"(bandpo_lut.reference.bounds supports all of {_div.names()})")
    return div


def is_number(x) -> bool:
    """A real Python or NumPy number, or a symbolic float under torch.compile; never a bool."""
    return isinstance(x, (numbers.Real, torch.SymFloat, torch.SymInt)) and not isinstance(x, bool)


def scalar_delta(delta, meta: TableMeta) -> tuple[torch.Tensor | None, float]:
    """A number δ as the ops take it, checked against the table's range. Eager: a float (the op's
    scalar argument). Under torch.compile: a 0-dim float64 CPU tensor, which the kernels read on the host,
    because a float argument of a custom op is specialised (one graph per value) while a tensor is an input
    (a δ schedule that Dynamo makes a symbolic float then runs one graph for every value). Both give the
    same bits."""
    if torch.compiler.is_compiling():
        check_delta(delta, meta)     # a symbolic δ gets range guards only, not a guard on its value
        return torch.scalar_tensor(delta, dtype=torch.float64), 0.0
    delta = float(delta)
    check_delta(delta, meta)
    return None, delta


def check_broadcast(named) -> None:
    """Shapes that cannot broadcast: an error naming the arguments, not torch's internal one."""
    shape, names = torch.Size(), []
    for name, t in named:
        try:
            shape = torch.broadcast_shapes(shape, t.shape)
        except RuntimeError:
            raise ValueError(f"{name}: shape {tuple(t.shape)} cannot be broadcast with "
                             f"{' and '.join(names)} (broadcast shape {tuple(shape)})") from None
        names.append(name)


@dataclass(frozen=True)
class BandArgs:
    """Validated band arguments, ready for the ops (every tensor in the common floating dtype)."""
    prob: torch.Tensor            # p_old, or log p_old when log_input
    log_input: bool
    delta: torch.Tensor | None    # per-token δ, or a 0-dim float64 CPU δ read on the host, or None
    delta_scalar: float           # the number δ when `delta` is None
    divergence_id: int
    coefficients: torch.Tensor
    grid: tuple
    max_ratio: float
    dtype: torch.dtype


def prepare_args(p_old, log_p_old, delta, divergence, max_ratio, others=()) -> BandArgs:
    """Validate the band arguments. `others` are (name, tensor) pairs that must share the device and take
    part in dtype promotion and broadcasting (e.g. the ratio)."""
    if (p_old is None) == (log_p_old is None):
        raise ValueError("p_old / log_p_old: give exactly one of them (got "
                         f"{'both' if p_old is not None else 'neither'})")
    name, prob = ("p_old", p_old) if p_old is not None else ("log_p_old", log_p_old)
    check_tensor(name, prob)
    div = compiled_divergence(divergence)
    named = list(others) + [(name, prob)]
    if isinstance(delta, torch.Tensor):
        named.append(("delta", delta))
    elif not is_number(delta):
        raise TypeError(f"delta: expected a number or a floating tensor, got {type(delta).__name__}")
    for other_name, t in named:
        check_tensor(other_name, t)
        if t.device != prob.device:
            raise ValueError(f"{other_name}: is on {t.device} but {name} is on {prob.device}; "
                             "put all tensors on one device")
    check_broadcast(named)
    dtype = prob.dtype
    for _, t in named:
        dtype = torch.promote_types(dtype, t.dtype)
    meta, coefficients = table_for(div.name, prob)
    if isinstance(delta, torch.Tensor):
        delta_t, delta_s = delta.to(dtype), 0.0
    else:
        delta_t, delta_s = scalar_delta(delta, meta)
    if max_ratio is None:
        max_ratio = math.inf
    elif not is_number(max_ratio) or not max_ratio >= 1:
        raise ValueError(f"max_ratio: expected None or a number >= 1, got {max_ratio!r}")
    return BandArgs(prob.to(dtype), p_old is None, delta_t, delta_s, div.compiled_id, coefficients, meta.grid,
                    float(max_ratio), dtype)


def bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
    """Lower and upper ratio bounds of the BandPO band for old-policy probabilities.

    Args:
        p_old: old-policy probabilities in [0, 1] (any shape; float32/64, float16, bfloat16).
        delta: trust-region radius: a number within the table's range (default table: [1e-3, 1],
            tv: [1e-3, 1)), or a tensor broadcastable to p_old (per-token radius; entries outside the
            range give NaN, since checking them would synchronise with the host; an entry that rounds to
            a range end in its own dtype is that end).
        divergence: "kl" (KL(π_old‖π_new), the paper's default), "tv", "chi2" or "hellinger".
        log_p_old: old log-probabilities instead of p_old (exactly one of the two); keeps full accuracy for
            p near 1, which float32 p cannot represent closer than 6e-8. A value in (0, 2^-9] is rounding
            and reads as 0 (p = 1); above 2^-9, NaN.
        max_ratio: optional cap of the upper bound (the paper's runs used 10).
    Returns:
        (lower, upper), broadcast over p_old and delta, in their common dtype. p = 0 gives (0, inf) (or
        max_ratio), p = 1 the p → 1 limits; NaN in gives NaN out. Not differentiable (constants).
    """
    a = prepare_args(p_old, log_p_old, delta, divergence, max_ratio)
    return _ops().bounds(a.prob, a.delta, a.delta_scalar, a.coefficients, list(a.grid), a.divergence_id,
                         a.log_input, a.max_ratio)


def clip(ratio, p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
    """`torch.clamp(ratio, *bounds(p_old, delta, divergence, ...))`, fused.

    Gradient (the rule of a scalar-bound `torch.clamp`, as PPO/GRPO trainers clip): 1 where
    lower <= ratio <= upper, ties included, and 0 elsewhere, including where ratio or a bound is NaN.
    None flows to p_old, log_p_old or delta. Arguments as in `bounds`; `ratio` is broadcast with them and
    all tensors are promoted to their common floating dtype. No host synchronisation: safe under
    torch.compile(fullgraph=True) and CUDA graphs.
    """
    check_tensor("ratio", ratio)
    a = prepare_args(p_old, log_p_old, delta, divergence, max_ratio, others=(("ratio", ratio),))
    return _ops().clip(ratio.to(a.dtype), a.prob, a.delta, a.delta_scalar, a.coefficients, list(a.grid),
                       a.divergence_id, a.log_input, a.max_ratio)


class TableArgs(NamedTuple):
    """A table as the ops take it (for tests and tools that call the ops directly)."""
    coefficients: torch.Tensor
    grid: list


def table_args(divergence: str, device="cpu") -> TableArgs:
    """The `table` and `grid` arguments of the ops for a shipped divergence on `device` (for a closed form, `table`
    is the empty placeholder the kernels take)."""
    meta, coefficients = table_for(divergence, torch.empty(0, device=device))
    return TableArgs(coefficients, list(meta.grid))
