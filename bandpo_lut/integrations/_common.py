"""What the four trainer integrations (verl, TRL, SkyRL, OpenRLHF) share: the paper's defaults, the one way an
integration turns its config fields into a `LossSettings`, the config getter, the "did you mean" hint and the
version policy.

Light on purpose: importing it imports no trainer (torch comes with the `bandpo_lut` package). The options are
validated by `LossSettings` alone (the loss's one validation path), which reads the divergence registry and the
shipped table's header, never the compiled extension: so a bad setting is refused when the trainer's config object
is built, before any model loads, in one message that names the user's field.
"""
from __future__ import annotations

import difflib
import warnings
from typing import Mapping

from bandpo_lut.runtime.settings import LossSettings
from bandpo_lut.runtime.settings import build as build_settings
from bandpo_lut.tables.checks import is_number
from bandpo_lut.tables.divergences import compiled_names as compiled_divergences

# The paper's settings (BandPO: KL trust region, δ = 0.05, upper ratio bound capped at 10, dual
# clip 10). Every integration defaults to these; departing from them is an explicit setting.
PAPER = {"divergence": "kl", "delta": 0.05, "max_ratio": 10.0, "dual_clip": 10.0}

# The clips an integration whose "fixed" is the trainer's own clip can run (TRL, SkyRL, OpenRLHF).
ROUTES = ("band", "fixed")

__all__ = ["PAPER", "ROUTES", "check_framework", "check_route", "compiled_divergences", "config_get",
           "delta_range", "did_you_mean", "is_number", "loss_settings", "unused_trainer_clips",
           "warn_unused_trainer_clips"]


def loss_settings(options: Mapping[str, object], names: Mapping[str, str]) -> LossSettings:
    """`LossSettings(**options)`, its messages naming `names` (option -> the user's field, e.g.
    ``{"delta": "actor_rollout_ref.actor.policy_loss.band_delta"}``). A bad value raises LossSettings' own
    error, unchanged: one message per check.

    Built once per distinct (options, names) (`settings.build`): the config builds it, and every loss call after
    that asks again with the same options (and its aggregation) and gets the object already built, not a second
    validation."""
    return build_settings(options, names)


def check_route(clip, name: str) -> None:
    """Refuse a clip other than ``ROUTES`` for the integrations whose ``"fixed"`` runs the trainer's own clip
    (``"dcpo"`` has no such route there), naming the user's field."""
    if clip not in ROUTES:
        raise ValueError(f"{name}={clip!r} is not one of {ROUTES} ('band': BandPO's band; 'fixed': the "
                         f"trainer's own clip, with the band metrics)")


def unused_trainer_clips(config, defaults: Mapping[str, float], dual_key: str, band: dict, *, trainer: str,
                         key_name, band_name) -> list[str]:
    """The trainer's own clip settings in `config` given a value other than its default (`defaults`: key -> the
    trainer's default) that the BandPO loss does not use, each with what takes its place: `dual_key` (the
    trainer's dual clip: band_dual_clip on every route), the others (its epsilon clip) where band_clip is "band"
    (the "fixed" route uses them). `band`: the band_* options; key_name / band_name: a key as the user writes it."""
    out = []
    for key, default in defaults.items():
        value = config_get(config, key, None)
        if value is None or value == default:
            continue
        if key == dual_key:
            out.append(f"{key_name(key)}={value!r} ({trainer}'s dual clip) is not used: the dual clip is "
                       f"{band_name('band_dual_clip')}={band['band_dual_clip']!r}")
        elif band["band_clip"] == "band":
            out.append(f"{key_name(key)}={value!r} ({trainer}'s fixed clip) is not used: the clip is the band of "
                       f"{band_name('band_delta')}={band['band_delta']!r} (band_divergence="
                       f"{band['band_divergence']!r}, band_max_ratio={band['band_max_ratio']!r})")
    return out


_warned_unused: set = set()


def warn_unused_trainer_clips(messages, prefix: str | None = None) -> None:
    """Messages about a trainer's settings that BandPO does not use (`unused_trainer_clips`'s, or an integration's
    own) as UserWarnings (`prefix`: the setting that made them unused, if any), each distinct one once per
    process: the config check and every loss call come here, the log should say it once."""
    for message in messages:
        if message not in _warned_unused:
            _warned_unused.add(message)
            warnings.warn(message if prefix is None else f"{prefix}: {message}", UserWarning, stacklevel=3)


def config_get(config, key: str, default=None):
    """``key`` of a trainer's config section, whatever its kind (dict, OmegaConf DictConfig, a config dataclass
    with ``get``, a plain object): its value where present (null included), else ``default``."""
    if config is None:
        return default
    get = getattr(config, "get", None)
    if callable(get):
        return get(key, default)
    return getattr(config, key, default)


def did_you_mean(given: str, known, *, show=str) -> str:
    """`` (did you mean X?)`` for the entry of ``known`` closest to ``given`` (shown with ``show``), or ``""``
    where none is close."""
    close = difflib.get_close_matches(given, sorted(known), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def delta_range(divergence: str) -> tuple[float, float, bool]:
    """(min, max, max_inclusive) of δ in the shipped table of `divergence` (its header only)."""
    from bandpo_lut.tables import store as tables

    table = tables.get(divergence)
    return table.delta_min, table.delta_max, table.delta_max_inclusive


def check_framework(package: str, version: str, tested: tuple, problems: list[str], *,
                    module: str | None = None, install: str | None = None) -> None:
    """The version policy, the same for every trainer.

    - ``problems`` (what the integration checked of the installed package's structure) is not
      empty: ImportError that lists them, whatever the version.
    - the structure matches but ``version`` is not one of ``tested`` (the versions CI runs):
      a warning saying so, and the integration is used.
    - otherwise: silent.
    """
    tested_txt = ", ".join(tested)
    module = module or package
    install = install or (f"pip install '{package}=={tested[-1]}' (or -r "
                          f"requirements-integrations.txt)")
    if problems:
        raise ImportError(f"bandpo_lut.integrations.{module} cannot work with the installed "
                          f"{package} {version}: " + "; ".join(problems) +
                          f". Tested with {package} {tested_txt}: {install}")
    if version not in tested:
        warnings.warn(f"bandpo_lut.integrations.{module}: {package} {version} is not one of the "
                      f"tested versions ({tested_txt}); the parts of {package} it relies on are "
                      f"where it expects them, so it is used", UserWarning, stacklevel=3)
