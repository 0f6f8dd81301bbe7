"""BandGRPOConfig(band_fused_linear=True): the loss from the last hidden states and the LM head equals the
unfused BandGRPOTrainer's (TRL's own _compute_loss with the band) on the same batch, loss and gradients, for
every loss type TRL clips, band and fixed clip, with and without the KL term. Tiny model of
tests/integrations/test_trl.py (offline, CPU)."""
from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from test_trl import loss_and_grads, make_inputs, make_model, make_trainer  # noqa: E402

from bandpo_lut import COUNTS  # noqa: E402
from bandpo_lut.integrations.trl import BandGRPOConfig, BandGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.integration

SETTINGS = [
    dict(loss_type="grpo"),
    dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="dr_grpo", delta=3.0, band_max_ratio=3.0),
    dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="luspo", band_delta=0.2, band_max_ratio=2.0),
    dict(loss_type="dapo", band_clip="fixed", epsilon_high=0.28, delta=3.0),
]
IDS = ["grpo", "bnpo+kl", "dr_grpo+delta", "dapo+kl", "luspo+tight", "dapo+fixed"]


def unfused_and_fused(tmp_path, **settings):
    path = tmp_path / "tiny-qwen2"
    make_model(3).save_pretrained(path)
    common = dict(num_iterations=2, **settings)
    plain = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=str(path), **common)
    fused = make_trainer(BandGRPOTrainer, BandGRPOConfig, tmp_path, model=str(path), band_fused_linear=True,
                         **common)
    return plain, fused


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_fused_linear_equals_unfused_trainer(tmp_path, settings):
    plain, fused = unfused_and_fused(tmp_path, **settings)
    inputs = make_inputs(plain, plain.model, seed=11, beta=settings.get("beta", 0.0), spread=1.5)
    want, want_grads, want_m = loss_and_grads(plain, inputs, accumulation=2)

    def no_logits(*args, **kwargs):
        raise AssertionError("the fused path must not run TRL's log-prob forward")

    fused._get_per_token_logps_and_entropies = no_logits
    got, got_grads, got_m = loss_and_grads(fused, inputs, accumulation=2)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (got, want)
    for g, w in zip(got_grads, want_grads):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max() + 1e-12
    # the band/ counts (recorded from the fused log-probs) and TRL's entropy/kl metrics agree
    assert torch.allclose(fused._band_counts["train"], plain._band_counts["train"], rtol=1e-5, atol=1e-5)
    assert fused._band_counts["train"][COUNTS.index("n_clipped")] > 0   # the clip acted on this batch
    for k in ("entropy", "kl"):
        if k in want_m:
            assert got_m[k] == pytest.approx(want_m[k], rel=1e-5)


@pytest.mark.parametrize("overrides, match", [
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(entropy_coef=0.01), "entropy_coef"),
    (dict(beta=0.04), "use_bias_correction_kl"),
    (dict(num_iterations=1), "num_iterations=1"),
    (dict(loss_type="cispo", band_clip="fixed"), "loss_type='cispo'"),
    (dict(band_fused_linear="yes"), "band_fused_linear must be True or False"),
])
def test_unsupported_settings_are_refused_when_the_config_is_built(tmp_path, overrides, match):
    kw = dict(num_iterations=2, band_fused_linear=True)
    kw.update(overrides)
    with pytest.raises(ValueError, match=match):
        BandGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)


def test_a_batch_with_multimodal_inputs_is_refused(tmp_path):
    """The fused path runs the backbone on the text alone: a batch with images (a vision-language model's)
    would train on new log-probs computed without them against old ones computed with them. Refused at the
    loss call, naming the inputs; and the refused names cover every input TRL's own _compute_loss passes to
    its policy forward besides the text, so a TRL that adds one is caught here."""
    import ast
    import inspect
    import textwrap

    from trl import GRPOTrainer

    from bandpo_lut.integrations.trl_fused_linear import MULTIMODAL_INPUTS

    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._compute_loss)))
    forward = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and getattr(n.func, "attr", "") == "_get_per_token_logps_and_entropies")
    passed = {kw.value.args[0].value for kw in forward.keywords
              if isinstance(kw.value, ast.Call) and getattr(kw.value.func, "attr", "") == "get"}
    assert passed and passed <= set(MULTIMODAL_INPUTS), passed - set(MULTIMODAL_INPUTS)

    _, fused = unfused_and_fused(tmp_path, loss_type="grpo")
    inputs = make_inputs(fused, fused.model, seed=3)
    inputs["pixel_values"] = torch.zeros(2, 3)
    inputs["image_grid_thw"] = torch.ones(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"multimodal inputs \(pixel_values, image_grid_thw\)"):
        fused.compute_loss(fused.model, inputs)
    del inputs["pixel_values"], inputs["image_grid_thw"]
    assert torch.isfinite(fused.compute_loss(fused.model, inputs))   # the text-only batch trains
