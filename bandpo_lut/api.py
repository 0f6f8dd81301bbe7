"""The public compiled API: `bounds` and `clip` (validation here, math in csrc/)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import divergences as _div
from . import tables as _tables

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _TableArgs:
    """What the ops need from a table, prepared once per (divergence, device) and reused every call."""
    coefficients: torch.Tensor
    grid: list
    table: _tables.Table


_PREPARED: dict = {}


def _prepare(divergence: str, device: torch.device) -> _TableArgs:
    key = (divergence, device)
    prepared = _PREPARED.get(key)
    if prepared is None:
        table = _tables.get(divergence)
        grid = [table.t.min, table.t.step, table.s.min, table.s.step, table.delta_min, table.delta_max,
                1.0 if table.delta_max_inclusive else 0.0]
        prepared = _TableArgs(table.coefficients(device), grid, table)
        _PREPARED[key] = prepared
    return prepared


@torch.compiler.assume_constant_result
def _coefficients(divergence: str, device: torch.device) -> torch.Tensor:
    return _prepare(divergence, device).coefficients


def _ops():
    from . import _ops as ops_module  # loads the extension and registers fake kernels/autograd once
    return ops_module.ops


def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a floating tensor (float32, float64, float16 or bfloat16), got {x.dtype}")


def prepare_args(p_old, log_p_old, delta, divergence, max_ratio, others=()):
    """Validate the band arguments; returns (prob, log_input, delta_tensor, delta_scalar, div_id, table, grid,
    max_ratio, dtype) with every tensor promoted to the common floating dtype. `others` are (name, tensor)
    pairs that must share the device and take part in dtype promotion (e.g. the ratio)."""
    if (p_old is None) == (log_p_old is None):
        raise ValueError("p_old / log_p_old: give exactly one of them (got "
                         f"{'both' if p_old is not None else 'neither'})")
    name, prob = ("p_old", p_old) if p_old is not None else ("log_p_old", log_p_old)
    _check_tensor(name, prob)
    div = _div.get(divergence)
    if div.compiled_id is None:
        raise ValueError(f"divergence: {divergence!r} has no compiled kernel; compiled: "
                         f"{[n for n in _div.names() if _div.get(n).compiled_id is not None]} "
                         f"(bandpo_lut.reference.bounds supports all of {_div.names()})")
    named = [(name, prob)] + list(others)
    if isinstance(delta, torch.Tensor):
        _check_tensor("delta", delta)
        named.append(("delta", delta))
    elif isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise TypeError(f"delta: expected a Python number or a floating tensor, got {type(delta).__name__}")
    for other_name, t in named[1:]:
        _check_tensor(other_name, t)
        if t.device != prob.device:
            raise ValueError(f"{other_name}: is on {t.device} but {name} is on {prob.device}; "
                             "put all tensors on one device")
    dtype = prob.dtype
    for _, t in named[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    prepared = _prepare(div.name, prob.device)
    if isinstance(delta, torch.Tensor):
        delta_t, delta_s = delta.to(dtype), 0.05
    else:
        prepared.table.check_delta(float(delta))
        delta_t, delta_s = None, float(delta)
    if max_ratio is None:
        max_ratio = math.inf
    elif isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not max_ratio >= 1:
        raise ValueError(f"max_ratio: expected None or a number >= 1, got {max_ratio!r}")
    coefficients = _coefficients(div.name, prob.device)
    return (prob.to(dtype), p_old is None, delta_t, delta_s, div.compiled_id, coefficients, prepared.grid,
            float(max_ratio), dtype)


def bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
    """Lower and upper ratio bounds of the BandPO band for old-policy probabilities.

    Args:
        p_old: old-policy probabilities in [0, 1] (any shape; float32/64, float16, bfloat16).
        delta: trust-region radius: a Python number within the table's range (default table: [1e-3, 1],
            tv: [1e-3, 1)), or a tensor broadcastable to p_old (per-token radius; entries outside the
            range give NaN, since checking them would synchronise with the host).
        divergence: "kl" (KL(π_old‖π_new), the paper's default), "tv", "chi2" or "hellinger".
        log_p_old: old log-probabilities instead of p_old (exactly one of the two); keeps full accuracy for
            p near 1, which float32 p cannot represent closer than 6e-8.
        max_ratio: optional cap of the upper bound (the paper's runs used 10).
    Returns:
        (lower, upper), broadcast over p_old and delta, in their common dtype. p = 0 gives (0, inf) (or
        max_ratio), p = 1 the p → 1 limits; NaN in gives NaN out. Not differentiable (constants).
    """
    prob, log_input, d_t, d_s, div_id, coef, grid, cap, _ = prepare_args(p_old, log_p_old, delta, divergence,
                                                                          max_ratio)
    return _ops().bounds(prob, d_t, d_s, coef, grid, div_id, log_input, cap)


def clip(ratio, p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
    """`torch.clamp(ratio, *bounds(p_old, delta, divergence, ...))`, fused, with torch.clamp's gradient.

    The gradient to `ratio` is 1 where lower <= ratio <= upper (ties included, as torch.clamp up to
    torch 2.13; 2.14's clamp gives 0 or 1/2 at exact ties) and 0 elsewhere; none flows to p_old,
    log_p_old or delta. Arguments as in `bounds`; `ratio` is broadcast with them and all tensors are
    promoted to their common floating dtype. No host synchronisation: safe under
    torch.compile(fullgraph=True) and CUDA graphs.
    """
    _check_tensor("ratio", ratio)
    prob, log_input, d_t, d_s, div_id, coef, grid, cap, dtype = prepare_args(
        p_old, log_p_old, delta, divergence, max_ratio, others=(("ratio", ratio),))
    return _ops().clip(ratio.to(dtype), prob, d_t, d_s, coef, grid, div_id, log_input, cap)
