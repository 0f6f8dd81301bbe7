"""torch's other ways in: forward-mode AD and torch.func (in process, against torch.clamp's own rules and the
pure-PyTorch reference loss), and, in fresh processes (tests/support/torch_modes_scenarios.py), a δ schedule under
torch.compile with inductor and aot_eager, a first call in inference mode or under torch.jit.trace, and
programs saved by torch.export / torch.jit loaded after `import bandpo_lut` alone. Also BandPolicyLoss's
per-token δ as module state."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import clamp_ties_included, run_fresh

import bandpo_lut
from bandpo_lut.reference.bounds import bounds as ref_bounds
from bandpo_lut.reference.policy_loss import policy_loss as ref_policy_loss

SCENARIOS = Path(__file__).resolve().parents[1] / "support" / "torch_modes_scenarios.py"


def ratios_with_edges(dtype=torch.float64):
    """Ratios around the band of p, with exact ties at both bounds, NaN and inf ratios and a NaN p."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(40, generator=g, dtype=dtype)
    p[5] = float("nan")
    lo, up = bandpo_lut.bounds(p, 0.05)
    ratio = 0.6 + 0.8 * torch.rand(40, generator=g, dtype=dtype)
    ratio[6], ratio[7], ratio[2], ratio[3], ratio[4] = lo[6], up[7], float("nan"), float("inf"), 0.0
    return ratio, p, lo, up


def clamp_tangent(ratio, lo, up, tangent):
    """The forward-mode rule of a clamp with ties included (helpers.clamp_ties_included): the tangent on
    [lo, up], 0 outside and where the ratio or a bound is NaN, as the gradient."""
    return torch.func.jvp(lambda x: clamp_ties_included(x, lo, up), (ratio,), (tangent,))[1]


def test_clip_forward_mode_is_torch_clamps():
    ratio, p, lo, up = ratios_with_edges()
    close = torch.testing.assert_close
    tangent = torch.randn(ratio.shape, generator=torch.Generator().manual_seed(1), dtype=ratio.dtype)
    want = clamp_tangent(ratio, lo, up, tangent)
    assert want.abs().sum() > 0 and (want == 0).any()   # the case has ratios inside and outside the band
    primal, got = torch.func.jvp(lambda x: bandpo_lut.clip(x, p, 0.05), (ratio,), (tangent,))
    close(primal, torch.clamp(ratio, *ref_bounds(p, 0.05)), equal_nan=True, rtol=1e-10, atol=0)
    close(got, want, rtol=0, atol=0)
    # and torch.clamp's own rule (tensor bounds) wherever torch versions agree: away from exact ties and NaN
    torch_rule = torch.func.jvp(lambda x: torch.clamp(x, lo, up), (ratio,), (tangent,))[1]
    away = (ratio != lo) & (ratio != up) & ~(ratio.isnan() | lo.isnan() | up.isnan())
    assert away.sum() >= 30
    close(got[away], torch_rule[away], rtol=0, atol=0)
    with fwAD.dual_level():
        out = bandpo_lut.clip(fwAD.make_dual(ratio, tangent), p, 0.05)
        close(fwAD.unpack_dual(out).tangent, want, rtol=0, atol=0)
    # broadcast: one ratio row against a (3, n) p; the tangent follows the broadcast
    p3 = torch.stack([p, p.flip(0), p.roll(3)])
    lo3, up3 = bandpo_lut.bounds(p3, 0.05)
    got3 = torch.func.jvp(lambda x: bandpo_lut.clip(x, p3, 0.05), (ratio,), (tangent,))[1]
    close(got3, clamp_tangent(ratio, lo3, up3, tangent), rtol=0, atol=0)


def test_clip_under_torch_func_transforms_is_torch_clamp():
    ratio, p, lo, up = ratios_with_edges()
    ratio, p, lo, up = ratio[6:], p[6:], lo[6:], up[6:]   # no NaN (see clamp_tangent), ties kept at 0 and 1
    ours = lambda x: bandpo_lut.clip(x, p, 0.05)           # noqa: E731
    theirs = lambda x: clamp_ties_included(x, lo, up)      # noqa: E731
    close = torch.testing.assert_close
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        close(transform(ours)(ratio), transform(theirs)(ratio), rtol=0, atol=0)
    close(torch.func.grad(lambda x: ours(x).square().sum())(ratio),
          torch.func.grad(lambda x: theirs(x).square().sum())(ratio), rtol=0, atol=0)
    close(torch.func.hessian(lambda x: ours(x).square().sum())(ratio),
          torch.func.hessian(lambda x: theirs(x).square().sum())(ratio), rtol=0, atol=0)
    rows = torch.stack([ratio, ratio * 1.1, ratio * 0.9])
    close(torch.vmap(torch.func.grad(lambda x: ours(x).sum()))(rows),
          torch.vmap(torch.func.grad(lambda x: theirs(x).sum()))(rows), rtol=0, atol=0)


def test_bounds_are_constants_in_forward_mode():
    p = torch.rand(16, dtype=torch.float64)
    jac = torch.func.jacfwd(lambda q: torch.stack(bandpo_lut.bounds(q, 0.05)))(p)
    assert jac.shape == (2, 16, 16) and not jac.any()
    with fwAD.dual_level():
        lo, up = bandpo_lut.bounds(fwAD.make_dual(p, torch.ones_like(p)), 0.05)
        for t in (fwAD.unpack_dual(lo).tangent, fwAD.unpack_dual(up).tangent):
            assert t is None or not t.any()


LOSS_CASES = [dict(), dict(dual_clip=3.0, agg="seq-mean-token-sum", max_ratio=10.0), dict(mode="mask"),
              dict(clip="fixed", agg="token-sum"), dict(delta=0.2, divergence="tv", agg="seq-mean-token-mean")]


def loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    olp = torch.log(torch.rand(3, 24, generator=g, dtype=torch.float64).clamp(min=1e-4))
    lp = (olp + 0.4 * torch.randn(olp.shape, generator=g, dtype=olp.dtype)).clamp(max=0)
    adv = torch.randn(olp.shape, generator=g, dtype=olp.dtype)
    mask = torch.rand(olp.shape, generator=g) > 0.2
    return lp, olp, adv, mask


@pytest.mark.parametrize("kw", LOSS_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_policy_loss_forward_mode_and_torch_func_match_the_reference(kw):
    lp, olp, adv, mask = loss_inputs()
    ours = lambda x: bandpo_lut.policy_loss(x, olp, adv, mask, **kw)[0]   # noqa: E731
    ref = lambda x: ref_policy_loss(x, olp, adv, mask, **kw)[0]           # noqa: E731
    tangent = torch.randn(lp.shape, generator=torch.Generator().manual_seed(5), dtype=lp.dtype)
    close = torch.testing.assert_close
    want = torch.func.jvp(ref, (lp,), (tangent,))[1]
    assert want.abs() > 1e-3
    close(torch.func.jvp(ours, (lp,), (tangent,))[1], want, rtol=1e-12, atol=1e-14)
    with fwAD.dual_level():
        close(fwAD.unpack_dual(ours(fwAD.make_dual(lp, tangent))).tangent, want, rtol=1e-12, atol=1e-14)
    close(torch.func.grad(ours)(lp), torch.func.grad(ref)(lp), rtol=1e-12, atol=1e-15)
    close(torch.func.jacrev(ours)(lp), torch.func.jacrev(ref)(lp), rtol=1e-12, atol=1e-15)
    rows = torch.stack([lp, lp - 0.1, lp.clamp(max=-0.2)])
    close(torch.vmap(torch.func.grad(ours))(rows), torch.stack([torch.func.grad(ref)(r) for r in rows]),
          rtol=1e-12, atol=1e-15)


def test_policy_loss_second_order_is_refused_naming_the_package():
    lp, olp, adv, mask = loss_inputs()
    with pytest.raises(NotImplementedError, match="bandpo_lut: policy_loss has no second derivative"):
        torch.func.hessian(lambda x: bandpo_lut.policy_loss(x, olp, adv, mask)[0])(lp)
    x = lp.clone().requires_grad_()
    (g,) = torch.autograd.grad(bandpo_lut.policy_loss(x, olp, adv, mask)[0], x, create_graph=True)
    with pytest.raises(NotImplementedError, match="bandpo_lut: policy_loss has no second derivative"):
        g.square().sum().backward()


def test_band_policy_loss_per_token_delta_is_module_state(device):
    lp, olp, adv, mask = loss_inputs()
    delta = torch.full((1, lp.shape[1]), 0.05, dtype=torch.float64)
    delta[0, ::3] = 0.2
    module = bandpo_lut.BandPolicyLoss(delta=delta)
    assert "delta" in dict(module.named_buffers()) and torch.equal(module.state_dict()["delta"], delta)
    other = bandpo_lut.BandPolicyLoss(delta=torch.full_like(delta, 0.3))
    other.load_state_dict(module.state_dict())
    other.to(device)
    assert other.delta.device.type == device
    got = other(*(t.to(device) for t in (lp, olp, adv, mask)))[0]
    want = ref_policy_loss(lp, olp, adv, mask, delta=delta)[0]
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("scenario", ["delta_schedule", "fixed_shape_delta_dynamic", "inference_mode_first",
                                      "jit_trace_first"])
def test_first_use_scenario(scenario, tmp_path):
    proc = run_fresh([SCENARIOS, scenario], cwd=tmp_path, check=True)
    assert f"ok {scenario}" in proc.stdout


@pytest.mark.slow
@pytest.mark.subprocess
def test_saved_programs_load_after_import_alone(tmp_path):
    run_fresh([SCENARIOS, "save_programs", tmp_path], cwd=tmp_path, check=True)
    proc = run_fresh([SCENARIOS, "load_programs", tmp_path], cwd=tmp_path, check=True)
    assert "ok load_programs" in proc.stdout
