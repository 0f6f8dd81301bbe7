"""The SkyRL plug-in (bandpo_lut.integrations.skyrl) against the real skyrl-train (pinned in
requirements-skyrl.txt).

skyrl-train 0.3.1 pins ray 2.51.1, whose API differs from the ray 2.60 that verl's tests use, and
declares Python 3.12 only; its loss module runs on 3.11. So it is installed apart, without
dependencies, into a folder of its own (``.skyrl-site`` at the repository root, or
``$BANDPO_SKYRL_SITE``)::

    pip install --no-deps --ignore-requires-python --upgrade --target .skyrl-site -r requirements-skyrl.txt

and the checks (tests/support/skyrl_checks.py) run once, in a fresh interpreter with that folder first on
PYTHONPATH. A missing folder is an error, not a skip; BANDPO_SKIP_INTEGRATIONS=1 skips this module.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("BANDPO_SKIP_INTEGRATIONS") == "1":
    pytest.skip("BANDPO_SKIP_INTEGRATIONS=1", allow_module_level=True)

from helpers import apart_env, run_check_script  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = apart_env("BANDPO_SKYRL_SITE", ".skyrl-site", "skyrl_train", first=True)   # ray 2.51 over the venv's
    return run_check_script("skyrl_checks.py", env, tmp_path_factory.mktemp("skyrl"))


CHECKS = {
    "registered": "`import bandpo_lut.integrations.skyrl` registers 'bandpo' in SkyRL's registry",
    "token_mean_equals_policy_loss": "loss and gradient equal bandpo_lut.policy_loss (paper's settings)",
    "reductions_equal_skyrls_reduce_loss": "every loss_reduction: an independent per-token band loss "
                                           "through SkyRL's own reduce_loss",
    "tis_weights": "use_tis: SkyRL's truncated IS weight on each token's loss",
    "fixed_is_skyrls_loss_bit_for_bit": "band_clip=fixed is SkyRL's ppo_policy_loss, bit for bit",
    "rounding_positive_old_log_prob": "an old log-prob of +6e-8 is p = 1 (finite loss)",
    "bad_options_refused_naming_the_key": "impossible options refused in one message naming "
                                          "trainer.algorithm.<key> once",
    "refused_by_skyrls_startup_validation": "SkyRL's validate_cfg (driver, before Ray) refuses a bad "
                                            "band setting, naming it",
    "misspelt_band_key_refused": "+trainer.algorithm.band_dleta is refused (validate_cfg, check_config, the loss), "
                                 "naming it and band_delta",
    "band_keys_without_bandpo_refused": "band_* keys with policy_loss_type regular/dual_clip: refused by validate_cfg",
    "tis_passes_skyrls_startup_validation": "use_tis with bandpo passes SkyRL's validate_cfg (its other TIS checks "
                                            "acting), the config keeping bandpo",
    "unused_skyrl_clips_warned": "SkyRL's eps_clip_low/high (with the band) and clip_ratio_c, set with bandpo, "
                                 "named in a warning once",
    "paper_defaults": "no band keys: the paper's settings; null turns the cap / dual clip off",
    "version_policy": "tested version silent; untested same-structure warns; changed convention refused",
}


@pytest.mark.parametrize("name", list(CHECKS), ids=list(CHECKS))
def test_skyrl(results, name):
    ok, detail = results[name]
    assert ok, f"{CHECKS[name]}: {detail}"
