"""BandPO for verl: importing this module registers the policy loss ``"bandpo"``.

Tested with the verl versions in `TESTED_VERL` (``requirements-integrations.txt``); the version
policy is TRL's: another version whose loss convention matches imports with a warning, one where it
differs is refused at import. What a verl user adds (the last four lines are the defaults, the
paper's settings)::

    actor_rollout_ref.actor.policy_loss.loss_mode=bandpo
    actor_rollout_ref.actor.policy_loss._target_=bandpo_lut.integrations.verl.BandPolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.band_delta=0.05
    +actor_rollout_ref.actor.policy_loss.band_divergence=kl
    +actor_rollout_ref.actor.policy_loss.band_max_ratio=10
    +actor_rollout_ref.actor.policy_loss.band_dual_clip=10

How it fits verl:

- **Registration.** ``@register_policy_loss("bandpo")`` on import, so
  ``verl.trainer.ppo.core_algos.get_policy_loss_fn("bandpo")`` is `compute_policy_loss_bandpo`.
- **Options.** verl builds its config dataclasses strictly (an unknown key fails), so the band
  settings live in a subclass of verl's ``PolicyLossConfig``, `BandPolicyLossConfig`, named by the
  ``_target_`` of the ``policy_loss`` section; the ``+`` tells Hydra the keys are new. Defaults are
  the paper's (kl, δ = 0.05, cap 10, dual clip 10). Unknown or invalid band settings (δ outside the
  shipped table's range, a divergence without a compiled kernel, cap < 1, dual clip <= 1) fail when
  verl builds the config -- in the driver's ``validate_config``, before any worker starts -- with a
  message naming the key; so does ``_target_`` without ``loss_mode=bandpo``. ``loss_mode=bandpo`` or
  band keys under verl's own ``PolicyLossConfig`` (a forgotten ``_target_``) fail there too, with a
  message naming the ``_target_`` line: `bandpo_lut.integrations.verl_plugin`, which verl's plug-in
  loader (entry point group ``verl.plugins``) imports at ``import verl``.
- **Import in the workers.** verl instantiates the actor config (and so imports this module through
  the ``_target_``) in the driver and in every worker process that builds an actor, i.e. exactly
  where the loss is looked up. No further switch is needed; verl's own hooks work too, e.g.
  ``actor_rollout_ref.model.external_lib=bandpo_lut.integrations.verl`` (imported by
  ``HFModelConfig``) or the environment variable ``VERL_USE_EXTERNAL_MODULES=bandpo_lut.integrations.verl``
  (imported by ``import verl``; it must reach the Ray workers' environment).
- **Call convention** (verl 0.9.1, ``verl.workers.utils.losses.ppo_loss``): keyword arguments
  ``old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights``;
  returns ``(loss, metrics)``. Checked at import against verl's own ``vanilla`` loss.
- **Aggregation.** Every ``actor.loss_agg_mode`` ("token-mean", "token-sum", "seq-mean-token-mean",
  "seq-mean-token-sum", "seq-mean-token-sum-norm"), normalised by verl's global batch information
  (``config.global_batch_info``: dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
  exactly as verl's ``agg_loss`` does, so gradients do not depend on micro-batching or dp size.
- **Rollout importance weights.** When verl passes ``rollout_is_weights`` (non-negative, no gradient)
  each token's loss is multiplied by its weight, as in verl's own losses. It is folded into the
  advantage (w * max(-A r, -A clip(r)) = max(-(wA) r, -(wA) clip(r)) for w >= 0, and likewise for
  the dual clip), which is exact for the loss and its gradient; the only trace in the metrics is that
  a token with weight 0 counts as never clipped.
- **Metrics.** 0-dim tensors, detached, never converted here: verl converts them when it logs
  (``Metric.from_dict``), and averages them over micro-batches and dp ranks. Names:
  ``actor/pg_clipfrac`` (= our clip_frac), ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (verl's
  meaning: the dual-clip fraction) for verl's dashboards, and every fraction of
  `bandpo_lut.policy_loss` under ``actor/bandpo/<name>``; with ``band_log_counts=True`` also the raw
  counts (``actor/bandpo/n_*``), whose averaged ratios are the exact global fractions (verl averages
  the same number of micro-batches on every rank).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

import bandpo_lut
from bandpo_lut.runtime.loss_spec import COUNTS
from bandpo_lut.runtime.settings import LossSettings

from . import verl_plugin
from ._common import (
    PAPER,
    check_framework,
    config_get,
    did_you_mean,
    loss_settings,
    unused_trainer_clips,
    warn_unused_trainer_clips,
)

try:
    import verl
    from verl.trainer.ppo import core_algos
    from verl.workers.config import PolicyLossConfig
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "bandpo_lut.integrations.verl needs verl (tested: verl==0.9.1). Install the pinned "
        "integration requirements: pip install -r requirements-integrations.txt"
    ) from exc

__all__ = ["BandPolicyLossConfig", "compute_policy_loss_bandpo", "LOSS_NAME", "TESTED_VERL"]

LOSS_NAME = "bandpo"
TESTED_VERL = ("0.9.1",)
TARGET = verl_plugin.TARGET
_SECTION = verl_plugin.SECTION

logger = logging.getLogger(__name__)

# The calling convention this module implements: verl's own loss has exactly these parameters.
_EXPECTED_LOSS_PARAMS = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
                         "config", "rollout_is_weights")
_EXPECTED_AGG_PARAMS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def _check_verl_convention() -> None:
    """Fail at import, not in the middle of a run, if this verl calls its losses differently."""
    version = getattr(verl, "__version__", "unknown")
    vanilla = getattr(core_algos, "compute_policy_loss_vanilla", None)
    agg = getattr(core_algos, "agg_loss", None)
    problems = []
    if not callable(getattr(core_algos, "register_policy_loss", None)):
        problems.append("verl.trainer.ppo.core_algos.register_policy_loss is missing")
    if vanilla is None:
        problems.append("verl.trainer.ppo.core_algos.compute_policy_loss_vanilla is missing")
    elif tuple(inspect.signature(vanilla).parameters) != _EXPECTED_LOSS_PARAMS:
        problems.append(f"verl's policy losses take {tuple(inspect.signature(vanilla).parameters)}, "
                        f"this integration implements {_EXPECTED_LOSS_PARAMS}")
    if agg is None or not set(_EXPECTED_AGG_PARAMS) <= set(inspect.signature(agg).parameters):
        problems.append(f"verl's agg_loss no longer takes the global batch info {_EXPECTED_AGG_PARAMS}")
    check_framework("verl", version, TESTED_VERL, problems)


_check_verl_convention()


# ---------------------------------------------------------------------------------------------
# config


@dataclass
class BandPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the BandPO settings (``actor.policy_loss`` section).

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=`` this class and
    ``loss_mode=bandpo``; set the fields below with ``+actor_rollout_ref.actor.policy_loss.<field>=``.
    The defaults are the paper's settings.

    Args:
        band_delta (float): trust-region radius δ (paper: 0.05), within the shipped table's range.
        band_divergence (str): f-divergence of the trust region, one with a compiled kernel: "kl"
            (paper), "tv", "chi2" or "hellinger".
        band_max_ratio (Optional[float]): cap on the upper ratio bound (paper: 10); null = no cap.
        band_dual_clip (Optional[float]): dual-clip constant c > 1 for A < 0 tokens (paper: 10);
            null = off. (verl's ``actor.clip_ratio_c`` belongs to the vanilla loss and is not used.)
        band_clip (str): "band" (BandPO), or a baseline through the same kernel: "fixed" (PPO/DAPO
            with verl's ``actor.clip_ratio_low`` / ``clip_ratio_high``) or "dcpo" (DCPO's dynamic
            bounds, with the same two ε).
        band_mode (str): "clip" (default), or "mask": tokens outside the band keep the unclipped
            value but lose their gradient (DPPO-style).
        band_log_counts (bool): also return the raw counts as metrics (``actor/bandpo/n_*``).
    """

    loss_mode: str = LOSS_NAME
    band_delta: float = PAPER["delta"]
    band_divergence: str = PAPER["divergence"]
    band_max_ratio: Optional[float] = PAPER["max_ratio"]
    band_dual_clip: Optional[float] = PAPER["dual_clip"]
    band_clip: str = "band"
    band_mode: str = "clip"
    band_log_counts: bool = False

    def __new__(cls, *args, **kwargs):
        # Hydra instantiates the config with every key of the YAML section as a keyword; catch
        # a misspelt band setting here, with a useful message, instead of dataclass's bare TypeError.
        known = {f.name for f in fields(cls)} | {"_target_"}
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            hints = [f"{key!r}" + did_you_mean(key, known - {"_target_"}, show=repr) for key in unknown]
            band = ", ".join(f.name for f in fields(cls) if f.name.startswith("band_"))
            raise TypeError(f"{cls.__name__}: unknown setting {', '.join(hints)} in "
                            f"actor.policy_loss. BandPO settings: {band}; other keys must be fields "
                            f"of verl's PolicyLossConfig")
        return super().__new__(cls)

    def __post_init__(self):
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        band_loss_settings(_band_fields(self))   # refused here, naming the key
        if self.loss_mode != LOSS_NAME:
            raise ValueError(
                f"{_SECTION}._target_ is {type(self).__name__} (BandPO's settings) but "
                f"{_SECTION}.loss_mode={self.loss_mode!r}, so verl would run its {self.loss_mode!r} "
                f"loss and ignore the band. Add {_SECTION}.loss_mode={LOSS_NAME} (or, for verl's "
                f"own loss, drop the _target_ and the band_* keys)")


# The LossSettings option of each band field, and the user's name for it (the key as written on the command line).
_OPTIONS = ("delta", "divergence", "max_ratio", "dual_clip", "clip", "mode")
_NAMES = {option: f"{_SECTION}.band_{option}" for option in _OPTIONS}


def _band_fields(cfg) -> dict:
    """The band_* fields of a policy_loss section (band_* -> value; a key it lacks: the default; null included:
    no cap / no dual clip). band_log_counts, which is no loss option, is checked here."""
    band = {k: config_get(cfg, k, d) for k, d in _DEFAULTS.items()}
    if not isinstance(band["band_log_counts"], bool):
        raise ValueError(f"{_SECTION}.band_log_counts must be true or false, got {band['band_log_counts']!r}")
    return band


def band_loss_settings(band: dict, agg: str = "token-mean", eps=(None, None), eps_names=()) -> LossSettings:
    """The one LossSettings of the band fields ``band`` (band_* -> value), with the aggregation a loss call
    uses and, for band_clip="fixed"/"dcpo", the ε of verl's actor config (``eps_names``: their keys). Built and
    validated once per distinct setting (when verl builds the config; every loss call after that finds it
    built), every message naming the key in full."""
    options = {option: band[f"band_{option}"] for option in _OPTIONS}
    return loss_settings({**options, "agg": agg, "eps_low": eps[0], "eps_high": eps[1]},
                         {**_NAMES, **dict(zip(("eps_low", "eps_high"), eps_names))})


# verl's own PolicyLossConfig refuses loss_mode=bandpo and band_* keys, naming the _target_ line. Also
# installed by verl's plug-in loader at `import verl` (setup.py: verl.plugins), so that a driver which
# never names this module refuses too.
verl_plugin.install()


_DEFAULTS = {f.name: f.default for f in fields(BandPolicyLossConfig) if f.name.startswith("band_")}
_warned_plain_config = False


def _band_of(policy_loss_cfg) -> dict:
    """The band_* fields of an actor's policy_loss section: a BandPolicyLossConfig's, or, for a section
    without them (a DictConfig from a caller of the loss outside verl's config classes: verl's own
    PolicyLossConfig with loss_mode=bandpo is refused when built, verl_plugin), the keys it has over the
    defaults (logged once)."""
    global _warned_plain_config
    band = _band_fields(policy_loss_cfg)
    if policy_loss_cfg is not None and all(hasattr(policy_loss_cfg, k) for k in _DEFAULTS):
        return band
    if not _warned_plain_config:
        _warned_plain_config = True
        logger.warning("loss_mode=bandpo without BandPolicyLossConfig: using the default band "
                       "settings (the paper's) where none are given: %s. Set %s._target_=%s to set "
                       "them in the config (and have them checked when it is built).",
                       band, _SECTION, TARGET)
    return band


# ---------------------------------------------------------------------------------------------
# the loss


@core_algos.register_policy_loss(LOSS_NAME)
def compute_policy_loss_bandpo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """BandPO's policy loss for verl (registered as ``"bandpo"``); see the module docstring.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, response_length) tensors.
        loss_agg_mode: verl's ``actor.loss_agg_mode``.
        config: the actor config (``ActorConfig``); its ``policy_loss`` carries the band settings,
            its ``global_batch_info`` the global normalisation, its ``clip_ratio_low/high`` the ε of
            the "fixed"/"dcpo" baselines.
        rollout_is_weights: optional (batch, response_length) non-negative per-token weights.

    Returns:
        (loss, metrics): the 0-dim loss, aggregated as verl's ``agg_loss`` would, and a dict of
        detached 0-dim metric tensors (see the module docstring for the names).
    """
    if config is None:
        raise ValueError("compute_policy_loss_bandpo: config (the actor config) is required")
    band = _band_of(config_get(config, "policy_loss"))
    _warn_ignored_verl_clips(config, band)
    eps, eps_names = _baseline_eps(config) if band["band_clip"] != "band" else ((None, None), ())

    if rollout_is_weights is not None:
        # Exact for w >= 0: the clip decisions depend only on the sign of A (module docstring).
        advantages = advantages * rollout_is_weights.detach()

    gbi = config_get(config, "global_batch_info", None) or {}
    dp_size = gbi.get("dp_size", 1) or 1
    batch_num_tokens = gbi.get("batch_num_tokens", None)
    global_batch_size = gbi.get("global_batch_size", None)
    loss_scale_factor = gbi.get("loss_scale_factor", None)

    def call(agg):
        return bandpo_lut.policy_loss(log_prob, old_log_prob, advantages, response_mask,
                                      settings=band_loss_settings(band, agg, eps, eps_names))

    # Same normalisation as verl.trainer.ppo.core_algos.agg_loss, on our sums/means.
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            loss, metrics = call("token-mean")
        else:
            loss, metrics = call("token-sum")
            loss = loss / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss, metrics = call("token-sum")
        loss = loss * dp_size
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            loss, metrics = call("seq-mean-token-sum")
        else:
            # the sum over sequences of their token sums is the token sum
            loss, metrics = call("token-sum")
            loss = loss / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (response_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    elif loss_agg_mode == "seq-mean-token-mean":
        loss, metrics = call("seq-mean-token-mean")
        if global_batch_size is not None:
            # ours is the mean over the local non-empty sequences; verl's divides their sum by the
            # global batch size (a tensor product, no host synchronisation)
            n_seq = (response_mask.to(loss.dtype).sum(dim=-1) > 0).to(loss.dtype).sum()
            loss = loss * n_seq / global_batch_size * dp_size
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")

    return loss, _verl_metrics(metrics, band["band_log_counts"])


_ACTOR = "actor_rollout_ref.actor"


def _baseline_eps(config) -> tuple[tuple, tuple]:
    """((eps_low, eps_high), their keys) of band_clip="fixed"/"dcpo": verl's actor.clip_ratio_low/high, each
    defaulting to actor.clip_ratio, as in verl's own loss."""
    eps = config_get(config, "clip_ratio", 0.2)
    values, names = [], []
    for side in ("low", "high"):
        value = config_get(config, f"clip_ratio_{side}", None)
        values.append(eps if value is None else value)
        names.append(f"{_ACTOR}.clip_ratio" + ("" if value is None else f"_{side}"))
    return tuple(values), tuple(names)


# verl's own clip settings (actor config) and their defaults; with loss_mode=bandpo a value other than the
# default is a setting the user expects to act, so it is named once in the log with what replaces it.
_VERL_CLIP_DEFAULTS = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def _warn_ignored_verl_clips(config, s: dict) -> None:
    """verl clip settings given a non-default value that the bandpo loss does not use, each named once."""
    warn_unused_trainer_clips(unused_trainer_clips(config, _VERL_CLIP_DEFAULTS, "clip_ratio_c", s, trainer="verl",
                                                   key_name=lambda k: f"actor.{k}",
                                                   band_name=lambda k: f"{_SECTION}.{k}"), "loss_mode=bandpo")


def _verl_metrics(metrics: dict, log_counts: bool) -> dict[str, torch.Tensor]:
    out = {
        # verl's own names, so its dashboards keep working (pg_clipfrac_lower = dual clip in verl)
        "actor/pg_clipfrac": metrics["clip_frac"].detach(),
        "actor/ppo_kl": metrics["ppo_kl"].detach(),
        "actor/pg_clipfrac_lower": metrics["dual_clip_frac"].detach(),
    }
    for name, value in metrics.items():
        if name in COUNTS and not log_counts:
            continue
        out[f"actor/bandpo/{name}"] = value.detach()
    return out

