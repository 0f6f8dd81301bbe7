"""Edge values (subnormal probabilities, δ at a range end in a 16-bit dtype, NumPy numbers), clip's gradient
rule against torch.clamp itself, and errors that name the argument."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import bandpo_lut
from bandpo_lut.tables import accuracy
from bandpo_lut.tables import store as tables


def test_subnormal_float32_p_gives_the_finite_upper_bound():
    # float32 p below the normal range: 1/p overflows, q/p does not (2.19e37 at log p = -89, δ = 0.05)
    logp = torch.tensor([-88.0, -89.0, -90.0, -100.0, -103.0])
    p32 = torch.exp(logp)                      # subnormal float32 values (the last two: q/p > FLT_MAX)
    assert (p32[1:] < torch.finfo(torch.float32).tiny).all()
    _, rup = accuracy.exact_bounds_f64(p32.double().numpy(), np.full(5, 0.05), "kl")
    want = torch.from_numpy(rup)
    for kw in ({"p_old": p32}, {"log_p_old": p32.double().log().float()}):
        lo, up = bandpo_lut.bounds(delta=0.05, **kw)
        fits = want <= torch.finfo(torch.float32).max
        assert fits.tolist() == [True, True, True, False, False]
        err = ((up.double() - want) / want).abs()
        assert (err[fits] <= 1e-5).all(), (kw.keys(), up, want)
        assert torch.isinf(up[~fits]).all()
        assert (lo == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divergence", tables.SHIPPED)
def test_16bit_delta_at_a_range_end_is_that_end(dtype, divergence):
    table = tables.get(divergence)
    p = torch.tensor([1e-4, 0.01, 0.3, 0.9], dtype=dtype)
    ends = [table.delta_min] + ([table.delta_max] if table.delta_max_inclusive else [])
    for end in ends:
        d = torch.full_like(p, end)   # e.g. 9.995e-4 in bfloat16: rounded across the range end
        rounded = float(d[0])
        inside = table.delta_min <= rounded <= table.delta_max
        lo, up = bandpo_lut.bounds(p, d, divergence)
        want_lo, want_up = bandpo_lut.bounds(p.float(), rounded if inside else end, divergence)
        assert torch.equal(lo, want_lo.to(dtype)) and torch.equal(up, want_up.to(dtype)), (end, lo, want_lo)
    # clearly outside (not by rounding): NaN
    below = torch.full_like(p, table.delta_min * 0.9)
    assert torch.isnan(bandpo_lut.bounds(p, below, divergence)[0]).all()


def test_numpy_numbers_are_numbers():
    p = torch.rand(16, dtype=torch.float64)
    want = bandpo_lut.bounds(p, 0.0625)
    for d in (np.float64(0.0625), np.float32(0.0625), np.float16(0.0625)):
        got = bandpo_lut.bounds(p, d)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), type(d)
    assert torch.equal(bandpo_lut.clip(p * 2, p, 0.0625, max_ratio=np.float32(3.0)),
                       bandpo_lut.clip(p * 2, p, 0.0625, max_ratio=3.0))
    with pytest.raises(TypeError, match="delta"):
        bandpo_lut.bounds(p, True)
    with pytest.raises(ValueError, match="delta"):
        bandpo_lut.bounds(p, np.float32(2.0))


def test_host_scalar_delta_tensor_equals_the_number():
    p = torch.rand(300)
    for d in (0.05, 0.3):
        for dtype in (torch.float32, torch.float64):   # a 0-dim δ does not widen p (torch's promotion rule)
            delta = torch.tensor(d, dtype=dtype)        # 0-dim CPU: read on the host
            want = bandpo_lut.bounds(p, float(delta))
            got = bandpo_lut.bounds(p, delta)
            assert got[0].dtype == torch.clamp(p, delta, delta).dtype
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (d, dtype)   # same δ, same bits
    lo, up = bandpo_lut.bounds(p, torch.tensor(2.0))   # a tensor δ out of range: NaN, as per token
    assert torch.isnan(lo).all() and torch.isnan(up).all()


def test_clip_gradient_is_scalar_bound_clamps():
    # One p, so the band is two numbers; torch.clamp with those numbers as Python scalars is the rule
    # (PPO/GRPO trainers clip with scalar bounds): 1 on [lower, upper] inclusive, 0 outside and for NaN.
    for divergence in tables.SHIPPED:
        p = torch.full((9,), 0.2, dtype=torch.float64)
        lo, up = (float(b[0]) for b in bandpo_lut.bounds(p, 0.05, divergence))
        ratio = torch.tensor([lo / 2, math.nextafter(lo, 0), lo, (lo + up) / 2, 1.0, up, math.nextafter(up, 9),
                              up * 2, math.nan], dtype=torch.float64, requires_grad=True)
        ours = bandpo_lut.clip(ratio, p, 0.05, divergence)
        ours.sum().backward()
        ours_grad = ratio.grad.clone()
        ratio.grad = None
        ref = torch.clamp(ratio, lo, up)
        ref.sum().backward()
        assert torch.equal(ours.detach().nan_to_num(-1), ref.detach().nan_to_num(-1))
        # torch.clamp's own gradient at an exact tie changed in torch 2.14 (1 before, 0 since); away from the
        # ties ours must be torch.clamp's, and at the ties it is 1 (the bounds belong to the band).
        ties = torch.tensor([False, False, True, False, False, True, False, False, False])
        assert torch.equal(ours_grad[~ties], ratio.grad[~ties]), (divergence, ours_grad, ratio.grad)
        assert ours_grad.tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0]


def test_broadcast_errors_name_the_argument():
    p = torch.rand(3)
    with pytest.raises(ValueError, match=r"delta: shape \(4,\)"):
        bandpo_lut.bounds(p, torch.full((4,), 0.05))
    with pytest.raises(ValueError, match=r"p_old: shape \(3,\)"):
        bandpo_lut.clip(torch.rand(5), p, 0.05)
    with pytest.raises(ValueError, match="log_p_old"):
        bandpo_lut.clip(torch.rand(2, 5), log_p_old=torch.rand(3, 1).log(), delta=torch.full((4, 1), 0.1))


def test_reference_bounds_is_callable_as_documented():
    p = torch.tensor([0.01, 0.5], dtype=torch.float64)
    lo, up = bandpo_lut.reference.bounds(p, 0.05, "kl")
    assert torch.allclose(up, bandpo_lut.bounds(p, 0.05)[1], rtol=1e-9)


def test_band_policy_loss_refuses_bad_settings_at_construction():
    with pytest.raises(ValueError, match="divergence"):
        bandpo_lut.BandPolicyLoss(divergence="nope")
    with pytest.raises(ValueError, match="divergence='reverse_kl' has no compiled kernel"):
        bandpo_lut.BandPolicyLoss(divergence="reverse_kl")
    with pytest.raises(ValueError, match="delta=2.0 is outside"):
        bandpo_lut.BandPolicyLoss(delta=2.0)
    bandpo_lut.BandPolicyLoss(clip="fixed", divergence="kl")   # the baselines ignore the band


def test_a_sparse_tensor_is_refused_naming_the_argument():
    """A sparse layout would reach torch's dispatcher, whose error lists backends and names no argument."""
    dense = torch.rand(2, 3)
    sparse = dense.to_sparse()
    for call, name in ((lambda: bandpo_lut.bounds(sparse, 0.05), "p_old"),
                       (lambda: bandpo_lut.bounds(log_p_old=sparse, delta=0.05), "log_p_old"),
                       (lambda: bandpo_lut.clip(sparse, dense, 0.05), "ratio"),
                       (lambda: bandpo_lut.clip(dense, dense, sparse), "delta"),
                       (lambda: bandpo_lut.policy_loss(dense, -dense, dense, (dense > 0.5).to_sparse()), "mask"),
                       (lambda: bandpo_lut.policy_loss(dense, -sparse, dense), "old_log_prob")):
        with pytest.raises(TypeError, match=rf"{name}.*dense \(strided\).*sparse_coo"):
            call()


def test_metrics_from_counts_names_the_missing_counts():
    _, metrics = bandpo_lut.policy_loss(torch.randn(2, 3), -torch.rand(2, 3), torch.randn(2, 3))
    counts = {k: metrics[k] for k in bandpo_lut.COUNTS}
    assert bandpo_lut.metrics_from_counts(counts)["clip_frac"] == metrics["clip_frac"]
    del counts["n_tokens"]
    with pytest.raises(KeyError, match="counts lacks n_tokens"):
        bandpo_lut.metrics_from_counts(counts)
