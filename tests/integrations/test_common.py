"""What the trainer integrations share (bandpo_lut.integrations._common), without any trainer installed: the one
way from a trainer's fields to a LossSettings, the config getter, the "did you mean" hint, the clip routes."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from bandpo_lut import LossSettings
from bandpo_lut.integrations import _common

NAMES = {"delta": "band_delta", "divergence": "band_divergence", "max_ratio": "band_max_ratio",
         "dual_clip": "trainer.delta", "clip": "band_clip", "mode": "band_mode"}


def test_loss_settings_is_the_options_as_given():
    s = _common.loss_settings({**_common.PAPER, "agg": "token-sum"}, NAMES)
    assert s == LossSettings(delta=0.05, divergence="kl", max_ratio=10.0, dual_clip=10.0, agg="token-sum")
    assert s.field_names == NAMES


def test_loss_settings_is_built_once_per_distinct_setting():
    """The loss asks at every micro-batch with the options the config was built with: the same object, not a
    second validation; a different aggregation (or value) is another object."""
    options = {**_common.PAPER, "max_ratio": 7.0}
    first = _common.loss_settings(options, NAMES)
    assert _common.loss_settings(dict(options), dict(NAMES)) is first
    assert _common.loss_settings({**options, "agg": "token-sum"}, NAMES) is not first
    # 1 == 1.0 == True as dict keys, but a bool is no number to LossSettings: still refused after 1.0 was built
    _common.loss_settings({**options, "dual_clip": 2.0}, NAMES)
    with pytest.raises(ValueError):
        _common.loss_settings({**options, "max_ratio": True}, NAMES)


BAD = [  # (option, value, how the value appears in the message)
    ("delta", 2.0, "2.0"), ("delta", -1.0, "-1.0"), ("delta", float("nan"), "nan"),
    ("divergence", "js", "'js'"), ("divergence", "reverse_kl", "'reverse_kl'"),
    ("max_ratio", 0.5, "0.5"), ("dual_clip", 1.0, "1.0"), ("dual_clip", float("nan"), "nan"),
    ("clip", "ppo", "'ppo'"), ("mode", "drop", "'drop'"),
    ("delta", [0.05], "[0.05]"),   # unhashable: still LossSettings' own message, not the cache's TypeError
]


@pytest.mark.parametrize("option, value, shown", BAD, ids=[f"{o}={v}" for o, v, _ in BAD])
def test_a_bad_value_is_one_message_naming_the_users_field_once(option, value, shown):
    with pytest.raises(ValueError) as info:
        _common.loss_settings({**_common.PAPER, option: value}, NAMES)
    message = str(info.value)
    field = NAMES[option]
    assert len(re.findall(rf"(?<![\w.]){re.escape(field)}(?!\w)", message)) == 1, message
    assert shown in message, message
    assert info.value.__cause__ is None, "one message: no second error chained under it"


def test_check_route_allows_band_and_fixed_only():
    for clip in ("band", "fixed"):
        _common.check_route(clip, "band_clip")
    with pytest.raises(ValueError) as info:
        _common.check_route("dcpo", "trainer.algorithm.band_clip")
    assert "trainer.algorithm.band_clip='dcpo'" in str(info.value)


def test_config_get_reads_every_kind_of_config_section():
    """A present key, null included, is its value; an absent one the default (dict, object, None)."""
    for config in ({"band_delta": 0.1, "band_max_ratio": None}, SimpleNamespace(band_delta=0.1, band_max_ratio=None)):
        assert _common.config_get(config, "band_delta", 0.05) == 0.1
        assert _common.config_get(config, "band_max_ratio", 10.0) is None
        assert _common.config_get(config, "band_dual_clip", 10.0) == 10.0
    assert _common.config_get(None, "band_delta", 0.05) == 0.05


def test_did_you_mean_names_the_closest_known_key():
    known = ["band_delta", "band_divergence", "band_max_ratio"]
    assert _common.did_you_mean("band_dleta", known) == " (did you mean band_delta?)"
    assert _common.did_you_mean("band_max_ratoi", known, show=repr) == " (did you mean 'band_max_ratio'?)"
    assert _common.did_you_mean("learning_rate", known) == ""
