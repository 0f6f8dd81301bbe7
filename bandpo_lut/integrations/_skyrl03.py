"""BandPO for skyrl-train 0.3 (imported by `bandpo_lut.integrations.skyrl` where skyrl-train is the SkyRL
installed): importing it registers the policy loss ``"bandpo"``.

What a SkyRL user adds: ``import bandpo_lut.integrations.skyrl`` in the entrypoint that starts training
(SkyRL's way for custom losses: its registry syncs registered functions to the Ray workers), and on
the command line (the last four lines are the defaults, the paper's settings)::

    trainer.algorithm.policy_loss_type=bandpo
    +trainer.algorithm.band_divergence=kl
    +trainer.algorithm.band_delta=0.05
    +trainer.algorithm.band_max_ratio=10
    +trainer.algorithm.band_dual_clip=10

How it fits SkyRL (tested: `TESTED_SKYRL`):

- **Call convention** (``skyrl_train.utils.ppo_utils``): ``(log_probs, old_log_probs, advantages,
  config, loss_mask, rollout_logprobs) -> (loss, clip_ratio)`` with ``config`` the
  ``trainer.algorithm`` section. Checked at import against SkyRL's own ``ppo_policy_loss``; another
  version with that convention imports with a warning, one without it is refused.
- **Options** come from ``trainer.algorithm.band_*`` (``+`` because they are new keys), defaulting
  to the paper's; a bad one, a misspelt ``band_*`` key, or ``band_*`` keys while ``policy_loss_type`` is
  not ``bandpo`` (SkyRL's own loss would ignore them) is refused, naming the key, by SkyRL's own start-up validation
  (``skyrl_train.utils.validate_cfg``, in the driver before Ray starts, once this module is imported
  first), by `check_config`, and at the latest at the first loss call.
- **Aggregation**: ``trainer.algorithm.loss_reduction`` ("token_mean", "sequence_mean",
  "seq_mean_token_sum_norm") exactly as SkyRL's ``reduce_loss`` (sequence_mean averages over all
  sequences, empty ones counting 0; seq_mean_token_sum_norm divides by ``max_seq_len``).
- **TIS** (``use_tis``): each token's loss times SkyRL's truncated importance weight
  ``min(exp(clamp(old - rollout, ±20)), tis_imp_ratio_cap)``, folded into the advantage (exact for a
  weight >= 0, as in the verl plug-in). SkyRL's ``validate_cfg`` allows ``use_tis`` only with its own
  "regular" and "dual_clip" losses; with this module imported it also allows it with ``bandpo`` (its other
  TIS checks unchanged).
- **SkyRL's own clip settings** (``eps_clip_low/high`` with the band, ``clip_ratio_c`` always) are not used
  by ``bandpo``: a value other than SkyRL's default is named in a warning, once, with what takes its place.
- **band_clip="fixed"** runs SkyRL's own ``ppo_policy_loss`` ("dual_clip" with
  ``clip_ratio_c = band_dual_clip``, "regular" without a dual clip), so the loss is SkyRL's, bit for
  bit, with ``eps_clip_low/high``.
- **clip_ratio**: SkyRL expects a Python float (its own losses call ``.item()``, and its worker calls
  ``.item()`` on the loss right after), so ours is ``float(clip_frac)``: one host synchronisation per
  micro-batch, SkyRL's convention. The other band metrics are not in SkyRL's per-loss return value.
- **Old log-probabilities** pass to bandpo_lut unchanged: one in (0, 2^-9] (rounding) is p = 1 there.
"""
from __future__ import annotations

import functools
import inspect
from importlib import metadata
from types import SimpleNamespace
from typing import Optional

import torch

import bandpo_lut

from ._common import check_framework, config_get
from ._skyrl_keys import (
    LOSS_NAME,
    band_loss_settings,
    band_of,
    unknown_band_keys,
    unread_band_keys,
    warn_unused_skyrl_clips,
)

try:
    from skyrl_train.utils import ppo_utils
except ImportError as exc:  # pragma: no cover - exercised only without skyrl-train
    raise ImportError(
        "bandpo_lut.integrations.skyrl needs SkyRL: the skyrl package (tested: 0.4.0, Python >= 3.12; "
        "requirements-skyrl04.txt) or skyrl-train (tested: 0.3.1; requirements-skyrl.txt)"
    ) from exc

__all__ = ["LOSS_NAME", "TESTED_SKYRL", "check_config", "compute_policy_loss_bandpo"]

TESTED_SKYRL = ("0.3.1",)
_SECTION = "trainer.algorithm"
_EXPECTED_PARAMS = ("log_probs", "old_log_probs", "advantages", "config", "loss_mask",
                    "rollout_logprobs")
_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


def _check_skyrl() -> None:
    try:
        version = metadata.version("skyrl-train")
    except metadata.PackageNotFoundError:
        version = "unknown"
    problems = []
    for name in ("register_policy_loss", "ppo_policy_loss", "reduce_loss", "PolicyLossRegistry"):
        if not hasattr(ppo_utils, name):
            problems.append(f"skyrl_train.utils.ppo_utils.{name} is missing")
    stock = getattr(ppo_utils, "ppo_policy_loss", None)
    if stock is not None:
        params = tuple(inspect.signature(inspect.unwrap(stock)).parameters)
        if params != _EXPECTED_PARAMS:
            problems.append(f"SkyRL's policy losses take {params}, this integration implements "
                            f"{_EXPECTED_PARAMS}")
    check_framework("skyrl-train", version, TESTED_SKYRL, problems, module="skyrl",
                    install=f"pip install --no-deps 'skyrl-train=={TESTED_SKYRL[-1]}' (see "
                            f"requirements-skyrl.txt for its ray and why)")


_check_skyrl()


def _keys(config) -> list:
    if config is None:
        return []
    return list(config.keys()) if hasattr(config, "keys") else list(vars(config))


_checked: set = set()


# SkyRL's loss_reduction -> the aggregation of the band loss whose result it rescales (compute_policy_loss_bandpo)
_AGG = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean", "seq_mean_token_sum_norm": "token-sum"}


def check_config(algorithm_config) -> dict:
    """The band options of SkyRL's ``trainer.algorithm`` section (defaults: the paper's), refused
    with a message naming the key if bandpo_lut cannot train them. Returns them (band_* -> value)."""
    band = band_of(algorithm_config)
    warn_unused_skyrl_clips(algorithm_config, band)
    reduction = config_get(algorithm_config, "loss_reduction", "token_mean")
    keys = tuple(sorted(k for k in _keys(algorithm_config) if isinstance(k, str) and k.startswith("band_")))
    key = (reduction, keys, *sorted((k, repr(v)) for k, v in band.items()))
    if key in _checked:
        return band
    unknown_band_keys(keys)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{_SECTION}.loss_reduction must be one of {_REDUCTIONS} with "
                         f"policy_loss_type={LOSS_NAME}, got {reduction!r}")
    band_loss_settings(band, _AGG[reduction])
    _checked.add(key)
    return band


def _fixed_config(config, dual_clip: Optional[float]):
    """SkyRL's own ppo_policy_loss settings for band_clip='fixed' (its loss, unchanged)."""
    names = ("loss_reduction", "eps_clip_low", "eps_clip_high", "use_tis", "tis_imp_ratio_cap",
             "max_seq_len")
    view = {k: config_get(config, k) for k in names}
    view["use_tis"] = bool(view["use_tis"])
    view["policy_loss_type"] = "regular" if dual_clip is None else "dual_clip"
    view["clip_ratio_c"] = dual_clip
    return SimpleNamespace(**view)


def compute_policy_loss_bandpo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config,
    loss_mask: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, float]:
    """BandPO's policy loss for SkyRL (registered as ``"bandpo"``); see the module docstring."""
    band = check_config(config)
    if band["band_clip"] == "fixed":
        return ppo_utils.ppo_policy_loss(log_probs, old_log_probs, advantages,
                                         _fixed_config(config, band["band_dual_clip"]), loss_mask,
                                         rollout_logprobs)
    mask = torch.ones_like(log_probs) if loss_mask is None else loss_mask
    adv = advantages
    if config_get(config, "use_tis", False):
        w = torch.exp(torch.clamp((old_log_probs - rollout_logprobs).to(torch.float32), -20.0, 20.0))
        w = torch.clamp(w.to(log_probs.dtype), max=config_get(config, "tis_imp_ratio_cap"))
        adv = adv * w.detach()
    reduction = config_get(config, "loss_reduction", "token_mean")
    settings = band_loss_settings(band, _AGG[reduction])   # the one check_config built
    if reduction == "seq_mean_token_sum_norm" and config_get(config, "max_seq_len") is None:
        raise ValueError(f"{_SECTION}.max_seq_len is required for loss_reduction="
                         f"seq_mean_token_sum_norm (SkyRL sets it from the generator's lengths)")
    loss, metrics = bandpo_lut.policy_loss(log_probs, old_log_probs, adv, mask, settings=settings)
    if reduction == "sequence_mean":
        # ours averages over the non-empty sequences; SkyRL's over all of them (an empty one is 0)
        n_seq = (mask.to(loss.dtype).sum(dim=-1) > 0).to(loss.dtype).sum()
        loss = loss * n_seq / mask.shape[0]
    elif reduction == "seq_mean_token_sum_norm":  # the token sum over max_seq_len, averaged over the sequences
        loss = loss / (config_get(config, "max_seq_len") * mask.shape[0])
    return loss, float(metrics["clip_frac"])


def _install_startup_check() -> None:
    """SkyRL's driver validates its config (``skyrl_train.utils.validate_cfg``) before Ray starts; with
    policy_loss_type=bandpo, make that accept ``use_tis`` (which SkyRL allows only with the stock losses that
    implement it; this one does) and refuse an impossible band setting, naming the key; with any
    loss, a misspelt band_* key, and band_* keys that no loss reads (policy_loss_type is not bandpo). Takes
    effect for an entrypoint that imports this module before it imports ``validate_cfg`` (as the
    documented one does). A config without band_* keys and another loss validates as before."""
    from skyrl_train import utils as skyrl_utils
    from skyrl_train.utils import utils as skyrl_utils_impl

    original = skyrl_utils_impl.validate_cfg
    if getattr(original, "_bandpo_check", False):
        return

    @functools.wraps(original)
    def validate_cfg(cfg):
        # SkyRL asserts that use_tis comes with "regular" or "dual_clip", the stock losses that implement TIS; the
        # bandpo loss implements it too, so SkyRL's other TIS checks (the cap, the rollout log-probs, the backend)
        # run as they do for "regular", and the config keeps "bandpo"
        before = cfg.trainer.algorithm
        tis = config_get(before, "policy_loss_type") == LOSS_NAME and config_get(before, "use_tis", False)
        if tis:
            before.policy_loss_type = "regular"
        try:
            original(cfg)
        finally:
            if tis:   # SkyRL's validate_cfg puts a copy of the section in its place: both get "bandpo" back
                before.policy_loss_type = LOSS_NAME
                cfg.trainer.algorithm.policy_loss_type = LOSS_NAME
        algorithm = cfg.trainer.algorithm
        band = [k for k in _keys(algorithm) if isinstance(k, str) and k.startswith("band_")]
        unknown_band_keys(band)
        unread_band_keys(config_get(algorithm, "policy_loss_type"), band)
        if config_get(algorithm, "policy_loss_type") == LOSS_NAME:
            check_config(algorithm)

    validate_cfg._bandpo_check = True
    skyrl_utils_impl.validate_cfg = validate_cfg
    skyrl_utils.validate_cfg = validate_cfg


ppo_utils.register_policy_loss(LOSS_NAME)(compute_policy_loss_bandpo)
_install_startup_check()
