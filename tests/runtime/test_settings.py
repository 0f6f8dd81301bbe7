"""LossSettings: the one validation path of the loss options. Validation names the field (the library's names,
or the user's through field_names); a settings object gives the bits of the same keyword arguments, checked
against the pure-PyTorch reference (bandpo_lut/reference/policy_loss.py), not against the fused code itself."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

import bandpo_lut
from bandpo_lut import LossSettings
from bandpo_lut.reference.policy_loss import policy_loss as ref_policy_loss

# (options, exception, the message's start with the library's names); with field_names, the same with "a_" + field
BAD = [
    (dict(agg="mean"), ValueError, "agg='mean' is not one of"),
    (dict(clip="ppo"), ValueError, "clip='ppo' is not one of"),
    (dict(mode="drop"), ValueError, "mode='drop' is not one of"),
    (dict(agg=["token-mean"]), ValueError, r"agg=\['token-mean'\] is not one of"),
    (dict(dual_clip=0.5), ValueError, "dual_clip must be None or a number > 1, got 0.5"),
    (dict(max_ratio=0.5), ValueError, r"max_ratio must be a number >= 1 \(the cap .*, got 0.5"),
    (dict(delta=-1.0), ValueError, r"delta must be a positive number \(the trust-region radius δ\) .*, got -1.0"),
    (dict(delta=float("nan")), ValueError, "delta must be a positive number .*, got nan"),
    (dict(delta="0.05"), ValueError, "delta must be a positive number .*, got '0.05'"),
    (dict(delta=3.0), ValueError, r"delta=3.0 is outside the range of the shipped 'kl' table, \[0.001, 1\]"),
    (dict(delta=torch.ones(2, 3, dtype=torch.int64)), TypeError,
     r"delta: expected a floating tensor \(float32, float64, float16 or bfloat16\), got torch.int64"),
    (dict(divergence="js"), ValueError, "divergence='js' is not a divergence; choose one of"),
    (dict(divergence=3), ValueError, "divergence=3 is not a divergence; choose one of"),
    (dict(divergence="reverse_kl"), ValueError, "divergence='reverse_kl' has no compiled kernel"),
    (dict(eps_low=0.1), ValueError, r"eps_low applies to clip='fixed' or 'dcpo' only .*, got 0.1"),
    (dict(eps_high=0.3), ValueError, r"eps_high applies to clip='fixed' or 'dcpo' only .*, got 0.3"),
    (dict(clip="fixed", eps_low=1.5), ValueError, r"eps_low must be a number in \[0, 1\] for clip='fixed', got 1.5"),
    (dict(clip="dcpo", eps_high=0.0), ValueError, "eps_high must be a finite number > 0 for clip='dcpo', got 0.0"),
]
USER = {f: f"a_{f}" for f in ("delta", "divergence", "max_ratio", "dual_clip", "agg", "clip", "mode", "eps_low",
                              "eps_high")}


@pytest.mark.parametrize("kw,exc,message", BAD)
def test_validation_names_the_field(kw, exc, message):
    """When built, with no tensor of a batch: one message per check, one exception type, naming the option (the
    library's name, or the user's with field_names) and the value; policy_loss, BandPolicyLoss,
    fused_linear_policy_loss and the reference refuse with the same message."""
    with pytest.raises(exc, match="^" + message) as library:
        LossSettings(**kw)
    with pytest.raises(exc, match="^a_" + message):
        LossSettings(**kw, field_names=USER)
    lp = torch.full((2, 3), -1.0)
    for call in (lambda: bandpo_lut.BandPolicyLoss(**kw), lambda: bandpo_lut.policy_loss(lp, lp, lp, **kw),
                 lambda: ref_policy_loss(lp, lp, lp, **kw),
                 lambda: bandpo_lut.fused_linear_policy_loss(torch.ones(2, 3, 4), torch.ones(5, 4),
                                                             torch.zeros(2, 3, dtype=torch.long), lp, lp, **kw)):
        with pytest.raises(exc) as err:
            call()
        assert str(err.value) == str(library.value)


def test_frozen_and_defaults():
    s = LossSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.delta = 0.1
    assert (s.delta, s.divergence, s.max_ratio, s.dual_clip, s.agg, s.clip) == (0.05, "kl", None, None,
                                                                                 "token-mean", "band")
    assert LossSettings(clip="fixed").eps() == (0.2, 0.2) and LossSettings(clip="dcpo").eps() == (0.16, 0.2)
    assert LossSettings(delta=0.1, field_names=USER) == LossSettings(delta=0.1)


def test_settings_and_keywords_not_both():
    lp = torch.full((2, 3), -1.0)
    with pytest.raises(ValueError, match="not both.*delta"):
        bandpo_lut.policy_loss(lp, lp, lp, delta=0.1, settings=LossSettings())
    with pytest.raises(TypeError, match="settings must be a bandpo_lut.LossSettings"):
        bandpo_lut.policy_loss(lp, lp, lp, settings={"delta": 0.1})


@pytest.mark.parametrize("kw", [dict(delta=0.05), dict(divergence="kl"), dict(max_ratio=None), dict(agg="token-mean"),
                                dict(eps_low=None), dict(delta=np.array([0.1, 0.2])), dict(clip=np.array(["band"]))],
                         ids=lambda kw: f"{next(iter(kw))}={kw[next(iter(kw))]!r}")
def test_a_keyword_given_at_its_default_value_with_settings_is_refused(kw):
    """Given is given, whatever the value (the default's value, a NumPy array): refused naming the keyword, by every
    entry point, never silently replaced by the settings' value."""
    lp = torch.full((2, 3), -1.0)
    settings = LossSettings(delta=0.2)
    message = f"give the options either as settings=LossSettings\\(...\\) or as keyword arguments, not both " \
              f"\\(also given: {next(iter(kw))}\\)"
    with pytest.raises(ValueError, match="^policy_loss: " + message):
        bandpo_lut.policy_loss(lp, lp, lp, settings=settings, **kw)
    with pytest.raises(ValueError, match="^BandPolicyLoss: " + message):
        bandpo_lut.BandPolicyLoss(settings=settings, **kw)
    with pytest.raises(ValueError, match="^fused_linear_policy_loss: " + message):
        bandpo_lut.fused_linear_policy_loss(torch.ones(2, 3, 4), torch.ones(5, 4), torch.zeros(2, 3, dtype=torch.long),
                                            lp, lp, settings=settings, **kw)


def test_signatures_show_the_defaults():
    for fn in (bandpo_lut.policy_loss, bandpo_lut.BandPolicyLoss, bandpo_lut.fused_linear_policy_loss):
        params = inspect.signature(fn).parameters
        shown = {k: repr(params[k].default) for k in LossSettings.__dataclass_fields__ if k != "field_names"}
        assert shown == {k: repr(getattr(LossSettings(), k)) for k in shown}, fn


def test_equality_and_hash_with_a_tensor_delta():
    """A tensor δ compares by identity (element-wise == has no single truth value): equal settings hash equally."""
    t = torch.full((4, 1), 0.05)
    a, b = LossSettings(delta=t), LossSettings(delta=t)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != LossSettings(delta=t.clone()) and a != LossSettings(delta=0.05) and LossSettings(delta=0.05) != a
    assert LossSettings(delta=0.1, divergence="tv") == LossSettings(delta=np.float64(0.1), divergence="tv")
    assert hash(LossSettings(delta=0.1)) == hash(LossSettings(delta=np.float64(0.1)))
    assert LossSettings(delta=0.1) != LossSettings(delta=0.2) and LossSettings() != "settings"


CASES = [dict(), dict(delta=0.2, divergence="tv", max_ratio=10.0, dual_clip=3.0, agg="seq-mean-token-mean"),
         dict(clip="fixed", eps_low=0.2, eps_high=0.28, agg="token-sum"), dict(clip="dcpo", mode="mask"),
         dict(delta=torch.tensor([[0.05], [0.1], [0.2]]), divergence="chi2", agg="seq-mean-token-sum")]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(kw) or "default")
def test_settings_give_the_keywords_bits_and_the_reference(kw):
    """policy_loss and BandPolicyLoss with settings=LossSettings(**kw): the same bits as the keywords, and the
    reference's loss and gradient (float64, to 1e-12); fused_linear_policy_loss with settings: the same bits as
    with the keywords."""
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(3, 16, generator=g, dtype=torch.float64) * 3).requires_grad_()
    olp = (lp.detach() + 0.4 * torch.randn(3, 16, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(3, 16, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 16, generator=g) > 0.2
    settings = LossSettings(**kw)
    loss_s, m_s = bandpo_lut.policy_loss(lp, olp, adv, mask, settings=settings)
    (g_s,) = torch.autograd.grad(loss_s, lp)
    loss_k, m_k = bandpo_lut.policy_loss(lp, olp, adv, mask, **kw)
    (g_k,) = torch.autograd.grad(loss_k, lp)
    loss_m, _ = bandpo_lut.BandPolicyLoss(settings=settings)(lp, olp, adv, mask)
    (g_m,) = torch.autograd.grad(loss_m, lp)
    assert torch.equal(loss_s, loss_k) and torch.equal(g_s, g_k) and torch.equal(loss_m, loss_k)
    assert torch.equal(g_m, g_k) and all(torch.equal(m_s[k], m_k[k]) for k in m_k)
    ref_loss, _ = ref_policy_loss(lp, olp, adv, mask, **kw)
    (g_ref,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(loss_s, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_s, g_ref, rtol=1e-9, atol=1e-12)

    hidden = torch.randn(3, 16, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 20, (3, 16), generator=g)
    out_s = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, mask, chunk_size=7, settings=settings)
    out_k = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, mask, chunk_size=7, **kw)
    assert torch.equal(out_s[0], out_k[0])
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out_s[0], (hidden, weight)),
                                                 torch.autograd.grad(out_k[0], (hidden, weight))))


def test_per_token_delta_shape_checked_at_call_time():
    s = LossSettings(delta=torch.full((5, 1), 0.05))   # a valid tensor δ: its shape is the batch's business
    lp = torch.full((4, 6), -1.0)
    with pytest.raises(ValueError, match=r"delta has shape \(5, 1\), which does not broadcast"):
        bandpo_lut.policy_loss(lp, lp, lp, settings=s)
