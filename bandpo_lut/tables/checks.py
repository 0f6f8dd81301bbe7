"""The argument checks every entry point shares, each written once: a floating tensor, a number, δ
against a table's range (with the one way of writing that range), the max_ratio cap, a divergence
with a compiled kernel.

The bottom of the package: it imports only the divergence registry (and torch), so that `api`,
`loss_spec`, `loss`, `tables`, the reference and the trainer integrations can all use it without an
import cycle.
"""
from __future__ import annotations

import math
import numbers

import torch

from bandpo_lut.tables import divergences as _div

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def is_number(x) -> bool:
    """A real Python or NumPy number, or a symbolic float under torch.compile; never a bool."""
    return isinstance(x, (numbers.Real, torch.SymFloat, torch.SymInt)) and not isinstance(x, bool)


def is_host_scalar(delta) -> bool:
    """A 0-dim δ tensor on the CPU: one δ for every element, read on the host by the kernels (csrc/band_host.h
    is_host_scalar_delta), so it may sit next to tensors on any device, as a 0-dim CPU tensor may in torch's own
    ops. Reading it is not a device synchronisation, and under torch.compile it is a graph input (a new value is
    not a recompile). Under a CUDA graph capture its value at capture is what replays use: a δ that changes
    between replays must be a tensor on the GPU."""
    return isinstance(delta, torch.Tensor) and delta.dim() == 0 and delta.device.type == "cpu"


def check_tensor(name: str, x) -> None:
    """The one check of a floating tensor argument, shared by every entry point."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}")
    if x.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a floating tensor (float32, float64, float16 or bfloat16), got {x.dtype}")


# ---- δ against a table's range -------------------------------------------------------------------------

def delta_interval(lo: float, hi: float, hi_inclusive: bool) -> str:
    """A table's δ range as the messages write it: "[0.001, 1]" or "[0.001, 1)"."""
    return f"[{lo:g}, {hi:g}{']' if hi_inclusive else ')'}"


def in_delta_range(delta, lo: float, hi: float, hi_inclusive: bool):
    """Whether δ lies in [lo, hi] (or [lo, hi)): a bool for a number (False for NaN), element-wise for a
    tensor; a symbolic δ under torch.compile only adds range guards."""
    above = lo <= delta
    below = delta <= hi if hi_inclusive else delta < hi
    return above & below if isinstance(above, torch.Tensor) else (above and below)


def check_delta(delta, divergence: str, lo: float, hi: float, hi_inclusive: bool, source: str) -> None:
    """Raise a clear error for a number δ outside the `divergence` table's range (NaN is refused too)."""
    if not in_delta_range(delta, lo, hi, hi_inclusive):
        raise ValueError(f"delta: {float(delta)!r} is outside the {divergence!r} table's range "
                         f"{delta_interval(lo, hi, hi_inclusive)} ({source})")


# ---- the max_ratio cap -----------------------------------------------------------------------------------

def max_ratio_ok(max_ratio) -> bool:
    """None (no cap) or a number >= 1 (NaN is not)."""
    return max_ratio is None or (is_number(max_ratio) and max_ratio >= 1)


def check_max_ratio(max_ratio, name: str = "max_ratio") -> float:
    """The cap as the ops take it (inf for None), or a ValueError naming `name`."""
    if not max_ratio_ok(max_ratio):
        raise ValueError(f"{name} must be None or a number >= 1, got {max_ratio!r}")
    return math.inf if max_ratio is None else float(max_ratio)


# ---- divergences -----------------------------------------------------------------------------------------

def compiled_divergence(divergence) -> _div.Divergence:
    """The registry entry of a divergence that has a compiled kernel, or a clear error."""
    div = _div.get(divergence)
    if div.compiled_id is None:
        raise ValueError(f"divergence: {divergence!r} has no compiled kernel; compiled: "
                         f"{_div.compiled_names()} (bandpo_lut.reference.bounds supports all of {_div.names()})")
    return div
