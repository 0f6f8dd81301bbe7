"""A δ tensor in a dtype other than the computation's (bfloat16/float16 δ with float32 p or log-probs, float64 δ
with float32 ones), per token and 0-dim, through every entry point: `bounds`, `clip`, `policy_loss` and
`fused_linear_policy_loss`. Whether an entry is in the table's range is decided in δ's own dtype (an entry that
rounds across a range end there, bfloat16's 9.995e-4 for 1e-3, is that end). The oracle is the float64 reference
reader, whose rule is checked first against the range ends written out by hand; dtypes follow torch's promotion
rule (a 0-dim tensor does not widen a tensor with dimensions), checked against torch.clamp itself."""
from __future__ import annotations

import pytest
import torch

import bandpo_lut
from bandpo_lut import reference
from bandpo_lut.reference import policy_loss as spec
from bandpo_lut.tables import store as tables

SIXTEEN = (torch.bfloat16, torch.float16)
# 1e-3 as each 16-bit dtype rounds it: bfloat16 below the range's lower end, float16 above it.
ROUNDED_MIN = {torch.bfloat16: 0.00099945068359375, torch.float16: 0.00100040435791015625}


def _p(dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    return torch.sigmoid(torch.randn(4, 33, generator=g, dtype=torch.float64) * 3).to(dtype)


def _batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(6)
    olp = -torch.rand(3, 21, generator=g, dtype=torch.float64) * 4
    lp = olp + torch.randn(3, 21, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 21, generator=g, dtype=torch.float64)
    return lp.to(dtype), olp.to(dtype), adv.to(dtype)


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_the_oracle_reads_a_rounded_range_end_as_that_end(dtype):
    table = tables.get("kl")
    at_end = torch.full((4,), table.delta_min, dtype=dtype)
    assert float(at_end[0]) == ROUNDED_MIN[dtype]          # the premise: rounding moved the end
    below = torch.nextafter(at_end, torch.zeros_like(at_end))   # one step of `dtype` below the rounded end
    p = torch.tensor([1e-4, 0.02, 0.5, 0.97], dtype=torch.float64)
    want = reference.bounds(p, max(ROUNDED_MIN[dtype], table.delta_min))   # moved onto the range, if outside
    got = reference.bounds(p, at_end)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isnan(reference.bounds(p, below)[0]).all()
    # the same entry in float64 (no rounding) is outside
    assert torch.isnan(reference.bounds(p, at_end.double())[0]).all() == (ROUNDED_MIN[dtype] < table.delta_min)


@pytest.mark.parametrize("p_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", SIXTEEN)
@pytest.mark.parametrize("zero_dim", [False, True])
@pytest.mark.parametrize("log_input", [False, True])
def test_bounds_and_clip_with_a_16bit_delta_at_the_lower_end(p_dtype, dtype, zero_dim, log_input):
    p = _p(p_dtype)
    delta = torch.tensor(1e-3, dtype=dtype) if zero_dim else torch.full(p.shape, 1e-3, dtype=dtype)
    x = {"log_p_old": p.log()} if log_input else {"p_old": p}
    lo, up = bandpo_lut.bounds(delta=delta, **x)
    assert lo.dtype == p_dtype and torch.isfinite(lo).all()
    ref_lo, ref_up = reference.bounds(delta=torch.full(p.shape, 1e-3, dtype=dtype), **x)
    rtol = 2e-5 if p_dtype == torch.float32 else 1e-9
    torch.testing.assert_close(lo, ref_lo, rtol=rtol, atol=0)
    torch.testing.assert_close(up, ref_up, rtol=rtol, atol=0)
    ratio = torch.exp(torch.randn(p.shape, generator=torch.Generator().manual_seed(1))).to(p_dtype)
    out = bandpo_lut.clip(ratio, delta=delta, **x)
    assert out.dtype == p_dtype
    assert torch.equal(out, torch.clamp(ratio, lo, up))
    # one step of `dtype` below the rounded end: NaN
    below = torch.nextafter(delta, torch.zeros_like(delta))
    assert torch.isnan(bandpo_lut.bounds(delta=below, **x)[0]).all()
    assert torch.isnan(bandpo_lut.clip(ratio, delta=below, **x)).all()


def test_a_float64_delta_narrowed_to_float32_keeps_its_own_range():
    # 1e-3 less a hair: outside in float64, though float32 rounds it to 1e-3 exactly
    table = tables.get("kl")
    hair = torch.tensor(table.delta_min, dtype=torch.float64) * (1 - 1e-12)
    assert float(hair.float()) == float(torch.tensor(table.delta_min, dtype=torch.float32))
    p = _p(torch.float32)
    lp, olp, adv = _batch()
    if torch.cuda.is_available():   # the narrowing path: a 0-dim δ that is not on the CPU
        lo, _ = bandpo_lut.bounds(p.cuda(), hair.cuda())
        assert lo.dtype == torch.float32 and torch.isnan(lo).all()
    per_token = hair.expand(lp.shape)
    assert torch.isnan(bandpo_lut.policy_loss(lp, olp, adv, delta=per_token)[0])
    ok = torch.full(lp.shape, 0.05, dtype=torch.float64)
    loss = bandpo_lut.policy_loss(lp, olp, adv, delta=ok)[0]
    torch.testing.assert_close(loss, spec.policy_loss(lp, olp, adv, delta=ok)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", SIXTEEN)
@pytest.mark.parametrize("zero_dim", [False, True])
def test_policy_loss_with_a_16bit_delta_at_the_lower_end(lp_dtype, dtype, zero_dim):
    lp, olp, adv = _batch(lp_dtype)
    delta = torch.tensor(1e-3, dtype=dtype) if zero_dim else torch.full(lp.shape, 1e-3, dtype=dtype)
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    loss, metrics = bandpo_lut.policy_loss(a, olp, adv, delta=delta)
    ref_loss, ref_metrics = spec.policy_loss(b, olp, adv, delta=delta)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(metrics["band_width_mean"], ref_metrics["band_width_mean"], rtol=1e-5, atol=0)
    ga, = torch.autograd.grad(loss, a)
    gb, = torch.autograd.grad(ref_loss, b)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    below = torch.nextafter(delta, torch.zeros_like(delta))
    assert torch.isnan(bandpo_lut.policy_loss(lp, olp, adv, delta=below)[0])


@pytest.mark.parametrize("dtype", SIXTEEN)
@pytest.mark.parametrize("zero_dim", [False, True])
def test_fused_linear_loss_with_a_16bit_delta_at_the_lower_end(dtype, zero_dim):
    g = torch.Generator().manual_seed(7)
    B, T, H, V = 2, 9, 8, 13
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g)
    lp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    olp = lp + torch.randn(B, T, generator=g) * 0.2
    delta = torch.tensor(1e-3, dtype=dtype) if zero_dim else torch.full((B, T), 1e-3, dtype=dtype)
    loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, delta=delta, chunk_size=4)
    ref_loss, _ = spec.policy_loss(lp, olp, adv, delta=delta)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    below = torch.nextafter(delta, torch.zeros_like(delta))
    assert torch.isnan(bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, delta=below)[0])


@pytest.mark.parametrize("delta_dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_a_0dim_delta_follows_torch_promotion(delta_dtype):
    p = _p(torch.float32)
    ratio = torch.exp(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    delta = torch.tensor(0.05, dtype=delta_dtype)
    lo, up = bandpo_lut.bounds(p, delta)
    want = torch.clamp(ratio, lo, delta).dtype      # torch's own rule for these operands
    assert want == torch.float32 and lo.dtype == up.dtype == want
    assert bandpo_lut.clip(ratio, p, delta).dtype == want
    # every operand 0-dim: ordinary promotion
    lo0, _ = bandpo_lut.bounds(p[0, 0], delta)
    assert lo0.dtype == torch.clamp(p[0, 0], delta, delta).dtype


@pytest.mark.parametrize("zero_dim_delta", [
    torch.tensor(2.0), torch.tensor(2.0, dtype=torch.float64), torch.tensor(5e-4, dtype=torch.bfloat16)])
def test_an_out_of_range_0dim_delta_is_nan_at_every_entry_point(zero_dim_delta):
    p = _p(torch.float32)
    lp, olp, adv = _batch()
    assert torch.isnan(bandpo_lut.bounds(p, zero_dim_delta)[0]).all()
    assert torch.isnan(bandpo_lut.clip(p, p, zero_dim_delta)).all()
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    loss, metrics = bandpo_lut.policy_loss(a, olp, adv, delta=zero_dim_delta)
    ref_loss, ref_metrics = spec.policy_loss(b, olp, adv, delta=zero_dim_delta)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    for k in ref_metrics:
        torch.testing.assert_close(metrics[k], ref_metrics[k], equal_nan=True, msg=k)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
    hidden, weight = torch.randn(3, 21, 4), torch.randn(7, 4)
    ids = torch.randint(0, 7, (3, 21))
    fl_loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, delta=zero_dim_delta)
    assert torch.isnan(fl_loss)
