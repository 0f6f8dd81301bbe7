"""The band options of SkyRL's ``trainer.algorithm`` section, shared by the skyrl-train 0.3 and skyrl 0.4
plug-ins: their names and defaults (the paper's), the one LossSettings they build, and the two ways an option
can be silently ignored that both refuse: a misspelt ``band_*`` key, and ``band_*`` options while
``policy_loss_type`` is not ``bandpo`` (SkyRL then trains its own loss, which reads none of them); and the
one they warn about: SkyRL's own clip settings given with ``bandpo``, which the band replaces."""
from __future__ import annotations

from bandpo_lut.runtime.settings import LossSettings

from ._common import (
    PAPER,
    check_route,
    config_get,
    did_you_mean,
    loss_settings,
    unused_trainer_clips,
    warn_unused_trainer_clips,
)

LOSS_NAME = "bandpo"
SECTION = "trainer.algorithm"
DEFAULTS = {"band_divergence": PAPER["divergence"], "band_delta": PAPER["delta"],
            "band_max_ratio": PAPER["max_ratio"], "band_dual_clip": PAPER["dual_clip"],
            "band_clip": "band"}
# The LossSettings options among them (band_clip is a route: "fixed" runs SkyRL's own loss) and their keys.
_OPTIONS = ("divergence", "delta", "max_ratio", "dual_clip")
_NAMES = {option: f"{SECTION}.band_{option}" for option in _OPTIONS}


def band_of(algorithm_config) -> dict:
    """trainer.algorithm.band_* where given (null included: no cap / no dual clip), else the paper's."""
    return {k: config_get(algorithm_config, k, d) for k, d in DEFAULTS.items()}


def band_loss_settings(band: dict, agg: str = "token-mean") -> LossSettings:
    """The one LossSettings of the band options ``band`` (DEFAULTS' keys) for a loss call aggregating with
    ``agg``: built and validated once per distinct setting (at SkyRL's config validation; the loss calls find
    it built), a bad value refused naming ``trainer.algorithm.<key>``. ``band_clip`` is checked too."""
    check_route(band["band_clip"], f"{SECTION}.band_clip")
    return loss_settings({**{option: band[f"band_{option}"] for option in _OPTIONS}, "agg": agg}, _NAMES)


def unknown_band_keys(keys) -> None:
    """Refuse a ``band_*`` key that is not a BandPO option, naming it and the closest valid one."""
    unknown = sorted(k for k in keys if isinstance(k, str) and k.startswith("band_") and k not in DEFAULTS)
    if not unknown:
        return
    hints = [f"{SECTION}.{key}" + did_you_mean(key, DEFAULTS, show=lambda k: f"{SECTION}.{k}") for key in unknown]
    raise ValueError(f"unknown BandPO setting {', '.join(hints)}: it would be ignored. BandPO's settings "
                     f"are {', '.join(DEFAULTS)}")


def unread_band_keys(policy_loss_type, band_keys) -> None:
    """Refuse band options that no loss reads: ``band_*`` given while the policy loss is not BandPO's."""
    band_keys = sorted(band_keys)
    if band_keys and policy_loss_type != LOSS_NAME:
        raise ValueError(f"{SECTION} has BandPO settings ({', '.join(band_keys)}) but "
                         f"{SECTION}.policy_loss_type={policy_loss_type!r}, so SkyRL would train its "
                         f"{policy_loss_type!r} loss and ignore them. Set {SECTION}.policy_loss_type="
                         f"{LOSS_NAME} (or drop the band_* settings)")


# SkyRL's own clip settings and their defaults (skyrl-train 0.3's ppo_base_config, skyrl 0.4's AlgorithmConfig):
# with policy_loss_type=bandpo a value other than the default is one the user expects to act.
SKYRL_CLIP_DEFAULTS = {"eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": 3.0}


def warn_unused_skyrl_clips(algorithm_config, band: dict) -> None:
    """SkyRL clip settings given a non-default value that the bandpo loss does not use (``clip_ratio_c``: the dual
    clip is band_dual_clip on both routes; ``eps_clip_low/high`` with the band), each named once."""
    warn_unused_trainer_clips(unused_trainer_clips(algorithm_config, SKYRL_CLIP_DEFAULTS, "clip_ratio_c", band,
                                                   trainer="SkyRL", key_name=lambda k: f"{SECTION}.{k}",
                                                   band_name=lambda k: f"{SECTION}.{k}"),
                              f"policy_loss_type={LOSS_NAME}")
