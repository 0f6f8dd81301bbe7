"""BandPO for TRL: GRPO with BandPO's band in place of the per-token ratio clip.

What a TRL user writes (the paper's settings are the defaults)::

    from bandpo_lut.integrations.trl import BandGRPOConfig, BandGRPOTrainer

    args = BandGRPOConfig(output_dir="out", num_iterations=2)   # 2 optimiser steps per generation
    trainer = BandGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)

Defaults: ``band_divergence="kl", band_delta=0.05, band_max_ratio=10.0`` and ``delta=10.0`` (TRL's
two-sided clip, which is the dual clip here), the paper's settings. Departing from them is an explicit
setting (``delta=None`` turns the dual clip off, ``band_max_ratio=None`` the cap when ``delta`` is None).

What changes, and what does not:

- TRL's GRPO loss (loss types "grpo", "bnpo", "dr_grpo", "dapo", "luspo") clips the token ratio
  with ``torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)``. `BandGRPOTrainer` replaces
  exactly those two bounds, for the duration of one loss call, by the per-token band
  ``[lo(p_old), min(up(p_old), band_max_ratio, delta)]`` of ``bandpo_lut.bounds(log_p_old=...)``:
  TRL's own ``_compute_loss`` then runs unchanged, so its loss types, KL term, importance sampling
  (vLLM IS correction, off-policy masking), entropy masking, tool masks, normalisation and gradient
  accumulation are TRL's. No TRL code is copied.
- Dual clip: TRL's ``delta`` caps ``coef_1`` (the unclipped ratio) at delta for every token. With the
  band's upper bound also capped at delta, TRL's loss is then exactly
  ``bandpo_lut.policy_loss(..., max_ratio=min(band_max_ratio, delta), dual_clip=delta)``: for A < 0 and
  ratio > delta the token's loss is ``-A * delta`` with no gradient (dual-clip PPO). Because TRL's
  delta also caps the ratio of A > 0 tokens, ``band_max_ratio > delta`` cannot be honoured and is
  refused (paper: both 10).
- ``band_clip="fixed"`` keeps TRL's epsilon clip untouched (a PPO/DAPO baseline run that logs the same
  band metrics); the loss is then stock GRPOTrainer's, bit for bit.
- ``--delta None`` / ``--band_max_ratio None`` on a command line: build the parser with
  `argument_parser` (HfArgumentParser parses an optional number as a float only).
- Metrics: ``band/<name>`` for every fraction of `bandpo_lut.policy_loss` (clip_frac,
  clip_frac_upper, clip_frac_lower, dual_clip_frac, clip_frac_upper_lowprob, ppo_kl, band_width_mean,
  clip_frac_pXX_YY), computed with the settings the loss really uses. Read these: TRL's own
  ``clip_ratio/*`` compare the ratio after TRL's delta cap with the bounds, so a token whose ratio is
  above delta (and above the capped bound) is missing from ``clip_ratio/high_mean``. The band counts
  are exact over the logging window and all processes: summed on the device every micro-batch,
  reduced, divided and moved to the host once, when the trainer logs (no host synchronisation in
  the loss path).
- Refused when the config is built, each naming the setting: a band bandpo_lut cannot compute
  (``band_delta`` outside the shipped table's range, a ``band_divergence`` without a compiled kernel,
  ``band_max_ratio < 1``), TRL's ``delta <= 1`` (``delta`` is the dual-clip cap; the radius is
  ``band_delta``), ``epsilon``/``epsilon_high`` with the band (they would be ignored), and, whatever
  ``band_clip``: ``use_liger_kernel=True`` where TRL's Liger path bypasses the hooked loss (a TRL with
  ``GRPOTrainer.compute_liger_loss``; not the tested ones, whose Liger path keeps the hooked loss), loss types
  without TRL's per-token two-sided clip ("cispo", "sapo", "vespo") and
  ``importance_sampling_level="sequence"`` (no per-token clip for the band or its metrics).
  A ``BandGRPOConfig`` given to any trainer but `BandGRPOTrainer` is refused when that trainer is built.
- Old log-probabilities: passed to bandpo_lut unchanged; one in (0, 2^-9] (rounding) is p = 1 there.
- Warned once, when the trainer is built: a schedule under which the ratio is identically 1
  (one optimiser step per generation batch, TRL's default), so that no ratio clip ever acts.

Versions: tested with the TRL versions in `TESTED_TRL` (CI runs the tests with each). Another version
whose GRPO loss still has the structure this hook relies on imports with a warning; one where it
changed is refused at import with a message saying what is missing.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

import bandpo_lut
from bandpo_lut.runtime.settings import LossSettings

from ._common import PAPER, check_framework, check_route, compiled_divergences, is_number, loss_settings

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        "bandpo_lut.integrations.trl needs trl (tested: trl 1.14.2, 1.16.0). Install the pinned "
        "integration requirements: pip install -r requirements-integrations.txt"
    ) from exc

__all__ = ["BandGRPOConfig", "BandGRPOTrainer", "TESTED_TRL", "BAND_LOSS_TYPES", "argument_parser"]

TESTED_TRL = ("1.14.2", "1.16.0")
BAND_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types with TRL's clip
# What the hook relies on in GRPOTrainer._compute_loss, in this order: one policy forward, the
# two-sided clip of the unclipped ratio, then TRL's delta cap of coef_1 (the dual clip).
_LOGPS_CALL = "self._get_per_token_logps_and_entropies("
_CLIP_LINE = "torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)"
_DELTA_LINE = "coef_1 = torch.clamp(coef_1, max=self.args.delta)"
_CONFIG_FIELDS = ("delta", "epsilon", "epsilon_high", "loss_type", "importance_sampling_level",
                  "num_iterations", "steps_per_generation", "gradient_accumulation_steps")
_TRAINER_ATTRS = ("_compute_loss", "_get_per_token_logps_and_entropies", "log")


def _trl_problems() -> list[str]:
    """What differs, in the installed TRL, from the structure this integration relies on."""
    problems = []
    missing = [a for a in _TRAINER_ATTRS if not callable(getattr(GRPOTrainer, a, None))]
    if missing:
        problems.append(f"GRPOTrainer has no {', '.join(missing)}")
    config_fields = {f.name for f in fields(GRPOConfig)}
    missing = [f for f in _CONFIG_FIELDS if f not in config_fields]
    if missing:
        problems.append(f"GRPOConfig has no {', '.join(missing)}")
    if problems:
        return problems
    try:
        src = inspect.getsource(GRPOTrainer._compute_loss)
    except (OSError, TypeError):
        return ["the source of GRPOTrainer._compute_loss is not installed, so its clip cannot be "
                "checked"]
    if src.count(_LOGPS_CALL) != 1:
        problems.append("GRPOTrainer._compute_loss no longer runs exactly one policy forward "
                        f"({_LOGPS_CALL}...)")
    if _CLIP_LINE not in src:
        problems.append(f"GRPOTrainer._compute_loss no longer clips with '{_CLIP_LINE}'")
    elif _DELTA_LINE not in src or src.index(_DELTA_LINE) < src.index(_CLIP_LINE):
        problems.append(f"GRPOTrainer._compute_loss no longer applies '{_DELTA_LINE}' after the clip")
    return problems


def _check_trl() -> None:
    """The version policy (`bandpo_lut.integrations._common.check_framework`), for TRL."""
    version = getattr(trl, "__version__", "unknown")
    problems = _trl_problems()
    if problems and version in TESTED_TRL and problems[0].startswith("the source of"):
        problems = []  # a tested version without its sources: the version is the check
    check_framework("trl", version, TESTED_TRL, problems)


_check_trl()


def _ratio_clip_is_inert(args) -> bool:
    """True when every micro-batch of a generation batch is trained with the weights that generated
    it (TRL then uses the current log-probs as the old ones): the ratio is identically 1.

    TRL generates every ``steps_per_generation * num_iterations`` micro-batches and steps the
    optimiser every ``gradient_accumulation_steps``; the weights change within one generation's use
    only if an optimiser step falls inside it (TRL's own test, grpo_trainer.py)."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every == 0


def _inert_schedule_message(a) -> str:
    """The warning for `_ratio_clip_is_inert`: the real condition, and a num_iterations that fixes it."""
    uses = a.steps_per_generation * a.num_iterations
    fix = a.num_iterations + 1
    while a.gradient_accumulation_steps % (a.steps_per_generation * fix) == 0:
        fix += 1
    return (f"BandGRPOTrainer: with num_iterations={a.num_iterations}, steps_per_generation="
            f"{a.steps_per_generation} and gradient_accumulation_steps="
            f"{a.gradient_accumulation_steps}, each generation batch is used for steps_per_generation "
            f"x num_iterations = {uses} micro-batches and the optimiser steps every "
            f"gradient_accumulation_steps = {a.gradient_accumulation_steps}, a multiple of {uses}: every "
            f"optimiser step sees a fresh generation batch, trained with the weights that generated it, "
            f"so the ratio pi/pi_old is 1 for every token and no ratio clip acts: the band (and the "
            f"dual clip) never clips, and this trains plain on-policy GRPO. For the band to act, the "
            f"weights must change while a generation batch is in use, i.e. gradient_accumulation_steps "
            f"must not be a multiple of steps_per_generation x num_iterations: e.g. num_iterations={fix}.")


@dataclass
class BandGRPOConfig(GRPOConfig):
    """TRL's `GRPOConfig` plus BandPO's settings (every GRPOConfig argument works as in TRL).

    Defaults are the paper's: ``band_divergence="kl", band_delta=0.05, band_max_ratio=10.0`` and dual
    clip 10, which in TRL is its two-sided clip ``delta=10.0``. TRL's ``epsilon``/``epsilon_high`` are
    TRL's fixed clip, used only with ``band_clip="fixed"``.
    """

    band_delta: float = field(default=PAPER["delta"], metadata={
        "help": "BandPO trust-region radius δ (paper: 0.05), within the shipped table's range "
                "(kl: [0.001, 1]). Not TRL's `delta`, which is the dual-clip cap."})
    band_divergence: str = field(default=PAPER["divergence"], metadata={
        "help": "f-divergence of the trust region: " + ", ".join(repr(n) for n in
                                                                 compiled_divergences())
                + " (paper: 'kl')."})
    band_max_ratio: Optional[float] = field(default=PAPER["max_ratio"], metadata={
        "help": "Cap on the band's upper ratio bound (paper: 10); at most `delta` when `delta` is "
                "set. None: no cap (only with delta=None)."})
    band_clip: str = field(default="band", metadata={
        "help": "'band' (BandPO) or 'fixed' (TRL's own epsilon clip, a baseline that logs the same "
                "band/ metrics)."})
    delta: Optional[float] = field(default=PAPER["dual_clip"], metadata={
        "help": "TRL's two-sided clip: the ratio is capped at delta, which for A < 0 is dual-clip "
                "PPO's cap (paper: 10). Must be > 1; None turns the dual clip off. BandPO's "
                "trust-region radius is band_delta."})

    band_fused_linear: bool = field(default=False, metadata={
        "help": "Compute the loss with bandpo_lut.fused_linear_policy_loss from the last hidden states and the "
                "LM head, chunk by chunk, without the logits (bandpo_lut/integrations/trl_fused_linear.py)."})

    def __post_init__(self):
        _refuse_liger(self)
        super().__post_init__()
        _validate(self)


def _refuse_liger(a) -> None:
    """A TRL whose GRPOTrainer computes the loss with Liger in `compute_liger_loss` (Liger's fused-linear GRPO
    loss, its scalar epsilon) never calls `_compute_loss`, the method the band hooks: the run would train
    TRL's fixed clip and log no band metrics, so use_liger_kernel=True is refused there. The tested TRLs
    (1.14.2, 1.16.0) have no such route: with Liger they compute the log-probs with Liger's kernels and
    still take the loss through `_compute_loss`, so the band applies and nothing is refused. Checked before
    GRPOConfig's own checks, so that this message, not one about Liger's installation, is what the user
    reads."""
    if getattr(a, "use_liger_kernel", False) and hasattr(GRPOTrainer, "compute_liger_loss"):
        raise ValueError(f"use_liger_kernel=True: this TRL ({getattr(trl, '__version__', 'unknown')}) computes "
                         "the GRPO loss in Liger's fused-linear kernel (GRPOTrainer.compute_liger_loss) with "
                         "its scalar epsilon clip, not in the loss the band replaces, so the band would be "
                         "silently ignored. Set use_liger_kernel=False; for a loss that never materialises "
                         "the logits, use band_fused_linear=True (BandGRPOTrainer's own fused-linear band "
                         "loss)")


def _refuse_unclipped_loss(a) -> None:
    """Loss types without TRL's per-token two-sided clip, and sequence-level importance sampling,
    have no clip for the band to replace nor for the band/* metrics to describe (they would report
    a clip fraction for a clip the loss never applies): refused whatever band_clip is."""
    if a.loss_type not in BAND_LOSS_TYPES:
        raise ValueError(f"loss_type={a.loss_type!r} has no per-token two-sided ratio clip for the band "
                         f"to replace or for the band/* metrics to describe (BandGRPOConfig works "
                         f"with loss_type in {BAND_LOSS_TYPES}). To train {a.loss_type!r} unchanged, "
                         f"use TRL's own GRPOConfig and GRPOTrainer")
    if a.importance_sampling_level != "token":
        raise ValueError("importance_sampling_level must be 'token' in BandGRPOConfig (the band and its "
                         "band/* metrics are per token, from each token's p_old), got "
                         f"{a.importance_sampling_level!r}. For sequence-level importance sampling "
                         f"(GSPO; TRL's recommendation for luspo), use TRL's own GRPOConfig and "
                         f"GRPOTrainer")


# The user's name of each LossSettings option: TRL's `delta` is the dual clip (and, with the fixed clip, the cap
# of the ratio); `epsilon`/`epsilon_high` are the fixed clip's ε.
_BAND_NAMES = {"delta": "band_delta", "divergence": "band_divergence", "max_ratio": "band_max_ratio",
               "dual_clip": "delta", "clip": "band_clip"}
_FIXED_NAMES = {"dual_clip": "delta", "max_ratio": "delta", "clip": "band_clip", "eps_low": "epsilon",
                "eps_high": "epsilon_high"}


def band_loss_settings(a) -> LossSettings:
    """The one LossSettings of a BandGRPOConfig: what the loss (and its band/* metrics) computes, TRL's delta
    as the dual clip. Built and validated once per distinct setting (when the config is built; the loss calls
    find it built), every message naming the config's field.

    band_clip="band": the band of band_delta/band_divergence, its upper bound capped at band_max_ratio (which
    is at most delta, `_validate`). band_clip="fixed": TRL's own clip [1 - epsilon, 1 + epsilon_high]
    (epsilon_high defaults to epsilon, as in GRPOTrainer), the ratio capped at delta."""
    if a.band_clip == "band":
        options = dict(delta=a.band_delta, divergence=a.band_divergence, max_ratio=a.band_max_ratio,
                       dual_clip=a.delta, clip="band")
        return loss_settings({**options, "agg": "token-sum"}, _BAND_NAMES)
    eps_high = a.epsilon if a.epsilon_high is None else a.epsilon_high
    options = dict(clip="fixed", eps_low=a.epsilon, eps_high=eps_high, dual_clip=a.delta, max_ratio=a.delta)
    names = _FIXED_NAMES if a.epsilon_high is not None else {**_FIXED_NAMES, "eps_high": "epsilon"}
    return loss_settings({**options, "agg": "token-sum"}, names)


def _validate(a) -> None:
    """Refuse every setting that would not train what it says (see the module docstring)."""
    _refuse_liger(a)
    check_route(a.band_clip, "band_clip")
    if is_number(a.delta) and 0 < a.delta <= 1:
        # TRL's name for its clip is BandPO's name for the radius: the one mix-up worth its own message
        raise ValueError(f"delta={a.delta!r} is TRL's two-sided clip, which caps the ratio (here: dual-clip "
                         f"PPO's cap for A < 0): a number > 1 (paper: {PAPER['dual_clip']:g}) or None. BandPO's "
                         f"trust-region radius is band_delta (e.g. band_delta={a.delta!r})")
    band_loss_settings(a)
    _refuse_unclipped_loss(a)
    from .trl_fused_linear import validate as validate_fused_linear

    validate_fused_linear(a, _ratio_clip_is_inert)
    if a.band_clip != "band":
        return
    if a.epsilon != 0.2 or a.epsilon_high is not None:
        raise ValueError(f"epsilon={a.epsilon!r}, epsilon_high={a.epsilon_high!r}: TRL's fixed "
                         f"clip [1 - epsilon, 1 + epsilon_high] is replaced by the band with "
                         f"band_clip='band', so these would be ignored. Remove them (the band's "
                         f"options are band_delta, band_divergence, band_max_ratio), or set "
                         f"band_clip='fixed' to train with TRL's clip")
    if a.delta is not None and (a.band_max_ratio is None or a.band_max_ratio > a.delta):
        raise ValueError(f"band_max_ratio={a.band_max_ratio!r} with delta={a.delta!r}: TRL's delta "
                         f"caps the ratio of every token (A > 0 included), so the band's upper "
                         f"bound cannot exceed it. Set band_max_ratio <= delta (paper: both "
                         f"{PAPER['dual_clip']:g}), or delta=None (no dual clip) for a higher cap")


class _BandEdge:
    """Stands in for TRL's ``epsilon_low`` / ``epsilon_high`` during one loss call, so that TRL's own
    expressions ``1 - self.epsilon_low`` and ``1 + self.epsilon_high`` are the band's per-token lower
    and upper bounds, exactly (no 1 - (1 - lo) rounding). Any other use is refused loudly."""

    __slots__ = ("bound", "side")

    def __init__(self, bound: torch.Tensor, side: str):
        self.bound, self.side = bound, side

    def _refuse(self, what):
        raise TypeError(f"BandGRPOTrainer: TRL used epsilon_{self.side} as {what}; only "
                        f"'1 {'-' if self.side == 'low' else '+'} epsilon_{self.side}' is supported "
                        f"(trl {', '.join(TESTED_TRL)})")

    def __rsub__(self, other):
        if self.side == "low" and is_number(other) and other == 1:
            return self.bound
        self._refuse(f"'{other!r} - epsilon'")

    def __radd__(self, other):
        if self.side == "high" and is_number(other) and other == 1:
            return self.bound
        self._refuse(f"'{other!r} + epsilon'")

    def __float__(self):
        self._refuse("a number")

    def __repr__(self):
        return f"_BandEdge({self.side}, shape={tuple(self.bound.shape)})"


def _install_config_guard() -> None:
    """A `BandGRPOConfig` given to a trainer that does not apply it (TRL's own GRPOTrainer, or another
    subclass of it) would train stock TRL with every band setting ignored: refuse it there, before the
    model loads. Only that call changes; every other construction runs GRPOTrainer's __init__."""
    original = GRPOTrainer.__init__
    if getattr(original, "_bandpo_guard", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if not isinstance(self, BandGRPOTrainer):
            try:
                given = signature.bind_partial(self, *args, **kwargs).arguments.get("args")
            except TypeError:
                given = None  # GRPOTrainer reports its own argument error
            if isinstance(given, BandGRPOConfig):
                raise TypeError(f"{type(self).__name__} got args=BandGRPOConfig(...), but only "
                                f"BandGRPOTrainer applies the band: {type(self).__name__} would train "
                                f"TRL's fixed clip and ignore every band_* setting. Use "
                                f"bandpo_lut.integrations.trl.BandGRPOTrainer (same arguments)")
        original(self, *args, **kwargs)

    __init__._bandpo_guard = True
    GRPOTrainer.__init__ = __init__


def argument_parser(*dataclass_types):
    """`transformers.HfArgumentParser` over ``dataclass_types`` (one of them BandGRPOConfig) where
    ``--delta None`` and ``--band_max_ratio None`` mean None, as their help says (HfArgumentParser
    parses an Optional[float] flag as a float only, so "None" fails there)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types)
    for action in parser._actions:  # argparse's list of flags; the only way to change one's type
        if action.dest in _NONE_FLAGS:
            action.type = _float_or_none
    return parser


_NONE_FLAGS = ("delta", "band_max_ratio")


def _float_or_none(text: str):
    return None if text.strip().lower() in ("none", "null") else float(text)


def _counts_and_fractions():
    from bandpo_lut.runtime.loss_spec import COUNTS, FRACTIONS, metrics_from_counts

    return COUNTS, FRACTIONS, metrics_from_counts


class BandGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with BandPO's band as the per-token ratio clip; see the module docstring.

    Takes exactly GRPOTrainer's arguments; ``args`` must be a `BandGRPOConfig`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, BandGRPOConfig):
            raise TypeError(f"BandGRPOTrainer needs args=BandGRPOConfig(...), got "
                            f"{type(self.args).__name__}")
        _validate(self.args)  # again: the config may have been edited since it was built
        self._band_counts = {"train": None, "eval": None}
        if _ratio_clip_is_inert(self.args):
            warnings.warn(_inert_schedule_message(self.args), UserWarning, stacklevel=2)

    # -- the loss ---------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self.args.band_fused_linear:
            from .trl_fused_linear import fused_linear_loss

            return fused_linear_loss(self, model, inputs, band_loss_settings(self.args))
        captured = []
        policy_forward = self._get_per_token_logps_and_entropies

        def capture(*args, **kwargs):
            out = policy_forward(*args, **kwargs)
            captured.append(out[0])
            return out

        old = inputs.get("old_per_token_logps")
        saved = (self.epsilon_low, self.epsilon_high)
        patched_before = "_get_per_token_logps_and_entropies" in self.__dict__
        settings = band_loss_settings(self.args)
        if settings.clip == "band" and old is not None:
            # (old is None means TRL uses the current log-probs: ratio == 1, nothing to clip.)
            with torch.no_grad():
                # A log-probability a hair above 0 (rounding) is p = 1 in bandpo_lut itself
                # (LOG_PROB_ROUNDING); a clearly invalid one gives a NaN bound, as in every integration.
                lo, up = bandpo_lut.bounds(log_p_old=old.detach(), delta=settings.delta,
                                           divergence=settings.divergence, max_ratio=settings.max_ratio)
            self.epsilon_low = _BandEdge(lo.to(old.dtype), "low")
            self.epsilon_high = _BandEdge(up.to(old.dtype), "high")
        self._get_per_token_logps_and_entropies = capture
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            if patched_before:  # someone else's wrapper of this instance: put it back
                self._get_per_token_logps_and_entropies = policy_forward
            else:
                del self._get_per_token_logps_and_entropies
            self.epsilon_low, self.epsilon_high = saved
        if captured:
            self._record_band_counts(inputs, captured[0], old)
        return loss

    @torch.no_grad()
    def _record_band_counts(self, inputs, per_token_logps, old):
        """Add this micro-batch's band counts to the window's (on the device, no host sync)."""
        counts_names, _, _ = _counts_and_fractions()
        logps = per_token_logps.detach()
        old = logps if old is None else old.detach()
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        adv = inputs["advantages"]
        if adv.dim() == 1:
            adv = adv.unsqueeze(1)
        adv = adv.expand_as(logps).contiguous()
        _, metrics = bandpo_lut.policy_loss(logps, old, adv, mask, settings=band_loss_settings(self.args))
        vec = torch.stack([metrics[name].detach().float() for name in counts_names])
        mode = "train" if self.model.training else "eval"
        acc = self._band_counts.get(mode)
        self._band_counts[mode] = vec if acc is None else acc + vec

    # -- logging ----------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        acc = self._band_counts.get(mode)
        if acc is not None:
            counts_names, fraction_names, metrics_from_counts = _counts_and_fractions()
            total = self.accelerator.reduce(acc, reduction="sum")  # exact global counts
            fractions = metrics_from_counts(dict(zip(counts_names, total.unbind())))
            values = torch.stack([fractions[k] for k in fraction_names]).tolist()  # one transfer
            prefix = "eval_" if mode == "eval" else ""
            logs.update({f"{prefix}band/{k}": v for k, v in zip(fraction_names, values)})
            self._band_counts[mode] = None
        super().log(logs, start_time)


_install_config_guard()
