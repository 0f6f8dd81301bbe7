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
2. Per chunk: logits (in the inputs' dtype: bf16 matmuls), then float32 log-softmax, the token's log-prob,
   its entropy, and d loss / d log_prob from the compiled backward op `policy_loss_bwd` on that chunk
   (each token a row of its own, with its row's `row_scale`): the same kernel and the same numbers as the
   unfused backward. d log_prob / d logits = onehot - softmax gives the chunk's logit gradient, which goes
   at once into the gradients of `hidden`, `weight` and `bias`. The chunk's logits are then freed.
3. After the chunks, the loss and the metrics come from the compiled forward op on the (tokens,) log-probs:
   exactly `policy_loss`'s loss and metrics on those log-probs.

So the gradients are final when the forward returns (no second pass over the logits); the backward only
scales them by the incoming gradient. Memory beyond the inputs and the gradients themselves: a few
chunk x vocab buffers and O(tokens) vectors.

Out-of-range token ids (< 0 or >= vocab) are not checked on the host (that would synchronise a GPU every
step): the token's log-prob is NaN, so a counted token gives a NaN loss and NaN gradients (NaN in, NaN out),
and a masked one (w == 0, e.g. a -100 label on padding) is ignored like any other masked token's inputs.
"""
from __future__ import annotations

import math

import torch

from bandpo_lut.runtime import loss as _loss
from bandpo_lut.runtime import loss_spec as _spec
from bandpo_lut.runtime import table_cache as _cache
from bandpo_lut.tables import checks as _checks

# Default chunk: about 2**25 logits (128 MB in float32) per chunk, at least 1 and at most all tokens.
CHUNK_ELEMENTS = 2 ** 25

_NAME = "fused_linear_policy_loss"


def default_chunk_size(n_tokens: int, vocab: int) -> int:
    return max(1, min(n_tokens, CHUNK_ELEMENTS // max(vocab, 1)))


def fused_linear_policy_loss(hidden, weight, token_ids, old_log_prob, advantages, mask=None, *, bias=None,
                             temperature=1.0, chunk_size=None, ref_log_prob=None, beta=0.0, return_entropy=False,
                             delta=0.05, divergence="kl", max_ratio=None, dual_clip=None, agg="token-mean",
                             clip="band", mode="clip", eps_low=None, eps_high=None, _with_log_prob=False):
    """`bandpo_lut.policy_loss` of the log-probs of `token_ids` under `(hidden @ weight.T + bias) / temperature`,
    computed chunk by chunk without the full logits (see the module docstring).

    Args:
        hidden: (batch, T, H) floating: the hidden states whose next tokens are `token_ids`.
        weight: (V, H), the LM head, hidden's dtype and device. bias: optional (V,).
        token_ids: (batch, T) integer tensor. Out-of-range ids give NaN log-probs (no host check).
        old_log_prob, advantages, mask: as `policy_loss` ((batch, T), on hidden's device).
        temperature: a number > 0 dividing the logits. chunk_size: tokens per chunk (default: about 2**25
            logits per chunk). ref_log_prob, beta: with beta > 0, adds beta times the aggregated k3 estimate
            of KL(pi || pi_ref) (as TRL and Liger compute it) to the loss. return_entropy: also return the
            per-token entropy of the softmax, (batch, T) float32, without gradient.
        delta, divergence, max_ratio, dual_clip, agg, clip, mode, eps_low, eps_high: as `policy_loss`.
    Returns:
        (loss, metrics), or (loss, metrics, entropy) with return_entropy=True. metrics: policy_loss's
        metrics of the same log-probs, plus "kl" (the masked mean of k3) when ref_log_prob is given.
        Gradients reach hidden, weight and bias; computation in float32 at least (bf16/fp16 inputs: matmuls
        in their dtype, softmax in float32), gradients in the inputs' dtypes.
    """
    batch, steps = _check_inputs(hidden, weight, bias, token_ids, temperature, chunk_size, ref_log_prob, beta)
    n_tokens, vocab = batch * steps, weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    # A stand-in log_prob: policy_loss's own checks and dtype rules on the per-token inputs.
    stand_in = torch.zeros((batch, steps), dtype=acc, device=hidden.device)
    _, olp, adv, mask_op, delta_t, settings = _loss.op_inputs(
        stand_in, old_log_prob, advantages, mask, delta, divergence, max_ratio, dual_clip, agg, clip, mode,
        eps_low, eps_high)
    dtype = olp.dtype   # policy_loss's compute dtype (float32 unless old_log_prob/advantages are float64)
    chunk = default_chunk_size(n_tokens, vocab) if chunk_size is None else int(chunk_size)
    grads = torch.is_grad_enabled()
    needs = (grads and hidden.requires_grad, grads and weight.requires_grad,
             grads and bias is not None and bias.requires_grad)
    ref = None
    if ref_log_prob is not None:
        ref = ref_log_prob.detach().to(dtype)
    loss, metric_vec, kl_mean, entropy, log_prob = _FusedLinearLoss.apply(
        hidden, weight, bias, token_ids, olp, adv, mask_op, delta_t, ref, settings,
        (float(temperature), chunk, float(beta), _spec.AGG_ID[agg], needs, return_entropy))
    metrics = dict(zip(_spec.METRICS, metric_vec.unbind()))
    if ref_log_prob is not None:
        metrics["kl"] = kl_mean
    if _with_log_prob:
        return loss, metrics, entropy, log_prob
    return (loss, metrics, entropy) if return_entropy else (loss, metrics)


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
                         f"{hidden.device}; they must match")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"{_NAME}: bias must be None or a ({weight.shape[0]},) tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"{_NAME}: bias is {bias.dtype} on {bias.device} but hidden is {hidden.dtype} on "
                             f"{hidden.device}; they must match")
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise TypeError(f"{_NAME}: token_ids must be an integer tensor, got {token_ids.dtype}")
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


def _chunk_grad_logits(exps, total, g, idx, temperature):
    """In place: exps (the chunk's exp(z - max), row sums `total`) becomes d loss / d logits
    = g * (onehot(idx) - softmax) / T, the softmax's normalisation folded into the one scaling pass."""
    scale = g / temperature
    exps.mul_((-scale / total).unsqueeze(1))
    exps.scatter_add_(1, idx.unsqueeze(1), scale.unsqueeze(1))
    return exps


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, olp, adv, mask, delta_t, ref, settings, options):
        temperature, chunk, beta, agg_id, needs, want_entropy = options
        ops = _cache.compiled_ops().ops   # the raw torch.ops.bandpo_lut: this Function is its own autograd
        batch, steps, width = hidden.shape
        n_tokens, vocab = batch * steps, weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)   # softmax arithmetic
        dtype = olp.dtype                                         # the loss's compute dtype
        h2 = hidden.reshape(n_tokens, width)
        ids = token_ids.reshape(n_tokens)
        olp_t, adv_t = _per_token(ops, olp, batch, steps), _per_token(ops, adv, batch, steps)
        mask_t, delta_tok = _per_token(ops, mask, batch, steps), _per_token(ops, delta_t, batch, steps)

        any_grad = any(needs)
        if any_grad or ref is not None:
            # The normalisers: row_scale of the compiled forward run on zeros with the real mask and settings
            # (row_scale reads only the mask and agg), repeated per token.
            zeros = torch.zeros((batch, steps), dtype=dtype, device=hidden.device)
            row_scale = ops.policy_loss_fwd(zeros, zeros, zeros, mask, delta_t, *settings, agg_id)[2]
            # (tokens,) float64. Not row_scale.repeat_interleave(steps): Inductor on CPU computes a chunk of that
            # wrongly when T does not divide the chunk (see bandpo_lut/runtime/_ops.py, per_token).
            token_scale = ops.per_token(row_scale.unsqueeze(1), batch, steps)
            one = torch.ones((), dtype=dtype, device=hidden.device)
        if ref is not None:
            ref_t = _per_token(ops, ref, batch, steps).reshape(n_tokens)   # dense: a broadcast ref, see _per_token
            w_tok = (torch.ones(n_tokens, dtype=dtype, device=hidden.device) if mask_t is None
                     else mask_t.reshape(n_tokens).to(dtype))
            # beta * w * d loss / d S_b per token: the k3 term's weight in the loss
            kl_scale = torch.where(w_tok != 0, beta * w_tok * token_scale.to(dtype), torch.zeros_like(w_tok))
        grad_h = torch.empty_like(h2) if needs[0] else None
        grad_w = torch.zeros((vocab, width), dtype=acc, device=weight.device) if needs[1] else None
        grad_b = torch.zeros((vocab,), dtype=acc, device=weight.device) if needs[2] else None
        log_probs, entropies = [], []

        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            h = h2[start:end]
            logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
            logits = logits.to(acc)
            if temperature != 1.0:
                logits.div_(temperature)
            # log-softmax in place, without logsumexp's chunk-sized temporary: z - max, then exp
            logits.sub_(logits.amax(dim=1, keepdim=True))
            ids_c = ids[start:end]
            in_range = (ids_c >= 0) & (ids_c < vocab)
            idx = torch.where(in_range, ids_c, torch.zeros_like(ids_c))
            chosen = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
            if want_entropy:
                probs = torch.exp(logits)
                total = probs.sum(dim=1)
                log_total = torch.log(total)
                # H = log(sum e) - sum p (z - max), the dot product batched: no third chunk x vocab buffer
                dot = (probs.unsqueeze(1) @ logits.unsqueeze(2)).reshape(-1)
                entropies.append(log_total - dot / total)
            else:
                probs = logits.exp_()                           # in place: one chunk x vocab buffer in all
                total = probs.sum(dim=1)
                log_total = torch.log(total)
            lp_c = torch.where(in_range, chosen - log_total, torch.full_like(chosen, math.nan))
            log_probs.append(lp_c)
            del logits
            if not any_grad:
                continue
            lp_tok = lp_c.to(dtype).unsqueeze(1)
            sl = slice(start, end)
            g = ops.policy_loss_bwd(one, token_scale[sl], lp_tok, olp_t[sl], adv_t[sl],
                                    None if mask_t is None else mask_t[sl],
                                    delta_tok if delta_tok is None or delta_tok.dim() == 0 else delta_tok[sl],
                                    *settings).squeeze(1)
            if ref is not None:   # d(beta * w * scale * k3)/d lp = beta * w * scale * (1 - exp(ref - lp))
                kl_g = kl_scale[sl] * (1.0 - torch.exp(ref_t[sl] - lp_c.to(dtype)))
                g = g + torch.where(kl_scale[sl] != 0, kl_g, torch.zeros_like(kl_g))
            grad_logits = _chunk_grad_logits(probs, total, g.to(acc), idx, temperature).to(weight.dtype)
            if grad_h is not None:
                grad_h[sl] = grad_logits @ weight
            if grad_w is not None:
                if grad_w.dtype == grad_logits.dtype:
                    grad_w.addmm_(grad_logits.t(), h)            # accumulate without a vocab x H temporary
                else:   # bf16/fp16: the chunk's product in their dtype, summed in float32
                    grad_w += (grad_logits.t() @ h).to(acc)
            if grad_b is not None:
                grad_b += grad_logits.sum(dim=0, dtype=acc)

        log_prob = torch.cat(log_probs).to(dtype).reshape(batch, steps)
        loss, metric_vec, _ = ops.policy_loss_fwd(log_prob, olp, adv, mask, delta_t, *settings, agg_id)
        kl_mean = loss.new_zeros(())
        if ref is not None:
            d = (ref - log_prob).reshape(n_tokens)
            k3 = torch.where(w_tok != 0, torch.exp(d) - d - 1.0, torch.zeros_like(d))
            kl_mean = _spec.safe_div((w_tok * k3).sum(), w_tok.sum())
            loss = loss + torch.where(kl_scale != 0, kl_scale * k3, torch.zeros_like(k3)).sum()
        entropy = (torch.cat(entropies).reshape(batch, steps) if want_entropy
                   else loss.new_zeros((0,), dtype=acc))
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype)
        log_prob = log_prob.detach()
        ctx.mark_non_differentiable(metric_vec, kl_mean, entropy, log_prob)
        return loss, metric_vec, kl_mean, entropy, log_prob

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.shapes
        out_h = out_w = out_b = None
        # In place: no second copy of the weight's gradient. A second backward through the same graph
        # (retain_graph=True) then fails autograd's saved-tensor version check instead of using scaled grads.
        if grad_loss is not None:
            if grad_h is not None:
                out_h = grad_h.mul_(grad_loss.to(grad_h.dtype)).reshape(shape)
            if grad_w is not None:
                out_w = grad_w.mul_(grad_loss.to(grad_w.dtype)).to(w_dtype)
            if grad_b is not None:
                out_b = grad_b.mul_(grad_loss.to(grad_b.dtype)).to(w_dtype)
        return (out_h, out_w, out_b) + (None,) * 8
