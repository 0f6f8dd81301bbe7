"""What both trainer integrations share: the paper's settings, the validation of a band setting
against what this build can compute (named by the user's field), and the version policy.

Light on purpose: importing it imports neither verl nor TRL (torch comes with the `bandpo_lut`
package). The band checks are `bandpo_lut.tables.checks`' and read the divergence registry and the shipped
table's header (`bandpo_lut.tables.store`), never the compiled extension, so a bad setting is refused when
the trainer's config object is built, before any model loads. `check_band` is the one place the
integrations ask "can bandpo_lut compute this band?".
"""
from __future__ import annotations

import warnings

from bandpo_lut.tables.checks import is_number
from bandpo_lut.tables.divergences import compiled_names as compiled_divergences

# The paper's settings (BandPO: KL trust region, δ = 0.05, upper ratio bound capped at 10, dual
# clip 10). Both integrations default to these; departing from them is an explicit setting.
PAPER = {"divergence": "kl", "delta": 0.05, "max_ratio": 10.0, "dual_clip": 10.0}

__all__ = ["PAPER", "check_band", "check_framework", "compiled_divergences", "delta_range", "is_number"]


def check_band(divergence, delta, max_ratio, *, field: dict) -> None:
    """Refuse a band that `bandpo_lut.policy_loss` would refuse at its first call.

    `field` maps "divergence", "delta", "max_ratio" to the user's names for them (e.g.
    ``{"delta": "band_delta", ...}`` or ``"actor.policy_loss.band_delta"``), so that every message
    names the setting the user wrote. Raises ValueError.

    A thin wrapper: the checks are `bandpo_lut.LossSettings`' (the loss's one validation path), built with
    the user's field names; the message gains the paper's settings as a hint.
    """
    from bandpo_lut.runtime.settings import LossSettings

    try:
        LossSettings(divergence=divergence, delta=delta, max_ratio=max_ratio, field_names=field)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{err} (paper: {field.get('divergence', 'divergence')}={PAPER['divergence']!r}, "
                         f"{field.get('delta', 'delta')}={PAPER['delta']}, "
                         f"{field.get('max_ratio', 'max_ratio')}={PAPER['max_ratio']:g})") from None


def delta_range(divergence: str) -> tuple[float, float, bool]:
    """(min, max, max_inclusive) of δ in the shipped table of `divergence` (its header only)."""
    from bandpo_lut.tables import store as tables

    table = tables.get(divergence)
    return table.delta_min, table.delta_max, table.delta_max_inclusive


def check_framework(package: str, version: str, tested: tuple, problems: list[str], *,
                    module: str | None = None, install: str | None = None) -> None:
    """The version policy, the same for TRL and verl.

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
