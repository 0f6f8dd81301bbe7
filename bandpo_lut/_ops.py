"""Registration of the compiled ops' fake kernels and autograd formulas (imported once, on first use).

The schemas live in csrc/ops.cpp. Fake kernels give shapes and dtypes without computing (so that
torch.compile and torch.export can trace the ops); autograd gives `clip` exactly torch.clamp's gradient
through the `clip_backward` op and treats the bounds as constants (no gradient to p_old or δ).
"""
from __future__ import annotations

import torch

from . import _extension

_extension.load()
ops = torch.ops.bandpo_lut


def _shape(*tensors):
    return torch.broadcast_shapes(*(t.shape for t in tensors if t is not None))


def n_inputs(op_name: str) -> int:
    """How many arguments an op's schema has: the length of its backward's gradient tuple."""
    return len(getattr(ops, op_name).default._schema.arguments)


def no_grads(op_name: str) -> tuple:
    return (None,) * n_inputs(op_name)


@torch.library.register_fake("bandpo_lut::bounds")
def _bounds_fake(prob, delta, delta_scalar, table, grid, divergence, log_input, max_ratio):
    shape = _shape(prob, delta)
    return prob.new_empty(shape), prob.new_empty(shape)


@torch.library.register_fake("bandpo_lut::clip")
def _clip_fake(ratio, prob, delta, delta_scalar, table, grid, divergence, log_input, max_ratio):
    return ratio.new_empty(_shape(ratio, prob, delta))


def _clip_setup_context(ctx, inputs, output):
    ratio = inputs[0]
    ctx.save_for_backward(ratio, output)


def _clip_backward(ctx, grad):
    ratio, clipped = ctx.saved_tensors
    grad_ratio = None
    if ctx.needs_input_grad[0]:
        grad_ratio = ops.clip_backward(grad, ratio, clipped)
        if grad_ratio.shape != ratio.shape:
            grad_ratio = grad_ratio.sum_to_size(ratio.shape)
    return (grad_ratio,) + no_grads("clip")[1:]


torch.library.register_autograd("bandpo_lut::clip", _clip_backward, setup_context=_clip_setup_context)


def _bounds_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _bounds_backward(ctx, grad_lo, grad_up):
    return no_grads("bounds")


torch.library.register_autograd("bandpo_lut::bounds", _bounds_backward, setup_context=_bounds_setup_context)


# ---- the fused policy loss ------------------------------------------------------------------------------

@torch.library.register_fake("bandpo_lut::policy_loss_fwd")
def _loss_fwd_fake(log_prob, old_log_prob, advantages, mask, delta, delta_scalar, table, grid, divergence,
                   clip_kind, eps_low, eps_high, max_ratio, dual_clip, mode):
    batch = log_prob.shape[0]
    f64 = dict(dtype=torch.float64, device=log_prob.device)
    return log_prob.new_empty(batch, **f64), log_prob.new_empty(batch, **f64), log_prob.new_empty(20, **f64)


@torch.library.register_fake("bandpo_lut::policy_loss_bwd")
def _loss_bwd_fake(grad_row, log_prob, *args):
    return torch.empty_like(log_prob)


def _loss_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs[:5] if t is not None))
    ctx.has_mask, ctx.has_delta = inputs[3] is not None, inputs[4] is not None
    ctx.params = inputs[5:]
    row_w, counts = output[1], output[2]
    ctx.mark_non_differentiable(row_w, counts)


def _loss_backward(ctx, grad_row, grad_w, grad_counts):
    saved = list(ctx.saved_tensors)
    lp, olp, adv = saved[:3]
    rest = saved[3:]
    mask = rest.pop(0) if ctx.has_mask else None
    delta = rest.pop(0) if ctx.has_delta else None
    grad = None
    if ctx.needs_input_grad[0]:
        grad = ops.policy_loss_bwd(grad_row, lp, olp, adv, mask, delta, *ctx.params)
    return (grad,) + (None,) * 14


torch.library.register_autograd("bandpo_lut::policy_loss_fwd", _loss_backward, setup_context=_loss_setup_context)
