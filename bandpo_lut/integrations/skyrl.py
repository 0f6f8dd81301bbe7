"""BandPO for SkyRL: importing this module registers the policy loss ``"bandpo"`` in the installed SkyRL.

Two SkyRL packages are supported behind this one import (docs/integrations.md, "SkyRL"):

- ``skyrl`` 0.4 (SkyRL's current package; Python >= 3.12): `_skyrl04`. The band settings are fields of
  `BandPOAlgorithmConfig` (SkyRL 0.4's config is a dataclass and refuses keys it does not declare); build
  the run's config with ``BandPOTrainConfig.from_cli_overrides(sys.argv[1:])`` and pass
  ``trainer.algorithm.policy_loss_type=bandpo trainer.algorithm.band_delta=0.05 ...`` (no ``+``).
- ``skyrl-train`` 0.3 (its last release, 0.3.1): `_skyrl03`, settings as ``+trainer.algorithm.band_*``.

Where the ``skyrl`` package is installed it is the one used (its import errors are raised, not hidden by a
fall-back); otherwise skyrl-train. Each follows the version policy of `_common.check_framework`.
"""
from __future__ import annotations

from importlib import util

if util.find_spec("skyrl") is not None:
    from ._skyrl04 import *  # noqa: F401,F403
    from ._skyrl04 import __all__, _check_skyrl, ppo_utils  # noqa: F401
    SKYRL_PACKAGE = "skyrl"
else:
    from ._skyrl03 import *  # noqa: F401,F403
    from ._skyrl03 import __all__, _check_skyrl, ppo_utils  # noqa: F401
    SKYRL_PACKAGE = "skyrl-train"
