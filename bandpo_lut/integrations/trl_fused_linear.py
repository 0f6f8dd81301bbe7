"""`BandGRPOConfig(band_fused_linear=True)`: BandGRPOTrainer's loss from the policy's last hidden states and
LM head through `bandpo_lut.fused_linear_policy_loss`, without the [tokens x vocab] logits and without
liger-kernel.

What it computes is TRL 1.16's `GRPOTrainer._compute_loss` for the loss types with the two-sided ratio clip
("grpo", "bnpo", "dr_grpo", "dapo", "luspo"), with the band (or, band_clip="fixed", TRL's epsilon clip) and
TRL's `delta` as the dual clip: every loss type is a masked sum of per-token losses divided by a normaliser
that depends on the mask only, so it is `agg="token-sum"` with the mask scaled by that normaliser (per row for
"grpo"). tests/integrations/test_trl_fused_linear.py checks loss and gradients against the unfused BandGRPOTrainer.

Refused when the config is built (they need the log-probs or the entropies of the whole batch before the
loss, or a gradient the fused loss does not form): top_entropy_quantile < 1, entropy_coef != 0 or adaptive
entropy, off_policy_mask_threshold, vLLM importance-sampling correction, beta > 0 with
use_bias_correction_kl, and a schedule in which TRL does not compute old log-probs (it then uses the current
ones: ratio 1, no clip). Refused at the first loss call: models whose logits are scaled or soft-capped, MoE
auxiliary losses, and a batch with multimodal inputs (`MULTIMODAL_INPUTS`: the fused loss's forward is text-only).
"""
from __future__ import annotations

import torch

FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# What TRL 1.16's _compute_loss passes to the policy forward besides the token ids and the attention mask (the
# inputs of vision-language models): the fused loss's forward takes the text only, so a batch with any is refused.
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def validate(a, ratio_clip_is_inert) -> None:
    """Refuse the settings that band_fused_linear=True cannot compute exactly (naming the user's field)."""
    if not isinstance(a.band_fused_linear, bool):
        raise ValueError(f"band_fused_linear must be True or False, got {a.band_fused_linear!r}")
    if not a.band_fused_linear:
        return
    why = "band_fused_linear=True computes the loss chunk by chunk from the hidden states, so"
    if a.loss_type not in FUSED_LOSS_TYPES:
        raise ValueError(f"loss_type={a.loss_type!r}: {why} it supports loss_type in {FUSED_LOSS_TYPES}")
    if a.importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level={a.importance_sampling_level!r}: {why} it needs 'token'")
    checks = (
        (a.top_entropy_quantile != 1.0, f"top_entropy_quantile={a.top_entropy_quantile!r}",
         "the entropy mask needs every token's entropy before the loss; use 1.0"),
        (a.entropy_coef != 0.0 or a.use_adaptive_entropy,
         f"entropy_coef={a.entropy_coef!r}, use_adaptive_entropy={a.use_adaptive_entropy!r}",
         "an entropy bonus needs the entropy's gradient, which the fused loss does not form"),
        (a.off_policy_mask_threshold is not None, f"off_policy_mask_threshold={a.off_policy_mask_threshold!r}",
         "the off-policy mask needs every sequence's log-probs before the loss"),
        (a.use_vllm and a.vllm_importance_sampling_correction, "vllm_importance_sampling_correction=True",
         "the vLLM importance-sampling correction is not supported by the fused loss; set it to False"),
        (a.beta != 0.0 and a.use_bias_correction_kl, f"use_bias_correction_kl=True with beta={a.beta!r}",
         "the bias-corrected KL (k3 times the ratio) is not the fused loss's k3 term; set use_bias_correction_kl="
         "False"),
        (ratio_clip_is_inert(a), f"num_iterations={a.num_iterations!r}, steps_per_generation="
         f"{a.steps_per_generation!r}, gradient_accumulation_steps={a.gradient_accumulation_steps!r}",
         "with this schedule TRL computes no old log-probs (the ratio is 1 and no clip acts); take several "
         "optimiser steps per generation (e.g. num_iterations=2)"),
    )
    for bad, setting, reason in checks:
        if bad:
            raise ValueError(f"{setting}: {why} {reason}")


def _head_and_backbone(trainer, model):
    """The LM head and the transformer backbone of the policy (PEFT and accelerate wrappers removed): the
    modules TRL's own fused LM head uses."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    text_config = base.config.get_text_config()
    scaled = [k for k in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                          "logits_scaling") if getattr(text_config, k, None) is not None]
    if scaled:
        raise ValueError(f"band_fused_linear=True: this model scales or soft-caps its logits ({', '.join(scaled)}), "
                         f"which fused_linear_policy_loss does not; set band_fused_linear=False")
    if trainer.aux_loss_enabled:
        raise ValueError("band_fused_linear=True: MoE auxiliary losses (router_aux_loss_coef) are not supported; "
                         "set band_fused_linear=False or router_aux_loss_coef=0")
    return base.get_output_embeddings(), base.base_model


def _normalised_weights(trainer, inputs, mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's normalisation of each loss type (GRPOTrainer._compute_loss), as per-token weights for a
    token sum: the loss is sum(per_token_loss * weights)."""
    a, loss_type = trainer.args, trainer.args.loss_type
    train = trainer.model.training
    accumulation = trainer.current_gradient_accumulation_steps if train else 1.0
    w = mask.to(torch.float32)
    rows = w.shape[0]
    if loss_type == "grpo":
        den = w.sum(-1, keepdim=True).clamp(min=1.0) * rows * accumulation
    elif loss_type == "bnpo":
        den = w.sum().clamp(min=1.0) * accumulation
    elif loss_type == "dr_grpo":
        den = torch.tensor(float(rows * a.max_completion_length * accumulation))
    elif loss_type == "dapo":
        den = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if train:
            den = den * accumulation / a.steps_per_generation
    else:   # luspo
        den = torch.tensor(float(rows * accumulation))
    return w / den.to(w.device)


def fused_linear_loss(trainer, model, inputs, settings):
    """BandGRPOTrainer's loss for one micro-batch with fused_linear_policy_loss (see the module docstring);
    `settings`: the config's LossSettings (trl.band_loss_settings), the unfused loss's, token-summed over the
    weights below."""
    from bandpo_lut.runtime.fused_linear import fused_linear_policy_loss

    multimodal = [k for k in MULTIMODAL_INPUTS if inputs.get(k) is not None]
    if multimodal:
        raise ValueError(f"band_fused_linear=True: this batch has multimodal inputs ({', '.join(multimodal)}), "
                         f"which the fused loss's text-only forward would drop (the new log-probs would be "
                         f"computed without the images, the old ones with them); set band_fused_linear=False")
    old = inputs.get("old_per_token_logps")
    if old is None:
        raise RuntimeError("band_fused_linear=True: TRL passed no old log-probs (an on-policy schedule, refused "
                           "when the config is built); take several optimiser steps per generation")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    head, backbone = _head_and_backbone(trainer, model)
    steps = completion_ids.size(1)
    with trainer.accelerator.autocast():
        out = backbone(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                       attention_mask=torch.cat([prompt_mask, completion_mask], 1), use_cache=False)
    # position p's hidden state predicts token p + 1: the completion's tokens from the positions before them
    hidden = out.last_hidden_state[:, -steps - 1:-1].to(head.weight.device, head.weight.dtype)
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.expand(completion_ids.shape)
    beta = float(trainer.beta)
    ref = inputs["ref_per_token_logps"] if beta != 0.0 else None
    loss, _, entropy, log_prob = fused_linear_policy_loss(
        hidden, head.weight, completion_ids.to(hidden.device), old, advantages, _normalised_weights(trainer, inputs,
                                                                                                    mask),
        bias=head.bias, temperature=trainer.temperature, ref_log_prob=ref, beta=beta, return_entropy=True,
        settings=settings, return_log_prob=True)
    _log_like_trl(trainer, mask, entropy, log_prob, ref)
    trainer._record_band_counts(inputs, log_prob, old)
    return loss


@torch.no_grad()
def _log_like_trl(trainer, mask, entropy, log_prob, ref):
    """TRL's `entropy` and `kl` metrics (global masked means); the band/ metrics are BandGRPOTrainer's."""
    mode = "train" if trainer.model.training else "eval"
    mask = mask.to(entropy.dtype)

    def global_masked_mean(x):
        totals = trainer.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if ref is not None:
        d = torch.where(mask != 0, ref.to(log_prob.dtype) - log_prob, torch.zeros_like(log_prob))
        trainer._metrics[mode]["kl"].append(global_masked_mean(torch.exp(d) - d - 1))
    trainer._metrics[mode]["entropy"].append(global_masked_mean(entropy))
