"""BandPO for TRL: GRPO with BandPO's band in place of the per-token ratio clip.

Supported TRL: exactly the versions in `SUPPORTED_TRL` (pinned in ``requirements-integrations.txt``);
any other version fails at import with a message saying so (``BANDPO_ALLOW_UNTESTED_TRL=1`` turns
that into a warning; the structural checks below still apply). What a TRL user writes::

    from bandpo_lut.integrations.trl import BandGRPOConfig, BandGRPOTrainer

    args = BandGRPOConfig(output_dir="out", band_delta=0.05, band_divergence="kl",
                          band_max_ratio=10.0, delta=10.0)    # delta: TRL's two-sided clip = dual clip
    trainer = BandGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)

What changes, and what does not:

- TRL's GRPO loss (loss types "grpo", "bnpo", "dr_grpo", "dapo", "luspo") clips the token ratio
  with ``torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)``. `BandGRPOTrainer` replaces
  exactly those two bounds, for the duration of one loss call, by the per-token band
  ``[lo(p_old), up(p_old)]`` of ``bandpo_lut.bounds(log_p_old=old_per_token_logps, ...)``: TRL's own
  ``_compute_loss`` then runs unchanged, so its loss types, KL term, importance sampling (vLLM IS
  correction, off-policy masking), entropy masking, tool masks, normalisation and gradient
  accumulation are TRL's, and its clip metrics (``clip_ratio/low_mean``, ``high_mean``,
  ``region_mean``, ...) count the band's clipping. This is the smallest hook: no TRL code is copied.
- Dual clip: TRL's own ``delta`` (its "two-sided" clip caps the ratio at delta) is dual-clip PPO's
  cap for A < 0; for A > 0 it also caps the ratio at delta, which changes nothing when
  ``band_max_ratio <= delta`` (the paper: both 10).
- ``band_clip="fixed"`` keeps TRL's epsilon clip untouched (a PPO/DAPO baseline run that logs the same
  band metrics); the loss is then stock GRPOTrainer's, bit for bit.
- Metrics: besides TRL's, ``band/<name>`` for every fraction of `bandpo_lut.policy_loss`
  (clip_frac, clip_frac_upper, clip_frac_lower, dual_clip_frac, clip_frac_upper_lowprob, ppo_kl,
  band_width_mean, clip_frac_pXX_YY). They are exact over the logging window and all processes:
  the raw counts are summed on the device every micro-batch and reduced, divided and moved to the
  host once, when the trainer logs (no host synchronisation in the loss path).
- Not supported with the band (a clear error at config time): loss types without TRL's two-sided
  clip ("cispo", "sapo", "vespo") and ``importance_sampling_level="sequence"`` (one ratio per
  sequence has no per-token p_old).
"""
from __future__ import annotations

import inspect
import math
import os
import warnings
from dataclasses import dataclass, field
from numbers import Real
from typing import Optional

import torch

import bandpo_lut

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        "bandpo_lut.integrations.trl needs trl (supported: trl==1.16.0). Install the pinned "
        "integration requirements: pip install -r requirements-integrations.txt"
    ) from exc

__all__ = ["BandGRPOConfig", "BandGRPOTrainer", "SUPPORTED_TRL", "BAND_LOSS_TYPES"]

SUPPORTED_TRL = ("1.16.0",)
BAND_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types with TRL's clip
_CLIP_LINE = "torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)"
_LOGPS_CALL = "self._get_per_token_logps_and_entropies("


def _check_trl() -> None:
    version = getattr(trl, "__version__", "unknown")
    if version not in SUPPORTED_TRL:
        msg = (f"bandpo_lut.integrations.trl supports trl {', '.join(SUPPORTED_TRL)}, but trl "
               f"{version} is installed: pip install -r requirements-integrations.txt (or "
               f"'trl=={SUPPORTED_TRL[-1]}')")
        if os.environ.get("BANDPO_ALLOW_UNTESTED_TRL") != "1":
            raise ImportError(msg + "; BANDPO_ALLOW_UNTESTED_TRL=1 tries it anyway")
        warnings.warn(msg, stacklevel=3)
    # The hook relies on two facts of GRPOTrainer._compute_loss; refuse a TRL where they changed.
    try:
        src = inspect.getsource(GRPOTrainer._compute_loss)
    except (OSError, TypeError):  # no source installed: the version check has to do
        return
    if _CLIP_LINE not in src or src.count(_LOGPS_CALL) != 1:
        raise ImportError(f"trl {version}: GRPOTrainer._compute_loss no longer clips with "
                          f"'{_CLIP_LINE}' after one policy forward; BandGRPOTrainer cannot "
                          f"replace its clip (supported: trl {', '.join(SUPPORTED_TRL)})")


_check_trl()


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


@dataclass
class BandGRPOConfig(GRPOConfig):
    """TRL's `GRPOConfig` plus BandPO's settings (every GRPOConfig argument works as in TRL).

    The paper's settings: ``band_divergence="kl", band_delta=0.05, band_max_ratio=10.0`` and dual
    clip 10, which in TRL is its two-sided clip ``delta=10.0``. TRL's ``epsilon``/``epsilon_high`` are
    used only with ``band_clip="fixed"``.
    """

    band_delta: float = field(default=0.05, metadata={
        "help": "BandPO trust-region radius δ of the band (paper: 0.05)."})
    band_divergence: str = field(default="kl", metadata={
        "help": "f-divergence of the trust region: 'kl' (paper), 'tv' or 'chi2'."})
    band_max_ratio: Optional[float] = field(default=None, metadata={
        "help": "Cap on the band's upper ratio bound (paper: 10). None: no cap."})
    band_clip: str = field(default="band", metadata={
        "help": "'band' (BandPO) or 'fixed' (TRL's own epsilon clip, a baseline that logs the same "
                "band/ metrics)."})

    def __post_init__(self):
        super().__post_init__()
        if self.band_clip not in ("band", "fixed"):
            raise ValueError(f"band_clip must be 'band' or 'fixed', got {self.band_clip!r}")
        if not (_is_number(self.band_delta) and 0 < self.band_delta < math.inf):
            raise ValueError(f"band_delta must be a positive number, got {self.band_delta!r}")
        from bandpo_lut import divergences

        if self.band_divergence not in divergences.names():
            raise ValueError(f"band_divergence must be one of {divergences.names()}, "
                             f"got {self.band_divergence!r}")
        if self.band_max_ratio is not None and not (_is_number(self.band_max_ratio)
                                                    and self.band_max_ratio >= 1):
            raise ValueError(f"band_max_ratio must be None or a number >= 1, "
                             f"got {self.band_max_ratio!r}")
        if self.band_clip == "band":
            if self.loss_type not in BAND_LOSS_TYPES:
                raise ValueError(f"BandPO replaces the two-sided ratio clip of loss_type in "
                                 f"{BAND_LOSS_TYPES}; loss_type={self.loss_type!r} has none "
                                 f"(use band_clip='fixed' to run it unchanged)")
            if self.importance_sampling_level != "token":
                raise ValueError("BandPO's band is per token (it depends on each token's p_old): "
                                 "importance_sampling_level must be 'token', got "
                                 f"{self.importance_sampling_level!r}")


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
                        f"(trl {', '.join(SUPPORTED_TRL)})")

    def __rsub__(self, other):
        if self.side == "low" and _is_number(other) and other == 1:
            return self.bound
        self._refuse(f"'{other!r} - epsilon'")

    def __radd__(self, other):
        if self.side == "high" and _is_number(other) and other == 1:
            return self.bound
        self._refuse(f"'{other!r} + epsilon'")

    def __float__(self):
        self._refuse("a number")

    def __repr__(self):
        return f"_BandEdge({self.side}, shape={tuple(self.bound.shape)})"


def _counts_and_fractions():
    from bandpo_lut.reference.policy_loss import COUNTS, FRACTIONS, metrics_from_counts

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
        self._band_counts = {"train": None, "eval": None}

    # -- the loss ---------------------------------------------------------------------------

    def _band_metric_kwargs(self) -> dict:
        a = self.args
        dual = a.delta if (a.delta is not None and a.delta > 1) else None
        if a.band_clip == "band":
            return dict(clip="band", delta=a.band_delta, divergence=a.band_divergence,
                        max_ratio=a.band_max_ratio, dual_clip=dual)
        return dict(clip="fixed", eps_low=float(self.epsilon_low),
                    eps_high=float(self.epsilon_high), dual_clip=dual)

    def _compute_loss(self, model, inputs):
        captured = []
        policy_forward = self._get_per_token_logps_and_entropies

        def capture(*args, **kwargs):
            out = policy_forward(*args, **kwargs)
            captured.append(out[0])
            return out

        old = inputs.get("old_per_token_logps")
        saved = (self.epsilon_low, self.epsilon_high)
        if self.args.band_clip == "band" and old is not None:
            # (old is None means TRL uses the current log-probs: ratio == 1, nothing to clip.)
            with torch.no_grad():
                # log-probs are <= 0; a rounding-positive one must not become a NaN bound (a NaN
                # bound on a padded token would still poison TRL's masked sum)
                log_p_old = torch.clamp(old.detach(), max=0.0)
                lo, up = bandpo_lut.bounds(log_p_old=log_p_old, delta=self.args.band_delta,
                                           divergence=self.args.band_divergence,
                                           max_ratio=self.args.band_max_ratio)
            self.epsilon_low = _BandEdge(lo.to(old.dtype), "low")
            self.epsilon_high = _BandEdge(up.to(old.dtype), "high")
        self._get_per_token_logps_and_entropies = capture
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
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
        _, metrics = bandpo_lut.policy_loss(logps, old, adv, mask, agg="token-sum",
                                            **self._band_metric_kwargs())
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
