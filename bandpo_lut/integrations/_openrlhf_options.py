"""The OpenRLHF integration's options, shared by its loss (`bandpo_lut.integrations.openrlhf`) and its command
line (`bandpo_lut.integrations.openrlhf_launcher`): the band's LossSettings from the ``--band.*`` options, the
OpenRLHF arguments the band cannot train, and the environment variable that carries the band to the Ray workers.

Light on purpose: it imports no OpenRLHF (nor deepspeed), so the launcher's ``--help`` and its argument errors
come before any of OpenRLHF's stack is imported.
"""
from __future__ import annotations

import json
from typing import Optional

from bandpo_lut.runtime.settings import LossSettings

from ._common import PAPER, check_route, loss_settings

ENV = "BANDPO_OPENRLHF"   # the band's options, as JSON, for the Ray workers' `activate_from_env`
# The band's options (the launcher's --band.*) and the argument that sets each.
OPTIONS = ("divergence", "delta", "max_ratio", "dual_clip", "clip")
NAMES = {option: f"--band.{option}" for option in OPTIONS}


def band_settings(divergence: str = PAPER["divergence"], delta: float = PAPER["delta"],
                  max_ratio: Optional[float] = PAPER["max_ratio"], dual_clip: Optional[float] = PAPER["dual_clip"],
                  clip: str = "band") -> LossSettings:
    """The band's LossSettings (defaults: the paper's), each bad value refused naming its ``--band.*``
    argument. ``clip``: "band", or "fixed" for OpenRLHF's own clip (with the band metrics)."""
    check_route(clip, NAMES["clip"])
    return loss_settings(dict(divergence=divergence, delta=delta, max_ratio=max_ratio, dual_clip=dual_clip,
                              clip=clip), NAMES)


def check_openrlhf_args(policy_loss_type="ppo", is_correction_level="off", loss_agg_mode="token-mean"):
    """Refuse the OpenRLHF settings the band does not train, naming OpenRLHF's argument."""
    if policy_loss_type != "ppo":
        raise ValueError(f"--actor.policy_loss_type={policy_loss_type!r} is not supported with BandPO: "
                         f"use 'ppo' (gspo uses one sequence-level ratio, which the per-token band "
                         f"does not bound)")
    if is_correction_level != "off":
        raise ValueError(f"--algo.advantage.is_correction_level={is_correction_level!r} is not supported "
                         f"with BandPO (the train/rollout IS correction is not carried over): use 'off'")
    if loss_agg_mode not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"--actor.loss_agg_mode must be 'token-mean' or 'seq-mean-token-mean', got "
                         f"{loss_agg_mode!r}")


# OpenRLHF's defaults of its own clip arguments (openrlhf.cli.train_ppo_ray): --actor.eps_clip 0.2, which
# --actor.eps_clip_low_high (default None) replaces on both sides, --actor.dual_clip None.
OPENRLHF_EPS = 0.2


def check_clip_args(settings: LossSettings, dual_clip=None, eps_clip=OPENRLHF_EPS, eps_clip_low_high=None) -> None:
    """Refuse OpenRLHF clip arguments that the band's settings replace and that would otherwise be silently
    ignored: a --actor.dual_clip other than --band.dual_clip (the dual clip on both --band.clip routes), and, with
    the band, an ε clip other than OpenRLHF's default (it acts only with --band.clip fixed)."""
    if dual_clip is not None and dual_clip != settings.dual_clip:
        raise ValueError(f"--actor.dual_clip={dual_clip!r}: the dual clip is --band.dual_clip="
                         f"{settings.dual_clip!r} (with --band.clip band and fixed alike; None turns it off); "
                         f"give --band.dual_clip {dual_clip!r} instead")
    if settings.clip != "band":
        return
    low, high = (eps_clip, eps_clip) if eps_clip_low_high is None else tuple(eps_clip_low_high)
    if (low, high) != (OPENRLHF_EPS, OPENRLHF_EPS):
        given = (f"--actor.eps_clip={eps_clip!r}" if eps_clip_low_high is None
                 else f"--actor.eps_clip_low_high={list(eps_clip_low_high)!r}")
        raise ValueError(f"{given}: with --band.clip band the ratio clip is the band (--band.delta="
                         f"{settings.delta!r}, --band.divergence={settings.divergence!r}), and OpenRLHF's epsilon "
                         f"clip does not act; drop it, or use --band.clip fixed for OpenRLHF's own clip")


def band_options_json(settings: LossSettings) -> str:
    """The band's options of ``settings`` as `activate_from_env` reads them from ``$BANDPO_OPENRLHF``."""
    return json.dumps({option: getattr(settings, option) for option in OPTIONS})


def band_from_json(text: str) -> LossSettings:
    """The LossSettings of `band_options_json`'s text."""
    return band_settings(**json.loads(text))
