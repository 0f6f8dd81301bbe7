"""The TRL integration, against the real TRL package (pinned in requirements-integrations.txt).

Offline and on CPU: the model is a tiny Qwen2 built from a config (random weights) and the
tokenizer a character-level WordLevel tokenizer built here; nothing is downloaded.

A missing TRL is an error, not a skip: CI installs the pinned packages (and reruns this file with
each TRL version in TESTED_TRL). Set BANDPO_SKIP_INTEGRATIONS=1 to skip this module on a machine
without them.

The library functions compared against are `bandpo_lut.policy_loss` and `bandpo_lut.bounds`;
where the compiled ones are not exposed, the fixture below puts the pure-PyTorch references there.
"""
from __future__ import annotations

import ast
import copy
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

if os.environ.get("BANDPO_SKIP_INTEGRATIONS") == "1":
    pytest.skip("BANDPO_SKIP_INTEGRATIONS=1", allow_module_level=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import trl  # noqa: E402  (an ImportError here means: pip install -r requirements-integrations.txt)
from datasets import Dataset  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import bandpo_lut  # noqa: E402
from bandpo_lut.integrations.trl import TESTED_TRL, BandGRPOConfig, BandGRPOTrainer  # noqa: E402
from bandpo_lut.reference import policy_loss as reference  # noqa: E402
from bandpo_lut.reference.bounds import bounds as reference_bounds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Most tests here build trainers with TRL's default schedule and call the loss directly; the
# warning that this schedule leaves the clip inert is tested on its own.
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:BandGRPOTrainer. with num_iterations")]


def _reference_library_bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None,
                              max_ratio=None):
    lo, up = reference_bounds(p_old, delta, divergence, log_p_old=log_p_old)
    return lo, up if max_ratio is None else torch.clamp(up, max=float(max_ratio))


@pytest.fixture(autouse=True)
def library_impl(monkeypatch):
    """`bandpo_lut.policy_loss` / `bandpo_lut.bounds`, or the references until they are exposed."""
    if getattr(bandpo_lut, "policy_loss", None) is None:
        monkeypatch.setattr(bandpo_lut, "policy_loss", reference.policy_loss, raising=False)
    if getattr(bandpo_lut, "bounds", None) is None:
        monkeypatch.setattr(bandpo_lut, "bounds", _reference_library_bounds, raising=False)


# ---------------------------------------------------------------------------------------------
# a tiny model and tokenizer, built here

CHARS = "abcdefgh "
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {**SPECIAL, **{c: i + len(SPECIAL) for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one token
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def make_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(SPECIAL) + len(CHARS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    return Qwen2ForCausalLM(config)


def reward_a(completions, **kwargs):
    """More 'a', fewer 'h': rewards that differ within a group, so advantages are not all 0."""
    return [float(c.count("a")) - 0.5 * c.count("h") for c in completions]


PROMPTS = ["abc", "hgf", "a b", "dd", "ceg", "bah", "fed", "g a"]


def common_args(tmp_path, **overrides) -> dict:
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                num_generations=4, max_completion_length=8, report_to="none", use_cpu=True,
                bf16=False, save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1,
                dataloader_num_workers=0)
    args.update(overrides)
    return args


def make_trainer(cls, config_cls, tmp_path, model=None, **overrides):
    args = config_cls(**common_args(tmp_path, **overrides))
    return cls(model=model if model is not None else make_model(), reward_funcs=reward_a, args=args,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
               processing_class=make_tokenizer())


# ---------------------------------------------------------------------------------------------
# training


def readme_trl_settings() -> dict:
    """The keyword arguments of the `BandGRPOConfig(...)` call in the README's TRL snippet."""
    text = (REPO / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "BandGRPOConfig(" in b]
    assert len(blocks) == 1, "the README should have one TRL snippet"
    calls = [n for n in ast.walk(ast.parse(blocks[0])) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "BandGRPOConfig"]
    assert len(calls) == 1
    return {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords}


def test_readme_snippet_runs_on_a_cpu_machine_as_written():
    """The README's TRL snippet sets use_cpu=True, bf16=False in its code (TRL's default bf16 fails on a CPU
    machine), not in a comment a reader has to act on."""
    settings = readme_trl_settings()
    assert settings.get("use_cpu") is True and settings.get("bf16") is False, settings


# What the tiny random model needs to move in a few steps; everything else is the README's.
TINY_TRAINING = dict(learning_rate=0.05, max_steps=4)


@pytest.mark.slow
def test_readme_snippet_trains_and_the_band_clips(tmp_path):
    """The README's TRL settings on top of BandGRPOConfig's defaults (the paper's): the trainer does
    not warn that its clip is inert, trains, and the band clips tokens; every band metric is
    logged at every step."""
    settings = readme_trl_settings()
    settings.pop("output_dir", None)
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="BandGRPOTrainer")
        trainer = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model,
                               **TINY_TRAINING, **settings)
    a = trainer.args
    assert (a.band_divergence, a.band_delta, a.band_max_ratio, a.delta, a.band_clip) == \
        ("kl", 0.05, 10.0, 10.0, "band")  # the paper's settings
    trainer.train()
    assert trainer.state.global_step == TINY_TRAINING["max_steps"]
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))

    logs = [h for h in trainer.state.log_history if "loss" in h and "band/clip_frac" in h]
    assert len(logs) == TINY_TRAINING["max_steps"]
    for h in logs:
        for name in reference.FRACTIONS:
            assert isinstance(h[f"band/{name}"], float), name
        assert h["band/band_width_mean"] > 0
    assert max(h["band/ppo_kl"] for h in logs) > 1e-3  # the ratio moved
    n_clipped = sum(h["band/clip_frac"] for h in logs)
    assert n_clipped > 0, "the band clipped no token: the README's settings leave it inert"


def test_default_schedule_warns_that_the_clip_is_inert(tmp_path):
    """TRL's default schedule (one optimiser step per generation batch): the ratio is 1, and the
    trainer says so once, at construction. Schedules with several steps per generation do not."""
    with pytest.warns(UserWarning, match=r"ratio pi/pi_old is 1 for every token") as record:
        make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path)
    assert sum("BandGRPOTrainer" in str(w.message) for w in record) == 1
    with pytest.warns(UserWarning, match="no ratio clip acts"):  # two generations per step
        make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, gradient_accumulation_steps=4,
                     steps_per_generation=2)
    for ok in (dict(num_iterations=2), dict(steps_per_generation=2),
               dict(gradient_accumulation_steps=2, steps_per_generation=4)):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="BandGRPOTrainer")
            make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, **ok)


def test_inert_schedule_really_has_ratio_one(tmp_path):
    """The warning's premise, checked on TRL itself: under the default schedule the trained batch
    carries no old log-probs (TRL uses the current ones), so every band count but n_tokens is 0."""
    trainer = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, learning_rate=0.05,
                           max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "band/clip_frac" in h]
    assert logs and all(h["band/clip_frac"] == 0 and h["band/ppo_kl"] == 0 for h in logs)


def test_fixed_baseline_trains_and_logs_the_same_metrics(tmp_path):
    trainer = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, steps_per_generation=2,
                           num_iterations=2, max_steps=2, learning_rate=0.05, band_clip="fixed")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("band/clip_frac_upper_lowprob" in h for h in logs)
    for h in logs:
        assert h["clip_ratio/region_mean"] == pytest.approx(h["band/clip_frac"], abs=1e-6)


@pytest.mark.slow
def test_example_script_trains_with_the_band(tmp_path, monkeypatch, capsys):
    """examples/trl_bandpo.py as a user runs it (tiny local model, offline, its own defaults): the
    paper's settings, several steps per generation, the band clips, and every logging window still
    has a learning signal (the stand-in reward is not saturated: reward_std > 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_bandpo_example",
                                                  REPO / "examples" / "trl_bandpo.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up
    spec.loader.exec_module(example)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="BandGRPOTrainer")
        trainer = example.main(["--output_dir", str(tmp_path / "ex"), "--disable_tqdm", "true"])
    a = trainer.args
    assert (a.band_divergence, a.band_delta, a.band_max_ratio, a.delta, a.num_iterations) == \
        ("kl", 0.05, 10.0, 10.0, 2)
    logs = [h for h in trainer.state.log_history if "band/clip_frac" in h]
    assert len(logs) == a.max_steps // a.logging_steps and sum(h["band/clip_frac"] for h in logs) > 0
    assert all(h["reward_std"] > 0 for h in logs), [h["reward_std"] for h in logs]
    assert f"mean over the {len(logs)} of {len(logs)} logging windows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="band_delta=2.0"):
        example.main(["--output_dir", str(tmp_path / "ex"), "--band_delta", "2"])


# ---------------------------------------------------------------------------------------------
# one batch, compared loss by loss


def make_inputs(trainer, model, seed, *, beta=0.0, batch=8, prompt_len=4, completion_len=7,
                spread=0.7):
    """A GRPO batch as TRL's _prepare_inputs hands it to compute_loss, with old log-probs off the
    current ones so that the ratio is far from 1."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(len(SPECIAL), vocab, (batch, prompt_len), generator=g)
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.int64)
    prompt_mask[::3, :2] = 0  # left padding
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(len(SPECIAL), vocab, (batch, completion_len), generator=g)
    lengths = torch.randint(1, completion_len + 1, (batch,), generator=g)
    completion_mask = (torch.arange(completion_len)[None] < lengths[:, None]).to(torch.int64)
    completion_ids[completion_mask == 0] = 0
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), completion_len)
    inputs = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=torch.randn(batch, generator=g),
        old_per_token_logps=(logps + spread * torch.randn(logps.shape, generator=g)).clamp(max=0),
        num_items_in_batch=completion_mask.sum())
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g)
    return inputs


def loss_and_grads(trainer, inputs, accumulation=2):
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = accumulation
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in trainer.model.parameters()]
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    trainer._metrics["train"].clear()
    return loss.detach(), grads, metrics


def stock_and_ours(tmp_path, band_clip, **overrides):
    """Stock and band trainers on the same weights, loaded from a local folder (with beta > 0 TRL
    builds its reference model from the policy's path, so an in-memory model would not do).

    Both get TRL's `delta` of `overrides` (stock's default None unless given). With the band, TRL's
    epsilons are refused (they would be ignored), so ours gets them only with band_clip='fixed', and
    its band_max_ratio is set to a delta that is given (the cap may not exceed it)."""
    path = tmp_path / "tiny-qwen2"
    make_model(1).save_pretrained(path)
    stock = make_trainer(GRPOTrainer, GRPOConfig, tmp_path, model=str(path), **overrides)
    mine = dict(overrides, band_clip=band_clip, delta=overrides.get("delta"))
    if band_clip == "band":
        mine.pop("epsilon", None)
        mine.pop("epsilon_high", None)
        mine["band_max_ratio"] = mine["delta"]
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=str(path), **mine)
    return stock, ours


LOSS_SETTINGS = [
    dict(loss_type="grpo"),
    dict(loss_type="bnpo", beta=0.04),
    dict(loss_type="dr_grpo", delta=3.0),
    dict(loss_type="dapo", epsilon_high=0.28, beta=0.04, delta=3.0),
    dict(loss_type="luspo"),
]
LOSS_IDS = [s["loss_type"] + ("+kl" if "beta" in s else "") + ("+delta" if "delta" in s else "")
            for s in LOSS_SETTINGS]


@pytest.mark.parametrize("settings", LOSS_SETTINGS, ids=LOSS_IDS)
def test_fixed_clip_parity_with_stock_grpo(tmp_path, settings):
    """band_clip='fixed' is stock GRPOTrainer: same loss, gradients and TRL metrics, bit for bit."""
    stock, ours = stock_and_ours(tmp_path, "fixed", **settings)
    inputs = make_inputs(stock, stock.model, seed=7, beta=settings.get("beta", 0.0))
    want, want_grads, want_metrics = loss_and_grads(stock, inputs)
    got, got_grads, got_metrics = loss_and_grads(ours, inputs)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert got_metrics == want_metrics
    assert want_metrics["clip_ratio/region_mean"][0] > 0  # the batch does exercise the clip


@pytest.mark.parametrize("settings", LOSS_SETTINGS, ids=LOSS_IDS)
def test_band_path_with_fixed_bounds_is_stock_grpo(tmp_path, settings, monkeypatch):
    """The band path itself, with the band replaced by the fixed clip [1-ε_low, 1+ε_high] as
    per-token tensors: identical to stock GRPOTrainer. So the band changes the clip and nothing
    else of TRL's loss (loss types, KL term, masks, normalisation)."""
    stock, ours = stock_and_ours(tmp_path, "band", **settings)
    eps_low, eps_high = stock.epsilon_low, stock.epsilon_high
    calls = []

    def fixed_bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
        calls.append(log_p_old.shape)
        return (torch.full_like(log_p_old, 1 - eps_low), torch.full_like(log_p_old, 1 + eps_high))

    monkeypatch.setattr(bandpo_lut, "bounds", fixed_bounds, raising=False)
    ours_eps = (ours.epsilon_low, ours.epsilon_high)
    inputs = make_inputs(stock, stock.model, seed=8, beta=settings.get("beta", 0.0))
    want, want_grads, want_metrics = loss_and_grads(stock, inputs)
    got, got_grads, got_metrics = loss_and_grads(ours, inputs)
    assert calls == [inputs["completion_ids"].shape]  # the band path was taken
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert got_metrics == want_metrics
    assert want_metrics["clip_ratio/region_mean"][0] > 0
    assert (ours.epsilon_low, ours.epsilon_high) == ours_eps  # restored


def policy_loss_like_trl(trainer, model, inputs, loss_type, agg, accumulation=2, **kwargs):
    """`bandpo_lut.policy_loss(**kwargs)` on a copy of `model`, normalised as TRL normalises
    `loss_type`; returns (loss, gradients w.r.t. the copy's parameters, metrics)."""
    twin = copy.deepcopy(model)
    T = inputs["completion_ids"].shape[1]
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        twin, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), T)
    adv = inputs["advantages"][:, None].expand_as(logps)
    want, want_m = bandpo_lut.policy_loss(logps, inputs["old_per_token_logps"], adv,
                                          inputs["completion_mask"], agg=agg, **kwargs)
    if loss_type == "dapo":  # TRL: sum / (num_items_in_batch / processes * accumulation / spg)
        want = want / (inputs["num_items_in_batch"] * accumulation / trainer.args.steps_per_generation)
    else:
        want = want / accumulation
    want.backward()
    return want.detach(), [p.grad for p in twin.parameters()], want_m


def assert_same_loss_and_grads(got, got_grads, want, want_grads):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


LOSS_AGGS = [("bnpo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("dapo", "token-sum")]


@pytest.mark.parametrize("loss_type, agg", LOSS_AGGS)
@pytest.mark.parametrize("band", [dict(band_delta=0.05, band_max_ratio=10.0),
                                  dict(band_delta=0.2, band_max_ratio=2.0)], ids=["paper", "tight"])
def test_band_loss_equals_policy_loss(tmp_path, loss_type, agg, band):
    """With the real band: TRL's loss through BandGRPOTrainer equals bandpo_lut.policy_loss (with
    TRL's normalisation and its dual clip delta=10, the default), loss and gradients w.r.t. the
    model's parameters."""
    model = make_model(2)
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model,
                        loss_type=loss_type, num_iterations=2, **band)
    inputs = make_inputs(ours, model, seed=9, spread=2.0)  # far enough out for the wide band
    got, got_grads, metrics = loss_and_grads(ours, inputs, accumulation=2)
    want, want_grads, want_m = policy_loss_like_trl(
        ours, model, inputs, loss_type, agg, delta=band["band_delta"], divergence="kl",
        max_ratio=band["band_max_ratio"], dual_clip=10.0)
    assert_same_loss_and_grads(got, got_grads, want, want_grads)
    assert float(want_m["clip_frac"]) > 0


RATIOS = torch.tensor([0.05, 0.5, 1.2, 4.0, 12.0, 20.0, 30.0, 80.0])


def peaked_model(seed):
    """The tiny model with logits scaled up, so that many completion tokens have p < 0.05: at ratio
    10-28 their p_old is ~2e-3, where the band's uncapped upper bound (28) is above the cap 10."""
    model = make_model(seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    return model


def dual_clip_inputs(trainer, model, seed, advantages):
    """A batch whose old log-probs put each token at a chosen ratio (0.05 ... 80)."""
    inputs = make_inputs(trainer, model, seed)
    T = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), T)
    n = logps.numel()
    ratio = RATIOS[torch.arange(n) % len(RATIOS)].view_as(logps)
    inputs["old_per_token_logps"] = (logps - ratio.log()).clamp(max=0.0)  # p_old <= 1
    inputs["advantages"] = advantages
    return inputs, logps


def independent_band_loss(log_prob, old, adv, mask, *, max_ratio, dual_clip):
    """Per-token BandPO loss written from its definition (PPO's pessimistic surrogate on the band,
    then dual-clip PPO's cap for A < 0), on the pure-PyTorch reference bounds; token mean."""
    ratio = torch.exp(log_prob - old)
    lo, up = reference_bounds(log_p_old=old.double(), delta=0.05, divergence="kl")
    up = up if max_ratio is None else up.clamp(max=max_ratio)
    a = adv.expand_as(ratio)
    loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, lo.float(), up.float()))
    loss = torch.where(a < 0, torch.minimum(loss, -a * dual_clip), loss)
    return torch.where(mask > 0, loss, 0.0).sum() / mask.sum()


@pytest.mark.parametrize("loss_type, agg", [("bnpo", "token-mean"), ("dapo", "token-sum")])
def test_dual_clip_with_trls_delta_equals_policy_loss(tmp_path, loss_type, agg):
    """A < 0 tokens whose ratio is above the dual-clip cap (delta=10) but below the band's uncapped
    upper bound (28 at p_old = 2e-3): with the defaults (band_max_ratio=10, delta=10) their loss is
    -A*10 with no gradient, and TRL's loss and gradient equal bandpo_lut.policy_loss(...,
    dual_clip=10), as do the logged band metrics."""
    model = peaked_model(3)
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model, loss_type=loss_type,
                        num_iterations=2)
    assert (ours.args.band_max_ratio, ours.args.delta) == (10.0, 10.0)
    adv = torch.tensor([-1.3, 0.7, -0.4, 2.0, -2.2, -0.9, 1.1, -0.6])
    inputs, logps = dual_clip_inputs(ours, model, seed=11, advantages=adv)
    old, mask = inputs["old_per_token_logps"], inputs["completion_mask"]

    # the case is in the batch
    ratio = torch.exp(logps - old)
    _, up = bandpo_lut.bounds(log_p_old=old, delta=0.05)
    case = (adv[:, None] < 0) & (ratio > 10.5) & (ratio < up) & (mask > 0)
    assert int(case.sum()) >= 3, "the batch has too few A < 0 tokens between the cap and the band"

    # per-token gradients of TRL's loss, through a wrapper of the policy forward
    seen = []
    forward = ours._get_per_token_logps_and_entropies

    def keep_grad(*args, **kwargs):
        out = forward(*args, **kwargs)
        out[0].retain_grad()
        seen.append(out[0])
        return out

    ours._get_per_token_logps_and_entropies = keep_grad
    got, got_grads, metrics = loss_and_grads(ours, inputs, accumulation=2)
    assert ours._get_per_token_logps_and_entropies is keep_grad  # our hook put it back
    del ours._get_per_token_logps_and_entropies
    token_grad = seen[0].grad
    assert torch.all(token_grad[case] == 0)  # dual-clipped: no gradient
    assert torch.all(token_grad[(ratio > 0.9) & (ratio < 1.5) & (mask > 0)] != 0)  # in the band

    want, want_grads, want_m = policy_loss_like_trl(ours, model, inputs, loss_type, agg,
                                                    delta=0.05, divergence="kl", max_ratio=10.0,
                                                    dual_clip=10.0)
    assert_same_loss_and_grads(got, got_grads, want, want_grads)
    assert float(want_m["n_dual_clipped"]) >= int(case.sum())
    # the band counts recorded by the loss call are those of the loss that was trained
    acc = dict(zip(reference.COUNTS, ours._band_counts["train"].unbind()))
    assert float(acc["n_dual_clipped"]) == float(want_m["n_dual_clipped"])
    assert float(acc["n_clipped_upper"]) == float(want_m["n_clipped_upper"])
    # and written out from the definitions, on the reference bounds
    indep = independent_band_loss(seen[0].detach(), old, adv[:, None], mask, max_ratio=10.0,
                                  dual_clip=10.0)
    if loss_type == "bnpo":
        torch.testing.assert_close(got, indep.float() / 2, rtol=1e-5, atol=1e-6)


def test_dual_clip_for_negative_advantages_ignores_the_cap(tmp_path):
    """Only A < 0 tokens: the loss is bandpo_lut.policy_loss(..., max_ratio=None, dual_clip=10) (the
    issue's comparison: at ratio 30 a token's loss is 10|A|, not 30|A|)."""
    model = peaked_model(4)
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model, loss_type="bnpo",
                        num_iterations=2)
    adv = -torch.linspace(0.2, 2.0, 8)
    inputs, _ = dual_clip_inputs(ours, model, seed=12, advantages=adv)
    got, got_grads, _ = loss_and_grads(ours, inputs, accumulation=2)
    want, want_grads, want_m = policy_loss_like_trl(ours, model, inputs, "bnpo", "token-mean",
                                                    delta=0.05, max_ratio=None, dual_clip=10.0)
    assert_same_loss_and_grads(got, got_grads, want, want_grads)
    assert float(want_m["n_dual_clipped"]) > 0
    no_dual, _, _ = policy_loss_like_trl(ours, model, inputs, "bnpo", "token-mean", delta=0.05,
                                         max_ratio=None, dual_clip=None)
    assert not torch.allclose(no_dual, want)  # the dual clip is what makes the difference


def test_band_counts_stay_on_device_until_log(tmp_path, monkeypatch):
    """Our additions to the loss path move nothing to the host (TRL's own metrics do, as in
    stock TRL); the one transfer happens in log()."""
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, band_max_ratio=10.0, delta=10.0)
    inputs = make_inputs(ours, ours.model, seed=10)
    logps = inputs["old_per_token_logps"] + 0.3
    ours.model.train()

    def boom(*args, **kwargs):
        raise RuntimeError("host synchronisation")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, boom)
        ours._record_band_counts(inputs, logps, inputs["old_per_token_logps"])
        ours._record_band_counts(inputs, logps, inputs["old_per_token_logps"])
    acc = ours._band_counts["train"]
    assert isinstance(acc, torch.Tensor) and acc.shape == (len(reference.COUNTS),)
    n_tokens = acc[list(reference.COUNTS).index("n_tokens")]
    assert n_tokens == 2 * inputs["completion_mask"].sum()
    logs = {}
    monkeypatch.setattr(GRPOTrainer, "log", lambda self, logs, start_time=None: None)
    ours.log(logs)
    assert set(logs) == {f"band/{k}" for k in reference.FRACTIONS}
    assert ours._band_counts["train"] is None


# ---------------------------------------------------------------------------------------------
# configuration and versions


# The options LossSettings checks (the one validation path): one message naming the field once, with the value.
BAD_OPTIONS = [
    # (overrides, the user's field, how the value appears)
    (dict(band_delta=2.0), "band_delta", "2.0"),
    (dict(band_delta=1e-4), "band_delta", "0.0001"),
    (dict(band_delta=0.0), "band_delta", "0.0"),
    (dict(band_delta=float("nan")), "band_delta", "nan"),
    (dict(band_divergence="tv", band_delta=1.0), "band_delta", "1.0"),
    (dict(band_divergence="reverse_kl"), "band_divergence", "'reverse_kl'"),
    (dict(band_divergence="kll"), "band_divergence", "'kll'"),
    (dict(band_max_ratio=0.5, delta=None), "band_max_ratio", "0.5"),
    (dict(delta=1.0), "delta", "1.0"),   # radius-sized: TRL's own message, which points to band_delta
    (dict(delta=-1.0), "delta", "-1.0"),
    (dict(delta=float("nan")), "delta", "nan"),
    (dict(band_clip="fixed", epsilon=1.5), "epsilon", "1.5"),
    (dict(band_clip="fixed", epsilon_high=-0.1), "epsilon_high", "-0.1"),
    (dict(band_clip="dcpo"), "band_clip", "'dcpo'"),
    (dict(band_clip="ppo"), "band_clip", "'ppo'"),
]


@pytest.mark.parametrize("overrides, field, shown", BAD_OPTIONS,
                         ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _, _ in BAD_OPTIONS])
def test_bad_option_is_refused_once_naming_the_field(tmp_path, overrides, field, shown):
    """Refused by BandGRPOConfig itself (before any model loads), in one message that names the user's field
    once (as a whole word: TRL's `delta` is not band_delta) and the value."""
    with pytest.raises(ValueError) as info:
        BandGRPOConfig(**common_args(tmp_path, **overrides))
    message = str(info.value)
    assert len(re.findall(rf"(?<![\w.]){re.escape(field)}(?!\w)", message)) == 1, (field, message)
    assert shown in message, (shown, message)


# TRL's own combinations, refused by the integration (LossSettings has no such rule), naming the fields.
BAD_SETTINGS = [
    # (overrides, the field the message must name, more of the message)
    (dict(band_max_ratio=None), "band_max_ratio=None with delta=10.0", r"band_max_ratio <= delta"),
    (dict(band_max_ratio=20.0), "band_max_ratio=20.0 with delta=10.0", r"cannot exceed it"),
    (dict(delta=0.05), "delta=0.05", r"radius is band_delta"),
    (dict(epsilon_high=0.28), "epsilon_high=0.28", r"would be ignored"),
    (dict(epsilon=0.3), "epsilon=0.3", r"band_clip='fixed'"),
    (dict(loss_type="sapo"), "loss_type='sapo'", r"no per-token two-sided ratio clip"),
    (dict(loss_type="cispo"), "loss_type='cispo'", r"no per-token two-sided ratio clip"),
    (dict(importance_sampling_level="sequence"), "importance_sampling_level", r"'token'"),
]


@pytest.mark.parametrize("overrides, field, match", BAD_SETTINGS,
                         ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _, _ in BAD_SETTINGS])
def test_bad_setting_is_refused_when_the_config_is_built(tmp_path, overrides, field, match):
    """Refused by BandGRPOConfig itself (before any model loads), naming the user's field."""
    with pytest.raises(ValueError, match=match) as info:
        BandGRPOConfig(**common_args(tmp_path, **overrides))
    assert field in str(info.value)


def test_explicit_departures_from_the_paper_are_accepted(tmp_path):
    """No dual clip and no cap, a different band, and TRL's epsilons with the fixed baseline."""
    args = BandGRPOConfig(**common_args(tmp_path, delta=None, band_max_ratio=None))
    assert (args.delta, args.band_max_ratio) == (None, None)
    args = BandGRPOConfig(**common_args(tmp_path, delta=None, band_max_ratio=50.0,
                                        band_divergence="hellinger", band_delta=0.2))
    assert args.band_divergence == "hellinger"
    BandGRPOConfig(**common_args(tmp_path, band_max_ratio=3.0, delta=3.0))
    BandGRPOConfig(**common_args(tmp_path, band_clip="fixed", epsilon_high=0.28, loss_type="dapo"))


def test_a_config_edited_after_it_was_built_is_checked_by_the_trainer(tmp_path):
    args = BandGRPOConfig(**common_args(tmp_path, num_iterations=2))
    args.band_delta = 5.0
    with pytest.raises(ValueError, match="band_delta=5.0"):
        BandGRPOTrainer(model=make_model(), reward_funcs=reward_a, args=args,
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        processing_class=make_tokenizer())


def test_band_options_from_the_command_line(tmp_path):
    """TRL's scripts parse their config with HfArgumentParser: the band fields are flags too, with the
    paper's defaults, and a bad one fails while parsing."""
    from transformers import HfArgumentParser

    base = ["--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "true"]
    (args,) = HfArgumentParser(BandGRPOConfig).parse_args_into_dataclasses(base)
    assert (args.band_divergence, args.band_delta, args.band_max_ratio, args.delta) == \
        ("kl", 0.05, 10.0, 10.0)
    (args,) = HfArgumentParser(BandGRPOConfig).parse_args_into_dataclasses(base + [
        "--band_divergence", "chi2", "--band_delta", "0.1", "--band_max_ratio", "5", "--delta", "5"])
    assert (args.band_divergence, args.band_delta, args.band_max_ratio, args.delta) == \
        ("chi2", 0.1, 5.0, 5.0)
    with pytest.raises(ValueError, match="band_delta=2.0"):
        HfArgumentParser(BandGRPOConfig).parse_args_into_dataclasses(base + ["--band_delta", "2"])


def test_help_lists_the_compiled_divergences():
    from dataclasses import fields

    help_text = {f.name: f.metadata["help"] for f in fields(BandGRPOConfig)}["band_divergence"]
    for name in ("kl", "tv", "chi2", "hellinger"):
        assert repr(name) in help_text
    assert "reverse_kl" not in help_text


def test_plain_grpo_config_is_refused(tmp_path):
    with pytest.raises(TypeError, match="BandGRPOConfig"):
        make_trainer(BandGRPOTrainer, GRPOConfig, tmp_path)


# ---------------------------------------------------------------------------------------------
# the version policy (the same as verl's: bandpo_lut.integrations._common.check_framework)


def test_installed_trl_is_a_tested_version_and_imports_silently():
    from bandpo_lut.integrations import trl as band_trl

    assert trl.__version__ in TESTED_TRL
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        band_trl._check_trl()


def test_tested_versions_are_the_ones_ci_runs():
    """TESTED_TRL is exactly the pinned TRL plus the one CI's second TRL phase swaps in."""
    pinned = re.search(r"^trl==(\S+)$", (REPO / "requirements-integrations.txt").read_text(), re.M)
    second = re.search(r"^TRL_SECOND=(\S+)$", (REPO / ".ci" / "run").read_text(), re.M)
    assert pinned and second
    assert sorted(TESTED_TRL) == sorted({pinned.group(1), second.group(1)})


def test_untested_trl_with_the_same_structure_warns(monkeypatch):
    from bandpo_lut.integrations import trl as band_trl

    monkeypatch.setattr(trl, "__version__", "1.16.1")
    with pytest.warns(UserWarning, match=r"trl 1\.16\.1 is not one of the tested versions "
                                         r"\(1\.14\.2, 1\.16\.0\)"):
        band_trl._check_trl()


@pytest.mark.parametrize("name, replacement, problem", [
    ("_CLIP_LINE", "torch.clamp(coef_1, lo, up)", "no longer clips with"),
    ("_DELTA_LINE", "coef_1 = coef_1.clamp(max=delta)", "no longer applies"),
    ("_LOGPS_CALL", "self._forward(", "exactly one policy forward"),
    ("_CONFIG_FIELDS", ("delta", "two_sided_cap"), "GRPOConfig has no two_sided_cap"),
])
@pytest.mark.parametrize("version", ["1.16.0", "2.0.0"])
def test_trl_with_a_different_structure_is_refused(monkeypatch, name, replacement, problem, version):
    """Whatever the version (a tested one included), a GRPO loss without the structure the hook
    relies on fails at import, saying what is missing."""
    from bandpo_lut.integrations import trl as band_trl

    monkeypatch.setattr(trl, "__version__", version)
    monkeypatch.setattr(band_trl, name, replacement)
    with pytest.raises(ImportError, match=problem) as info:
        band_trl._check_trl()
    assert f"trl {version}" in str(info.value) and "Tested with trl 1.14.2, 1.16.0" in str(info.value)


# ---------------------------------------------------------------------------------------------
# paths on which a setting was once silently not what trains


def test_liger_kernel_is_refused_where_trls_liger_path_bypasses_the_hooked_loss(tmp_path, monkeypatch):
    """A TRL whose GRPOTrainer has `compute_liger_loss` (Liger's own GRPO loss, outside `_compute_loss`)
    would train its fixed clip: use_liger_kernel=True is refused there by the config, naming the field, with
    the logits-free alternative, whatever band_clip."""
    monkeypatch.setattr(GRPOTrainer, "compute_liger_loss", lambda self, *a, **k: None, raising=False)
    for clip in ("band", "fixed"):
        with pytest.raises(ValueError, match="use_liger_kernel=True") as info:
            BandGRPOConfig(**common_args(tmp_path, use_liger_kernel=True, band_clip=clip))
        assert "compute_liger_loss" in str(info.value) and "band_fused_linear=True" in str(info.value)


def test_liger_kernel_is_accepted_where_the_loss_stays_in_the_hooked_method(tmp_path):
    """The installed TRL (a tested one) computes only the log-probs with Liger: its compute_loss has no
    Liger loss and returns `_compute_loss`, the method BandGRPOTrainer overrides, so use_liger_kernel=True
    builds (Liger itself is needed only when the trainer is built)."""
    import inspect

    assert not hasattr(GRPOTrainer, "compute_liger_loss")
    source = inspect.getsource(GRPOTrainer.compute_loss)
    assert "self._compute_loss" in source and "liger_loss" not in source.lower()
    args = BandGRPOConfig(**common_args(tmp_path, use_liger_kernel=True, num_iterations=2))
    assert args.use_liger_kernel is True and args.band_delta == 0.05


def test_band_config_in_a_plain_grpo_trainer_is_refused(tmp_path):
    """GRPOTrainer(args=BandGRPOConfig(...)) would train stock TRL with every band setting ignored;
    it fails before the model loads, naming the trainer to use. GRPOConfig still works there."""
    args = BandGRPOConfig(**common_args(tmp_path, num_iterations=2))
    kwargs = dict(reward_funcs=reward_a, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                  processing_class=make_tokenizer())
    with pytest.raises(TypeError, match="only BandGRPOTrainer applies the band"):
        GRPOTrainer(model=make_model(), args=args, **kwargs)
    with pytest.raises(TypeError, match="GRPOTrainer got args=BandGRPOConfig"):
        GRPOTrainer(make_model(), reward_a, args, **{k: v for k, v in kwargs.items()
                                                     if k != "reward_funcs"})
    GRPOTrainer(model=make_model(), args=GRPOConfig(**common_args(tmp_path)), **kwargs)


@pytest.mark.parametrize("overrides", [dict(loss_type="cispo"), dict(loss_type="sapo"),
                                       dict(loss_type="vespo"),
                                       dict(loss_type="grpo", importance_sampling_level="sequence"),
                                       dict(loss_type="luspo", importance_sampling_level="sequence")])
def test_no_band_metrics_for_a_clip_the_loss_never_applies(tmp_path, overrides):
    """cispo/sapo/vespo and sequence-level importance sampling have no per-token clip: band/*
    would describe a clip that never acts, so BandGRPOConfig refuses them with band_clip='fixed'
    too, and the advice is TRL's own trainer, not band_clip='fixed'."""
    for clip in ("band", "fixed"):
        with pytest.raises(ValueError, match="use TRL's own GRPOConfig and GRPOTrainer") as info:
            BandGRPOConfig(**common_args(tmp_path, band_clip=clip, **overrides))
        assert "band_clip='fixed'" not in str(info.value)
    if overrides.get("loss_type") == "luspo":
        assert "luspo" in str(info.value)  # TRL recommends luspo at sequence level: said


def test_none_on_the_example_command_line(tmp_path, monkeypatch):
    """--delta None and --band_max_ratio None (the docs' way to turn the dual clip and the cap off)
    parse as None in examples/trl_bandpo.py, and train."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_bandpo_example_none",
                                                  REPO / "examples" / "trl_bandpo.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)
    trainer = example.main(["--output_dir", str(tmp_path / "ex"), "--max_steps", "1",
                            "--delta", "None", "--band_max_ratio", "None", "--disable_tqdm", "true"])
    assert (trainer.args.delta, trainer.args.band_max_ratio) == (None, None)
    from bandpo_lut.integrations.trl import argument_parser

    (args,) = argument_parser(BandGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--delta=none", "--band_max_ratio", "12", "--use_cpu", "true",
         "--bf16", "false"])
    assert (args.delta, args.band_max_ratio) == (None, 12.0)


def test_inert_schedule_warning_states_the_real_condition(tmp_path):
    """gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=2: every optimiser step
    sees a fresh generation batch. The warning says so, and its suggested fix (not num_iterations=2,
    already set) does make the clip act: the trainer built with it does not warn."""
    schedule = dict(gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=2)
    with pytest.warns(UserWarning, match="no ratio clip acts") as record:
        make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, **schedule)
    (message,) = [str(w.message) for w in record if "BandGRPOTrainer" in str(w.message)]
    assert "every optimiser step sees a fresh generation batch" in message
    assert "num_iterations=2 (or more)" not in message
    fix = re.search(r"e\.g\. num_iterations=(\d+)", message)
    assert fix and int(fix.group(1)) != 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="BandGRPOTrainer")
        make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path,
                     **{**schedule, "num_iterations": int(fix.group(1))})


def test_rounding_positive_old_log_probs_are_p_one_in_trl(tmp_path):
    """An old log-prob a hair above 0 (bf16 / inference-engine rounding) is p = 1 in the core
    (bandpo_lut.reference.bounds.LOG_PROB_ROUNDING), which TRL's plug-in now uses as is: the loss
    equals policy_loss on the same inputs and stays finite."""
    model = make_model(3)
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model, num_iterations=2,
                        loss_type="dapo")
    inputs = make_inputs(ours, model, seed=4)
    old = inputs["old_per_token_logps"]
    old[:, 0] = 6e-8
    old[1, 1] = 2.0 ** -9
    got, got_grads, _ = loss_and_grads(ours, inputs, accumulation=1)
    assert torch.isfinite(got) and all(torch.isfinite(g).all() for g in got_grads)
    want, want_grads, _ = policy_loss_like_trl(ours, model, inputs, "dapo", "token-sum",
                                               delta=0.05, divergence="kl", max_ratio=10.0,
                                               dual_clip=10.0, accumulation=1)
    assert_same_loss_and_grads(got, got_grads, want, want_grads)
