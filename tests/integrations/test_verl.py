"""The verl integration, against the real verl package (pinned in requirements-integrations.txt).

A missing verl is an error, not a skip: CI installs the pinned packages. Set
BANDPO_SKIP_INTEGRATIONS=1 to skip this module on a machine without them.

The loss implementation compared against is `bandpo_lut.policy_loss` (itself held to the pure-PyTorch
reference by tests/runtime/test_loss.py).
"""
from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import fresh_env, run_fresh

if os.environ.get("BANDPO_SKIP_INTEGRATIONS") == "1":
    pytest.skip("BANDPO_SKIP_INTEGRATIONS=1", allow_module_level=True)

import torch  # noqa: E402
import verl  # noqa: E402  (an ImportError here means: pip install -r requirements-integrations.txt)
from hydra import compose, initialize_config_dir  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import bandpo_lut  # noqa: E402
import bandpo_lut.integrations.verl as bverl  # noqa: E402  (registers "bandpo")
from bandpo_lut.integrations import _common  # noqa: E402
from bandpo_lut.reference import policy_loss as reference  # noqa: E402
from bandpo_lut.reference.bounds import bounds as reference_bounds  # noqa: E402

VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
TARGET = "bandpo_lut.integrations.verl.BandPolicyLossConfig"
pytestmark = pytest.mark.integration
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")


@functools.lru_cache(maxsize=None)
def _compose(overrides: tuple):
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def actor_config(*overrides: str, band: bool = True):
    """The actor config exactly as verl builds it: Hydra compose of verl's own ppo_trainer.yaml
    with command-line overrides, then `omega_conf_to_dataclass` (what verl's workers call)."""
    base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    if band:
        base += ["actor_rollout_ref.actor.policy_loss.loss_mode=bandpo",
                 f"actor_rollout_ref.actor.policy_loss._target_={TARGET}"]
    cfg = _compose(tuple(base + list(overrides)))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # a fresh object every call


def band_overrides(**settings) -> list[str]:
    def fmt(v):
        return "null" if v is None else str(v)
    return [f"+actor_rollout_ref.actor.policy_loss.band_{k}={fmt(v)}" for k, v in settings.items()]


def make_batch(seed: int, batch: int = 6, prompt_len: int = 5, resp_len: int = 9, *,
               spread: float = 0.6, weights: bool = False, dtype=torch.float32):
    """A padded verl batch (left-padded prompts, right-padded responses) with one sequence whose
    response mask is empty, plus the per-token tensors of the loss."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt_len + 1, (batch,), generator=g)
    r_len = torch.randint(1, resp_len + 1, (batch,), generator=g)
    attn = torch.zeros(batch, prompt_len + resp_len, dtype=torch.int64)
    for b in range(batch):
        attn[b, prompt_len - p_len[b]:prompt_len] = 1
        attn[b, prompt_len:prompt_len + r_len[b]] = 1
    resp_valid = attn[:, prompt_len:].bool()
    response_mask = resp_valid.clone()
    response_mask[0] = False                       # a sequence that contributes nothing
    response_mask[1, 0] = False                    # a masked token inside a response (e.g. a tool)
    old = torch.log(torch.rand(batch, resp_len, generator=g, dtype=torch.float64)
                    .clamp_min(1e-6)).to(dtype)
    new = (old.double() + spread * torch.randn(batch, resp_len, generator=g, dtype=torch.float64)
           ).clamp_max(0.0).to(dtype)
    adv = torch.randn(batch, resp_len, generator=g, dtype=torch.float64).to(dtype)
    # GRPO-like: some sequences share one advantage over all their tokens
    adv[2:4] = adv[2:4, :1]
    w = (torch.rand(batch, resp_len, generator=g, dtype=torch.float64) * 2).to(dtype) \
        if weights else None
    if w is not None:
        w[3, :2] = 0.0                             # IcePop-style rejected tokens
    return dict(attn=attn, prompt_len=prompt_len, p_len=p_len, r_len=r_len,
                response_mask=response_mask, old=old, new=new, adv=adv, w=w)


def verl_data(b: dict, *, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """The TensorDict that verl's engine hands to `ppo_loss` (padded layout)."""
    n = b["attn"].shape[0]
    td = {
        "prompts": torch.ones(n, b["prompt_len"], dtype=torch.int64),
        "responses": torch.ones(n, b["response_mask"].shape[1], dtype=torch.int64),
        "attention_mask": b["attn"],
        "response_mask": b["response_mask"].to(torch.int64),
        "old_log_probs": b["old"],
        "advantages": b["adv"],
    }
    if b["w"] is not None:
        td["rollout_is_weights"] = b["w"]
    data = TensorDict(td, batch_size=[n])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                         global_batch_size=global_batch_size)
    return data


def model_output(b: dict, log_prob: torch.Tensor) -> dict:
    """What the model forward returns without padding: one flat log-prob per valid input
    position; the log-prob of response token j sits at the position before it."""
    pieces = []
    for i in range(log_prob.shape[0]):
        p, r = int(b["p_len"][i]), int(b["r_len"][i])
        pieces += [log_prob.new_zeros(p - 1), log_prob[i, :r], log_prob.new_zeros(1)]
    return {"log_probs": torch.cat(pieces)}


def run_ppo_loss(config, b, **global_info):
    """verl's own actor loss entry point; returns (loss, grad w.r.t. log_prob, metrics)."""
    log_prob = b["new"].clone().requires_grad_(True)
    loss, metrics = ppo_loss(config, model_output(b, log_prob), verl_data(b, **global_info))
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def assert_close(a, b, **kw):
    kw.setdefault("rtol", 1e-5)
    kw.setdefault("atol", 1e-7)
    torch.testing.assert_close(a, b, **kw)


# ---------------------------------------------------------------------------------------------
# registration and config


def test_registered_in_verls_registry():
    assert core_algos.get_policy_loss_fn("bandpo") is bverl.compute_policy_loss_bandpo
    assert bverl.LOSS_NAME == "bandpo"


def test_band_options_through_verls_config():
    cfg = actor_config(*band_overrides(delta=0.1, divergence="kl", max_ratio=10, dual_clip=10))
    pl = cfg.policy_loss
    assert isinstance(pl, bverl.BandPolicyLossConfig)
    assert (pl.loss_mode, pl.band_delta, pl.band_divergence, pl.band_max_ratio, pl.band_dual_clip) \
        == ("bandpo", 0.1, "kl", 10, 10)
    # verl's own policy-loss fields are still there, and verl reads the loss mode as it always does
    assert pl.clip_cov_ratio == 0.0002 and cfg.policy_loss.get("loss_mode", "vanilla") == "bandpo"


def test_band_options_in_a_users_yaml(tmp_path):
    """The README's YAML form: a user config on top of verl's ppo_trainer (no '+' needed there)."""
    (tmp_path / "bandpo_ppo.yaml").write_text(f"""
hydra:
  searchpath:
    - file://{VERL_CONFIG_DIR}
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    ppo_micro_batch_size_per_gpu: 2
    policy_loss:
      _target_: {TARGET}
      loss_mode: bandpo
      band_divergence: kl
      band_delta: 0.05
      band_max_ratio: 10
      band_dual_clip: 10
""")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="bandpo_ppo")
    pl = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss
    assert isinstance(pl, bverl.BandPolicyLossConfig)
    assert (pl.loss_mode, pl.band_divergence, pl.band_delta, pl.band_max_ratio, pl.band_dual_clip) \
        == ("bandpo", "kl", 0.05, 10, 10)


def test_defaults_without_band_keys_are_the_papers():
    pl = actor_config().policy_loss
    assert isinstance(pl, bverl.BandPolicyLossConfig)
    assert (pl.band_delta, pl.band_divergence, pl.band_max_ratio, pl.band_dual_clip,
            pl.band_clip, pl.band_mode) == (0.05, "kl", 10.0, 10.0, "band", "clip")
    # departing from them is explicit: null turns the cap and the dual clip off
    pl = actor_config(*band_overrides(max_ratio=None, dual_clip=None)).policy_loss
    assert (pl.band_max_ratio, pl.band_dual_clip) == (None, None)


def test_unknown_band_setting_is_a_clear_error():
    with pytest.raises(Exception) as info:
        actor_config(*band_overrides(dleta=0.1))
    msg = str(info.value)
    assert "band_dleta" in msg and "did you mean 'band_delta'" in msg and "actor.policy_loss" in msg
    with pytest.raises(TypeError, match="unknown setting 'band_max_ratoi'.*band_max_ratio"):
        bverl.BandPolicyLossConfig(band_max_ratoi=10)


def assert_named_once(message: str, field: str, value: str) -> None:
    """One message for one bad value: the user's field named exactly once (not a second check's message stacked
    on the first), with the offending value."""
    assert message.count(field) == 1, (field, message)
    assert value in message, (value, message)


BAD_VALUES = [  # (key, value, how the value appears in the message)
    ("delta", -0.1, "-0.1"),
    ("delta", 2.0, "2.0"),
    ("delta", 1e-4, "0.0001"),
    ("delta", "nan", "nan"),
    ("divergence", "reverse_kl", "'reverse_kl'"),
    ("divergence", "klx", "'klx'"),
    ("max_ratio", 0.5, "0.5"),
    ("dual_clip", 1.0, "1.0"),
    ("dual_clip", "nan", "nan"),
    ("clip", "ppo", "'ppo'"),
    ("mode", "hard", "'hard'"),
    ("log_counts", 3, "3"),
]


@pytest.mark.parametrize("key, value, shown", BAD_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_VALUES])
def test_bad_band_value_is_refused_when_the_config_is_built(key, value, shown):
    """Refused when verl builds the config object, in one message naming the user's key in full, once."""
    with pytest.raises(Exception) as info:
        actor_config(*band_overrides(**{key: value}))
    assert_named_once(str(info.value), f"actor_rollout_ref.actor.policy_loss.band_{key}", shown)


@pytest.mark.parametrize("clip", ["fixed", "dcpo"])
def test_bad_baseline_eps_is_refused_naming_verls_key(clip):
    """band_clip=fixed/dcpo takes its ε from verl's actor.clip_ratio_low/high (else actor.clip_ratio): a bad one is
    refused at the first loss call (the policy_loss section is built before, and apart from, the actor's clip
    keys), naming verl's key once."""
    b = make_batch(0)
    for overrides, key, shown in (
            (["actor_rollout_ref.actor.clip_ratio_low=-0.5"], "actor_rollout_ref.actor.clip_ratio_low", "-0.5"),
            (["actor_rollout_ref.actor.clip_ratio_high=-1.0"], "actor_rollout_ref.actor.clip_ratio_high", "-1.0")):
        cfg = actor_config(*band_overrides(clip=clip), *overrides)
        with pytest.raises(ValueError) as info:
            run_ppo_loss(cfg, b)
        assert_named_once(str(info.value), key, shown)


def _driver_config(*overrides):
    base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.policy_loss.loss_mode=bandpo",
            f"actor_rollout_ref.actor.policy_loss._target_={TARGET}"]
    return _compose(tuple(base + list(overrides)))


def test_verls_driver_validation_refuses_a_bad_band():
    """verl's own validate_config, which main_ppo runs in the driver before Ray starts a worker,
    refuses a band the loss could not compute (it used to pass, and fail in the first loss call)."""
    from verl.utils.config import validate_config

    validate_config(_driver_config(*band_overrides(delta=0.05)), use_reference_policy=False,
                    use_critic=False)  # the paper's settings pass
    for key, value in (("delta", 2.0), ("delta", 1e-4), ("divergence", "reverse_kl")):
        with pytest.raises(Exception, match=f"policy_loss.band_{key}="):
            validate_config(_driver_config(*band_overrides(**{key: value})),
                            use_reference_policy=False, use_critic=False)


def test_target_without_loss_mode_says_what_to_add():
    with pytest.raises(Exception) as info:
        actor_config(f"actor_rollout_ref.actor.policy_loss._target_={TARGET}", band=False)
    msg = str(info.value)
    assert "loss_mode='vanilla'" in msg
    assert "Add actor_rollout_ref.actor.policy_loss.loss_mode=bandpo" in msg


def test_band_keys_without_target_say_to_set_it():
    """In a process where bandpo_lut.integrations.verl is imported (here; in a driver through
    VERL_USE_EXTERNAL_MODULES, below), band keys under verl's own PolicyLossConfig fail saying
    which _target_ to set, not with a bare 'unexpected keyword argument'."""
    with pytest.raises(Exception) as info:
        actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=bandpo",
                     *band_overrides(delta=0.05, max_ratio=10), band=False)
    msg = str(info.value)
    assert "band_delta, band_max_ratio" in msg
    assert f"Add actor_rollout_ref.actor.policy_loss._target_={TARGET}" in msg
    # verl's own class is otherwise untouched
    from verl.workers.config import PolicyLossConfig

    assert PolicyLossConfig(loss_mode="vanilla").loss_mode == "vanilla"


def test_loss_mode_bandpo_without_target_is_refused_naming_the_line():
    """loss_mode=bandpo under verl's own PolicyLossConfig (the _target_ line forgotten): refused when the
    config is built, naming the line to add (it used to pass, and the run died in a worker at the first
    update, or trained with settings nobody set). verl's own losses build as before."""
    with pytest.raises(Exception) as info:
        actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=bandpo", band=False)
    assert f"add the line actor_rollout_ref.actor.policy_loss._target_={TARGET}" in str(info.value)
    assert type(actor_config(band=False).policy_loss).__name__ == "PolicyLossConfig"
    assert actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", band=False).policy_loss.loss_mode \
        == "gspo"


# verl's driver as `python -m verl.trainer.main_ppo OVERRIDES` runs it (Hydra main, validate_config), up to
# the point where it would start Ray: run_ppo, replaced by a marker.
_DRIVER = """
import sys
import verl.trainer.main_ppo as main_ppo
main_ppo.run_ppo = lambda *a, **k: print("VALIDATED: the driver would start Ray now")
sys.argv = ["main_ppo", *sys.argv[1:]]
main_ppo.main()
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_verls_driver_refuses_loss_mode_bandpo_without_target(tmp_path):
    """A fresh driver that never names bandpo_lut (no _target_, no VERL_USE_EXTERNAL_MODULES): verl's
    plug-in loader imports bandpo_lut.integrations.verl_plugin (setup.py's verl.plugins entry point), and
    validate_config refuses, naming the missing line, before Ray starts. With the line, it validates."""
    base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=1",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=bandpo",
            "hydra.run.dir=" + str(tmp_path / "h")]
    env = fresh_env()
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    out = run_fresh(["-c", _DRIVER, *base], cwd=tmp_path, env=env, timeout=300)
    assert "VALIDATED" not in out.stdout, "verl's driver accepted loss_mode=bandpo without the _target_ line"
    assert out.returncode != 0
    assert f"add the line actor_rollout_ref.actor.policy_loss._target_={TARGET}" in out.stderr + out.stdout, \
        out.stderr[-3000:]
    ok = run_fresh(["-c", _DRIVER, *base, f"actor_rollout_ref.actor.policy_loss._target_={TARGET}"], cwd=tmp_path,
                   env=env, timeout=300)
    assert ok.returncode == 0 and "VALIDATED" in ok.stdout, ok.stderr[-3000:]


def _run_fresh_python(code: str, **env) -> subprocess.CompletedProcess:
    # the bandpo_lut this test process imported (installed or source tree), not a guess: helpers.fresh_env
    return run_fresh(["-c", code], cwd=tempfile.gettempdir(), env=fresh_env(**env), timeout=300)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_worker_building_the_actor_config_imports_the_loss():
    """A fresh process that never imports bandpo_lut (a verl worker) gets "bandpo" registered by
    building the actor config, whose policy_loss _target_ names our class."""
    code = f"""
import os
from hydra import compose, initialize_config_dir
import verl
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass
assert "bandpo" not in core_algos.POLICY_LOSS_REGISTRY
d = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
with initialize_config_dir(config_dir=d, version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=[
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=bandpo",
        "actor_rollout_ref.actor.policy_loss._target_={TARGET}"])
omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
fn = core_algos.get_policy_loss_fn("bandpo")
assert fn.__module__ == "bandpo_lut.integrations.verl", fn.__module__
print("OK")
"""
    out = _run_fresh_python(code)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.subprocess
def test_band_keys_without_target_in_a_driver_with_external_modules():
    code = """
import os
from hydra import compose, initialize_config_dir
import verl
from verl.utils.config import omega_conf_to_dataclass
d = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
with initialize_config_dir(config_dir=d, version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=[
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=bandpo",
        "+actor_rollout_ref.actor.policy_loss.band_delta=0.05"])
try:
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
except Exception as e:
    print("ERROR:", e)
"""
    out = _run_fresh_python(code, VERL_USE_EXTERNAL_MODULES="bandpo_lut.integrations.verl")
    assert f"Add actor_rollout_ref.actor.policy_loss._target_={TARGET}" in out.stdout, \
        out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.subprocess
def test_verl_external_modules_env_imports_the_loss():
    out = _run_fresh_python(
        "from verl.trainer.ppo import core_algos; core_algos.get_policy_loss_fn('bandpo'); print('OK')",
        VERL_USE_EXTERNAL_MODULES="bandpo_lut.integrations.verl")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# the loss through verl's entry point


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum"])
@pytest.mark.parametrize("settings", [
    dict(delta=0.05, divergence="kl", max_ratio=None, dual_clip=None),
    dict(delta=0.05, divergence="kl", max_ratio=10, dual_clip=10),
    dict(delta=0.2, divergence="kl", max_ratio=3, dual_clip=2.5),
], ids=["kl-uncapped", "paper", "tight"])
def test_loss_and_grad_equal_policy_loss(agg, settings):
    """Through ppo_loss with a real actor config (dp 1, no global info): the same loss and
    gradient as calling bandpo_lut.policy_loss directly."""
    cfg = actor_config(*band_overrides(**settings), f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    b = make_batch(1)
    loss, grad, metrics = run_ppo_loss(cfg, b)

    log_prob = b["new"].clone().requires_grad_(True)
    want, want_m = bandpo_lut.policy_loss(log_prob, b["old"], b["adv"], b["response_mask"], agg=agg,
                             delta=settings["delta"], divergence=settings["divergence"],
                             max_ratio=settings["max_ratio"], dual_clip=settings["dual_clip"])
    (want_grad,) = torch.autograd.grad(want, log_prob)
    assert_close(loss, want.detach())
    assert_close(grad, want_grad)
    assert grad.abs().sum() > 0
    # the metrics verl logs (Metric objects, converted by verl) are ours
    assert metrics["actor/pg_clipfrac"].aggregate() == pytest.approx(float(want_m["clip_frac"]))
    assert metrics["actor/bandpo/clip_frac_upper_lowprob"].aggregate() == pytest.approx(
        float(want_m["clip_frac_upper_lowprob"]))
    assert metrics["actor/ppo_kl"].aggregate() == pytest.approx(float(want_m["ppo_kl"]))
    assert float(want_m["clip_frac"]) > 0  # the batch does exercise the clip


def _band_per_token(b, delta, divergence, max_ratio, dual_clip):
    """An independent per-token BandPO loss (PPO's max of the two surrogates, then the dual cap),
    to be aggregated by verl's own agg_loss."""
    lp = b["new"].clone().requires_grad_(True)  # |log-ratio| < 20 here: no clamp needed
    ratio = torch.exp(lp - b["old"])
    lo, up = reference_bounds(log_p_old=b["old"], delta=delta, divergence=divergence)
    up = up.clamp(max=max_ratio)
    adv = b["adv"]
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, lo, up))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return lp, loss


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("global_info", [
    dict(),
    dict(dp_size=2, batch_num_tokens=97, global_batch_size=11),
], ids=["local", "global"])
def test_global_batch_info_and_rollout_weights(agg, global_info):
    """With verl's global batch info and rollout IS weights, ppo_loss through "bandpo" equals an
    independent per-token band loss, weighted and aggregated by verl's own agg_loss."""
    settings = dict(delta=0.05, divergence="kl", max_ratio=10, dual_clip=3)
    cfg = actor_config(*band_overrides(**settings), f"actor_rollout_ref.actor.loss_agg_mode={agg}",
                       "actor_rollout_ref.actor.loss_scale_factor=16")
    b = make_batch(2, weights=True)
    loss, grad, _ = run_ppo_loss(cfg, b, **global_info)

    lp, per_token = _band_per_token(b, **settings)
    want = core_algos.agg_loss(per_token * b["w"], b["response_mask"], agg,
                               **{"dp_size": 1, **global_info, "loss_scale_factor": 16})
    (want_grad,) = torch.autograd.grad(want, lp)
    want_grad = want_grad * b["response_mask"]
    assert_close(loss, want.detach())
    assert_close(grad, want_grad)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("weights", [False, True], ids=["plain", "is_weights"])
def test_fixed_clip_baseline_equals_verls_vanilla(agg, weights):
    """band_clip=fixed with verl's eps and dual clip = clip_ratio_c is verl's own vanilla PPO loss:
    same loss, gradient and clip fraction, with global batch info and IS weights."""
    common = [f"actor_rollout_ref.actor.loss_agg_mode={agg}", "actor_rollout_ref.actor.clip_ratio_low=0.2",
              "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=3.0"]
    ours = actor_config(*band_overrides(clip="fixed", dual_clip=3.0), *common)
    vanilla = actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", *common, band=False)
    b = make_batch(3, weights=weights, spread=0.8)
    info = dict(dp_size=2, batch_num_tokens=101, global_batch_size=12)
    loss, grad, m = run_ppo_loss(ours, b, **info)
    want, want_grad, want_m = run_ppo_loss(vanilla, b, **info)
    assert_close(loss, want)
    assert_close(grad, want_grad)
    if not weights:  # with weights, zero-weight tokens count as unclipped in ours (documented)
        for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
            assert m[key].aggregate() == pytest.approx(want_m[key].aggregate(), rel=1e-5, abs=1e-7)
    assert want_m["actor/pg_clipfrac"].aggregate() > 0


def test_metrics_are_detached_tensors_under_actor_names():
    cfg = actor_config(*band_overrides(max_ratio=10, dual_clip=10))
    b = make_batch(4)
    log_prob = b["new"].clone().requires_grad_(True)
    loss, metrics = bverl.compute_policy_loss_bandpo(
        old_log_prob=b["old"], log_prob=log_prob, advantages=b["adv"],
        response_mask=b["response_mask"], loss_agg_mode="token-mean", config=cfg)
    fractions = set(reference.FRACTIONS)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} | {
        f"actor/bandpo/{k}" for k in fractions}
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
    # verl's logging accepts them as they are (it converts them, not us)
    Metric.from_dict(metrics, aggregation="mean")

    cfg = actor_config(*band_overrides(log_counts="true"))
    _, metrics = bverl.compute_policy_loss_bandpo(
        b["old"], log_prob, b["adv"], b["response_mask"], "token-mean", cfg)
    assert {f"actor/bandpo/{k}" for k in reference.COUNTS} <= set(metrics)
    # averaged counts give the exact fractions (verl averages micro-batches on every rank alike)
    n = metrics["actor/bandpo/n_tokens"]
    assert_close(metrics["actor/bandpo/n_clipped"] / n, metrics["actor/bandpo/clip_frac"])


class _HostSync(RuntimeError):
    pass


def test_no_host_synchronisation_in_the_loss(monkeypatch):
    """Every way a tensor reaches the host raises inside our loss call (CPU stand-in for a CUDA
    sync check): the integration keeps everything on the device."""
    cfg = actor_config(*band_overrides(max_ratio=10, dual_clip=10, log_counts="true"),
                       "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=100, global_batch_size=12,
                                 loss_scale_factor=None)
    b = make_batch(5, weights=True)
    log_prob = b["new"].clone().requires_grad_(True)

    def boom(*args, **kwargs):
        raise _HostSync("host synchronisation")

    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    loss, metrics = bverl.compute_policy_loss_bandpo(
        b["old"], log_prob, b["adv"], b["response_mask"], "seq-mean-token-mean", cfg, b["w"])
    monkeypatch.undo()
    assert loss.requires_grad and len(metrics) > 3


def test_dp_without_global_info_is_an_error():
    cfg = actor_config()
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=None, global_batch_size=None)
    b = make_batch(6)
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        bverl.compute_policy_loss_bandpo(b["old"], b["new"], b["adv"], b["response_mask"],
                                         "token-mean", cfg)


# ---------------------------------------------------------------------------------------------
# the version policy (the same as TRL's: bandpo_lut.integrations._common.check_framework)


def test_installed_verl_is_a_tested_version_and_imports_silently():
    import warnings

    assert verl.__version__ in bverl.TESTED_VERL
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bverl._check_verl_convention()


def test_untested_verl_with_the_same_convention_warns(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.warns(UserWarning, match=r"verl 0\.9\.2 is not one of the tested versions"):
        bverl._check_verl_convention()


def test_verl_with_a_different_loss_convention_is_refused(monkeypatch):
    def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
        pass

    monkeypatch.setattr(core_algos, "compute_policy_loss_vanilla", vanilla)
    with pytest.raises(ImportError, match=r"cannot work with the installed verl .*policy losses "
                                          r"take .*Tested with verl 0\.9\.1"):
        bverl._check_verl_convention()


# ---------------------------------------------------------------------------------------------
# the launch script in examples/


@pytest.mark.subprocess
def test_example_launch_script_builds_the_papers_config(tmp_path):
    """examples/verl_bandpo.sh, run by bash with a stand-in `python3` that records its arguments:
    its command line composes with verl's config, passes verl's driver validation, and the actor's
    policy loss is BandPO with the paper's settings."""
    from verl.utils.config import validate_config

    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    out = tmp_path / "args.txt"
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
               ARGS_OUT=str(out), HOME=str(tmp_path))
    script = Path(__file__).resolve().parents[2] / "examples" / "verl_bandpo.sh"   # the checkout's, not site-packages'
    subprocess.run(["bash", str(script), "trainer.total_epochs=1"], env=env, check=True,
                   timeout=60)
    args = out.read_text().splitlines()
    assert args[:2] == ["-m", "verl.trainer.main_ppo"] and args[-1] == "trainer.total_epochs=1"
    cfg = _compose(tuple(args[2:]))
    validate_config(cfg, use_reference_policy=False, use_critic=False)
    pl = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss
    assert isinstance(pl, bverl.BandPolicyLossConfig)
    assert (pl.loss_mode, pl.band_divergence, pl.band_delta, pl.band_max_ratio, pl.band_dual_clip,
            pl.band_clip) == ("bandpo", "kl", 0.05, 10, 10, "band")
    # several optimiser steps per rollout batch, so that the ratio moves and the band acts
    assert cfg.data.train_batch_size > cfg.actor_rollout_ref.actor.ppo_mini_batch_size


# ---------------------------------------------------------------------------------------------
# verl's own clip settings under loss_mode=bandpo, and rounding-positive old log-probs


def _bandpo_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("loss_mode=bandpo")]


def test_ignored_verl_clip_settings_are_named_once(monkeypatch):
    """actor.clip_ratio_c / clip_ratio_low / clip_ratio_high set by the user do nothing under
    loss_mode=bandpo: each is named once, with the band setting that takes its place."""
    import warnings

    monkeypatch.setattr(_common, "_warned_unused", set())
    cfg = actor_config("actor_rollout_ref.actor.clip_ratio_c=5.0",
                       "actor_rollout_ref.actor.clip_ratio_high=0.28")
    b = make_batch(5)
    with pytest.warns(UserWarning) as record:
        run_ppo_loss(cfg, b)
        run_ppo_loss(cfg, b)
    messages = _bandpo_warnings(record)
    assert len(messages) == 2, messages
    assert any("actor.clip_ratio_c=5.0" in m and "band_dual_clip=10" in m for m in messages)
    assert any("actor.clip_ratio_high=0.28" in m and "band_delta=0.05" in m for m in messages)
    # verl's defaults, and the fixed baseline's eps (which it uses), are not named
    for overrides in ([], [*band_overrides(clip="fixed"), "actor_rollout_ref.actor.clip_ratio_high=0.28"]):
        with warnings.catch_warnings(record=True) as quiet:
            warnings.simplefilter("always")
            run_ppo_loss(actor_config(*overrides), b)
        assert _bandpo_warnings(quiet) == []


def test_rounding_positive_old_log_prob_is_p_one_in_verl():
    """A counted token with old_log_prob = +6e-8 (bf16 or an inference engine's rounding): the loss
    is finite, like verl's own, and equals a per-token PPO loss whose band for that token is the
    band at log p = 0 (the reference reader at exactly 0, the p = 1 limit), with the ratio from the
    old log-prob as given."""
    cfg = actor_config()
    b = make_batch(6)
    rows, cols = b["response_mask"].nonzero(as_tuple=True)
    b["old"][rows[0], cols[0]] = 6e-8
    b["old"][rows[-1], cols[-1]] = 2.0 ** -9
    loss, grad, _ = run_ppo_loss(cfg, b)
    vanilla, _, _ = run_ppo_loss(actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
                                              band=False), b)
    assert torch.isfinite(loss) and torch.isfinite(vanilla) and torch.isfinite(grad).all()

    lp = b["new"].clone().requires_grad_(True)
    ratio = torch.exp(lp - b["old"])
    lo, up = reference_bounds(log_p_old=b["old"].clamp(max=0.0), delta=0.05, divergence="kl")
    adv = b["adv"]
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, lo, up.clamp(max=10)))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 10), per_token)
    want = core_algos.agg_loss(per_token, b["response_mask"], "token-mean", dp_size=1)
    (want_grad,) = torch.autograd.grad(want, lp)
    assert_close(loss, want.detach())
    assert_close(grad, want_grad * b["response_mask"])
