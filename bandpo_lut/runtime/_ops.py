"""Registration of the compiled ops' fake kernels and autograd formulas, and the entry points `bounds`,
`clip` and `policy_loss_fwd` that the public API calls (imported with the package when the extension is
built, so that a saved program using the ops loads after `import bandpo_lut`).

The schemas live in csrc/ops.cpp. Fake kernels give shapes and dtypes without computing (so that
torch.compile and torch.export can trace the ops); autograd gives `clip` exactly torch.clamp's gradient
through the `clip_backward` op and treats the bounds as constants (no gradient to p_old or δ).

Two routes to the same kernels (see `_registered_op_suffices`): under forward-mode AD or a torch.func
transform, eager calls go through torch.autograd.Function classes with setup_context, a backward, a
forward-mode rule (jvp) and a vmap rule, so that forward mode and the transforms (grad, jacrev, jacfwd,
hessian, vmap of them) see correct derivatives; other calls, and those traced by torch.compile,
torch.export or torch.jit.trace, use the ops with their registered backward (Dynamo cannot trace an
autograd.Function that has a jvp, and the jit tracer would record one as an unserialisable Python op). The policy
loss has a third, cheaper route for plain eager calls with a gradient to take (`_EagerLoss`); `policy_loss_fwd`
is the one place its route is chosen.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

from bandpo_lut.runtime import _extension
from bandpo_lut.runtime.loss_spec import METRICS

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
# from literals; tests/runtime/test_contract.py checks both against the C++ side.
_LOSS_FWD = ops.policy_loss_fwd.default
_LOSS_FWD_ARGS = [a.name for a in _LOSS_FWD._schema.arguments]
_LOSS_SAVED = ("log_prob", "old_log_prob", "advantages", "mask", "delta")   # tensors the backward recomputes from
_LOSS_SAVED_AT = tuple(_LOSS_FWD_ARGS.index(k) for k in _LOSS_SAVED)            # their places among the inputs
# The scalar arguments the backward takes: delta_scalar .. mode (agg is folded into row_scale).
_LOSS_PARAMS = slice(_LOSS_FWD_ARGS.index("delta_scalar"), _LOSS_FWD_ARGS.index("agg"))


@torch.library.register_fake("bandpo_lut::policy_loss_fwd")
def _loss_fwd_fake(log_prob, *args):
    return (log_prob.new_empty(()), log_prob.new_empty(len(METRICS)),
            log_prob.new_empty(log_prob.shape[0], dtype=torch.float64))


@torch.library.register_fake("bandpo_lut::policy_loss_fwd_grad")
def _loss_fwd_grad_fake(log_prob, *args):
    factor_dtype = torch.float32 if log_prob.dtype in (torch.float16, torch.bfloat16) else log_prob.dtype
    return (*_loss_fwd_fake(log_prob), log_prob.new_empty(log_prob.shape, dtype=factor_dtype))


@torch.library.register_fake("bandpo_lut::policy_loss_bwd_factor")
def _loss_bwd_factor_fake(grad_loss, row_scale, grad_factor, mask):
    return grad_factor.new_empty(grad_factor.shape)   # contiguous, as the kernel writes it


@torch.library.register_fake("bandpo_lut::policy_loss_bwd")
def _loss_bwd_fake(grad_loss, row_scale, log_prob, *args):
    return log_prob.new_empty(log_prob.shape)   # contiguous, as the kernels write it


def _loss_setup_context(ctx, inputs, output, factor=None):
    ctx.present = [k for k, i in zip(_LOSS_SAVED, _LOSS_SAVED_AT) if inputs[i] is not None]
    ctx.has_factor = factor is not None   # _EagerLoss on the CPU: the gradient factor, saved before row_scale
    ctx.save_for_backward(*(inputs[i] for i in _LOSS_SAVED_AT if inputs[i] is not None),
                          *((factor,) if ctx.has_factor else ()), output[2])
    ctx.params = inputs[_LOSS_PARAMS]
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)   # no zero tensors for the metrics' and row_scale's (absent) gradients


def _loss_backward(ctx, grad_loss, grad_metrics, grad_row_scale):
    *saved, row_scale = ctx.saved_tensors
    if ctx.has_factor:
        saved = saved[:-1]
    named = dict.fromkeys(_LOSS_SAVED)
    named.update(zip(ctx.present, saved))
    grad = None
    if ctx.needs_input_grad[0] and grad_loss is not None:
        args = (grad_loss, row_scale, *(named[k] for k in _LOSS_SAVED), *ctx.params)
        # create_graph=True (grad mode on in the backward): a second derivative must raise, not be a silent zero.
        second_order = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        grad = _LossBackward.apply(*_wrap(args)) if second_order else ops.policy_loss_bwd(*args)
    return (grad,) + (None,) * (len(_LOSS_FWD_ARGS) - 1)


torch.library.register_autograd("bandpo_lut::policy_loss_fwd", _loss_backward, setup_context=_loss_setup_context)


# ---- the entry points: an autograd.Function in eager code, the registered op when traced ------------------


def _registered_op_suffices() -> bool:
    """True where the ops with their registered backward are right and cheapest: traced (compile, export,
    jit.trace), or eager with no forward-mode level open and no torch.func transform active. The
    autograd.Function route costs more per call (torch binds its arguments with inspect.signature), so it is
    taken only where its jvp and functorch support are needed."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return not (torch._C._are_functorch_transforms_active() or _forward_ad._current_level >= 0)


def _no_second_order(what: str):
    raise NotImplementedError(
        f"bandpo_lut: {what} has no second derivative (its backward is a compiled kernel). First-order "
        "derivatives work: .backward(), torch.autograd.grad, torch.func.grad/vjp/jacrev/jvp/jacfwd and vmap "
        "of them; second order (double backward, torch.func.hessian) works for bandpo_lut.clip.")


class _Clip(torch.autograd.Function):
    """ops.clip: tangent and gradient pass where lower <= ratio <= upper (torch.clamp's rule), 0 elsewhere."""
    generate_vmap_rule = True

    @staticmethod
    def forward(ratio, *args):
        return ops.clip(ratio, *_unwrap(args))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ratio_shape = inputs[0].shape
        ctx.save_for_backward(inputs[0], output)
        ctx.save_for_forward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad):
        ratio, clipped = ctx.saved_tensors
        grad_ratio = None
        if ctx.needs_input_grad[0]:
            grad_ratio = ops.clip_backward(grad, ratio, clipped)
            if grad_ratio.shape != ctx.ratio_shape:
                grad_ratio = grad_ratio.sum_to_size(ctx.ratio_shape)
        return (grad_ratio,) + no_grads("clip")[1:]

    @staticmethod
    def jvp(ctx, ratio_t, *other_tangents):   # the bounds are constants: only the ratio's tangent counts
        ratio, clipped = ctx.saved_tensors
        if ratio_t is None:
            return torch.zeros_like(clipped)
        return ops.clip_backward(ratio_t.expand(clipped.shape), ratio, clipped)


class _Bounds(torch.autograd.Function):
    """ops.bounds: constants (zero derivative in both modes)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return ops.bounds(*_unwrap(args))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)

    @staticmethod
    def backward(ctx, grad_lo, grad_up):
        return no_grads("bounds")

    @staticmethod
    def jvp(ctx, *tangents):
        return None, None


class _LossBackward(torch.autograd.Function):
    """ops.policy_loss_bwd, refusing second derivatives with a clear message instead of torch's silent zero."""
    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return ops.policy_loss_bwd(*_unwrap(args))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        _no_second_order("policy_loss")

    @staticmethod
    def jvp(ctx, *tangents):
        _no_second_order("policy_loss")


class _PolicyLoss(torch.autograd.Function):
    """ops.policy_loss_fwd: derivatives to log_prob only (the other inputs are constants, as in the reference)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return ops.policy_loss_fwd(*_unwrap(args))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _loss_setup_context(ctx, inputs, output)
        ctx.save_for_forward(*(dict(zip(_LOSS_FWD_ARGS, inputs))[k] for k in ctx.present), output[2])

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics, grad_row_scale):
        *saved, row_scale = ctx.saved_tensors
        named = dict.fromkeys(_LOSS_SAVED)
        named.update(zip(ctx.present, saved))
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            grad = _LossBackward.apply(grad_loss, row_scale, *(named[k] for k in _LOSS_SAVED), *ctx.params)
        return (grad,) + (None,) * (len(_LOSS_FWD_ARGS) - 1)

    @staticmethod
    def jvp(ctx, log_prob_t, *other_tangents):
        # The loss is a scalar: its tangent is <d loss / d log_prob, tangent>, the gradient from the backward kernel.
        *saved, row_scale = ctx.saved_tensors
        named = dict.fromkeys(_LOSS_SAVED)
        named.update(zip(ctx.present, saved))
        lp = named["log_prob"]
        if log_prob_t is None:
            return lp.new_zeros(()), None, None
        one = lp.new_ones(())
        grad = _LossBackward.apply(one, row_scale, *(named[k] for k in _LOSS_SAVED), *ctx.params)
        return (grad * log_prob_t).sum(), None, None


class _Opaque:
    """A non-tensor argument (the grid list) handed to an autograd.Function whole: torch.func flattens list
    arguments into leaves and, nested (torch.func.hessian), rebuilds them with the wrong arity."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _unwrap(args):
    return tuple(a.value if isinstance(a, _Opaque) else a for a in args)


def _wrap(args):
    return tuple(_Opaque(a) if isinstance(a, list) else a for a in args)


def bounds(*args):
    return ops.bounds(*args) if _registered_op_suffices() else _Bounds.apply(*_wrap(args))


def clip(*args):
    return ops.clip(*args) if _registered_op_suffices() else _Clip.apply(*_wrap(args))


def policy_loss_fwd(*args):
    """The policy loss's forward, and the one place its autograd route is chosen (same kernels, same bits):
    - traced (torch.compile, torch.export, jit.trace), or eager with no gradient to take: the op itself, with its
      registered backward;
    - eager under forward-mode AD or a torch.func transform: `_PolicyLoss` (jvp and vmap rules);
    - plain eager with a gradient to take: `_EagerLoss`, the cheapest per call."""
    if not _registered_op_suffices():
        return _PolicyLoss.apply(*_wrap(args))
    traced = torch.compiler.is_compiling() or torch.jit.is_tracing()
    if not traced and torch.is_grad_enabled() and args[0].requires_grad:
        return _EagerLoss.apply(*args)
    return ops.policy_loss_fwd(*args)


class _EagerLoss(torch.autograd.Function):
    """The op with its registered autograd (the same setup_context and backward), for plain eager code with a
    gradient to take (see `policy_loss_fwd`): without the ~0.1-0.2 ms per call that torch.library's Python
    wrapper spends re-binding the schema. For float32 on the CPU the forward is `policy_loss_fwd_grad`, which also
    keeps each token's gradient factor (one float32 per token, held until the backward): the backward is then
    grad_loss · row_scale times it (`policy_loss_bwd_factor`: the same arithmetic and bits as `policy_loss_bwd`'s
    float32 rows, an ignored token's +0 included), without forming the band a second time."""

    @staticmethod
    def forward(ctx, *args):
        # Below the Autograd key: this Function is the autograd, and the op's own Autograd kernel is
        # torch.library's Python wrapper (~45 us a call re-binding the schema before it redispatches).
        with torch._C._AutoDispatchBelowAutograd():
            if args[0].device.type == "cpu" and args[0].dtype == torch.float32:
                *output, factor = ops.policy_loss_fwd_grad(*args)
                output = tuple(output)
            else:
                output, factor = ops.policy_loss_fwd(*args), None
        _loss_setup_context(ctx, args, output, factor)
        return output

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics, grad_row_scale):
        if ctx.has_factor and grad_loss is not None and not torch.is_grad_enabled():
            *saved, factor, row_scale = ctx.saved_tensors
            mask = saved[ctx.present.index("mask")] if "mask" in ctx.present else None
            grad = ops.policy_loss_bwd_factor(grad_loss, row_scale, factor, mask)
            return (grad,) + (None,) * (len(_LOSS_FWD_ARGS) - 1)
        return _loss_backward(ctx, grad_loss, grad_metrics, grad_row_scale)


# ---- per-token copies for the chunked loss (bandpo_lut.runtime.fused_linear) ------------------------------------
# Why an opaque op: Inductor's CPU code generator (torch 2.13 and earlier, codegen/cpp.py `loop_split`)
# splits a pointwise loop x over range N at a floor division x // c (c > 8) into N // c blocks of c and
# drops the remainder when c does not divide N. A per-row value repeated per token (row_scale, a per-sequence
# delta or advantage) is read at token // T, and a chunk of tokens is such a loop, so e.g. the first 48 tokens
# of T = 40 got rows 40..47 never written (uninitialised memory: NaN or wrong gradients, no error). Inductor
# cannot look inside a custom op: the copy below is a whole (batch * T,) buffer with no floor division in any
# generated loop, and the chunks are plain slices (views) of it.
@torch.library.custom_op("bandpo_lut::per_token", mutates_args=())
def per_token(x: torch.Tensor, batch: int, steps: int) -> torch.Tensor:
    """x, broadcastable to (batch, steps), as a new dense (batch * steps,) tensor: token t is
    x[t // steps, t % steps]."""
    out = x.new_empty((batch, steps))
    out.copy_(x.expand(batch, steps))
    return out.reshape(batch * steps)


@per_token.register_fake
def _per_token_fake(x, batch, steps):
    return x.new_empty((batch * steps,))
