"""The TRL integration, against the real TRL package (pinned in requirements-integrations.txt).

Offline and on CPU: the model is a tiny Qwen2 built from a config (random weights) and the
tokenizer a character-level WordLevel tokenizer built here; nothing is downloaded.

A missing TRL is an error, not a skip: CI installs the pinned packages. Set
BANDPO_SKIP_INTEGRATIONS=1 to skip this module on a machine without them.

The library functions used are `bandpo_lut.policy_loss` and `bandpo_lut.bounds`; until the compiled
ones are exposed there, the fixture below puts the pure-PyTorch references in their place.
"""
from __future__ import annotations

import copy
import os

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
from bandpo_lut.integrations.trl import (  # noqa: E402
    SUPPORTED_TRL, BandGRPOConfig, BandGRPOTrainer)
from bandpo_lut.reference import policy_loss as reference  # noqa: E402
from bandpo_lut.reference.bounds import bounds as reference_bounds  # noqa: E402

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


def test_band_grpo_trains_and_logs_band_metrics(tmp_path):
    """≥ 2 optimizer steps; several updates per generation (num_iterations=2, steps_per_generation
    =2), so the ratio moves and the band clips; band metrics logged every step."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model,
                           steps_per_generation=2, num_iterations=2, max_steps=4,
                           learning_rate=0.05, beta=0.0, band_delta=0.05, band_divergence="kl",
                           band_max_ratio=10.0, delta=10.0)
    trainer.train()
    assert trainer.state.global_step == 4
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))

    logs = [h for h in trainer.state.log_history if "loss" in h and "band/clip_frac" in h]
    assert len(logs) == 4
    for h in logs:
        for name in reference.FRACTIONS:
            assert isinstance(h[f"band/{name}"], float), name
        # TRL's own clip metrics now count the band's clipping: the same tokens as ours
        assert h["clip_ratio/region_mean"] == pytest.approx(h["band/clip_frac"], abs=1e-6)
        assert h["clip_ratio/high_mean"] == pytest.approx(h["band/clip_frac_upper"], abs=1e-6)
        assert h["clip_ratio/low_mean"] == pytest.approx(h["band/clip_frac_lower"], abs=1e-6)
        assert h["band/band_width_mean"] > 0
    assert logs[-1]["band/ppo_kl"] > 1e-3  # the ratio moved
    assert sum(h["band/clip_frac"] for h in logs) > 0  # and some tokens were clipped


def test_fixed_baseline_trains_and_logs_the_same_metrics(tmp_path):
    trainer = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, steps_per_generation=2,
                           num_iterations=2, max_steps=2, learning_rate=0.05, band_clip="fixed")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("band/clip_frac_upper_lowprob" in h for h in logs)
    for h in logs:
        assert h["clip_ratio/region_mean"] == pytest.approx(h["band/clip_frac"], abs=1e-6)


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


def stock_and_ours(tmp_path, **overrides):
    """Stock and band trainers on the same weights, loaded from a local folder (with beta > 0 TRL
    builds its reference model from the policy's path, so an in-memory model would not do)."""
    path = tmp_path / "tiny-qwen2"
    make_model(1).save_pretrained(path)
    stock = make_trainer(GRPOTrainer, GRPOConfig, tmp_path, model=str(path), **overrides)
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=str(path), **overrides)
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
    stock, ours = stock_and_ours(tmp_path, **settings)
    ours.args.band_clip = "fixed"
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
    stock, ours = stock_and_ours(tmp_path, **settings)
    eps_low, eps_high = stock.epsilon_low, stock.epsilon_high
    calls = []

    def fixed_bounds(p_old=None, delta=0.05, divergence="kl", *, log_p_old=None, max_ratio=None):
        calls.append(log_p_old.shape)
        return (torch.full_like(log_p_old, 1 - eps_low), torch.full_like(log_p_old, 1 + eps_high))

    monkeypatch.setattr(bandpo_lut, "bounds", fixed_bounds, raising=False)
    inputs = make_inputs(stock, stock.model, seed=8, beta=settings.get("beta", 0.0))
    want, want_grads, want_metrics = loss_and_grads(stock, inputs)
    got, got_grads, got_metrics = loss_and_grads(ours, inputs)
    assert calls == [inputs["completion_ids"].shape]  # the band path was taken
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert got_metrics == want_metrics
    assert want_metrics["clip_ratio/region_mean"][0] > 0
    assert (ours.epsilon_low, ours.epsilon_high) == (eps_low, eps_high)  # restored


@pytest.mark.parametrize("loss_type, agg", [("bnpo", "token-mean"), ("grpo", "seq-mean-token-mean"),
                                            ("dapo", "token-sum")])
@pytest.mark.parametrize("band", [dict(band_delta=0.05, band_max_ratio=10.0),
                                  dict(band_delta=0.2, band_max_ratio=2.0)], ids=["paper", "tight"])
def test_band_loss_equals_policy_loss(tmp_path, loss_type, agg, band):
    """With the real band: TRL's loss through BandGRPOTrainer equals bandpo_lut.policy_loss (with
    TRL's normalisation), loss and gradients w.r.t. the model's parameters."""
    model = make_model(2)
    ours = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=model,
                        loss_type=loss_type, **band)
    inputs = make_inputs(ours, model, seed=9, spread=2.0)  # far enough out for the wide band
    got, got_grads, metrics = loss_and_grads(ours, inputs, accumulation=2)

    twin = copy.deepcopy(model)
    T = inputs["completion_ids"].shape[1]
    logps, _, _ = ours._get_per_token_logps_and_entropies(
        twin, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), T)
    adv = inputs["advantages"][:, None].expand_as(logps)
    want, want_m = bandpo_lut.policy_loss(logps, inputs["old_per_token_logps"], adv,
                                          inputs["completion_mask"], agg=agg,
                                          delta=band["band_delta"], divergence="kl",
                                          max_ratio=band["band_max_ratio"])
    if loss_type == "dapo":  # TRL: sum / (num_items_in_batch / processes * accumulation / spg)
        want = want / (inputs["num_items_in_batch"] * 2 / ours.args.steps_per_generation)
    else:
        want = want / 2
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)
    for a, b in zip(got_grads, [p.grad for p in twin.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert float(want_m["clip_frac"]) > 0
    assert metrics["clip_ratio/region_mean"][0] == pytest.approx(float(want_m["clip_frac"]), abs=1e-6)


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


@pytest.mark.parametrize("overrides, match", [
    (dict(loss_type="sapo"), "has none"),
    (dict(loss_type="cispo"), "has none"),
    (dict(importance_sampling_level="sequence"), "importance_sampling_level must be 'token'"),
    (dict(band_delta=0.0), "band_delta must be a positive number"),
    (dict(band_divergence="kll"), "band_divergence must be one of"),
    (dict(band_max_ratio=0.5), "band_max_ratio must be None or a number >= 1"),
    (dict(band_clip="ppo"), "band_clip must be 'band' or 'fixed'"),
])
def test_bad_config_is_a_clear_error(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        BandGRPOConfig(**common_args(tmp_path, **overrides))


def test_band_settings_from_the_command_line(tmp_path):
    """TRL's scripts parse their config with HfArgumentParser: the band fields are flags too."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(BandGRPOConfig).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "true",
        "--band_divergence", "kl", "--band_delta", "0.05", "--band_max_ratio", "10",
        "--delta", "10"])
    assert (args.band_divergence, args.band_delta, args.band_max_ratio, args.delta) == \
        ("kl", 0.05, 10.0, 10.0)


def test_fixed_clip_allows_other_loss_types(tmp_path):
    BandGRPOConfig(**common_args(tmp_path, loss_type="sapo", band_clip="fixed"))


def test_plain_grpo_config_is_refused(tmp_path):
    with pytest.raises(TypeError, match="BandGRPOConfig"):
        make_trainer(BandGRPOTrainer, GRPOConfig, tmp_path)


def test_unsupported_trl_version_fails_clearly(monkeypatch):
    from bandpo_lut.integrations import trl as band_trl

    band_trl._check_trl()  # the installed, pinned TRL is accepted
    assert trl.__version__ in SUPPORTED_TRL
    monkeypatch.setattr(trl, "__version__", "0.0.1")
    monkeypatch.delenv("BANDPO_ALLOW_UNTESTED_TRL", raising=False)
    with pytest.raises(ImportError, match=r"supports trl 1\.16\.0, but trl 0\.0\.1 is installed"):
        band_trl._check_trl()
    monkeypatch.setenv("BANDPO_ALLOW_UNTESTED_TRL", "1")
    with pytest.warns(UserWarning, match="trl 0.0.1 is installed"):
        band_trl._check_trl()


def test_changed_trl_loss_is_refused(monkeypatch):
    """If TRL's _compute_loss no longer has the clip this hook replaces, import fails clearly."""
    from bandpo_lut.integrations import trl as band_trl

    monkeypatch.setattr(band_trl, "_CLIP_LINE", "torch.clamp(coef_1, lo, up)")
    with pytest.raises(ImportError, match="cannot replace its clip"):
        band_trl._check_trl()
