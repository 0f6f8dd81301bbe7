"""The band settings of SkyRL's ``trainer.algorithm`` section, shared by the skyrl-train 0.3 and skyrl 0.4
plug-ins: their names and defaults (the paper's), their validation, and the two ways a setting can be silently
ignored that both refuse: a misspelt ``band_*`` key, and ``band_*`` settings while
``policy_loss_type`` is not ``bandpo`` (SkyRL then trains its own loss, which reads none of them)."""
from __future__ import annotations

import difflib
import math

from ._common import PAPER, check_band, is_number

LOSS_NAME = "bandpo"
SECTION = "trainer.algorithm"
CLIPS = ("band", "fixed")
DEFAULTS = {"band_divergence": PAPER["divergence"], "band_delta": PAPER["delta"],
            "band_max_ratio": PAPER["max_ratio"], "band_dual_clip": PAPER["dual_clip"],
            "band_clip": "band"}


def unknown_band_keys(keys) -> None:
    """Refuse a ``band_*`` key that is not a BandPO setting, naming it and the closest valid one."""
    unknown = sorted(k for k in keys if isinstance(k, str) and k.startswith("band_") and k not in DEFAULTS)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(DEFAULTS), n=1)
        hints.append(f"{SECTION}.{key}" + (f" (did you mean {SECTION}.{close[0]}?)" if close else ""))
    raise ValueError(f"unknown BandPO setting {', '.join(hints)}: it would be ignored. BandPO's settings "
                     f"are {', '.join(DEFAULTS)}")


def unread_band_keys(policy_loss_type, band_keys) -> None:
    """Refuse band settings that no loss reads: ``band_*`` given while the policy loss is not BandPO's."""
    band_keys = sorted(band_keys)
    if band_keys and policy_loss_type != LOSS_NAME:
        raise ValueError(f"{SECTION} has BandPO settings ({', '.join(band_keys)}) but "
                         f"{SECTION}.policy_loss_type={policy_loss_type!r}, so SkyRL would train its "
                         f"{policy_loss_type!r} loss and ignore them. Set {SECTION}.policy_loss_type="
                         f"{LOSS_NAME} (or drop the band_* settings)")


def validate(s: dict) -> None:
    """Refuse band settings (a dict with DEFAULTS' keys) that bandpo_lut cannot train, naming the key."""
    check_band(s["band_divergence"], s["band_delta"], s["band_max_ratio"],
               field={k: f"{SECTION}.band_{k}" for k in ("divergence", "delta", "max_ratio")})
    dual = s["band_dual_clip"]
    if dual is not None and not (is_number(dual) and dual > 1 and not math.isnan(dual)):
        raise ValueError(f"{SECTION}.band_dual_clip must be null (off) or a number > 1 (paper: "
                         f"{PAPER['dual_clip']:g}), got {dual!r}")
    if s["band_clip"] not in CLIPS:
        raise ValueError(f"{SECTION}.band_clip must be one of {CLIPS}, got {s['band_clip']!r}")
