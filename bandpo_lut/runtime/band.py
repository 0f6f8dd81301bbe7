"""The band's public entry points, `bounds` and `clip`: validation here, the math in csrc/band_element.h
(host: csrc/band_host.h, kernels: csrc/cpu/band_cpu.cpp, csrc/cuda/band_cuda.cu), the tables' way to the ops in
`table_cache`. Tests: tests/runtime/test_band*.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bandpo_lut.runtime.table_cache import TableArgs, scalar_delta, table_args, table_for  # noqa: F401 (band.table_args: tests, tools)
from bandpo_lut.tables.checks import check_max_ratio, check_tensor, compiled_divergence, is_host_scalar, is_number


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


def result_dtype(tensors) -> torch.dtype:
    """The dtype torch's own element-wise ops (torch.clamp) give these floating tensors: the promotion of those
    with dimensions, a 0-dim tensor counting only when every tensor is 0-dim (among floating dtypes a 0-dim
    tensor never raises the category, so it never changes the result)."""
    ranked = [t for t in tensors if t.dim() > 0] or list(tensors)
    dtype = ranked[0].dtype
    for t in ranked[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


@dataclass(frozen=True)
class BandArgs:
    """Validated band arguments, ready for the ops (every tensor but δ in the common floating dtype)."""
    prob: torch.Tensor            # p_old, or log p_old when log_input
    log_input: bool
    delta: torch.Tensor | None    # per-token δ in its own dtype, or a 0-dim CPU δ read on the host, or None
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
        if t.device != prob.device and not (other_name == "delta" and is_host_scalar(t)):
            raise ValueError(f"{other_name}: is on {t.device} but {name} is on {prob.device}; "
                             "put all tensors on one device (a 0-dim CPU delta may go with any)")
    check_broadcast(named)
    dtype = result_dtype([t for _, t in named])
    meta, coefficients = table_for(div.name, prob)
    if isinstance(delta, torch.Tensor):
        # In its own dtype: the ops decide its range there and convert it (csrc/band_host.h resolve_delta).
        delta_t, delta_s = delta, 0.0
    else:
        delta_t, delta_s = scalar_delta(delta, meta)
    return BandArgs(prob.to(dtype), p_old is None, delta_t, delta_s, div.compiled_id, coefficients, meta.grid,
                    check_max_ratio(max_ratio), dtype)


def bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
    """Lower and upper ratio bounds of the BandPO band for old-policy probabilities.

    Args:
        p_old: old-policy probabilities in [0, 1] (any shape; float32/64, float16, bfloat16).
        delta: trust-region radius: a number within the table's range (default table: [1e-3, 1],
            tv: [1e-3, 1)), or a tensor broadcastable to p_old, in any floating dtype (per-token radius, or
            0-dim; entries outside the range give NaN, since checking them would synchronise with the host;
            an entry that rounds to a range end in its own dtype is that end).
        divergence: "kl" (KL(π_old‖π_new), the paper's default), "tv", "chi2" or "hellinger".
        log_p_old: old log-probabilities instead of p_old (exactly one of the two); keeps full accuracy for
            p near 1, which float32 p cannot represent closer than 6e-8. A value in (0, 2^-9] is rounding
            and reads as 0 (p = 1); above 2^-9, NaN.
        max_ratio: optional cap of the upper bound (the paper's runs used 10).
    Returns:
        (lower, upper), broadcast over p_old and delta, in the dtype torch.clamp gives them (a 0-dim δ does not
        widen p_old). p = 0 gives (0, inf) (or
        max_ratio), p = 1 the p → 1 limits; NaN in gives NaN out. Not differentiable (constants).
    """
    a = prepare_args(p_old, log_p_old, delta, divergence, max_ratio)
    from bandpo_lut.runtime import _ops  # loads the library on first use, not at import

    return _ops.bounds(a.prob, a.delta, a.delta_scalar, a.coefficients, list(a.grid), a.divergence_id,
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
    from bandpo_lut.runtime import _ops  # loads the library on first use, not at import

    return _ops.clip(ratio.to(a.dtype), a.prob, a.delta, a.delta_scalar, a.coefficients, list(a.grid),
                       a.divergence_id, a.log_input, a.max_ratio)


