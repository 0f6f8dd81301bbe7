"""What both trainer integrations share: the paper's settings, the validation of a band setting
against what this build can compute (named by the user's field), and the version policy.

Light on purpose: importing it imports neither verl nor TRL (torch comes with the `bandpo_lut`
package). The band checks are `bandpo_lut.tables.checks`' and read the divergence registry and the shipped
table's header (`bandpo_lut.tables.store`), never the compiled extension, so a bad setting is refused when
the trainer's config object is built, before any model loads. `check_band` is the one place the
integrations ask "can bandpo_lut compute this band?".
"""
from __future__ import annotations

import math
import warnings

from bandpo_lut.tables.checks import delta_interval, in_delta_range, is_number, max_ratio_ok
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
    """
    from bandpo_lut.tables import divergences

    known = divergences.names()
    compiled = compiled_divergences()
    if not isinstance(divergence, str) or divergence not in known:
        raise ValueError(f"{field['divergence']}={divergence!r} is not a divergence; choose one of "
                         f"{compiled} (paper: {PAPER['divergence']!r})")
    if divergence not in compiled:
        raise ValueError(f"{field['divergence']}={divergence!r} has no compiled kernel in this build "
                         f"(only the pure-PyTorch reference reads it); a training loss can use "
                         f"{compiled} (paper: {PAPER['divergence']!r})")
    if not (is_number(delta) and math.isfinite(delta) and delta > 0):
        raise ValueError(f"{field['delta']} must be a positive number (the trust-region radius δ, "
                         f"paper: {PAPER['delta']}), got {delta!r}")
    lo, hi, hi_inclusive = delta_range(divergence)
    if not in_delta_range(delta, lo, hi, hi_inclusive):
        raise ValueError(f"{field['delta']}={delta!r} is outside the range of the shipped "
                         f"{divergence!r} table, {delta_interval(lo, hi, hi_inclusive)} "
                         f"(paper: {PAPER['delta']})")
    if not max_ratio_ok(max_ratio):
        raise ValueError(f"{field['max_ratio']} must be a number >= 1 (the cap of the upper ratio "
                         f"bound, paper: {PAPER['max_ratio']:g}) or None for no cap, got "
                         f"{max_ratio!r}")


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
