"""The compiled ops `bandpo_lut.bounds` / `bandpo_lut.clip`, on every available device, against mpmath,
the pure-PyTorch reference reader and torch.clamp."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import rel_error_lower, rel_error_upper

import bandpo_lut
from bandpo_lut.reference.bounds import bounds as ref_bounds
from bandpo_lut.tables import accuracy, exact
from bandpo_lut.tables import store as tables

SHIPPED = tables.SHIPPED   # every shipped divergence, hellinger included


def random_points(n, seed, t_range=(-20.0, 20.0)):
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(n, dtype=torch.float64).uniform_(*t_range, generator=g)
    d = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-3), math.log(0.999), generator=g))
    return torch.sigmoid(t), d


# ---- accuracy ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("per_token", [False, True])
def test_float32_accuracy_against_mpmath(device, name, per_token):
    p64, d64 = random_points(300, seed=sum(map(ord, name)) + per_token)   # reproducible across processes
    p64[:6] = torch.tensor([1e-9, 2e-12, 1e-30, 1 - 2 ** -24, 0.5, 1 - 1e-6], dtype=torch.float64)
    p32 = p64.float()
    d = d64.float() if per_token else 0.05
    lo, up = bandpo_lut.bounds(p32.to(device), d.to(device) if per_token else d, name)
    assert lo.dtype == torch.float32 and lo.device.type == device
    d_exact = d.double().numpy() if per_token else np.full(300, 0.05)
    rlo, rup = accuracy.exact_bounds_f64(p32.double().numpy(), d_exact, name)
    eu = rel_error_upper(up, torch.from_numpy(rup).float())
    el = rel_error_lower(lo, torch.from_numpy(rlo), torch.float32)
    assert eu.max() <= 1e-6, (p32[eu.argmax()], eu.max())
    assert el.max() <= 1e-6, (p32[el.argmax()], el.max())


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("log_input", [False, True])
def test_agrees_with_reference(device, name, dtype, per_token, log_input):
    p64, d64 = random_points(20000, seed=5)
    x = (torch.log(p64) if log_input else p64).to(dtype)
    d = d64.to(dtype) if per_token else 0.05
    kw = {"log_p_old": x.to(device)} if log_input else {"p_old": x.to(device)}
    lo, up = bandpo_lut.bounds(delta=d.to(device) if per_token else d, divergence=name, **kw)
    rkw = {"log_p_old": x.double()} if log_input else {"p_old": x.double()}
    rlo, rup = ref_bounds(delta=d.double() if per_token else d, divergence=name, **rkw)
    assert rel_error_upper(up, rup.to(dtype)).max() <= 1e-6
    assert rel_error_lower(lo, rlo, dtype).max() <= 1e-6


def test_log_p_old_is_accurate_where_float32_p_rounds_to_one():
    lp = torch.tensor([-1e-9, -3e-8, -5e-8, -1e-7, -1e-6, 0.0], dtype=torch.float32)
    lo, up = bandpo_lut.bounds(log_p_old=lp, delta=0.05)
    for i, v in enumerate(lp.double().tolist()):
        rlo, rup = exact.bounds_from_logp(v, 0.05, "kl")
        assert float(lo[i]) == pytest.approx(float(rlo), rel=1e-6)
        assert float(up[i]) == pytest.approx(float(rup), rel=1e-6)
    # such tokens given as float32 p collapse to p = 1 and lose that information
    assert (torch.exp(torch.tensor([-1e-9, -2e-8])) == 1).all()


def test_hellinger_closed_form_kernel():
    p = torch.tensor([1e-8, 0.01, 0.2, 0.5, 0.9, 0.999], dtype=torch.float64)
    lo, up = bandpo_lut.bounds(p, 0.05, "hellinger")
    for i, pi in enumerate(p.tolist()):
        rlo, rup = exact.bounds(pi, 0.05, "hellinger")
        assert float(up[i]) == pytest.approx(float(rup), rel=1e-12)
        assert float(lo[i]) == pytest.approx(float(rlo), rel=1e-12, abs=1e-300)


# ---- special values, dtypes, shapes -----------------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
def test_special_values(device, name):
    p = torch.tensor([0.0, 1.0, math.nan, -0.5, 2.0], device=device)
    lo, up = bandpo_lut.bounds(p, 0.05, name)
    assert lo[0] == 0 and math.isinf(up[0])
    r1 = float(exact.bounds(1, 0.05, name)[0])
    assert float(lo[1]) == pytest.approx(r1, rel=1e-6) and up[1] == 1
    assert torch.isnan(lo[2:]).all() and torch.isnan(up[2:]).all()
    lo, up = bandpo_lut.bounds(log_p_old=torch.tensor([0.0, -math.inf, math.nan, 0.5], device=device),
                               delta=0.05, divergence=name)
    assert float(lo[0]) == pytest.approx(r1, rel=1e-6) and up[0] == 1     # padding tokens: log p = 0
    assert lo[1] == 0 and math.isinf(up[1])
    assert torch.isnan(lo[2:]).all() and torch.isnan(up[2:]).all()
    _, up = bandpo_lut.bounds(torch.tensor([0.0, 1e-4], device=device), 0.05, name, max_ratio=10)
    assert up.tolist() == [10.0, 10.0]
    # a per-token δ outside the table's range gives NaN (checking it would need a host sync)
    lo, up = bandpo_lut.bounds(torch.tensor([0.5, 0.5], device=device), torch.tensor([0.05, 3.0], device=device), name)
    assert not torch.isnan(up[0]) and torch.isnan(up[1]) and torch.isnan(lo[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(device, dtype):
    p = torch.rand(1000, device=device).to(dtype)
    ratio = (torch.rand(1000, device=device) * 2).to(dtype)
    lo, up = bandpo_lut.bounds(p, 0.05)
    assert lo.dtype == dtype
    rlo, rup = ref_bounds(p.double().cpu(), 0.05)
    # Computed in float32 and rounded once to `dtype`: within half a unit in the last place of `dtype` of the
    # float64 reference (float32's own error, ~1e-6 relative, is far below that). Not bit for bit: a float32
    # result exactly on a `dtype` tie may round either way on another backend (CUDA's logf/expf, FMA).
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(rup.abs())))
    both_inf = torch.isinf(rup) & (up.cpu().double() == rup)
    err = torch.where(both_inf, torch.zeros_like(rup), (up.cpu().double() - rup).abs())
    assert (err <= 0.5 * ulp + 2e-6 * rup.abs()).all()
    if dtype == torch.float16:
        # the tie: p = 0.0015544891357421875 gives 35.765625 in float32, halfway between float16 neighbours
        tie_p = torch.tensor([0.0015544891357421875], dtype=dtype, device=device)
        _, tie_up = bandpo_lut.bounds(tie_p, 0.05)
        assert tie_up.item() in (35.75, 35.78125)
    out = bandpo_lut.clip(ratio, p, 0.05)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.clamp(ratio, lo, up), rtol=0, atol=0)


def test_broadcasting_noncontiguous_and_empty(device):
    g = torch.Generator().manual_seed(3)
    p = torch.rand(7, 33, generator=g).to(device).t()              # non-contiguous (33, 7)
    ratio = (torch.rand(7, generator=g) * 2).to(device)            # broadcast over rows
    d = torch.full((33, 1), 0.07, device=device)                   # per-row δ
    out = bandpo_lut.clip(ratio, p, d)
    lo, up = bandpo_lut.bounds(p.contiguous(), d.expand(33, 7).contiguous())
    assert out.shape == (33, 7)
    # strided operands take the scalar loop, contiguous ones the vectorised (FMA) loop: a few ulp apart
    torch.testing.assert_close(out, torch.clamp(ratio.expand(33, 7), lo, up), rtol=1e-6, atol=0)
    lo2, up2 = bandpo_lut.bounds(p, 0.07)
    assert rel_error_lower(lo2, lo.double(), torch.float32).max() <= 2e-6    # scalar-δ vs per-token path
    assert rel_error_upper(up2, up).max() <= 2e-6
    e = torch.empty(0, 5, device=device)
    assert bandpo_lut.clip(e, e, 0.05).shape == (0, 5)
    assert bandpo_lut.bounds(torch.tensor(0.3, device=device))[0].shape == ()
    strided = torch.rand(4000, device=device)[::3]
    torch.testing.assert_close(bandpo_lut.bounds(strided)[1], bandpo_lut.bounds(strided.contiguous())[1],
                               rtol=1e-6, atol=0)


# ---- autograd ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
def test_clip_equals_clamp_forward_and_gradient(device, name):
    g = torch.Generator().manual_seed(11)
    p = torch.sigmoid(torch.randn(5000, generator=g) * 4).to(device)
    ratio = torch.exp(torch.randn(5000, generator=g) * 0.5).to(device)
    lo, up = bandpo_lut.bounds(p, 0.05, name, max_ratio=10)
    ratio[:3] = torch.stack([lo[0], up[1], torch.tensor(math.nan, device=device)])   # ties and NaN
    r1 = ratio.clone().requires_grad_()
    out = bandpo_lut.clip(r1, p, 0.05, name, max_ratio=10)
    torch.testing.assert_close(out, torch.clamp(ratio, lo, up), rtol=0, atol=0, equal_nan=True)
    w = torch.randn(5000, generator=g).to(device)
    (out * w).nansum().backward()
    # The gradient of the spec (torch.clamp's up to torch 2.13): 1 on lower <= ratio <= upper, ties
    # included, 0 elsewhere (torch 2.14's clamp gives 0 or 1/2 at exact ties).
    inside = (ratio >= lo) & (ratio <= up)
    torch.testing.assert_close(r1.grad, torch.where(inside, w, torch.zeros_like(w)), rtol=0, atol=0)
    assert r1.grad[0] == w[0] and r1.grad[1] == w[1] and r1.grad[2] == 0   # ties keep the gradient; NaN not
    assert 0 < (r1.grad == 0).sum() < 5000


def test_no_gradient_to_p_or_delta_and_broadcast_gradient():
    p = torch.rand(4, 6, dtype=torch.float64, requires_grad=True)
    d = torch.full((4, 1), 0.05, dtype=torch.float64, requires_grad=True)
    ratio = (torch.rand(6, dtype=torch.float64) * 2).requires_grad_()
    out = bandpo_lut.clip(ratio, p, d)
    out.sum().backward()
    assert p.grad is None and d.grad is None
    lo, up = bandpo_lut.bounds(p.detach(), d.detach())
    expected = ((ratio.detach() >= lo) & (ratio.detach() <= up)).double().sum(0)
    torch.testing.assert_close(ratio.grad, expected)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    p = torch.sigmoid(torch.randn(40, generator=g, dtype=torch.float64) * 3)
    lo, up = bandpo_lut.bounds(p, 0.05)
    # keep the ratios away from the kinks, where the finite differences of a clamp are not defined
    ratio = torch.exp(torch.randn(40, generator=g, dtype=torch.float64) * 0.6)
    far = torch.minimum((ratio - lo).abs(), (ratio - up).abs()) > 1e-3
    ratio = ratio[far].requires_grad_()
    assert torch.autograd.gradcheck(lambda r: bandpo_lut.clip(r, p[far], 0.05), (ratio,))


def _ppo_loss(ratio, p, adv):
    return -(torch.minimum(ratio * adv, bandpo_lut.clip(ratio, p, 0.05, max_ratio=10.0) * adv)).mean()


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(device):
    g = torch.Generator().manual_seed(4)
    p = torch.sigmoid(torch.randn(512, generator=g) * 3).to(device)
    ratio0 = torch.exp(torch.randn(512, generator=g) * 0.4).to(device)
    adv = torch.randn(512, generator=g).to(device)
    compiled = torch.compile(_ppo_loss, fullgraph=True)
    r1, r2 = ratio0.clone().requires_grad_(), ratio0.clone().requires_grad_()
    l1, l2 = _ppo_loss(r1, p, adv), compiled(r2, p, adv)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=0)
    torch.testing.assert_close(r2.grad, r1.grad, rtol=1e-6, atol=1e-9)


# ---- bad input --------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    p = torch.rand(8)
    r = torch.rand(8)
    with pytest.raises(ValueError, match="exactly one"):
        bandpo_lut.clip(r, p, log_p_old=p.log())
    with pytest.raises(ValueError, match="exactly one"):
        bandpo_lut.bounds()
    with pytest.raises(ValueError, match="unknown divergence 'js'"):
        bandpo_lut.bounds(p, 0.05, "js")
    with pytest.raises(ValueError, match="no compiled kernel"):
        bandpo_lut.bounds(p, 0.05, "reverse_kl")
    with pytest.raises(ValueError, match="delta: 1.5 is outside"):
        bandpo_lut.clip(r, p, 1.5)
    with pytest.raises(ValueError, match="delta: 0.0005 is outside"):
        bandpo_lut.bounds(p, 5e-4, "chi2")
    with pytest.raises(ValueError, match="p_old: shape .* cannot be broadcast"):
        bandpo_lut.clip(torch.rand(3), torch.rand(4), 0.05)
    with pytest.raises(TypeError, match="p_old: expected a floating tensor"):
        bandpo_lut.bounds(torch.tensor([1, 2]), 0.05)
    with pytest.raises(TypeError, match="ratio: expected a floating tensor"):
        bandpo_lut.clip(torch.tensor([1j]), p)
    with pytest.raises(TypeError, match="delta: expected a number or a floating tensor"):
        bandpo_lut.bounds(p, "0.05")
    with pytest.raises(ValueError, match="ratio: is on meta but p_old is on cpu"):
        bandpo_lut.clip(torch.empty(8, device="meta"), p)
    with pytest.raises(ValueError, match="max_ratio"):
        bandpo_lut.clip(r, p, max_ratio=0.5)
    with pytest.raises(TypeError, match="p_old: expected a torch.Tensor"):
        bandpo_lut.bounds([0.5])


def test_per_token_delta_blocks_inside_the_grid(device):
    """Blocks whose every p lies inside the table's t range take a shortcut on CPU: same results."""
    p64, d64 = random_points(600, seed=21, t_range=(-9.0, 9.0))
    lo, up = bandpo_lut.bounds(p64.float().to(device), d64.float().to(device), "kl")
    rlo, rup = accuracy.exact_bounds_f64(p64.float().double().numpy(), d64.float().double().numpy(), "kl")
    assert rel_error_upper(up, torch.from_numpy(rup).float()).max() <= 1e-6
    assert rel_error_lower(lo, torch.from_numpy(rlo), torch.float32).max() <= 1e-6
