"""A log-probability a hair above 0 (rounding from a trainer's or an inference engine's arithmetic) means
p = 1, in the compiled ops, the reference and so in every integration; a clearly invalid one gives NaN.

The rule (csrc/bandpo_math.h kLogProbRounding, bandpo_lut.reference.bounds.LOG_PROB_ROUNDING): log p in
(0, 2^-9] reads as 0; above 2^-9, NaN. Checked against the bounds at p = 1 of the mpmath solver of the
exact equation (`bandpo_lut.tables.exact`, independent of the tables and of both implementations; for KL it is
the closed form [e^-δ, 1]).
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import ALL_DEVICES

import bandpo_lut
from bandpo_lut.reference import policy_loss as reference
from bandpo_lut.reference.bounds import LOG_PROB_ROUNDING
from bandpo_lut.reference.bounds import bounds as reference_bounds
from bandpo_lut.tables import exact

DELTA = 0.05
COMPILED = ("kl", "tv", "chi2", "hellinger")
ROUNDING = [6e-8, 1e-6, 3e-5, 1e-3, 2.0 ** -9]       # each read as log p = 0
INVALID = [2.0 ** -9 * (1 + 2.0 ** -7), 0.01, 0.5, 3.0]  # NaN bounds


def test_threshold_is_two_to_the_minus_nine():
    assert LOG_PROB_ROUNDING == 2.0 ** -9
    # every value at or below it has exp(x) round to 1 in bfloat16; the first bfloat16 above it does not
    assert torch.tensor(math.exp(LOG_PROB_ROUNDING), dtype=torch.bfloat16).item() == 1.0
    assert torch.tensor(math.exp(2 ** -8), dtype=torch.bfloat16).item() > 1.0


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rounding_positive_log_p_is_p_equal_one(device, name, dtype):
    x = torch.tensor(ROUNDING + [0.0] + INVALID, dtype=dtype, device=device)
    n = len(ROUNDING) + 1
    lower_at_1, upper_at_1 = (float(v) for v in exact.bounds(1, DELTA, name))
    assert upper_at_1 == 1 and (name != "kl" or lower_at_1 == pytest.approx(math.exp(-DELTA)))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    for impl in (bandpo_lut.bounds, None):
        if impl is None:
            if dtype == torch.bfloat16:
                continue  # the reference takes float32/float64
            lo, up = reference_bounds(log_p_old=x, delta=DELTA, divergence=name)
        else:
            lo, up = impl(log_p_old=x, delta=DELTA, divergence=name)
        lo, up = lo.double().cpu(), up.double().cpu()
        assert torch.allclose(lo[:n], torch.full((n,), lower_at_1, dtype=torch.float64),
                              rtol=tol, atol=0), (name, lo[:n])
        assert (up[:n] == 1).all(), up[:n]
        assert torch.isnan(lo[n:]).all() and torch.isnan(up[n:]).all(), (lo[n:], up[n:])


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_policy_loss_with_a_rounding_positive_old_log_prob(device):
    """A counted token with old log-prob +6e-8 gives a finite loss and gradient: the band at p = 1,
    [e^-δ, 1], with the ratio from the old log-prob as given; checked against a hand-written PPO loss."""
    old = torch.tensor([[6e-8, 1e-5, 2.0 ** -9, 6e-8]], dtype=torch.float64, device=device)
    new = torch.tensor([[-0.01, 0.02, -0.2, 0.5]], dtype=torch.float64, device=device, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]], dtype=torch.float64, device=device)
    mask = torch.ones_like(adv)
    loss, metrics = bandpo_lut.policy_loss(new, old, adv, mask, delta=DELTA, max_ratio=10, dual_clip=10)
    (grad,) = torch.autograd.grad(loss, new)

    leaf = new.detach().clone().requires_grad_(True)
    ratio = torch.exp(leaf - old)
    clipped = torch.clamp(ratio, math.exp(-DELTA), 1.0)
    expected = (-torch.min(ratio * adv, clipped * adv)).mean()  # no ratio reaches the dual clip
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    # ratios 0.99 (inside), 1.02 > 1 with A > 0 and e^-0.2 < e^-δ with A < 0 (clipped), e^0.5 with A < 0
    # (the unclipped branch, below the dual clip)
    assert int(metrics["n_clipped"]) == 2
    ref_loss, _ = reference.policy_loss(new.detach(), old, adv, mask, delta=DELTA, max_ratio=10,
                                        dual_clip=10)
    torch.testing.assert_close(loss.detach(), ref_loss)


def test_an_invalid_old_log_prob_gives_nan_not_an_error():
    """No host synchronisation in the loss: a clearly invalid old log-prob is NaN out, not a raise."""
    old = torch.tensor([[0.3, -0.5]])
    new = torch.tensor([[-0.1, -0.4]])
    loss, _ = bandpo_lut.policy_loss(new, old, torch.ones_like(old), torch.ones_like(old))
    assert torch.isnan(loss)
