"""The fused BandPO policy loss: `policy_loss(...) -> (loss, metrics)` and the `BandPolicyLoss` module.

Semantics, metrics and counts are exactly those of `bandpo_lut.reference.policy_loss` (its module
docstring is the specification: per-token surrogate, dual clip, the "fixed", "dcpo" and "band" clips, the
"clip" and "mask" modes, the four aggregations and the metric names). Here one compiled kernel computes,
per token, the ratio, the bounds, the surrogate and the metric partial sums, returning only per-row sums
and 20 counts; the backward kernel recomputes what it needs from the inputs, so the loss saves nothing of
the input's size, except in float32 eager calls on the CPU: there the forward also keeps each token's gradient
factor (one float32 per token until the backward, which then only scales it; the same bits). No host
synchronisation: works under torch.compile(fullgraph=True).

Counts for exact global metrics: `metrics` holds every count of `COUNTS` next to the fractions. Sum the
counts over micro-batches and data-parallel ranks (e.g. all-reduce), then call
`bandpo_lut.metrics_from_counts(summed)` for the exact global fractions.
"""
from __future__ import annotations

import math

import torch

from bandpo_lut.runtime import loss_spec as _spec
from bandpo_lut.runtime import settings as _settings
from bandpo_lut.runtime import table_cache as _cache
from bandpo_lut.runtime.band import bounds
from bandpo_lut.tables import checks as _checks

COUNTS = _spec.COUNTS
FRACTIONS = _spec.FRACTIONS
metrics_from_counts = _spec.metrics_from_counts
_D = _settings.DEFAULTS   # the options' defaults, told apart from the same values given (settings= plus keywords)


def policy_loss(log_prob, old_log_prob, advantages, mask=None, *, delta=_D["delta"], divergence=_D["divergence"],
                max_ratio=_D["max_ratio"], dual_clip=_D["dual_clip"], agg=_D["agg"], clip=_D["clip"], mode=_D["mode"],
                eps_low=_D["eps_low"], eps_high=_D["eps_high"], settings=None):
    """PPO-family policy loss with BandPO's band (default) or a baseline clip, fused.

    Args:
        log_prob, old_log_prob, advantages: (batch, T) floating tensors on one device, any strides; the
            gradient flows to `log_prob` only.
        mask: optional (batch, T) bool, integer or floating mask (values act as per-token weights).
        delta, divergence: the band's radius (a number in the table's range, or a floating tensor
            broadcastable to (batch, T)) and divergence ("kl", "tv", "chi2", "hellinger").
        max_ratio: cap of the upper bound (the paper used 10). dual_clip: c > 1 caps the loss of A < 0
            tokens at -A·c.
        agg: "token-mean", "token-sum", "seq-mean-token-mean" or "seq-mean-token-sum".
        clip: "band", "fixed" (eps_low/eps_high, default 0.2/0.2; DAPO's clip-higher is 0.2/0.28) or
            "dcpo" (default eps 0.16/0.2). mode: "clip", or "mask" (out-of-band tokens keep their
            surrogate's value but lose the gradient in the unsafe direction).
        settings: a `bandpo_lut.LossSettings` holding these nine options, validated when built (then give none
            of the keyword options, not even at its default value: that is refused).
    Derivatives: to log_prob only, first order in both modes (backward, torch.func.grad/jacrev/vjp, forward
    mode: torch.func.jvp/jacfwd, torch.autograd.forward_ad); a second derivative (double backward,
    torch.func.hessian) raises NotImplementedError.
    Returns:
        (loss, metrics): a 0-dim loss, and a dict of 0-dim tensors: the fractions of FRACTIONS (clip_frac,
        clip_frac_upper, clip_frac_lower, dual_clip_frac, clip_frac_upper_lowprob, ppo_kl, band_width_mean,
        clip_frac_pXX_YY) and the raw counts of COUNTS.

    One compiled op computes the loss (aggregated), every count and every fraction (a constant number of
    kernel launches, in a fixed-order reduction: bit-identical run to run); the backward is one op too.
    """
    settings = _settings.resolve(settings, dict(
        delta=delta, divergence=divergence, max_ratio=max_ratio, dual_clip=dual_clip, agg=agg, clip=clip, mode=mode,
        eps_low=eps_low, eps_high=eps_high), "policy_loss")
    lp, olp, adv, mask, delta_t, op_args = op_inputs(log_prob, old_log_prob, advantages, mask, settings)
    args = (lp, olp, adv, mask, delta_t, *op_args, _spec.AGG_ID[settings.agg])
    from bandpo_lut.runtime import _ops  # loads the library on first use, not at import

    loss, metrics, _ = _ops.policy_loss_fwd(*args)   # the one place a route is chosen
    return loss, dict(zip(_spec.METRICS, metrics.unbind()))


def op_inputs(log_prob, old_log_prob, advantages, mask, settings: _settings.LossSettings):
    """Check the batch's tensors against validated `settings` and put them in the form the compiled ops take:
    (lp, olp, adv, mask, delta_t, op_args), where `policy_loss_fwd(lp, olp, adv, mask, delta_t, *op_args,
    agg_id)` is the loss and `policy_loss_bwd(grad, row_scale, lp, olp, adv, mask, delta_t, *op_args)` its
    gradient (also used by `bandpo_lut.runtime.fused_linear`, so that both share one reading of the options)."""
    _spec.check_tensors(log_prob, old_log_prob, advantages, mask, settings)
    dtype = _spec.compute_dtype(log_prob, old_log_prob, advantages)
    # No .detach(): the op's autograd gives old_log_prob, advantages, mask and delta no gradient. A cast to the
    # dtype a tensor has is no call at all (Tensor.to would return the tensor itself, after a dispatch).
    lp = log_prob if log_prob.dtype == dtype else log_prob.to(dtype)
    olp = old_log_prob if old_log_prob.dtype == dtype else old_log_prob.to(dtype)
    adv = advantages if advantages.dtype == dtype else advantages.to(dtype)
    if mask is not None and mask.dtype not in (torch.bool, dtype):
        mask = mask.to(dtype)            # bool masks pass as bytes; others are weights
    delta_t, op_args = _settings_op_args(settings, lp)
    return lp, olp, adv, mask, delta_t, op_args


def _settings_op_args(settings: _settings.LossSettings, lp: torch.Tensor) -> tuple:
    """(delta_t, op_args) of validated `settings` for a batch on lp's device: the table, a number δ in the ops'
    form, the clip's ids and numbers. Constants of the settings (frozen) and the device (the table's tensors live
    for the process): an eager call with real tensors takes them from the settings object's cache, filled at its
    first call on that device (an eager loop reuses one settings object: `settings.build`'s memo, a module's
    `_built`). Traced calls (torch.compile, jit.trace, a FakeTensor batch) build them each time: there δ may be
    symbolic and the table fake."""
    cacheable = not (torch.compiler.is_compiling() or torch.jit.is_tracing()
                     or getattr(lp, "fake_mode", None) is not None)
    if cacheable:
        cached = settings.__dict__.get(_settings.OP_ARGS_CACHE)
        hit = cached.get(lp.device) if cached is not None else None
        if hit is not None:
            return hit
    eps_low, eps_high = settings.eps()
    clip, delta = settings.clip, settings.delta
    # The baseline clips read no table: a placeholder, and any compiled id (the kernels ignore both).
    div = _checks.compiled_divergence(settings.divergence if clip == "band" else "kl")
    meta, coefficients = _cache.table_for(div.name if clip == "band" else None, lp)
    delta_t, delta_s = None, 0.0
    if clip == "band":
        if isinstance(delta, torch.Tensor):
            # In its own dtype, broadcast to (batch, T) inside the op, which decides its range in that dtype.
            delta_t = delta
        else:   # already checked against the table's range by LossSettings; this is the ops' form of it
            delta_t, delta_s = _cache.scalar_delta(delta, meta)
    max_ratio, dual_clip = settings.max_ratio, settings.dual_clip
    op_args = (delta_s, coefficients, list(meta.grid), div.compiled_id, _spec.CLIP_ID[clip],
                   float(eps_low or 0.0), float(eps_high or 0.0), math.inf if max_ratio is None else float(max_ratio),
                   0.0 if dual_clip is None else float(dual_clip), _spec.MODE_ID[settings.mode])
    if cacheable:
        # the settings are frozen (no __setattr__): the cache goes into the instance's dictionary directly
        settings.__dict__.setdefault(_settings.OP_ARGS_CACHE, {})[lp.device] = (delta_t, op_args)
    return delta_t, op_args


def ratio_bounds(p_old: torch.Tensor, *, clip="band", delta=0.05, divergence="kl", max_ratio=None, eps_low=None,
                 eps_high=None):
    """The [lower, upper] ratio bounds that `policy_loss(clip=...)` applies at the old probabilities `p_old`
    (for figures and logs): the compiled band for clip="band", the baseline formulas otherwise (eps defaults
    as in `policy_loss`); the upper bound capped by max_ratio. Returned in p_old's dtype."""
    if clip == "band":
        return bounds(p_old, delta, divergence, max_ratio=max_ratio)
    if clip not in _spec.DEFAULT_EPS:
        raise ValueError(f"clip: unknown clip={clip!r}; choose one of {_spec.CLIPS}")
    _spec.check_max_ratio(max_ratio)
    lo, up = _spec.baseline_bounds(p_old, clip, *_spec.baseline_eps(clip, eps_low, eps_high))
    return lo, up if max_ratio is None else torch.clamp(up, max=float(max_ratio))


class BandPolicyLoss(torch.nn.Module):
    """`policy_loss` with its settings held by a module: `loss, metrics = BandPolicyLoss(...)(lp, olp, adv, mask)`.

    A tensor δ is a buffer (`module.delta`: in state_dict, moved by .to()). A δ schedule under torch.compile
    (dynamic=True) runs one graph: set `module.settings["delta"] = value` between steps, or give a 0-dim tensor δ
    and update it in place (`module.delta.fill_(value)`)."""

    def __init__(self, *, delta=_D["delta"], divergence=_D["divergence"], max_ratio=_D["max_ratio"],
                 dual_clip=_D["dual_clip"], agg=_D["agg"], clip=_D["clip"], mode=_D["mode"], eps_low=_D["eps_low"],
                 eps_high=_D["eps_high"], settings=None):
        super().__init__()
        # Validated once, here (a bad setting fails at construction, not mid-training), with no tensor made.
        built = _settings.resolve(settings, dict(
            delta=delta, divergence=divergence, max_ratio=max_ratio, dual_clip=dual_clip, agg=agg, clip=clip,
            mode=mode, eps_low=eps_low, eps_high=eps_high), "BandPolicyLoss")
        self.settings = built.options()
        if isinstance(built.delta, torch.Tensor):
            # Module state, by torch's convention: a buffer, in state_dict and moved by .to()/.cuda().
            del self.settings["delta"]
            self.register_buffer("delta", built.delta)
        self._built = built

    def __setstate__(self, state):
        # A module pickled whole (torch.save(module)) by a build that kept only `settings` and the buffer: its
        # settings object is built (and validated) at its first call, from those.
        state.setdefault("_built", None)
        super().__setstate__(state)

    def loss_settings(self) -> _settings.LossSettings:
        """The settings of the next call: the object built at construction, rebuilt (and validated) only when
        `module.settings` was changed (a δ schedule), with the buffer δ when δ is a tensor."""
        options = self.settings if "delta" in self.settings else dict(self.settings, delta=self.delta)
        built = self._built
        if built is None:
            built = self._built = _settings.LossSettings(**options)
        if all(options[k] is getattr(built, k) for k in _settings.FIELDS):
            return built
        return _settings.LossSettings(**options)

    def forward(self, log_prob, old_log_prob, advantages, mask=None):
        return policy_loss(log_prob, old_log_prob, advantages, mask, settings=self.loss_settings())

    def extra_repr(self) -> str:
        shown = [f"{k}={v!r}" for k, v in self.settings.items() if v is not None]
        if "delta" not in self.settings:
            shown.insert(0, f"delta=<buffer {tuple(self.delta.shape)} {self.delta.dtype}>")
        return ", ".join(shown)
