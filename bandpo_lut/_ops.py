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
    return grad_ratio, None, None, None, None, None, None, None, None


torch.library.register_autograd("bandpo_lut::clip", _clip_backward, setup_context=_clip_setup_context)


def _bounds_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _bounds_backward(ctx, grad_lo, grad_up):
    return None, None, None, None, None, None, None, None


torch.library.register_autograd("bandpo_lut::bounds", _bounds_backward, setup_context=_bounds_setup_context)
