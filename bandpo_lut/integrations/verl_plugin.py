"""verl's plug-in hook for bandpo_lut: config-time checks of the ``actor.policy_loss`` section.

verl (0.9.1) loads every entry point of the group ``verl.plugins`` when ``verl`` is imported, in the
driver and in every Ray worker (unless ``VERL_USE_EXTERNAL_PLUGINS=none``); setup.py declares this
module there, and the loader's import installs the checks. Without them, nothing of bandpo_lut runs in
a driver whose command line forgot the ``_target_`` line: ``loss_mode=bandpo`` passes verl's driver
validation (``validate_config`` builds verl's own ``PolicyLossConfig``, which accepts any loss name),
and the run dies in a worker at the first update ("Unsupported loss mode: bandpo") or, where a worker
has the loss registered, trains with band settings that nobody set or checked.

`install` makes building verl's own ``PolicyLossConfig`` refuse, naming the missing line:

- ``loss_mode=bandpo`` (the band settings live in `BandPolicyLossConfig`, selected by the ``_target_``);
- ``band_*`` keys (which verl's class would reject with a bare "unexpected keyword argument").

Any other construction of ``PolicyLossConfig`` runs verl's ``__init__`` unchanged. Light on purpose: it
imports only verl's config module, never the loss (``bandpo_lut.integrations.verl``, which the
``_target_`` imports, also calls `install`).
"""
from __future__ import annotations

import functools

LOSS_NAME = "bandpo"
SECTION = "actor_rollout_ref.actor.policy_loss"
TARGET = "bandpo_lut.integrations.verl.BandPolicyLossConfig"
TARGET_LINE = f"{SECTION}._target_={TARGET}"

__all__ = ["install", "LOSS_NAME", "SECTION", "TARGET", "TARGET_LINE"]


def install() -> None:
    """Wrap ``verl.workers.config.PolicyLossConfig.__init__`` with the checks above (once)."""
    from verl.workers.config import PolicyLossConfig

    original = PolicyLossConfig.__init__
    if getattr(original, "_bandpo_checks", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        plain = type(self) is PolicyLossConfig   # a subclass (ours among them) has its own fields and checks
        band = sorted(k for k in kwargs if k.startswith("band_"))
        if plain and band:
            raise TypeError(
                f"{SECTION} has BandPO settings ({', '.join(band)}) but its _target_ is verl's "
                f"PolicyLossConfig, which has no such fields. Add {TARGET_LINE} (and "
                f"{SECTION}.loss_mode={LOSS_NAME})")
        original(self, *args, **kwargs)
        if plain and getattr(self, "loss_mode", None) == LOSS_NAME:
            raise ValueError(
                f"{SECTION}.loss_mode={LOSS_NAME} needs BandPO's policy_loss config: add the line "
                f"{TARGET_LINE} . Without it verl builds its own PolicyLossConfig, which carries no band "
                f"settings, and a worker that has not imported bandpo_lut fails at its first update "
                f"('Unsupported loss mode: {LOSS_NAME}')")

    __init__._bandpo_checks = True
    PolicyLossConfig.__init__ = __init__


# verl's entry-point loader imports this module and calls nothing: the checks go in at import.
install()
