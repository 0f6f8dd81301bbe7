"""Checks of bandpo_lut.integrations.skyrl against the real skyrl-train, run by
tests/integrations/test_skyrl.py in a fresh interpreter (skyrl-train needs ray 2.51, which is installed
apart, on PYTHONPATH, so that it does not replace the ray the verl tests use). Prints one JSON object:
check name -> [ok, detail]."""
from __future__ import annotations

import inspect
import json
import os
import sys
from importlib import metadata

import plugin_checks  # tests/, the script's folder
import torch
from omegaconf import OmegaConf
from plugin_checks import RESULTS, check, close, independent_per_token
from skyrl_train.utils import ppo_utils

import bandpo_lut
import bandpo_lut.integrations.skyrl as bsky


def algorithm_config(**overrides):
    """SkyRL's own trainer.algorithm section (ppo_base_config.yaml) with command-line-like overrides."""
    base = OmegaConf.load(os.path.join(os.path.dirname(ppo_utils.__file__), "..", "config",
                                       "ppo_base_config.yaml"))
    algo = OmegaConf.create(OmegaConf.to_container(base.trainer.algorithm, resolve=False))
    algo.max_seq_len = 12
    for key, value in overrides.items():
        OmegaConf.update(algo, key, value, force_add=True)
    return algo


def batch(seed, **sizes):
    """plugin_checks.batch, with two sequences of constant advantage (GRPO's) and rollout log-probs (for TIS)."""
    new, old, adv, mask, g = plugin_checks.batch(seed, **sizes)
    adv[1:3] = adv[1:3, :1]
    rollout = old + 0.05 * torch.randn(old.shape, generator=g)
    return new, old, adv, mask, rollout


def loss_and_grad(fn, new, *args, **kwargs):
    lp = new.clone().requires_grad_(True)
    loss, clip_ratio = fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, clip_ratio


@check("registered")
def _():
    fn = ppo_utils.PolicyLossRegistry.get("bandpo")
    assert inspect.unwrap(fn) is bsky.compute_policy_loss_bandpo, fn
    return metadata.version("skyrl-train")


@check("token_mean_equals_policy_loss")
def _():
    new, old, adv, mask, _ = batch(1)
    cfg = algorithm_config(policy_loss_type="bandpo")
    loss, grad, clip_ratio = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv, cfg, mask)
    lp = new.clone().requires_grad_(True)
    want, m = bandpo_lut.policy_loss(lp, old, adv, mask, delta=0.05, max_ratio=10, dual_clip=10)
    (want_grad,) = torch.autograd.grad(want, lp)
    close(loss, want.detach())
    close(grad, want_grad)
    assert isinstance(clip_ratio, float) and clip_ratio == float(m["clip_frac"]) and clip_ratio > 0
    return clip_ratio


@check("reductions_equal_skyrls_reduce_loss")
def _():
    new, old, adv, mask, _ = batch(2)
    out = {}
    for reduction in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        cfg = algorithm_config(policy_loss_type="bandpo", loss_reduction=reduction,
                               **{"band_delta": 0.1, "band_max_ratio": 3.0, "band_dual_clip": 2.5})
        loss, grad, _ = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv, cfg, mask)
        lp, per_token = independent_per_token(new, old, adv, delta=0.1, max_ratio=3.0, dual_clip=2.5)
        want = ppo_utils.reduce_loss(per_token, mask, reduction, cfg.max_seq_len)
        (want_grad,) = torch.autograd.grad(want, lp)
        close(loss, want.detach())
        close(grad, want_grad * mask)
        out[reduction] = float(loss)
    return out


@check("tis_weights")
def _():
    new, old, adv, mask, rollout = batch(3)
    cfg = algorithm_config(policy_loss_type="bandpo", use_tis=True, tis_imp_ratio_cap=1.02)
    loss, grad, _ = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv, cfg, mask, rollout)
    w = torch.clamp(torch.exp(old - rollout), max=1.02)
    lp, per_token = independent_per_token(new, old, adv, weight=w)
    want = ppo_utils.reduce_loss(per_token, mask, "token_mean")
    (want_grad,) = torch.autograd.grad(want, lp)
    close(loss, want.detach())
    close(grad, want_grad * mask)
    return float(loss)


@check("fixed_is_skyrls_loss_bit_for_bit")
def _():
    new, old, adv, mask, rollout = batch(4, spread=1.0)
    old[3], new[3], adv[3] = -3.0, -0.5, -1.0  # ratio e^2.5 with A < 0: the dual clip acts
    out = {}
    for dual, tis in ((3.0, False), (None, False), (3.0, True)):
        extra = dict(eps_clip_low=0.2, eps_clip_high=0.28, use_tis=tis, tis_imp_ratio_cap=2.0)
        ours_cfg = algorithm_config(policy_loss_type="bandpo", band_clip="fixed", band_dual_clip=dual,
                                    **extra)
        stock_cfg = algorithm_config(policy_loss_type="regular" if dual is None else "dual_clip",
                                     clip_ratio_c=3.0, **extra)
        loss, grad, clip = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv, ours_cfg,
                                         mask, rollout)
        want, want_grad, want_clip = loss_and_grad(ppo_utils.ppo_policy_loss, new, old, adv, stock_cfg,
                                                   mask, rollout)
        assert torch.equal(loss, want) and torch.equal(grad, want_grad) and clip == want_clip
        out[f"dual={dual},tis={tis}"] = float(loss)
    assert out["dual=3.0,tis=False"] != out["dual=None,tis=False"], out  # the dual clip acts here
    return out


@check("rounding_positive_old_log_prob")
def _():
    new, old, adv, mask, _ = batch(5)
    old[1:, 0] = 6e-8
    loss, grad, _ = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv,
                                  algorithm_config(policy_loss_type="bandpo"), mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    lp, per_token = independent_per_token(new, old.clamp(max=0.0), adv)  # the band at log p = 0
    ratio_fix = torch.exp(torch.clamp(new - old, -20, 20)) / torch.exp(torch.clamp(new - old.clamp(max=0), -20, 20))
    assert float((ratio_fix - 1).abs().max()) < 1e-6
    close(loss, ppo_utils.reduce_loss(per_token, mask, "token_mean").detach())
    return float(loss)


@check("bad_options_refused_naming_the_key")
def _():
    """Each bad value: one message that names trainer.algorithm.<key> once, with the value."""
    out = []
    for key, value, shown in (("band_delta", 2.0, "2.0"), ("band_delta", -1.0, "-1.0"),
                              ("band_divergence", "reverse_kl", "'reverse_kl'"), ("band_divergence", "js", "'js'"),
                              ("band_max_ratio", 0.5, "0.5"), ("band_dual_clip", 1.0, "1.0"),
                              ("band_dual_clip", float("nan"), "nan"), ("band_clip", "ppo", "'ppo'"),
                              ("band_clip", "dcpo", "'dcpo'"), ("loss_reduction", "token_sum", "'token_sum'")):
        try:
            bsky.check_config(algorithm_config(policy_loss_type="bandpo", **{key: value}))
        except ValueError as exc:
            message = str(exc)
            assert message.count(f"trainer.algorithm.{key}") == 1 and shown in message, message
            out.append(message[:80])
        else:
            raise AssertionError(f"{key}={value!r} was accepted")
    return out


@check("refused_by_skyrls_startup_validation")
def _():
    from hydra import compose, initialize_config_dir
    from skyrl_train import utils as skyrl_utils

    config_dir = os.path.abspath(os.path.join(os.path.dirname(ppo_utils.__file__), "..", "config"))
    common = ["trainer.algorithm.policy_loss_type=bandpo", "trainer.logger=console"]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        good = compose(config_name="ppo_base_config", overrides=common)
        bad = compose(config_name="ppo_base_config",
                      overrides=common + ["+trainer.algorithm.band_delta=2.0"])
    skyrl_utils.validate_cfg(good)
    try:
        skyrl_utils.validate_cfg(bad)
    except ValueError as exc:
        assert "trainer.algorithm.band_delta=2.0" in str(exc), str(exc)
        return str(exc)[:80]
    raise AssertionError("SkyRL's validate_cfg accepted band_delta=2.0")


def _composed(*overrides):
    """SkyRL's own config as its driver composes it (hydra), with command-line overrides."""
    from hydra import compose, initialize_config_dir

    config_dir = os.path.abspath(os.path.join(os.path.dirname(ppo_utils.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_base_config", overrides=["trainer.logger=console", *overrides])


@check("misspelt_band_key_refused")
def _():
    from skyrl_train import utils as skyrl_utils

    bad = _composed("trainer.algorithm.policy_loss_type=bandpo", "+trainer.algorithm.band_dleta=0.2")
    out = []
    for where, call in (("validate_cfg", lambda: skyrl_utils.validate_cfg(bad)),
                        ("check_config", lambda: bsky.check_config(bad.trainer.algorithm)),
                        ("first loss call", lambda: bsky.compute_policy_loss_bandpo(
                            *batch(6)[:3], bad.trainer.algorithm, batch(6)[3]))):
        try:
            call()
        except ValueError as exc:
            assert "trainer.algorithm.band_dleta" in str(exc) and "band_delta" in str(exc), str(exc)
            out.append(f"{where}: {str(exc)[:60]}")
        else:
            raise AssertionError(f"{where} accepted band_dleta")
    return out


@check("band_keys_without_bandpo_refused")
def _():
    from skyrl_train import utils as skyrl_utils

    out = []
    for loss in ("regular", "dual_clip"):
        bad = _composed(f"trainer.algorithm.policy_loss_type={loss}", "+trainer.algorithm.band_delta=0.2")
        try:
            skyrl_utils.validate_cfg(bad)
        except ValueError as exc:
            assert "band_delta" in str(exc) and f"policy_loss_type={loss!r}" in str(exc), str(exc)
            out.append(str(exc)[:60])
        else:
            raise AssertionError(f"band_delta with policy_loss_type={loss} was accepted")
    skyrl_utils.validate_cfg(_composed("trainer.algorithm.policy_loss_type=regular"))  # no band keys: fine
    return out


@check("tis_passes_skyrls_startup_validation")
def _():
    """use_tis with bandpo: SkyRL's validate_cfg allows TIS only with its own regular/dual_clip losses; with the
    plug-in imported it passes for bandpo too, SkyRL's other TIS checks still acting (it turns the rollout
    log-probs on, refuses a cap <= 0) and the config keeping policy_loss_type=bandpo."""
    from skyrl_train import utils as skyrl_utils

    tis = ["trainer.algorithm.policy_loss_type=bandpo", "trainer.algorithm.use_tis=true",
           "trainer.algorithm.tis_imp_ratio_cap=2.0", "generator.backend=vllm"]
    cfg = _composed(*tis)
    cfg.generator.sampling_params.logprobs = None
    skyrl_utils.validate_cfg(cfg)
    assert cfg.trainer.algorithm.policy_loss_type == "bandpo", cfg.trainer.algorithm.policy_loss_type
    assert cfg.generator.sampling_params.logprobs == 0, cfg.generator.sampling_params.logprobs
    out = []
    for extra, error in ((["trainer.algorithm.tis_imp_ratio_cap=-1.0"], ValueError),):
        bad = _composed(*tis, *extra)
        try:
            skyrl_utils.validate_cfg(bad)
        except error as exc:
            assert bad.trainer.algorithm.policy_loss_type == "bandpo"
            out.append(str(exc)[:60])
        else:
            raise AssertionError(f"{extra} was accepted")
    return out


@check("unused_skyrl_clips_warned")
def _():
    """eps_clip_low/high (with the band) and clip_ratio_c (always) given with bandpo: one warning each, naming the
    key and what takes its place; SkyRL's defaults are silent."""
    import warnings

    def warned(**overrides):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bsky.check_config(algorithm_config(policy_loss_type="bandpo", **overrides))
        return [str(w.message) for w in caught if "is not used" in str(w.message)]

    assert warned() == []
    got = warned(eps_clip_high=0.28, clip_ratio_c=5.0)
    assert len(got) == 2 and any("eps_clip_high=0.28" in m for m in got), got
    assert any("clip_ratio_c=5.0" in m and "band_dual_clip=10.0" in m for m in got), got
    assert warned(band_clip="fixed", eps_clip_low=0.1) == []   # the fixed route uses SkyRL's eps
    return got


@check("paper_defaults")
def _():
    s = bsky.check_config(algorithm_config(policy_loss_type="bandpo"))
    assert s == {"band_divergence": "kl", "band_delta": 0.05, "band_max_ratio": 10.0,
                 "band_dual_clip": 10.0, "band_clip": "band"}, s
    s = bsky.check_config(algorithm_config(band_dual_clip=None, band_max_ratio=None))
    assert s["band_dual_clip"] is None and s["band_max_ratio"] is None, s
    return s


@check("version_policy")
def _():
    assert metadata.version("skyrl-train") in bsky.TESTED_SKYRL
    return plugin_checks.version_policy(
        "skyrl-train", "skyrl", bsky._check_skyrl, ppo_utils, "ppo_policy_loss",
        lambda log_probs, old_log_probs, advantages, config, loss_mask: 0,
        "take ('log_probs'", "requirements-skyrl.txt")


json.dump(RESULTS, sys.stdout)
