"""The policy loss from the last hidden states and the LM head, without the [tokens x vocab] logits.

    loss, metrics = fused_linear_policy_loss(hidden, weight, token_ids, old_log_prob, advantages, mask)

is, to floating-point rounding, the unfused

    log_prob = log_softmax((hidden @ weight.T + bias) / temperature).gather(-1, token_ids)
    loss, metrics = bandpo_lut.policy_loss(log_prob, old_log_prob, advantages, mask, ...)
    loss = loss + beta * aggregate(k3)          # with ref_log_prob: k3 = exp(ref - lp) - (ref - lp) - 1

but the logits exist one chunk of `chunk_size` tokens at a time. How:

1. The aggregation's normalisers depend on the mask only. They come from the compiled loss op itself, run
   once on zeros with the real mask (`row_scale`, d loss / d(row b's sum of w*loss), float64), so they are
   the unfused backward's numbers, not a second implementation of the aggregations.
2. Per chunk: logits (bf16/fp16 inputs: a bf16/fp16 GEMM, float32 accumulation), then float32 log-softmax,
   the token's log-prob, its entropy, and d loss / d log_prob from the compiled backward op `policy_loss_bwd` on
   that chunk (each token a row of its own, with its row's `row_scale`): the same kernel and the same numbers as
   the unfused backward. d log_prob / d logits = onehot - softmax gives the chunk's logit gradient (in the
   weight's dtype), which goes at once into the gradients of `hidden` (a GEMM into its rows) and `weight` (a
   GEMM adding into the one gradient buffer in place, `addmm_`) and `bias`. The chunk's buffers are then freed.
3. After the chunks, the loss and the metrics come from the compiled forward op on the (tokens,) log-probs:
   exactly `policy_loss`'s loss and metrics on those log-probs.

So the gradients are final when the forward returns (no second pass over the logits); the backward only
scales them by the incoming gradient. Memory beyond the inputs and the gradients themselves: one
chunk x vocab float32 buffer (two with return_entropy; bf16/fp16 add the chunk's logit gradient in their dtype)
and O(tokens) vectors.

The chunk loop of step 2 is one custom op (`bandpo_lut::fused_linear_chunks`), so that torch.compile(dynamic=True)
runs one graph for every token count. Supported: backward and torch.autograd.grad (first order; a second
derivative raises NotImplementedError, as policy_loss's), torch.compile (fullgraph, dynamic). Refused with
NotImplementedError: torch.func transforms and forward-mode AD.

Out-of-range token ids (< 0 or >= vocab) are not checked on the host (that would synchronise a GPU every
step): the token's log-prob is NaN, so a counted token gives a NaN loss (NaN in, NaN out) and the gradient of
`policy_loss` at a NaN log-prob, zero; a masked one (w == 0, e.g. a -100 label on padding) is ignored like any
other masked token's inputs.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.autograd.forward_ad as _forward_ad

from bandpo_lut.runtime import loss as _loss
from bandpo_lut.runtime import loss_spec as _spec
from bandpo_lut.runtime import settings as _settings
from bandpo_lut.tables import checks as _checks

# Default chunk, in logits per chunk (at least 1 token, at most all). CPU: 2**25 (a 128 MB float32 buffer).
# CUDA: 2**26, in whole multiples of 64 tokens where that leaves at least 64: larger chunks make each chunk's
# weight-gradient GEMM (K = chunk tokens) compute-bound rather than bound by reading and writing the V x H
# gradient, and fewer chunks mean fewer launches and fewer roundings of a bf16 gradient; 2**26 keeps the chunk's
# buffers (float32 logits, plus their bf16 gradient for bf16 weights: 6 bytes a logit, 384 MB) well under an
# eighth of the unfused path's logits, log-softmax and their gradients at 4096 tokens.
CHUNK_ELEMENTS = 2 ** 25
CUDA_CHUNK_ELEMENTS = 2 ** 26

_NAME = "fused_linear_policy_loss"
_D = _settings.DEFAULTS   # the options' defaults, told apart from the same values given (settings= plus keywords)
TOKEN_ID_DTYPES = (torch.int64, torch.int32)


def default_chunk_size(n_tokens: int, vocab: int, device="cpu") -> int:
    """The tokens per chunk when chunk_size is None (see CHUNK_ELEMENTS), on `device`."""
    if torch.device(device).type != "cuda":
        return max(1, min(n_tokens, CHUNK_ELEMENTS // max(vocab, 1)))
    chunk = CUDA_CHUNK_ELEMENTS // max(vocab, 1)
    return max(1, min(n_tokens, chunk if chunk < 64 else chunk - chunk % 64))


def fused_linear_policy_loss(hidden, weight, token_ids, old_log_prob, advantages, mask=None, *, bias=None,
                             temperature=1.0, chunk_size=None, ref_log_prob=None, beta=0.0, return_entropy=False,
                             delta=_D["delta"], divergence=_D["divergence"], max_ratio=_D["max_ratio"],
                             dual_clip=_D["dual_clip"], agg=_D["agg"], clip=_D["clip"], mode=_D["mode"],
                             eps_low=_D["eps_low"], eps_high=_D["eps_high"], settings=None,
                             return_log_prob=False):
    """`bandpo_lut.policy_loss` of the log-probs of `token_ids` under `(hidden @ weight.T + bias) / temperature`,
    computed chunk by chunk without the full logits (see the module docstring).

    Args:
        hidden: (batch, T, H) floating: the hidden states whose next tokens are `token_ids`.
        weight: (V, H), the LM head, hidden's dtype and device. bias: optional (V,).
        token_ids: (batch, T) integer tensor. Out-of-range ids give NaN log-probs (no host check).
        old_log_prob, advantages, mask: as `policy_loss` ((batch, T), on hidden's device).
        temperature: a number > 0 dividing the logits (a schedule under torch.compile runs one graph).
            chunk_size: tokens per chunk (default: about 2**25 logits per chunk on the CPU, 2**26 on CUDA; see
            default_chunk_size). ref_log_prob, beta: with beta > 0, adds beta times the aggregated k3 estimate
            of KL(pi || pi_ref) (as TRL and Liger compute it) to the loss. return_entropy: also return the
            per-token entropy of the softmax, (batch, T) float32, without gradient. return_log_prob: also return
            the per-token log-probs of token_ids, (batch, T) in the loss's compute dtype, without gradient (what a
            trainer logs or counts clips from, e.g. the ratio against old_log_prob; computing them again would need
            the logits).
        delta, divergence, max_ratio, dual_clip, agg, clip, mode, eps_low, eps_high, settings: as `policy_loss`
            (settings: a `bandpo_lut.LossSettings` instead of the nine keyword options).
    Returns:
        (loss, metrics), then entropy if return_entropy, then log_prob if return_log_prob. metrics: policy_loss's
        metrics of the same log-probs, plus "kl" (the masked mean of k3) when ref_log_prob is given.
        Gradients reach hidden, weight and bias; computation in float32 at least (bf16/fp16 inputs: matmuls
        in their dtype with float32 accumulation, softmax in float32), gradients in the inputs' dtypes (bf16/fp16:
        the weight's gradient rounded to its dtype once per chunk, as it is summed).
    Under torch.autocast (enabled for hidden's device type), hidden, weight and bias are cast to the autocast
    dtype first, as F.linear's inputs are (float64 excepted, as autocast excepts it): a bf16 hidden state next to
    a float32 head then runs the bf16 matmuls that `hidden @ weight.T` runs under autocast, and the head's
    gradient comes back in float32 through the cast. Outside autocast the dtypes must match.
    """
    _refuse_transforms(hidden, weight, bias)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    batch, steps = _check_inputs(hidden, weight, bias, token_ids, temperature, chunk_size, ref_log_prob, beta)
    loss_settings = _settings.resolve(settings, dict(
        delta=delta, divergence=divergence, max_ratio=max_ratio, dual_clip=dual_clip, agg=agg, clip=clip, mode=mode,
        eps_low=eps_low, eps_high=eps_high), _NAME)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    # The log-probs' shape, dtype and device (one element, expanded: no stand-in batch allocated) for
    # policy_loss's own checks and dtype rules on the per-token inputs.
    log_prob_like = torch.zeros((), dtype=acc, device=hidden.device).expand(batch, steps)
    _, olp, adv, mask_op, delta_t, op_args = _loss.op_inputs(
        log_prob_like, old_log_prob, advantages, mask, loss_settings)
    dtype = olp.dtype   # policy_loss's compute dtype (float32 unless old_log_prob/advantages are float64)
    # 0: the default, chosen inside the chunk op (min(n_tokens, ...) here would guard on the token count)
    chunk = 0 if chunk_size is None else int(chunk_size)
    grads = torch.is_grad_enabled()
    needs = (grads and hidden.requires_grad, grads and weight.requires_grad,
             grads and bias is not None and bias.requires_grad)
    ref = None
    if ref_log_prob is not None:
        ref = ref_log_prob.detach().to(dtype)
    temperature_t, temperature_s = _host_number(temperature)
    loss, metric_vec, kl_mean, entropy, log_prob = _FusedLinearLoss.apply(
        hidden, weight, bias, token_ids, olp, adv, mask_op, delta_t, ref, temperature_t, op_args,
        (temperature_s, chunk, float(beta), _spec.AGG_ID[loss_settings.agg], needs, return_entropy))
    # Non-differentiable outputs (marked so in the Function), detached again here: under torch.compile, torch 2.11's
    # AOT autograd lost the mark on the entropy and asked for its gradient ("element 1 of tensors does not require
    # grad"). Detaching a tensor without gradient changes nothing else.
    entropy, kl_mean, log_prob = entropy.detach(), kl_mean.detach(), log_prob.detach()
    metrics = dict(zip(_spec.METRICS, metric_vec.unbind()))
    if ref_log_prob is not None:
        metrics["kl"] = kl_mean
    return (loss, metrics) + ((entropy,) if return_entropy else ()) + ((log_prob,) if return_log_prob else ())


def _host_number(value) -> tuple[torch.Tensor | None, float]:
    """A number the chunk op reads on the host (the temperature), as (tensor, float). Eager: (None, the float).
    Under torch.compile: a 0-dim float64 CPU tensor, because a float argument of a custom op is specialised (one
    graph per value: a temperature schedule recompiled at every new value) while a tensor is a graph input.
    Made as `zeros(()) + value`, an arithmetic op that Dynamo keeps symbolic, as the table cache makes a δ (see
    bandpo_lut/runtime/table_cache.py). Reading a CPU tensor is not a device synchronisation."""
    if torch.compiler.is_compiling():
        return torch.zeros((), dtype=torch.float64) + value, 0.0
    return None, float(value)


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
_NO_CONTEXT = contextlib.nullcontext()


@torch.compiler.assume_constant_result
def _autocast_available(device_type: str) -> bool:
    """Whether torch has autocast for this device type: a constant of the process, which Dynamo reads when it
    traces instead of tracing torch's builtin (torch 2.11's Dynamo cannot, and fullgraph=True would fail)."""
    return torch.amp.is_autocast_available(device_type)


def _autocast_inputs(hidden, weight, bias):
    """hidden, weight and bias as F.linear sees them under torch.autocast: cast to the autocast dtype of their
    device type when autocast is on there (each floating input but float64, which autocast leaves alone), so
    that the matmuls run where autocast runs them. A differentiable cast: the gradients come back in the
    inputs' own dtypes. Unchanged when autocast is off (then mismatched dtypes are refused by _check_inputs)."""
    if not (isinstance(hidden, torch.Tensor) and _autocast_available(hidden.device.type)
            and torch.is_autocast_enabled(hidden.device.type)):
        return hidden, weight, bias
    target = torch.get_autocast_dtype(hidden.device.type)

    def cast(x):
        return x.to(target) if isinstance(x, torch.Tensor) and x.dtype in _AUTOCAST_ELIGIBLE else x
    return cast(hidden), cast(weight), cast(bias)


def _refuse_transforms(hidden, weight, bias):
    """torch.func transforms and forward-mode AD: refused by name. The gradients are formed in the forward by
    an autograd.Function without setup_context or jvp (torch's own error would be about setup_context)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"bandpo_lut: {_NAME} does not run under torch.func transforms (grad, vjp, jacrev, jvp, jacfwd, "
            "vmap, hessian): its gradients are formed chunk by chunk in the forward. Use .backward() or "
            "torch.autograd.grad, or the unfused log_softmax + bandpo_lut.policy_loss, which supports them.")
    if _forward_ad._current_level >= 0 and any(
            x is not None and _forward_ad.unpack_dual(x).tangent is not None for x in (hidden, weight, bias)):
        raise NotImplementedError(
            f"bandpo_lut: {_NAME} has no forward-mode derivative (a dual tensor reached hidden, weight or bias). "
            "Use the unfused log_softmax + bandpo_lut.policy_loss, which supports forward mode.")


def _check_inputs(hidden, weight, bias, token_ids, temperature, chunk_size, ref_log_prob, beta):
    """Shapes, dtypes and devices of the linear part (policy_loss checks the per-token inputs)."""
    for name, x in (("hidden", hidden), ("weight", weight), ("token_ids", token_ids)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_NAME}: {name} must be a torch.Tensor, got {type(x).__name__}")
    _checks.check_tensor(f"{_NAME}: hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"{_NAME}: hidden must have shape (batch, T, H), got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"{_NAME}: weight must have shape (V, H) with H = hidden.shape[-1] = {hidden.shape[2]}, "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"{_NAME}: weight is {weight.dtype} on {weight.device} but hidden is {hidden.dtype} on "
                         f"{hidden.device}; they must match (under torch.autocast both are cast to the autocast "
                         "dtype, as F.linear's inputs are)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"{_NAME}: bias must be None or a ({weight.shape[0]},) tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"{_NAME}: bias is {bias.dtype} on {bias.device} but hidden is {hidden.dtype} on "
                             f"{hidden.device}; they must match")
    if token_ids.dtype not in TOKEN_ID_DTYPES:
        # int16/uint8 cannot hold a real vocabulary's ids (uint8 not even -100); refused rather than widened
        raise TypeError(f"{_NAME}: token_ids must be an integer tensor of dtype int64 or int32, got {token_ids.dtype}")
    if token_ids.shape != hidden.shape[:2]:
        raise ValueError(f"{_NAME}: token_ids has shape {tuple(token_ids.shape)} but hidden has (batch, T) = "
                         f"{tuple(hidden.shape[:2])}; they must be equal")
    if token_ids.device != hidden.device:
        raise ValueError(f"{_NAME}: token_ids is on {token_ids.device} but hidden is on {hidden.device}")
    if not (_checks.is_number(temperature) and 0 < temperature < math.inf):
        raise ValueError(f"{_NAME}: temperature must be a positive finite number, got {temperature!r}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool)
                                       and chunk_size >= 1):
        raise ValueError(f"{_NAME}: chunk_size must be None or an integer >= 1, got {chunk_size!r}")
    if not (_checks.is_number(beta) and 0 <= beta < math.inf):
        raise ValueError(f"{_NAME}: beta must be a finite number >= 0, got {beta!r}")
    if beta != 0 and ref_log_prob is None:
        raise ValueError(f"{_NAME}: beta={beta!r} needs ref_log_prob (the reference policy's log-probs)")
    if ref_log_prob is not None:
        _checks.check_tensor(f"{_NAME}: ref_log_prob", ref_log_prob)
        if ref_log_prob.shape != token_ids.shape or ref_log_prob.device != hidden.device:
            raise ValueError(f"{_NAME}: ref_log_prob must have token_ids' shape {tuple(token_ids.shape)} and be on "
                             f"{hidden.device}, got {tuple(ref_log_prob.shape)} on {ref_log_prob.device}")
    return hidden.shape[0], hidden.shape[1]


def _per_token(ops, x, batch, steps):
    """A (batch, T)-broadcastable tensor as a dense (tokens, 1), each token a row of its own; 0-dim stays 0-dim
    (a scalar delta under torch.compile is a 0-dim CPU tensor the kernels read on the host). Anything but an
    already dense (batch, T) tensor goes through the opaque `per_token` copy: a chunk of a broadcast
    (batch, 1) tensor computed by Inductor on CPU loses tokens (see bandpo_lut/runtime/_ops.py, per_token)."""
    if x is None or x.dim() == 0:
        return x
    if x.shape == (batch, steps) and x.is_contiguous():
        return x.reshape(batch * steps, 1)
    return ops.per_token(x, batch, steps).unsqueeze(1)


def _chunk_grad_logits(exps, total, g, idx, temperature, out_dtype):
    """d loss / d logits = g * (onehot(idx) - softmax) / T of a chunk whose exps (exp(z - max), row sums `total`)
    are given, in out_dtype. float32 weights, and every dtype on the CPU: in place, scale = g / T times -exps /
    total, then + scale at the token (one scaling pass and a per-row scatter), converted once for bf16/fp16.
    bf16/fp16 weights on CUDA: the one-hot part first (exps - total at the token), then one pass that scales
    every entry by -g / (T * total) and stores it in out_dtype, the buffer the GEMMs read (the kernel casts as
    it stores; on the CPU TensorIterator would compute into a float32 temporary and copy it)."""
    if out_dtype == exps.dtype or not exps.is_cuda:
        scale = g / temperature
        exps.mul_((-scale / total).unsqueeze(1))
        exps.scatter_add_(1, idx.unsqueeze(1), scale.unsqueeze(1))
        return exps.to(out_dtype)
    exps.scatter_add_(1, idx.unsqueeze(1), -total.unsqueeze(1))
    coeff = (g / (-temperature * total)).unsqueeze(1)
    return torch.mul(exps, coeff, out=torch.empty(exps.shape, dtype=out_dtype, device=exps.device))


def _chunk_logits(h, weight, bias, acc):
    """The chunk's logits h @ weight.T + bias in the softmax dtype `acc` (float32 at least). float32/float64: one
    GEMM writes them. bf16/fp16 on CUDA: a bf16/fp16 GEMM (tensor cores, float32 accumulation) that writes float32
    (torch.mm's out_dtype), no low-precision copy. bf16/fp16 elsewhere (the CPU has no out_dtype GEMM): the
    product in their dtype, then its float32 copy."""
    if h.dtype == acc:
        return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    if h.is_cuda:
        logits = torch.mm(h, weight.t(), out_dtype=acc)
        return logits if bias is None else logits.add_(bias)
    return (h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())).to(acc)


# ---- the chunk loop, one opaque op ---------------------------------------------------------------------
# Why an op: a Python loop `for start in range(0, n_tokens, chunk)` in traced code is unrolled by Dynamo, which
# specialises the graph on the token count (one graph per length: under torch.compile(dynamic=True) the 9th
# distinct length raised FailOnRecompileLimitHit). Inside a custom op the loop runs eagerly on real tensors
# and the graph holds one node whose output shapes (the fake kernel below) are symbolic in the token count:
# one graph for every length. The loop reads only shapes (no host synchronisation).
def _chunked_pass_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                 olp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None, delta: torch.Tensor | None,
                 token_scale: torch.Tensor | None, kl_scale: torch.Tensor | None, ref: torch.Tensor | None,
                 delta_scalar: float, table: torch.Tensor, grid: list[float], divergence: int, clip: int,
                 eps_low: float, eps_high: float, max_ratio: float, dual_clip: float, mode: int,
                 temperature_t: torch.Tensor | None, temperature: float, chunk_size: int, want_entropy: bool,
                 need_h: bool, need_w: bool,
                 need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk of tokens: the log-prob of each token (and its entropy), and, when token_scale is given, the
    chunk's contribution to the gradients of hidden (n, H), weight (V, H) and bias (V,).

    hidden (n, H); ids (n,); olp, adv, mask, delta: (n, 1) per token (delta: or 0-dim, or None); token_scale,
    kl_scale, ref: (n,) or None; op_args: the scalar arguments as `policy_loss_bwd` takes them; the temperature
    as a 0-dim CPU tensor (under torch.compile) or the float. chunk_size 0: the default.
    Returns (log_prob (n,), entropy (n,) or (0,), grad_h, grad_w, grad_b), each gradient (0,) when not asked
    for. log_prob and entropy in the softmax dtype (float32 at least), grad_h and grad_w in the inputs' dtype
    (one buffer each, written by the GEMMs in place), grad_b in the softmax dtype."""
    device_type = hidden.device.type
    with torch.autocast(device_type, enabled=False) if _autocast_available(device_type) else _NO_CONTEXT:
        # The inputs arrive in one dtype (cast by _autocast_inputs); the float32 ops inside (the entropy's
        # batched dot product) must stay float32 under a caller's autocast.
        return _chunk_loop(hidden, weight, bias, ids, olp, adv, mask, delta, token_scale, kl_scale, ref,
                           (delta_scalar, table, grid, divergence, clip, eps_low, eps_high, max_ratio, dual_clip,
                            mode),
                           temperature if temperature_t is None else temperature_t.item(), chunk_size,
                           want_entropy, need_h, need_w, need_b)


def _chunk_loop(hidden, weight, bias, ids, olp, adv, mask, delta, token_scale, kl_scale, ref, op_args, temperature,
                chunk_size, want_entropy, need_h, need_w, need_b):
    from bandpo_lut.runtime._ops import ops  # the library, loaded on first use

    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)   # softmax arithmetic
    dtype = olp.dtype                                         # the loss's compute dtype
    chunk = default_chunk_size(n_tokens, vocab, hidden.device) if chunk_size == 0 else chunk_size
    any_grad = token_scale is not None
    def empty():   # an absent output: a fresh (0,) tensor each (a custom op's outputs may not alias)
        return hidden.new_empty((0,), dtype=acc)
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty((0,))
    # The weight's gradient in its own dtype, accumulated in place by the GEMM (addmm_: float32 accumulation
    # inside the GEMM, one rounding per chunk in bf16/fp16): no vocab x H temporary, no float32 copy per chunk.
    grad_w = torch.zeros_like(weight) if need_w else hidden.new_empty((0,))
    grad_b = torch.zeros((vocab,), dtype=acc, device=weight.device) if need_b else empty()
    log_prob = torch.empty((n_tokens,), dtype=acc, device=hidden.device)
    entropy = torch.empty((n_tokens,), dtype=acc, device=hidden.device) if want_entropy else empty()
    one = torch.ones((), dtype=dtype, device=hidden.device)
    # which ids are in range, and the column each token reads (0 for the others): once for all tokens, not a
    # handful of small launches per chunk
    in_range_all = (ids >= 0) & (ids < vocab)
    idx_all = torch.where(in_range_all, ids, torch.zeros_like(ids)).long()

    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        sl = slice(start, end)
        h = hidden[sl]
        logits = _chunk_logits(h, weight, bias, acc)
        if temperature != 1.0:
            logits.div_(temperature)
        # log-softmax in place, without logsumexp's chunk-sized temporary: z - max, then exp
        logits.sub_(logits.amax(dim=1, keepdim=True))
        in_range, idx = in_range_all[sl], idx_all[sl]
        chosen = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
        if want_entropy:
            probs = torch.exp(logits)   # a second chunk x vocab buffer: the entropy reads both
            total = probs.sum(dim=1)
            log_total = torch.log(total)
            # H = log(sum e) - sum p (z - max), the dot product batched: no third chunk x vocab buffer
            dot = (probs.unsqueeze(1) @ logits.unsqueeze(2)).reshape(-1)
            entropy[sl] = log_total - dot / total
        else:
            probs = logits.exp_()                           # in place: one chunk x vocab buffer in all
            total = probs.sum(dim=1)
            log_total = torch.log(total)
        del logits
        lp_c = torch.where(in_range, chosen - log_total, torch.full_like(chosen, math.nan))
        log_prob[sl] = lp_c
        if any_grad:
            g = ops.policy_loss_bwd(one, token_scale[sl], lp_c.to(dtype).unsqueeze(1), olp[sl], adv[sl],
                                    None if mask is None else mask[sl],
                                    delta if delta is None or delta.dim() == 0 else delta[sl],
                                    *op_args).squeeze(1)
            if ref is not None:   # d(beta * w * scale * k3)/d lp = beta * w * scale * (1 - exp(ref - lp))
                kl_g = kl_scale[sl] * (1.0 - torch.exp(ref[sl] - lp_c.to(dtype)))
                g = g + torch.where(kl_scale[sl] != 0, kl_g, torch.zeros_like(kl_g))
            # float32 weights: the same buffer, in place; bf16/fp16: a new buffer in their dtype, and the
            # float32 one is freed when `probs` goes
            grad_logits = _chunk_grad_logits(probs, total, g.to(acc), idx, temperature, weight.dtype)
            del probs
            if need_h:
                torch.mm(grad_logits, weight, out=grad_h[sl])   # straight into its rows: no chunk x H temporary
            if need_w:
                grad_w.addmm_(grad_logits.t(), h)
            if need_b:
                grad_b += grad_logits.sum(dim=0, dtype=acc)
            del grad_logits
        else:
            del probs
        # Nothing chunk x vocab outlives its iteration: the next chunk's logits are the only such buffer
        # (before, the previous chunk's buffer was still referenced when the next one was allocated).
    return log_prob, entropy, grad_h, grad_w, grad_b


# The op; its Python body stays callable as _chunked_pass_impl (the memory test watches its allocations).
chunked_pass = torch.library.custom_op("bandpo_lut::fused_linear_chunks", mutates_args=())(_chunked_pass_impl)


@chunked_pass.register_fake
def _chunked_pass_fake(hidden, weight, bias, ids, olp, adv, mask, delta, token_scale, kl_scale, ref,
                       delta_scalar, table, grid, divergence, clip, eps_low, eps_high, max_ratio, dual_clip, mode,
                       temperature_t, temperature, chunk_size, want_entropy, need_h, need_w, need_b):
    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    def empty():
        return hidden.new_empty((0,), dtype=acc)
    return (hidden.new_empty((n_tokens,), dtype=acc),
            hidden.new_empty((n_tokens,), dtype=acc) if want_entropy else empty(),
            hidden.new_empty((n_tokens, width)) if need_h else hidden.new_empty((0,)),
            weight.new_empty((vocab, width)) if need_w else hidden.new_empty((0,)),
            hidden.new_empty((vocab,), dtype=acc) if need_b else empty())


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, olp, adv, mask, delta_t, ref, temperature_t, op_args,
                options):
        temperature, chunk, beta, agg_id, needs, want_entropy = options
        from bandpo_lut.runtime._ops import ops  # the raw torch.ops.bandpo_lut: this Function is its own autograd
        batch, steps, width = hidden.shape
        n_tokens = batch * steps
        dtype = olp.dtype                                         # the loss's compute dtype
        olp_t, adv_t = _per_token(ops, olp, batch, steps), _per_token(ops, adv, batch, steps)
        mask_t, delta_tok = _per_token(ops, mask, batch, steps), _per_token(ops, delta_t, batch, steps)

        any_grad = any(needs)
        if any_grad or ref is not None:
            # The normalisers: row_scale of the compiled forward run on zeros with the real mask and options
            # (row_scale reads only the mask and agg), repeated per token.
            zeros = torch.zeros((batch, steps), dtype=dtype, device=hidden.device)
            row_scale = ops.policy_loss_fwd(zeros, zeros, zeros, mask, delta_t, *op_args, agg_id)[2]
            # (tokens,) float64. Not row_scale.repeat_interleave(steps): Inductor on CPU computes a chunk of that
            # wrongly when T does not divide the chunk (see bandpo_lut/runtime/_ops.py, per_token).
            token_scale = ops.per_token(row_scale.unsqueeze(1), batch, steps)
        if ref is not None:
            ref_t = _per_token(ops, ref, batch, steps).reshape(n_tokens)   # dense: a broadcast ref, see _per_token
            w_tok = (torch.ones(n_tokens, dtype=dtype, device=hidden.device) if mask_t is None
                     else mask_t.reshape(n_tokens).to(dtype))
            # beta * w * d loss / d S_b per token: the k3 term's weight in the loss
            kl_scale = torch.where(w_tok != 0, beta * w_tok * token_scale.to(dtype), torch.zeros_like(w_tok))
        log_prob, entropy, grad_h, grad_w, grad_b = chunked_pass(
            hidden.reshape(n_tokens, width), weight, bias, token_ids.reshape(n_tokens), olp_t, adv_t, mask_t, delta_tok,
            token_scale if any_grad else None, kl_scale if ref is not None else None,
            ref_t if ref is not None else None, *op_args, temperature_t, temperature, chunk, want_entropy, *needs)
        grad_h = grad_h if needs[0] else None
        grad_w = grad_w if needs[1] else None
        grad_b = grad_b if needs[2] else None
        log_prob = log_prob.to(dtype).reshape(batch, steps)
        loss, metric_vec, _ = ops.policy_loss_fwd(log_prob, olp, adv, mask, delta_t, *op_args, agg_id)
        kl_mean = loss.new_zeros(())
        if ref is not None:
            d = (ref - log_prob).reshape(n_tokens)
            k3 = torch.where(w_tok != 0, torch.exp(d) - d - 1.0, torch.zeros_like(d))
            kl_mean = _spec.safe_div((w_tok * k3).sum(), w_tok.sum())
            loss = loss + torch.where(kl_scale != 0, kl_scale * k3, torch.zeros_like(k3)).sum()
        entropy = entropy.reshape(batch, steps) if want_entropy else entropy
        # hidden, weight, bias (no copies): the anchors of a second derivative's refusal (see backward)
        ctx.save_for_backward(grad_h, grad_w, grad_b, hidden, weight, bias)
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype)
        log_prob = log_prob.detach()
        ctx.mark_non_differentiable(metric_vec, kl_mean, entropy, log_prob)
        return loss, metric_vec, kl_mean, entropy, log_prob

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_h, grad_w, grad_b, hidden, weight, bias = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.shapes
        if grad_loss is None:
            return (None,) * 12
        # create_graph=True (grad mode on in the backward): the gradients below would carry no second-order
        # term (they were formed in the forward, outside autograd), so a second derivative must raise, as
        # policy_loss's does, not be a silent zero. First order under create_graph still works.
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            saved = _Saved((grad_h, grad_w, grad_b, shape, w_dtype))
            out = _FirstOrderOnly.apply(grad_loss, hidden, weight, bias, saved)
            return tuple(o if g is not None else None for o, g in zip(out, (grad_h, grad_w, grad_b))) + (None,) * 9
        return _scale(grad_loss, grad_h, grad_w, grad_b, shape, w_dtype) + (None,) * 9


def _scale(grad_loss, grad_h, grad_w, grad_b, shape, w_dtype, in_place=True):
    """The saved gradients times the incoming one. In place: no second copy of the weight's gradient; a second
    backward through the same graph (retain_graph=True) then fails autograd's saved-tensor version check
    instead of using scaled grads. Not in place under create_graph (new tensors for _FirstOrderOnly's outputs)."""
    def times(g):
        scale = grad_loss.to(g.dtype)
        return g.mul_(scale) if in_place else g * scale
    out_h = out_w = out_b = None
    if grad_h is not None:
        out_h = times(grad_h).reshape(shape)
    if grad_w is not None:
        out_w = times(grad_w).to(w_dtype)
    if grad_b is not None:
        out_b = times(grad_b).to(w_dtype)
    return out_h, out_w, out_b


class _Saved:
    """Tensors handed to _FirstOrderOnly whole, so that they are not inputs of its node."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _FirstOrderOnly(torch.autograd.Function):
    """The first-order gradients under create_graph=True, as a node whose own derivative refuses. hidden,
    weight and bias are inputs only so that the outputs depend on them in autograd's eyes (as policy_loss's
    gradient depends on log_prob): differentiating the gradients again reaches this backward."""

    @staticmethod
    def forward(ctx, grad_loss, hidden, weight, bias, saved):
        out = _scale(grad_loss, *saved.value, in_place=False)
        # an absent gradient as an empty tensor: autograd.Function outputs are tensors
        return tuple(hidden.new_empty((0,)) if o is None else o for o in out)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"bandpo_lut: {_NAME} has no second derivative (its gradients are formed chunk by chunk in the "
            "forward, outside autograd). First order works: .backward(), torch.autograd.grad (also with "
            "create_graph=True, as long as nothing differentiates the result again). For a second derivative "
            "use the unfused log_softmax + bandpo_lut.policy_loss, whose second derivative also raises; "
            "bandpo_lut.clip has one.")
