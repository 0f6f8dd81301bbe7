"""A 0-dim CPU δ next to tensors on any device: what torch's own ops accept, and the documented way to
schedule δ under torch.compile. The kernels read it on the host (no device synchronisation), so every entry point
takes it with p / log-probabilities on any device: `bounds`, `clip`, `policy_loss`, `BandPolicyLoss` and
`fused_linear_policy_loss`. It gives the bits of the same Python float δ; on the CPU both are compared with the
pure-PyTorch reference; on `meta` (shapes and dtypes through the fake kernels) it is accepted and the outputs have
the right shapes, dtypes and device; under torch.compile a new value is not a new graph."""
from __future__ import annotations

import pytest
import torch
from helpers import ALL_DEVICES

import bandpo_lut
from bandpo_lut import reference
from bandpo_lut.reference import policy_loss as spec

DEVICES = [*ALL_DEVICES, "meta"]
DELTA = 0.07


def _inputs(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(26)
    p = torch.sigmoid(torch.randn(3, 64, generator=g, dtype=torch.float64) * 3)
    ratio = torch.exp(torch.randn(64, generator=g, dtype=torch.float64) * 0.5)
    return p.to(device=device, dtype=dtype), ratio.to(device=device, dtype=dtype)


def _loss_inputs(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(27)
    olp = -torch.rand(4, 37, generator=g, dtype=torch.float64) * 3
    lp = olp + torch.randn(4, 37, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(4, 37, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 37, generator=g) > 0.2
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else None) for t in (lp, olp, adv, mask)]


def _host(dtype=torch.float64):
    return torch.tensor(DELTA, dtype=dtype)    # on the CPU whatever the device of the rest


@pytest.mark.parametrize("device", DEVICES)
def test_bounds_and_clip(device):
    p, ratio = _inputs(device)
    lo, up = bandpo_lut.bounds(p, _host())
    out = bandpo_lut.clip(ratio, p, _host(), max_ratio=10.0)
    assert lo.shape == up.shape == (3, 64) and out.shape == (3, 64)
    assert {lo.device, up.device, out.device} == {p.device} and {lo.dtype, out.dtype} == {torch.float64}
    if device == "meta":
        return
    lo_f, up_f = bandpo_lut.bounds(p, DELTA)
    assert torch.equal(lo, lo_f) and torch.equal(up, up_f)
    assert torch.equal(out, bandpo_lut.clip(ratio, p, DELTA, max_ratio=10.0))
    if device == "cpu":
        ref_lo, ref_up = reference.bounds(p, DELTA)
        torch.testing.assert_close(lo, ref_lo, rtol=1e-9, atol=0)
        torch.testing.assert_close(up, ref_up, rtol=1e-9, atol=0)
        torch.testing.assert_close(out, torch.minimum(torch.maximum(ratio, ref_lo), ref_up.clamp(max=10.0)),
                                   rtol=1e-9, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_and_module(device):
    lp, olp, adv, mask = _loss_inputs(device)
    lp = lp.requires_grad_()
    loss, metrics = bandpo_lut.policy_loss(lp, olp, adv, mask, delta=_host(), max_ratio=10.0)
    module_loss, _ = bandpo_lut.BandPolicyLoss(delta=_host(), max_ratio=10.0)(lp, olp, adv, mask)
    assert loss.shape == module_loss.shape == () and loss.device == lp.device
    assert all(v.shape == () and v.device == lp.device for v in metrics.values())
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.shape == lp.shape and grad.device == lp.device
    if device == "meta":
        return
    loss_f, metrics_f = bandpo_lut.policy_loss(lp, olp, adv, mask, delta=DELTA, max_ratio=10.0)
    (grad_f,) = torch.autograd.grad(loss_f, lp)
    assert torch.equal(loss, loss_f) and torch.equal(module_loss, loss_f) and torch.equal(grad, grad_f)
    assert all(torch.equal(metrics[k], metrics_f[k]) for k in metrics_f)
    if device == "cpu":
        ref, ref_metrics = spec.policy_loss(lp.detach(), olp, adv, mask, delta=DELTA, max_ratio=10.0)
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(metrics["clip_frac"], ref_metrics["clip_frac"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_linear_policy_loss(device):
    g = torch.Generator().manual_seed(28)
    B, T, H, V = 2, 9, 16, 32
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / 4).to(device)
    ids = torch.randint(0, V, (B, T), generator=g).to(device)
    olp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 1).to(device)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64).to(device)
    loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, delta=_host(), chunk_size=4)
    assert loss.shape == () and loss.device == hidden.device
    if device == "meta":
        return
    loss_f, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, olp, adv, delta=DELTA, chunk_size=4)
    assert torch.equal(loss, loss_f)
    if device == "cpu":   # the unfused reference: log-softmax, gather, the reference loss
        lp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        ref, _ = spec.policy_loss(lp.detach(), olp, adv, delta=DELTA)
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_a_new_host_delta_value_is_not_a_new_graph(device):
    """As on the CPU: the host δ is a graph input, so a schedule of values runs one graph (fullgraph)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    p, ratio = _inputs(device, torch.float32)

    @torch.compile(backend=counter, fullgraph=True)
    def step(ratio, p, delta):
        return bandpo_lut.clip(ratio, p, delta)

    for d in (0.05, 0.07, 0.2):
        delta = torch.tensor(d, dtype=torch.float32)     # p's dtype: no promotion; its value is float(delta), not d
        out = step(ratio, p, delta)
        assert torch.equal(out, bandpo_lut.clip(ratio, p, float(delta)))
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_only_a_0dim_cpu_delta_may_sit_on_another_device(device):
    p, _ = _inputs(device)
    with pytest.raises(ValueError, match="delta: is on cpu but p_old is on"):
        bandpo_lut.bounds(p, torch.full((64,), DELTA, dtype=torch.float64))
    lp, olp, adv, mask = _loss_inputs(device)
    with pytest.raises(ValueError, match="policy_loss: delta is on cpu but log_prob is on"):
        bandpo_lut.policy_loss(lp, olp, adv, mask, delta=torch.full((4, 1), DELTA, dtype=torch.float64))
