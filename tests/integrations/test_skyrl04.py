"""The SkyRL plug-in (bandpo_lut.integrations.skyrl) against the real SkyRL 0.4 (the ``skyrl`` package, pinned in
requirements-skyrl04.txt), beside tests/integrations/test_skyrl.py's skyrl-train 0.3.1.

skyrl 0.4.0 declares Python >= 3.12 and pulls far more than its loss path imports, so it is installed apart,
without dependencies, into a folder of its own (``.skyrl04-site`` at the repository root, or
``$BANDPO_SKYRL04_SITE``)::

    pip install --no-deps --ignore-requires-python --target .skyrl04-site -r requirements-skyrl04.txt

and the checks (tests/support/skyrl04_checks.py, which says how it runs on Python 3.11) run once, in a fresh interpreter
with that folder on PYTHONPATH and without .skyrl-site (the plug-in picks the ``skyrl`` package wherever it is
installed). A missing folder is an error, not a skip; BANDPO_SKIP_INTEGRATIONS=1 skips this module.
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
    env = apart_env("BANDPO_SKYRL04_SITE", ".skyrl04-site", "skyrl", first=True)
    return run_check_script("skyrl04_checks.py", env, tmp_path_factory.mktemp("skyrl04"))


CHECKS = {
    "registered": "`import bandpo_lut.integrations.skyrl` registers 'bandpo' in SkyRL 0.4's registry",
    "reductions_equal_reference": "every loss_reduction (SkyRL's advantage normalisation, then the masked sum) "
                                  "equals the reference loss under that reduction's definition, loss and gradient",
    "paper_settings_and_clip_ratio": "SkyRL's own AlgorithmConfig with policy_loss_type=bandpo: the paper's "
                                     "settings; clip_ratio is the band's clip fraction; null turns cap/dual off",
    "off_policy_correction_applied": "off_policy_correction (token/sequence TIS, token and geometric masks) "
                                     "applied as defined, not ignored",
    "fixed_is_skyrls_loss_bit_for_bit": "band_clip=fixed is SkyRL 0.4's ppo_policy_loss, bit for bit",
    "rounding_positive_old_log_prob": "an old log-prob of +6e-8 is p = 1 (finite loss)",
    "bad_options_refused_naming_the_key": "impossible options refused when the config is built, in one "
                                           "message naming trainer.algorithm.<key> once",
    "misspelt_band_key_refused": "trainer.algorithm.band_dleta refused, suggesting band_delta",
    "band_keys_without_bandpo_refused": "band settings with another policy loss, or on SkyRL's own config "
                                        "class, refused",
    "command_line_as_skyrls_entrypoint": "BandPOTrainConfig.from_cli_overrides builds the run's config with "
                                         "the band settings; misspelt / unread / wrong-class band keys refused",
    "fully_async_refused": "trainer.fully_async.enabled=true with policy_loss_type=bandpo refused when the config "
                           "is built (SkyRL's own guard checks a fixed list of its losses)",
    "unused_skyrl_clips_warned": "SkyRL's eps_clip_low/high (with the band) and clip_ratio_c, set with bandpo, "
                                 "named in a warning once",
    "version_policy": "tested version silent; untested same-structure warns; changed convention refused",
}


@pytest.mark.parametrize("name", list(CHECKS), ids=list(CHECKS))
def test_skyrl04(results, name):
    ok, detail = results[name]
    assert ok, f"{CHECKS[name]}: {detail}"
