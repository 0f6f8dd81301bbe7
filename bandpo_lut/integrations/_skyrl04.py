"""BandPO for SkyRL 0.4 (the ``skyrl`` package; imported by `bandpo_lut.integrations.skyrl` where it is
installed): importing it registers the policy loss ``"bandpo"``.

What a SkyRL 0.4 user adds, in the entrypoint that starts training (SkyRL's registry syncs registered
functions to the Ray workers)::

    import bandpo_lut.integrations.skyrl as bandpo_skyrl
    cfg = bandpo_skyrl.BandPOTrainConfig.from_cli_overrides(sys.argv[1:])   # instead of SkyRLTrainConfig

and on the command line (no ``+``: SkyRL 0.4 refuses it; the last four lines are the defaults, the paper's)::

    trainer.algorithm.policy_loss_type=bandpo
    trainer.algorithm.band_divergence=kl
    trainer.algorithm.band_delta=0.05
    trainer.algorithm.band_max_ratio=10
    trainer.algorithm.band_dual_clip=10

How it fits SkyRL 0.4 (tested: `TESTED_SKYRL`; read from its source, ``skyrl.backends.skyrl_train``):

- **Call convention** (``utils.ppo_utils``): ``(log_probs, old_log_probs, advantages, config, loss_mask,
  rollout_logprobs) -> (loss, metrics)``, ``metrics`` a dict of Python floats, ``config`` the
  ``trainer.algorithm`` dataclass. Checked at import (`_check_skyrl`) with the other structure below.
- **Normalisation is in the advantages**: the trainer divides each advantage by the ``loss_reduction``'s
  denominator (``apply_loss_reduction_to_advantages_minibatch``: token_mean by the mini-batch's token count,
  sequence_mean by batch x the sequence's tokens, seq_mean_token_sum_norm by batch x max_seq_len,
  prompt_mean by prompts x the prompt's tokens), and a loss returns the masked SUM of its per-token losses
  (``reduce_loss``). BandPO's per-token loss is positively homogeneous in A (its bounds depend on p_old
  only; only A's sign picks the branch), so the band loss of the scaled advantages, token-summed, is the
  reduction SkyRL asked for: every ``loss_reduction`` works unchanged.
- **Options** are fields of `BandPOAlgorithmConfig` (SkyRL 0.4 builds its config dataclasses strictly).
  Refused when the config is built, naming ``trainer.algorithm.<key>``: an impossible setting, a misspelt
  ``band_*`` key (with the closest valid one), band settings that differ from the defaults while
  ``policy_loss_type`` is not ``bandpo`` (no loss would read them), and ``band_*`` keys given to SkyRL's
  own config class (which has no such fields). A stock ``AlgorithmConfig`` with ``policy_loss_type=bandpo``
  trains the paper's settings.
- **Off-policy correction** (``trainer.algorithm.off_policy_correction``, which replaced ``use_tis``;
  SkyRL's ``validate_cfg`` turns a deprecated ``use_tis`` into ``tis_ratio_type="token"``): applied as
  SkyRL's own losses apply it (``apply_off_policy_correction``, when rollout log-probs are given): its
  masks (outlier/token/sequence) multiply the loss mask, its truncated IS ratio (token or sequence,
  detached, >= 0) multiplies each token's loss -- folded into the advantage, exact for a weight >= 0 by
  the same homogeneity. Its metrics join ours.
- **Fully-async training** (``trainer.fully_async.enabled=true``) is refused with ``bandpo`` when the config is
  built: SkyRL's fully-async trainer refuses its own losses that read old log-probs (it keeps no stale policy,
  so they would be recomputed by the current weights), but checks a fixed list of its own names.
- **SkyRL's own clip settings** (``eps_clip_low/high`` with the band, ``clip_ratio_c`` always) are not used
  by ``bandpo``: a value other than SkyRL's default is named in a warning, once, with what takes its place.
- **band_clip="fixed"** runs SkyRL's own ``ppo_policy_loss`` ("dual_clip" with ``clip_ratio_c =
  band_dual_clip``, "regular" without), bit for bit, with ``eps_clip_low/high``.
- **metrics**: ``{"clip_ratio": float(clip_frac)}`` (SkyRL's losses report Python floats, one host
  synchronisation per micro-batch, its convention), over the tokens the loss trains (after the
  off-policy masks), plus the off-policy correction's.
"""
import functools
import inspect
import platform
import sys
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import metadata
from types import SimpleNamespace
from typing import Optional

import torch

import bandpo_lut

from ._common import PAPER, check_framework, config_get
from ._skyrl_keys import (
    DEFAULTS,
    LOSS_NAME,
    SECTION,
    band_loss_settings,
    band_of,
    unknown_band_keys,
    unread_band_keys,
    warn_unused_skyrl_clips,
)

TESTED_SKYRL = ("0.4.0",)


def _check_python() -> None:
    """SkyRL 0.4 declares Python >= 3.12. What breaks below it: importing its loss path imports ``skyrl.backends``,
    which builds the Tinker API's pydantic models, and pydantic refuses a ``typing.TypedDict`` field before 3.12
    with an error that names neither SkyRL nor the Python version. The condition is pydantic's own (the class
    ``typing.TypedDict`` makes comes from ``typing``), checked before SkyRL is imported: where a program made
    ``typing.TypedDict`` the ``typing_extensions`` one, as pydantic asks, the loss path imports and runs."""
    if sys.version_info >= (3, 12) or type(typing.TypedDict("_Probe", {})).__module__ != "typing":
        return
    raise ImportError(
        f"bandpo_lut.integrations.skyrl: the installed skyrl package (SkyRL 0.4) needs Python >= 3.12; this is "
        f"Python {platform.python_version()} (its import would fail in pydantic, which refuses SkyRL's "
        f"typing.TypedDict models before 3.12). Use Python >= 3.12 (tested: skyrl {TESTED_SKYRL[-1]}), or "
        f"skyrl-train 0.3.1 with skyrl uninstalled (requirements-skyrl.txt)")


_check_python()

try:
    from skyrl.backends.skyrl_train.utils import off_policy_correction_utils, ppo_utils
    from skyrl.train.config import AlgorithmConfig, SkyRLTrainConfig, TrainerConfig
    from skyrl.train.config import config as skyrl_config
except ImportError as exc:  # pragma: no cover - exercised only with a broken skyrl install
    raise ImportError(
        f"bandpo_lut.integrations.skyrl: the skyrl package is installed but its loss path does not import "
        f"({exc}); SkyRL 0.4 needs Python >= 3.12 (tested: skyrl 0.4.0, requirements-skyrl04.txt)"
    ) from exc

__all__ = ["BandPOAlgorithmConfig", "BandPOTrainConfig", "BandPOTrainerConfig", "LOSS_NAME", "TESTED_SKYRL",
           "check_config", "compute_policy_loss_bandpo"]

_EXPECTED_PARAMS = ("log_probs", "old_log_probs", "advantages", "config", "loss_mask", "rollout_logprobs")


def _check_skyrl() -> None:
    try:
        version = metadata.version("skyrl")
    except metadata.PackageNotFoundError:
        version = "unknown"
    problems = []
    for name in ("register_policy_loss", "ppo_policy_loss", "reduce_loss", "PolicyLossRegistry",
                 "apply_loss_reduction_to_advantages_minibatch"):
        if not hasattr(ppo_utils, name):
            problems.append(f"skyrl.backends.skyrl_train.utils.ppo_utils.{name} is missing")
    stock = getattr(ppo_utils, "ppo_policy_loss", None)
    if stock is not None:
        params = tuple(inspect.signature(inspect.unwrap(stock)).parameters)
        if params != _EXPECTED_PARAMS:
            problems.append(f"SkyRL's policy losses take {params}, this integration implements "
                            f"{_EXPECTED_PARAMS}")
    reduce = getattr(ppo_utils, "reduce_loss", None)
    if reduce is not None and tuple(inspect.signature(reduce).parameters) != ("loss", "loss_mask"):
        problems.append("SkyRL's reduce_loss is no longer the masked sum (loss, loss_mask) this integration "
                        "relies on (the loss_reduction normalisation in the advantages)")
    if not hasattr(off_policy_correction_utils, "compute_off_policy_correction"):
        problems.append("skyrl...off_policy_correction_utils.compute_off_policy_correction is missing")
    if not (is_dataclass(AlgorithmConfig)
            and "off_policy_correction" in {f.name for f in fields(AlgorithmConfig)}):
        problems.append("SkyRL's AlgorithmConfig is not a dataclass with off_policy_correction")
    check_framework("skyrl", version, TESTED_SKYRL, problems, module="skyrl",
                    install=f"pip install --no-deps 'skyrl=={TESTED_SKYRL[-1]}' (Python >= 3.12; see "
                            f"requirements-skyrl04.txt)")


_check_skyrl()


@dataclass
class BandPOAlgorithmConfig(AlgorithmConfig):
    """SkyRL's ``trainer.algorithm`` section plus BandPO's settings (defaults: the paper's)."""

    band_divergence: str = PAPER["divergence"]
    band_delta: float = PAPER["delta"]
    band_max_ratio: Optional[float] = PAPER["max_ratio"]
    band_dual_clip: Optional[float] = PAPER["dual_clip"]
    band_clip: str = "band"

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        band = band_of(self)
        band_loss_settings(band, "token-sum")   # refused here, naming trainer.algorithm.<key>
        # a dataclass always has every field: "set" is "differs from the default" here
        unread_band_keys(self.policy_loss_type, [k for k, d in DEFAULTS.items() if getattr(self, k) != d])
        if self.policy_loss_type == LOSS_NAME:
            warn_unused_skyrl_clips(self, band)


def refuse_fully_async(policy_loss_type, fully_async_enabled) -> None:
    """SkyRL's fully-async trainer refuses its own losses that read old log-probs (its list of them is fixed, so
    it lets ``bandpo`` through): it keeps no stale policy, so the old log-probs would be recomputed by the
    current weights and the band centred on them, not on the policy that generated the rollouts."""
    if policy_loss_type == LOSS_NAME and fully_async_enabled is True:
        raise ValueError(f"trainer.fully_async.enabled=true with {SECTION}.policy_loss_type={LOSS_NAME}: the "
                         f"fully-async trainer keeps no stale policy, so BandPO's old log-probs (the band's "
                         f"centre) would be recomputed by the current weights instead of the rollout policy's "
                         f"(SkyRL refuses its own PPO losses there for the same reason). Train BandPO with "
                         f"the synchronous trainer (trainer.fully_async.enabled=false)")


@dataclass
class BandPOTrainerConfig(TrainerConfig):
    algorithm: BandPOAlgorithmConfig = field(default_factory=BandPOAlgorithmConfig)

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        refuse_fully_async(self.algorithm.policy_loss_type, getattr(self.fully_async, "enabled", False))


@dataclass
class BandPOTrainConfig(SkyRLTrainConfig):
    """SkyRLTrainConfig whose ``trainer.algorithm`` holds BandPO's settings (SkyRL's subclassing way)."""

    trainer: BandPOTrainerConfig = field(default_factory=BandPOTrainerConfig)


def _install_key_checks() -> None:
    """SkyRL refuses a key its dataclass lacks with the list of every field; for ``band_*`` keys under
    ``trainer.algorithm`` say what is wrong instead: a misspelling (with the closest BandPO setting), or
    band settings given to SkyRL's own AlgorithmConfig (which has none). Other keys: SkyRL's check, as before."""
    original = skyrl_config.validate_dict_keys_against_dataclass
    if getattr(original, "_bandpo_check", False):
        return

    @functools.wraps(original)
    def validate_dict_keys_against_dataclass(datacls, d):
        if isinstance(datacls, type) and issubclass(datacls, TrainerConfig) and isinstance(d, dict):
            # SkyRL's own TrainerConfig too (a stock config may name the registered loss)
            algorithm, fully_async = d.get("algorithm"), d.get("fully_async")
            if isinstance(algorithm, dict) and isinstance(fully_async, dict):
                refuse_fully_async(algorithm.get("policy_loss_type"), fully_async.get("enabled"))
        if isinstance(datacls, type) and issubclass(datacls, AlgorithmConfig) and isinstance(d, dict):
            band = [k for k in d if isinstance(k, str) and k.startswith("band_")]
            if issubclass(datacls, BandPOAlgorithmConfig):
                unknown_band_keys(band)
            elif band:
                raise ValueError(
                    f"{SECTION} has BandPO settings ({', '.join(sorted(band))}) but the config class is "
                    f"SkyRL's {datacls.__name__}, which has no such fields: build the config with "
                    f"bandpo_lut.integrations.skyrl.BandPOTrainConfig.from_cli_overrides(...)")
        return original(datacls, d)

    validate_dict_keys_against_dataclass._bandpo_check = True
    skyrl_config.validate_dict_keys_against_dataclass = validate_dict_keys_against_dataclass


def check_config(algorithm_config) -> dict:
    """The band options of SkyRL's ``trainer.algorithm`` (a `BandPOAlgorithmConfig`, or any config, which
    gets the paper's options where it has none), refused naming the key if bandpo_lut cannot train them.
    Returns them (band_* -> value); their LossSettings is built once, here or when the config was built."""
    band = band_of(algorithm_config)
    band_loss_settings(band, "token-sum")
    warn_unused_skyrl_clips(algorithm_config, band)
    return band


def _fixed_config(config, dual_clip: Optional[float]):
    """SkyRL's own ppo_policy_loss settings for band_clip='fixed' (its loss, unchanged)."""
    return SimpleNamespace(policy_loss_type="regular" if dual_clip is None else "dual_clip",
                           eps_clip_low=config_get(config, "eps_clip_low"),
                           eps_clip_high=config_get(config, "eps_clip_high"),
                           clip_ratio_c=dual_clip, off_policy_correction=config_get(config, "off_policy_correction"))


def compute_policy_loss_bandpo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config,
    loss_mask: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict]:
    """BandPO's policy loss for SkyRL 0.4 (registered as ``"bandpo"``); see the module docstring."""
    band = check_config(config)
    if band["band_clip"] == "fixed":
        return ppo_utils.ppo_policy_loss(log_probs, old_log_probs, advantages,
                                         _fixed_config(config, band["band_dual_clip"]), loss_mask,
                                         rollout_logprobs)
    mask = torch.ones_like(log_probs) if loss_mask is None else loss_mask
    adv = advantages
    metrics = {}
    correction = config_get(config, "off_policy_correction")
    if rollout_logprobs is not None and correction is not None:
        tis_ratio, correction_metrics, mask = off_policy_correction_utils.compute_off_policy_correction(
            old_log_probs, rollout_logprobs, mask, correction)
        if tis_ratio is not None:
            adv = adv * tis_ratio
        metrics.update(correction_metrics)
    loss, m = bandpo_lut.policy_loss(log_probs, old_log_probs, adv, mask,
                                     settings=band_loss_settings(band, "token-sum"))
    return loss, {"clip_ratio": float(m["clip_frac"]), **metrics}


ppo_utils.register_policy_loss(LOSS_NAME)(compute_policy_loss_bandpo)
_install_key_checks()
