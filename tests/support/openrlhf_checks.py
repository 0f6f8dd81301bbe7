"""Checks of bandpo_lut.integrations.openrlhf (and its launcher) against the real openrlhf (and the real deepspeed its
loss module's utils import), run by tests/integrations/test_openrlhf.py in a fresh interpreter with
.openrlhf-site on PYTHONPATH. Prints one JSON object: check name -> [ok, detail]."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings
from importlib import metadata
from pathlib import Path

import plugin_checks  # tests/, the script's folder
import torch
from plugin_checks import RESULTS, check, close, independent_per_token

import bandpo_lut
import bandpo_lut.integrations._common as _common
import bandpo_lut.integrations._openrlhf_options as options
import bandpo_lut.integrations.openrlhf as borl
import bandpo_lut.integrations.openrlhf_launcher as launcher

orl_loss = sys.modules["openrlhf.models.loss"]
STOCK = orl_loss.PolicyLoss  # OpenRLHF's own class (before any `activate` below)


def batch(seed, **sizes):
    return plugin_checks.batch(seed, **sizes)[:4]


def run(loss_fn, new, *args, **kwargs):
    lp = new.clone().requires_grad_(True)
    out = loss_fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(out[0], lp)
    return out, grad


def expect_error(fn, *needles, once=None):
    """The ValueError of fn(), which holds every needle; `once`: the user's argument, named once (one message,
    not a second check's stacked on it)."""
    try:
        fn()
    except (ValueError, AssertionError) as exc:
        assert all(n in str(exc) for n in needles), f"{needles} not in: {exc}"
        assert once is None or str(exc).count(once) == 1, f"{once} not named exactly once: {exc}"
        return str(exc)
    raise AssertionError(f"accepted; expected an error naming {needles}")


@check("real_packages")
def _():
    site = os.environ["BANDPO_OPENRLHF_SITE"]
    import deepspeed

    for mod in (orl_loss, sys.modules["openrlhf.models.utils"], deepspeed):
        assert Path(mod.__file__).resolve().is_relative_to(Path(site).resolve()), mod.__file__
    assert metadata.version("openrlhf") in borl.TESTED_OPENRLHF
    assert issubclass(borl.BandPolicyLoss, STOCK) and STOCK.__module__ == "openrlhf.models.loss"
    return f"openrlhf {metadata.version('openrlhf')}, deepspeed {deepspeed.__version__}"


@check("token_mean_equals_policy_loss")
def _():
    new, old, adv, mask = batch(0)
    out, grad = run(borl.BandPolicyLoss(), new, old, adv, action_mask=mask)
    lp = new.clone().requires_grad_(True)
    ref, metrics = bandpo_lut.policy_loss(lp, old, adv, mask, delta=0.05, divergence="kl", max_ratio=10.0,
                                          dual_clip=10.0, agg="token-mean")
    (ref_grad,) = torch.autograd.grad(ref, lp)
    assert torch.equal(out[0], ref.detach()) and torch.equal(grad, ref_grad)
    assert torch.equal(out[1], metrics["clip_frac"]) and out[3] is None and out[4] is None
    return f"loss {out[0].item():.6f}, clip_ratio {out[1].item():.3f}"


@check("aggregations_equal_openrlhfs_aggregate_loss")
def _():
    new, old, adv, mask = batch(1)
    done = []
    for token_level in (True, False):
        for extra in ({}, {"dp_size": 2, "batch_num_tokens": torch.tensor(61.0),
                           "global_batch_size": torch.tensor(7.0)}):
            out, grad = run(borl.BandPolicyLoss(token_level_loss=token_level), new, old, adv,
                            action_mask=mask, **extra)
            lp, per_token = independent_per_token(new, old, adv)
            ref = orl_loss.aggregate_loss(per_token, mask, token_level_loss=token_level, **extra)
            (ref_grad,) = torch.autograd.grad(ref, lp)
            close(out[0].detach(), ref.detach())
            close(grad, ref_grad)
            done.append(f"{'token' if token_level else 'sample'}{'/global' if extra else ''}")
    return done


@check("fixed_is_openrlhfs_loss_bit_for_bit")
def _():
    new, old, adv, mask = batch(2, spread=0.4)
    done = []
    # --band.dual_clip is OpenRLHF's dual clip on the fixed route (the paper's 10 by default, None: off)
    for kw, dual in (({}, 10.0), ({"clip_eps_low": 0.2, "clip_eps_high": 0.28}, 3.0), ({}, None),
                     ({"token_level_loss": False}, 10.0), ({"policy_loss_type": "gspo"}, 10.0)):
        for extra in ({}, {"dp_size": 2, "batch_num_tokens": torch.tensor(61.0),
                           "global_batch_size": torch.tensor(7.0)}):
            ours, g1 = run(borl.BandPolicyLoss(band=borl.band_settings(clip="fixed", dual_clip=dual), **kw), new,
                           old, adv, action_mask=mask, **extra)
            stock, g2 = run(STOCK(**kw, dual_clip=dual), new, old, adv, action_mask=mask, **extra)
            for a, b in zip(ours, stock):
                assert (a is None and b is None) or torch.equal(a.detach(), b.detach()), (kw, a, b)
            assert torch.equal(g1, g2), kw
            done.append(kw)
    return f"{len(done)} settings"


@check("band_metrics_in_openrlhfs_logging")
def _():
    new, old, adv, mask = batch(3)
    loss_fn = borl.BandPolicyLoss()
    (_, clip_ratio, ppo_kl, _, _), _ = run(loss_fn, new, old, adv, action_mask=mask)
    stock_kl = STOCK()(new, old, adv, action_mask=mask)[2]
    assert torch.equal(ppo_kl, stock_kl), "ppo_kl is OpenRLHF's"
    m = loss_fn.last_band_metrics
    names = {k if k.startswith("band_") else f"band_{k}" for k in bandpo_lut.runtime.loss_spec.FRACTIONS}
    assert set(m) == names and "band_clip_frac_upper" in m and "band_width_mean" in m, sorted(m)
    assert all(v.dim() == 0 for v in m.values()), "0-dim: OpenRLHF weights them by tokens"
    assert torch.equal(m["band_clip_frac"], clip_ratio)
    # OpenRLHF's training_step copies experience.info into its logged metrics after the loss call; the
    # wrapper puts the band metrics there. The real step (flash-attn, GPUs) cannot run here: its source
    # is checked for that order, and the wrapper is run on a step of the same shape.
    src = Path(sys.modules["openrlhf"].__file__).parent / "trainer" / "ray" / "ppo_actor.py"
    text = src.read_text()
    i_loss = text.index("= self.actor_loss_fn(")
    i_copy = text.index("for k, v in experience.info.items():")
    assert i_loss < i_copy, "OpenRLHF's training_step no longer copies info after the loss"

    class Experience:
        info: dict

    class Trainer:
        actor_loss_fn = loss_fn

        def training_step(self, experience):
            self.actor_loss_fn(new, old, adv, action_mask=mask)
            return dict(experience.info)

    step = borl._log_band_metrics(Trainer.training_step)
    exp = Experience()
    exp.info = {}
    logged = step(Trainer(), exp)
    assert set(logged) == set(m) and "forward" not in vars(loss_fn)
    return sorted(logged)[:3]


@check("rounding_positive_old_log_prob")
def _():
    new, old, adv, mask = batch(4)
    old[1, 2], mask[1, 2] = 6e-8, 1.0
    (loss, *_), grad = run(borl.BandPolicyLoss(), new, old, adv, action_mask=mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    return f"{loss.item():.6f}"


@check("bad_options_refused_naming_the_argument")
def _():
    S = borl.band_settings
    msgs = [  # each bad value: one message naming the argument once, with the value
        expect_error(lambda: S(delta=-1.0), "-1.0", once="--band.delta"),
        expect_error(lambda: S(delta=50.0), "50.0", once="--band.delta"),
        expect_error(lambda: S(delta=float("nan")), "nan", once="--band.delta"),
        expect_error(lambda: S(divergence="js"), "'js'", once="--band.divergence"),
        expect_error(lambda: S(divergence="reverse_kl"), "'reverse_kl'", once="--band.divergence"),
        expect_error(lambda: S(max_ratio=0.5), "0.5", once="--band.max_ratio"),
        expect_error(lambda: S(dual_clip=1.0), "1.0", once="--band.dual_clip"),
        expect_error(lambda: S(dual_clip=float("nan")), "nan", once="--band.dual_clip"),
        expect_error(lambda: S(clip="dcpo"), "'dcpo'", once="--band.clip"),
        expect_error(lambda: borl.BandPolicyLoss(band=bandpo_lut.LossSettings(clip="dcpo")), "'dcpo'",
                     once="--band.clip"),
        expect_error(lambda: borl.BandPolicyLoss(policy_loss_type="gspo"), "--actor.policy_loss_type"),
        expect_error(lambda: borl.BandPolicyLoss(is_correction_level="token"),
                     "--algo.advantage.is_correction_level"),
        # the launcher: before Ray starts
        expect_error(lambda: launcher.parse_band_args(["--band.delta", "7", "--data.prompt_dataset", "x"]),
                     "--band.delta"),
        expect_error(lambda: launcher.parse_band_args(["--actor.policy_loss_type", "gspo"]),
                     "--actor.policy_loss_type"),
        expect_error(lambda: launcher.parse_band_args(["--algo.advantage.is_correction_level", "seq"]),
                     "--algo.advantage.is_correction_level"),
        expect_error(lambda: launcher.parse_band_args(["--band.delta", "abc"]), "--band.delta", "'abc'"),
        expect_error(lambda: launcher.parse_band_args(["--band.dual_clip", "off"]), "--band.dual_clip", "'off'"),
        # no abbreviations, and no --band option that is not one of the launcher's
        expect_error(lambda: launcher.parse_band_args(["--band.max", "3"]), "--band.max ", "--band.max_ratio?"),
        expect_error(lambda: launcher.parse_band_args(["--band.dual=3"]), "--band.dual ", "--band.dual_clip?"),
        expect_error(lambda: launcher.parse_band_args(["--band_delta", "0.1"]), "--band_delta", "--band.delta?"),
    ]
    # the launcher's main: each of these is an argparse error (exit 2, one line naming the argument)
    for argv, needle in ((["--band.divergence", "js"], "--band.divergence='js'"),
                         (["--actor.policy_loss_type", "gspo"], "--actor.policy_loss_type='gspo'"),
                         (["--band.max_ratio", "0.5"], "--band.max_ratio"),
                         (["--band.clip=dcpo"], "--band.clip='dcpo'")):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                launcher.main(["--actor.model_name_or_path", "m", *argv])
        except SystemExit as exc:
            assert exc.code == 2, (argv, exc.code)
        else:
            raise AssertionError(f"{argv} accepted")
        lines = [line for line in err.getvalue().splitlines() if line.startswith(f"{launcher.PROG}: error: ")]
        assert len(lines) == 1 and needle in lines[0], (argv, err.getvalue())
    # built without the launcher: the replaced values named in a warning, once each
    for kw, needle in (({"dual_clip": 3.0}, "--band.dual_clip=10.0 takes its place"),
                       ({"clip_eps_low": 0.1}, "--actor.eps_clip_low_high=[0.1, 0.2] has no effect")):
        for band, warned in ((borl.band_settings(), True), (borl.band_settings(clip="fixed"), "dual_clip" in kw)):
            _common._warned_unused.clear()
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                loss = borl.BandPolicyLoss(band=band, **kw)
                borl.BandPolicyLoss(band=band, **kw)
            got = [str(w.message) for w in record if needle in str(w.message)]
            assert len(got) == int(warned), (kw, band.clip, [str(w.message) for w in record])
            assert loss.dual_clip == band.dual_clip
    return msgs[0]


@check("paper_defaults_and_launcher_args")
def _():
    assert borl.band_settings() == bandpo_lut.LossSettings(divergence="kl", delta=0.05, max_ratio=10.0,
                                                           dual_clip=10.0, clip="band")
    s, rest = launcher.parse_band_args(["--actor.model_name_or_path", "m", "--band.max_ratio", "None",
                                    "--band.delta", "0.1", "--actor.dual_clip", "10", "--actor.eps_clip", "0.2"])
    assert (s.delta, s.max_ratio, s.dual_clip) == (0.1, None, 10.0), s
    assert rest == ["--actor.model_name_or_path", "m", "--actor.dual_clip", "10", "--actor.eps_clip", "0.2"], rest
    # what the band's settings replace is refused, naming the argument, before Ray starts
    refused = [expect_error(lambda: launcher.parse_band_args(argv), *needles) for argv, needles in (
        (["--actor.dual_clip", "3"], ("--actor.dual_clip=3.0", "--band.dual_clip 3.0")),
        (["--band.clip", "fixed", "--actor.dual_clip", "3"], ("--actor.dual_clip=3.0",)),
        (["--band.dual_clip", "None", "--actor.dual_clip", "3"], ("--actor.dual_clip=3.0",)),
        (["--actor.eps_clip", "0.1"], ("--actor.eps_clip=0.1", "--band.clip fixed")),
        (["--actor.eps_clip_low_high", "0.2", "0.28"], ("--actor.eps_clip_low_high=[0.2, 0.28]",)))]
    s, _ = launcher.parse_band_args(["--band.clip", "fixed", "--actor.eps_clip_low_high", "0.2", "0.28",
                                     "--band.dual_clip", "3", "--actor.dual_clip", "3"])   # the fixed baseline's
    assert (s.clip, s.dual_clip) == ("fixed", 3.0), s
    return refused


@check("activate_rebinds_policyloss_and_ray_hook")
def _():
    settings = borl.band_settings(delta=0.1, max_ratio=None)
    os.environ[borl.ENV] = options.band_options_json(settings)
    assert json.loads(os.environ[borl.ENV]) == {"divergence": "kl", "delta": 0.1, "max_ratio": None,
                                                "dual_clip": 10.0, "clip": "band"}
    cls = borl.activate(settings, patch_actor=False)
    # what OpenRLHF's actor does: PolicyLoss(...) by the module's name, with its own arguments
    built = orl_loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=None, token_level_loss=True,
                                policy_loss_type="ppo", is_correction_level="off")
    assert isinstance(built, borl.BandPolicyLoss) and built.band == settings and cls is orl_loss.PolicyLoss
    new, old, adv, mask = batch(5)
    ref, _ = bandpo_lut.policy_loss(new, old, adv, mask, delta=0.1, max_ratio=None, dual_clip=10.0)
    assert torch.equal(built(new, old, adv, action_mask=mask)[0], ref)
    # the launcher's ray.init: OpenRLHF's runtime_env kept, the settings and the worker hook added
    seen = {}
    init = launcher._ray_init_with_hook(lambda **kw: seen.update(kw))
    init(runtime_env={"env_vars": {"NCCL_DEBUG": "WARN"}})
    env = seen["runtime_env"]
    assert env["env_vars"] == {"NCCL_DEBUG": "WARN", borl.ENV: os.environ[borl.ENV]}, env
    hook = env["worker_process_setup_hook"]
    module, _, name = hook.rpartition(".")
    assert getattr(sys.modules[module], name) is borl.activate_from_env
    return hook


@check("version_policy")
def _():
    return plugin_checks.version_policy(
        "openrlhf", "openrlhf", borl._check_openrlhf, STOCK, "forward",
        lambda self, log_probs, old_log_probs, advantages, action_mask=None: 0,
        "PolicyLoss.forward takes", "requirements-openrlhf.txt")


json.dump(RESULTS, sys.stdout)
