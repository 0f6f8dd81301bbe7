"""Checks of bandpo_lut.integrations.skyrl against the real SkyRL 0.4 (the ``skyrl`` package), run by
tests/integrations/test_skyrl04.py in a fresh interpreter with ``.skyrl04-site`` on PYTHONPATH. Prints one JSON
object: check name -> [ok, detail].

Python 3.11: skyrl 0.4 declares Python >= 3.12. Its loss path (ppo_utils, off_policy_correction_utils,
torch_utils, train.config) runs on 3.11, but importing it imports the package ``skyrl.backends``, whose
``backend.py`` imports ``skyrl.tinker.types`` (the Tinker HTTP API's pydantic models), and pydantic refuses a
``typing.TypedDict`` field before Python 3.12 ("Please use typing_extensions.TypedDict"). On 3.11 this script
therefore makes ``typing.TypedDict`` the typing_extensions one before importing SkyRL -- the class pydantic asks
for, the same on 3.12, where nothing is changed. It touches no code of the loss path."""
from __future__ import annotations

import inspect
import json
import sys
import typing
from importlib import metadata

if sys.version_info < (3, 12):
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict

import plugin_checks  # noqa: E402  (tests/, the script's folder)
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from plugin_checks import RESULTS, check, close, independent_per_token  # noqa: E402
from skyrl.backends.skyrl_train.utils import ppo_utils  # noqa: E402
from skyrl.train.config import AlgorithmConfig, OffPolicyCorrectionConfig, TrainerConfig  # noqa: E402

import bandpo_lut.integrations.skyrl as bsky  # noqa: E402
from bandpo_lut.reference import policy_loss as reference  # noqa: E402

PAPER = dict(delta=0.05, max_ratio=10.0, dual_clip=10.0)


def batch(seed, **sizes):
    """plugin_checks.batch, with two sequences of constant advantage (GRPO's) and rollout log-probs."""
    new, old, adv, mask, g = plugin_checks.batch(seed, **sizes)
    adv[1:3] = adv[1:3, :1]
    rollout = old + 0.05 * torch.randn(old.shape, generator=g)
    return new, old, adv, mask, rollout


def loss_and_grad(fn, new, *args, **kwargs):
    lp = new.clone().requires_grad_(True)
    loss, metrics = fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def ref_loss_and_grad(new, *args, **kwargs):
    return loss_and_grad(reference.policy_loss, new, *args, **kwargs)


def trainer_config(*overrides, cls=None):
    """``trainer`` built the way SkyRL 0.4 builds it from the command line (OmegaConf.from_cli, then its
    from_dict_config: strict keys, nested dataclasses), from `overrides` under ``trainer.``."""
    cls = cls or bsky.BandPOTrainerConfig
    return cls.from_dict_config(OmegaConf.from_cli(list(overrides)))


@check("registered")
def _():
    fn = ppo_utils.PolicyLossRegistry.get("bandpo")
    assert inspect.unwrap(fn) is bsky.compute_policy_loss_bandpo, fn
    assert bsky.SKYRL_PACKAGE == "skyrl", bsky.SKYRL_PACKAGE
    return [metadata.version("skyrl"), sys.version.split()[0]]


@check("reductions_equal_reference")
def _():
    """SkyRL 0.4 normalises the advantages (its apply_loss_reduction_to_advantages_minibatch) and sums; the
    result must be the reference loss on the raw advantages under each reduction's definition."""
    new, old, adv, mask, _ = batch(2)
    b, t = mask.shape
    kw = dict(delta=0.1, max_ratio=3.0, dual_clip=2.5)
    cfg = trainer_config("algorithm.policy_loss_type=bandpo", "algorithm.band_delta=0.1",
                         "algorithm.band_max_ratio=3.0", "algorithm.band_dual_clip=2.5").algorithm
    n_rows = float((mask.sum(-1) > 0).sum())
    prompts = [(0, 2), (2, b)]
    want = {"token_mean": ref_loss_and_grad(new, old, adv, mask, agg="token-mean", **kw)}
    # Dr. GRPO's: each row's token sum over max_seq_len (= t here), averaged over ALL rows
    loss, grad, _ = ref_loss_and_grad(new, old, adv, mask, agg="seq-mean-token-sum", **kw)
    want["seq_mean_token_sum_norm"] = (loss * n_rows / (b * t), grad * n_rows / (b * t))
    # SkyRL's sequence_mean averages over ALL rows (an empty one counts 0); the reference's over non-empty ones
    loss, grad, _ = ref_loss_and_grad(new, old, adv, mask, agg="seq-mean-token-mean", **kw)
    want["sequence_mean"] = (loss * n_rows / b, grad * n_rows / b)
    # prompt_mean: the token mean within each prompt's rows, averaged over prompts
    parts = [ref_loss_and_grad(new[s:e], old[s:e], adv[s:e], mask[s:e], agg="token-mean", **kw) for s, e in prompts]
    want["prompt_mean"] = (sum(p[0] for p in parts) / len(parts),
                           torch.cat([p[1] for p in parts]) / len(parts))
    out = {}
    for reduction, (want_loss, want_grad, *_) in want.items():
        scaled = ppo_utils.apply_loss_reduction_to_advantages_minibatch(
            adv, mask, reduction, micro_batch_size=b, max_seq_len=t, prompt_boundaries=prompts)
        loss, grad, metrics = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, scaled, cfg, mask)
        close(loss, want_loss.detach())
        close(grad, want_grad)
        assert set(metrics) == {"clip_ratio"} and isinstance(metrics["clip_ratio"], float), metrics
        out[reduction] = float(loss)
    return out


@check("paper_settings_and_clip_ratio")
def _():
    new, old, adv, mask, _ = batch(1)
    cfg = AlgorithmConfig(policy_loss_type="bandpo")  # SkyRL's own config class: the paper's settings
    scaled = adv / mask.sum()
    loss, grad, metrics = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, scaled, cfg, mask)
    want, want_grad, m = ref_loss_and_grad(new, old, adv, mask, **PAPER)
    close(loss, want.detach())
    close(grad, want_grad)
    assert abs(metrics["clip_ratio"] - float(m["clip_frac"])) < 1e-6 and metrics["clip_ratio"] > 0, (metrics, m)
    assert bsky.check_config(bsky.BandPOAlgorithmConfig(policy_loss_type="bandpo")) == {
        "band_divergence": "kl", "band_delta": 0.05, "band_max_ratio": 10.0, "band_dual_clip": 10.0,
        "band_clip": "band"}
    s = bsky.check_config(trainer_config("algorithm.policy_loss_type=bandpo", "algorithm.band_max_ratio=null",
                                         "algorithm.band_dual_clip=null").algorithm)
    assert s["band_max_ratio"] is None and s["band_dual_clip"] is None, s
    return metrics


@check("off_policy_correction_applied")
def _():
    """SkyRL's off_policy_correction, computed here from its definition: token TIS + per-token IS mask, and
    sequence TIS + geometric sequence mask; each token's loss times the weight, masked tokens out."""
    new, old, adv, mask, rollout = batch(3)
    q = torch.exp(torch.clamp(old - rollout, -20, 20))
    out = {}
    for name, opc in (
            ("token", OffPolicyCorrectionConfig(tis_ratio_type="token", token_tis_ratio_clip_high=1.02,
                                                token_mask_is_threshold_low=0.95,
                                                token_mask_is_threshold_high=1.05)),
            ("sequence", OffPolicyCorrectionConfig(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=1.1,
                                                   sequence_mask_metric="geometric", geo_mask_low=0.99,
                                                   geo_mask_high=1.01))):
        cfg = bsky.BandPOAlgorithmConfig(policy_loss_type="bandpo", off_policy_correction=opc)
        if name == "token":
            m2 = mask * ((q >= 0.95) & (q <= 1.05)).float()
            weight = torch.clamp(q, max=1.02)
        else:
            log_seq = ((old - rollout) * mask).sum(-1, keepdim=True)
            geo = torch.exp(log_seq / mask.sum(-1, keepdim=True).clamp(min=1))
            m2 = mask * ((geo >= 0.99) & (geo <= 1.01)).float()
            weight = torch.clamp(torch.exp(log_seq), max=1.1).expand_as(mask)
        assert 0 < float(m2.sum()) < float(mask.sum()), "the masks must act in this batch"
        assert float((weight * mask).max()) > 1.0 and float((weight * (weight < 1.02)).max()) > 0
        loss, grad, metrics = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv, cfg, mask, rollout)
        lp, per_token = independent_per_token(new, old, adv, weight=weight)
        want = (per_token * m2).sum()
        (want_grad,) = torch.autograd.grad(want, lp)
        close(loss, want.detach())
        close(grad, want_grad)
        assert "is_ratio_mean" in metrics, metrics  # SkyRL's own correction metrics are passed on
        without, *_ = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv,
                                    bsky.BandPOAlgorithmConfig(policy_loss_type="bandpo"), mask, rollout)
        assert float((loss - without).abs()) > 1e-4, "the correction changed nothing"
        out[name] = float(loss)
    return out


@check("fixed_is_skyrls_loss_bit_for_bit")
def _():
    new, old, adv, mask, rollout = batch(4, spread=1.0)
    old[3], new[3], adv[3] = -3.0, -0.5, -1.0  # ratio e^2.5 with A < 0: the dual clip acts
    out = {}
    for dual, tis in ((3.0, None), (None, None), (3.0, "token")):
        opc = OffPolicyCorrectionConfig(tis_ratio_type=tis, token_tis_ratio_clip_high=2.0)
        ours = bsky.BandPOAlgorithmConfig(policy_loss_type="bandpo", band_clip="fixed", band_dual_clip=dual,
                                          eps_clip_low=0.2, eps_clip_high=0.28, off_policy_correction=opc)
        stock = AlgorithmConfig(policy_loss_type="regular" if dual is None else "dual_clip", clip_ratio_c=3.0,
                                eps_clip_low=0.2, eps_clip_high=0.28, off_policy_correction=opc)
        loss, grad, m = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv, ours, mask, rollout)
        want, want_grad, want_m = loss_and_grad(ppo_utils.ppo_policy_loss, new, old, adv, stock, mask, rollout)
        assert torch.equal(loss, want) and torch.equal(grad, want_grad) and m == want_m, (m, want_m)
        out[f"dual={dual},tis={tis}"] = float(loss)
    assert out["dual=3.0,tis=None"] != out["dual=None,tis=None"], out  # the dual clip acts here
    return out


@check("rounding_positive_old_log_prob")
def _():
    new, old, adv, mask, _ = batch(5)
    old[1:, 0] = 6e-8
    loss, grad, _ = loss_and_grad(bsky.compute_policy_loss_bandpo, new, old, adv,
                                  AlgorithmConfig(policy_loss_type="bandpo"), mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    want, *_ = ref_loss_and_grad(new, old.clamp(max=0.0), adv, mask, agg="token-sum", **PAPER)
    close(loss, want.detach())
    return float(loss)


def refused(overrides, *needles, cls=None, once=None):
    """The ValueError of building the config, holding every needle; `once`: the key, named exactly once (one
    message, not a second check's stacked on it)."""
    try:
        trainer_config(*overrides, cls=cls)
    except ValueError as exc:
        assert all(n in str(exc) for n in needles), str(exc)
        assert once is None or str(exc).count(once) == 1, str(exc)
        return str(exc)[:90]
    raise AssertionError(f"{overrides} was accepted")


@check("bad_options_refused_naming_the_key")
def _():
    bandpo = "algorithm.policy_loss_type=bandpo"
    cases = (("band_delta", "2.0", "2.0"), ("band_delta", "-1.0", "-1.0"),
             ("band_divergence", "reverse_kl", "'reverse_kl'"), ("band_max_ratio", "0.5", "0.5"),
             ("band_dual_clip", "1.0", "1.0"), ("band_clip", "ppo", "'ppo'"), ("band_clip", "dcpo", "'dcpo'"))
    return [refused([bandpo, f"algorithm.{key}={value}"], shown, once=f"trainer.algorithm.{key}")
            for key, value, shown in cases]


@check("misspelt_band_key_refused")
def _():
    return refused(["algorithm.policy_loss_type=bandpo", "algorithm.band_dleta=0.2"],
                   "trainer.algorithm.band_dleta", "did you mean trainer.algorithm.band_delta")


@check("band_keys_without_bandpo_refused")
def _():
    out = [refused(["algorithm.policy_loss_type=regular", "algorithm.band_delta=0.2"],
                   "band_delta", "policy_loss_type='regular'"),
           refused(["algorithm.band_delta=0.2"], "band_delta", "policy_loss_type='regular'"),
           # SkyRL's own config class has no band fields: say which class to use
           refused(["algorithm.policy_loss_type=bandpo", "algorithm.band_delta=0.2"], "band_delta",
                   "BandPOTrainConfig", cls=TrainerConfig)]
    trainer_config("algorithm.policy_loss_type=regular")  # the BandPO class running a baseline: no band keys, fine
    return out


@check("command_line_as_skyrls_entrypoint")
def _():
    """What a user runs: the whole run config from command-line overrides (SkyRL's main_base does
    SkyRLTrainConfig.from_cli_overrides(sys.argv[1:]); ours is BandPOTrainConfig's)."""
    from skyrl.train.config import SkyRLTrainConfig

    cfg = bsky.BandPOTrainConfig.from_cli_overrides(["trainer.algorithm.policy_loss_type=bandpo",
                                                      "trainer.algorithm.band_delta=0.1"])
    algo = cfg.trainer.algorithm
    assert isinstance(algo, bsky.BandPOAlgorithmConfig) and algo.band_delta == 0.1, algo
    assert bsky.check_config(algo)["band_delta"] == 0.1
    out = []
    for cls, args, needles in (
            (bsky.BandPOTrainConfig, ["trainer.algorithm.policy_loss_type=bandpo", "trainer.algorithm.band_dleta=0.2"],
             ("trainer.algorithm.band_dleta", "band_delta")),
            (bsky.BandPOTrainConfig, ["trainer.algorithm.band_delta=0.2"], ("policy_loss_type='regular'",)),
            (SkyRLTrainConfig, ["trainer.algorithm.policy_loss_type=bandpo", "trainer.algorithm.band_delta=0.2"],
             ("BandPOTrainConfig",))):
        try:
            cls.from_cli_overrides(args)
        except ValueError as exc:
            assert all(n in str(exc) for n in needles), str(exc)
            out.append(str(exc)[:70])
        else:
            raise AssertionError(f"{cls.__name__} accepted {args}")
    return out


@check("fully_async_refused")
def _():
    """SkyRL's fully-async trainer refuses its own old-log-prob losses by a fixed list of names; bandpo is refused
    when the config is built: the command line, SkyRL's own config class, and a config built in Python."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import LOSSES_WITH_OLD_LOGPROBS
    from skyrl.train.config import SkyRLTrainConfig

    assert "bandpo" not in LOSSES_WITH_OLD_LOGPROBS   # what lets it past SkyRL's own guard
    out = []
    args = ["trainer.algorithm.policy_loss_type=bandpo", "trainer.fully_async.enabled=true"]
    for cls in (bsky.BandPOTrainConfig, SkyRLTrainConfig):
        try:
            cls.from_cli_overrides(args)
        except ValueError as exc:
            assert "trainer.fully_async.enabled=true" in str(exc) and "policy_loss_type=bandpo" in str(exc), exc
            out.append(str(exc)[:80])
        else:
            raise AssertionError(f"{cls.__name__} accepted {args}")
    built = bsky.BandPOTrainConfig.from_cli_overrides(args[:1])   # synchronous: fine
    built.trainer.algorithm.policy_loss_type = "bandpo"
    try:
        bsky.BandPOTrainerConfig(algorithm=built.trainer.algorithm,
                                 fully_async=type(built.trainer.fully_async)(enabled=True))
    except ValueError as exc:
        out.append(str(exc)[:40])
    else:
        raise AssertionError("BandPOTrainerConfig(fully_async=enabled) accepted")
    bsky.BandPOTrainConfig.from_cli_overrides(["trainer.fully_async.enabled=true"])   # SkyRL's own loss: its guard
    return out


@check("unused_skyrl_clips_warned")
def _():
    """eps_clip_low/high (with the band) and clip_ratio_c (always) given with bandpo are named in one warning each,
    with what takes their place; defaults and band_clip=fixed's eps are silent."""
    import warnings

    def warned(*overrides):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer_config("algorithm.policy_loss_type=bandpo", *overrides)
        return [str(w.message) for w in caught if "is not used" in str(w.message)]

    assert warned() == [], warned()
    got = warned("algorithm.eps_clip_high=0.28", "algorithm.clip_ratio_c=5.0")
    assert len(got) == 2 and "eps_clip_high=0.28" in got[0] + got[1] and "band_dual_clip=10.0" in " ".join(got), got
    assert warned("algorithm.eps_clip_high=0.28") == []   # said once per process
    fixed = warned("algorithm.band_clip=fixed", "algorithm.eps_clip_low=0.1")
    assert fixed == [], fixed
    return got


@check("version_policy")
def _():
    assert metadata.version("skyrl") in bsky.TESTED_SKYRL
    plugin_checks.version_policy(
        "skyrl", "skyrl", bsky._check_skyrl, ppo_utils, "ppo_policy_loss",
        lambda log_probs, old_log_probs, advantages, config, loss_mask: 0,
        "take ('log_probs'", "requirements-skyrl04.txt")
    return plugin_checks.version_policy(
        "skyrl", "skyrl", bsky._check_skyrl, ppo_utils, "reduce_loss",
        lambda loss, loss_mask, loss_reduction: 0, "masked sum", "requirements-skyrl04.txt")


json.dump(RESULTS, sys.stdout)
