"""Registration of the compiled ops' fake kernels and autograd formulas (imported once, on first use).

The schemas live in csrc/ops.cpp. Fake kernels give shapes and dtypes without computing (so that
torch.compile and torch.export can trace the ops); autograd gives `clip` exactly torch.clamp's gradient
through the `clip_backward` op and treats the bounds as constants (no gradient to p_old or δ).
"""
from __future__ import annotations

import torch

from . import _extension
from .loss_spec import METRICS

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
# Sizes and tuple lengths come from the schemas (csrc/ops.cpp) and the metric list (loss_spec.METRICS), never
# from literals; tests/test_contract.py checks both against the C++ side.
_LOSS_FWD = ops.policy_loss_fwd.default
_LOSS_FWD_ARGS = [a.name for a in _LOSS_FWD._schema.arguments]
_LOSS_SAVED = ("log_prob", "old_log_prob", "advantages", "mask", "delta")   # tensors the backward recomputes from


@torch.library.register_fake("bandpo_lut::policy_loss_fwd")
def _loss_fwd_fake(log_prob, *args):
    return (log_prob.new_empty(()), log_prob.new_empty(len(METRICS)),
            log_prob.new_empty(log_prob.shape[0], dtype=torch.float64))


@torch.library.register_fake("bandpo_lut::policy_loss_bwd")
def _loss_bwd_fake(grad_loss, row_scale, log_prob, *args):
    return log_prob.new_empty(log_prob.shape)   # contiguous, as the kernels write it


def _loss_setup_context(ctx, inputs, output):
    named = dict(zip(_LOSS_FWD_ARGS, inputs))
    present = [k for k in _LOSS_SAVED if named[k] is not None]
    ctx.present = present
    ctx.save_for_backward(*(named[k] for k in present), output[2])
    # The settings the backward takes: delta_scalar .. mode (agg is folded into row_scale).
    ctx.params = inputs[_LOSS_FWD_ARGS.index("delta_scalar"):_LOSS_FWD_ARGS.index("agg")]
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)   # no zero tensors for the metrics' and row_scale's (absent) gradients


def _loss_backward(ctx, grad_loss, grad_metrics, grad_row_scale):
    *saved, row_scale = ctx.saved_tensors
    named = dict.fromkeys(_LOSS_SAVED)
    named.update(zip(ctx.present, saved))
    grad = None
    if ctx.needs_input_grad[0] and grad_loss is not None:
        grad = ops.policy_loss_bwd(grad_loss, row_scale, *(named[k] for k in _LOSS_SAVED), *ctx.params)
    return (grad,) + (None,) * (len(_LOSS_FWD_ARGS) - 1)


torch.library.register_autograd("bandpo_lut::policy_loss_fwd", _loss_backward, setup_context=_loss_setup_context)
