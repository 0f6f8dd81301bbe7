"""The fused policy loss against the pure-PyTorch reference (bandpo_lut.reference.policy_loss), on every
available device: loss, gradient and every metric, for every clip, mode, aggregation and dual-clip setting."""
from __future__ import annotations

import itertools

import pytest
import torch

import bandpo_lut
from bandpo_lut.reference import policy_loss as spec

SETTINGS = list(itertools.product(spec.CLIPS, spec.MODES, spec.AGGS, (None, 3.0)))


def make_batch(device, dtype, B=6, T=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6          # p_old across (0.0025, 1]
    old[0, :40] = -torch.rand(40, generator=g, dtype=torch.float64) * 1e-6  # p near 1
    new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    new[1, :5] = old[1, :5] + torch.tensor([25.0, -25.0, 20.0, -20.0, 0.0], dtype=torch.float64)  # the ±20 clamp
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[2, :10] = 0
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[3] = False                                                          # an empty row
    to = dict(device=device, dtype=dtype)
    return new.to(**to), old.to(**to), adv.to(**to), mask.to(device)


def compare(fused, ref, rtol):
    (l1, m1), (l2, m2) = fused, ref
    torch.testing.assert_close(l1, l2, rtol=rtol, atol=rtol * 1e-2)
    assert set(m1) == set(m2) == set(spec.COUNTS) | set(spec.FRACTIONS)
    for k in m1:
        assert m1[k].dim() == 0 and m1[k].dtype == m2[k].dtype, k
        torch.testing.assert_close(m1[k], m2[k], rtol=rtol, atol=rtol * 1e-2, msg=k)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("clip,mode,agg,dual", SETTINGS)
def test_matches_reference(device, dtype, rtol, clip, mode, agg, dual):
    lp, olp, adv, mask = make_batch(device, dtype)
    kw = dict(clip=clip, mode=mode, agg=agg, dual_clip=dual, max_ratio=10.0)
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    fused = bandpo_lut.policy_loss(a, olp, adv, mask, **kw)
    ref = spec.policy_loss(b, olp, adv, mask, **kw)
    compare(fused, ref, rtol)
    ga, = torch.autograd.grad(fused[0], a)
    gb, = torch.autograd.grad(ref[0], b)
    torch.testing.assert_close(ga, gb, rtol=rtol, atol=rtol * 1e-3)


@pytest.mark.parametrize("divergence", ["kl", "tv", "chi2"])
def test_band_options_per_token_delta_and_float_mask(device, divergence):
    lp, olp, adv, mask = make_batch(device, torch.float64, seed=1)
    delta = torch.linspace(0.01, 0.3, lp.shape[1], dtype=torch.float64, device=device)   # broadcast per column
    wmask = mask.to(torch.float64) * 0.5                                                  # weights
    for m in (wmask, mask.to(torch.int32), None):
        kw = dict(delta=delta, divergence=divergence, agg="seq-mean-token-mean")
        a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        fused, ref = bandpo_lut.policy_loss(a, olp, adv, m, **kw), spec.policy_loss(b, olp, adv, m, **kw)
        compare(fused, ref, 1e-10)
        torch.testing.assert_close(torch.autograd.grad(fused[0], a)[0], torch.autograd.grad(ref[0], b)[0],
                                   rtol=1e-10, atol=1e-13)


def test_bfloat16_inputs_and_empty_mask(device):
    lp, olp, adv, mask = make_batch(device, torch.bfloat16, seed=2)
    a = lp.clone().requires_grad_()
    loss, metrics = bandpo_lut.policy_loss(a, olp, adv, mask)
    ref, ref_metrics = spec.policy_loss(lp.clone().requires_grad_(), olp, adv, mask)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad).all()
    empty = torch.zeros_like(mask)
    a.grad = None
    loss, metrics = bandpo_lut.policy_loss(a, olp, adv, empty, agg="seq-mean-token-mean")
    loss.backward()
    assert loss == 0 and (a.grad == 0).all() and metrics["clip_frac"] == 0


def test_nan_padding_is_ignored_and_nan_tokens_poison():
    lp, olp, adv, mask = make_batch("cpu", torch.float32, seed=3)
    lp[~mask] = float("nan")
    loss, _ = bandpo_lut.policy_loss(lp, olp, adv, mask)
    assert torch.isfinite(loss)
    loss, _ = bandpo_lut.policy_loss(lp, olp, adv, None)
    assert torch.isnan(loss)


def test_counts_sum_to_global_fractions():
    lp, olp, adv, mask = make_batch("cpu", torch.float64, B=8, seed=4)
    _, whole = bandpo_lut.policy_loss(lp, olp, adv, mask)
    parts = [bandpo_lut.policy_loss(lp[i:i + 2], olp[i:i + 2], adv[i:i + 2], mask[i:i + 2])[1] for i in (0, 2, 4, 6)]
    summed = {k: sum(p[k] for p in parts) for k in bandpo_lut.COUNTS}
    merged = bandpo_lut.metrics_from_counts(summed)
    for k in bandpo_lut.FRACTIONS:
        torch.testing.assert_close(merged[k], whole[k], rtol=1e-12, atol=1e-15)


def test_module_wrapper():
    lp, olp, adv, mask = make_batch("cpu", torch.float32, seed=5)
    module = bandpo_lut.BandPolicyLoss(max_ratio=10, dual_clip=10)
    torch.testing.assert_close(module(lp, olp, adv, mask)[0],
                               bandpo_lut.policy_loss(lp, olp, adv, mask, max_ratio=10, dual_clip=10)[0])
    assert "dual_clip=10" in repr(module)
    with pytest.raises(ValueError, match="dual_clip"):
        bandpo_lut.BandPolicyLoss(dual_clip=1.0)


@pytest.mark.parametrize("kw", [dict(max_ratio=10.0, dual_clip=3.0),
                                dict(delta=torch.linspace(0.02, 0.2, 257)[None, :], divergence="tv")],
                         ids=["number_delta", "buffer_delta"])
def test_a_module_saved_whole_by_an_older_build_loads_and_runs(kw):
    import io
    lp, olp, adv, mask = make_batch("cpu", torch.float64, seed=8)
    old = bandpo_lut.BandPolicyLoss(**kw)
    del old.__dict__["_built"]   # the state of a build that kept only `settings` and the δ buffer
    buf = io.BytesIO()
    torch.save(old, buf)
    module = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert isinstance(module, bandpo_lut.BandPolicyLoss)
    got = module(lp, olp, adv, mask)
    torch.testing.assert_close(got[0], spec.policy_loss(lp, olp, adv, mask, **kw)[0], rtol=1e-10, atol=1e-12)
    module.settings["agg"] = "token-sum"    # a changed setting is still read
    torch.testing.assert_close(module(lp, olp, adv, mask)[0],
                               spec.policy_loss(lp, olp, adv, mask, agg="token-sum", **kw)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(device):
    lp, olp, adv, mask = make_batch(device, torch.float32, seed=6)

    def step(lp, olp, adv, mask):
        loss, metrics = bandpo_lut.policy_loss(lp, olp, adv, mask, max_ratio=10.0, dual_clip=3.0)
        return loss, metrics

    compiled = torch.compile(step, fullgraph=True)
    a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    (l1, m1), (l2, m2) = step(a, olp, adv, mask), compiled(b, olp, adv, mask)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9)
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-6, atol=1e-8, msg=k)


def test_opcheck():
    lp, olp, adv, mask = make_batch("cpu", torch.float64, B=4, T=64, seed=7)
    prep = bandpo_lut.runtime.band.table_args("kl")
    args = (lp.requires_grad_(), olp, adv, mask.view(torch.uint8), None, 0.05, prep.coefficients, prep.grid, 0, 0,
            0.0, 0.0, 10.0, 3.0, 0, 2)   # ..., mode "clip", agg "seq-mean-token-mean"
    torch.library.opcheck(torch.ops.bandpo_lut.policy_loss_fwd, args)


def test_bad_inputs_name_the_argument():
    lp, olp, adv, mask = make_batch("cpu", torch.float32, B=4, T=64)
    cases = [
        (dict(old_log_prob=olp[:, :4]), ValueError, "old_log_prob has shape"),
        (dict(mask=mask.to(torch.complex64)), TypeError, "mask"),
        (dict(agg="mean"), ValueError, "agg='mean' is not one of"),
        (dict(clip="ppo"), ValueError, "clip='ppo' is not one of"),
        (dict(mode="drop"), ValueError, "mode='drop' is not one of"),
        (dict(dual_clip=0.5), ValueError, "dual_clip"),
        (dict(delta=3.0), ValueError, "outside"),
        (dict(divergence="js"), ValueError, "divergence='js' is not a divergence"),
    ]
    for override, exc, match in cases:
        kw = dict(log_prob=lp, old_log_prob=olp, advantages=adv, mask=mask)
        extra = {k: v for k, v in override.items() if k not in kw}
        kw.update({k: v for k, v in override.items() if k in kw})
        with pytest.raises(exc, match=match):
            bandpo_lut.policy_loss(kw.pop("log_prob"), kw.pop("old_log_prob"), kw.pop("advantages"),
                                   kw.pop("mask"), **extra)


def test_per_token_delta_is_validated_like_bounds_and_clip():
    lp, olp, adv, mask = make_batch("cpu", torch.float32, B=4, T=64)
    for bad in (torch.ones(4, 64, dtype=torch.bool), torch.full((4, 64), 1, dtype=torch.int64),
                torch.full((4, 64), 0.05, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="delta"):
            bandpo_lut.policy_loss(lp, olp, adv, mask, delta=bad)
        with pytest.raises(TypeError, match="delta"):
            bandpo_lut.clip(torch.ones(4, 64), olp.exp(), bad)
    for shape in ((4, 63), (5, 1), (2, 4, 64), (64, 4)):
        with pytest.raises(ValueError, match=r"delta has shape .* does not broadcast"):
            bandpo_lut.policy_loss(lp, olp, adv, mask, delta=torch.full(shape, 0.05))
    for shape in ((4, 1), (64,), (1, 64), ()):
        loss, _ = bandpo_lut.policy_loss(lp, olp, adv, mask, delta=torch.full(shape, 0.05))
        torch.testing.assert_close(loss, bandpo_lut.policy_loss(lp, olp, adv, mask, delta=0.05)[0], rtol=1e-6,
                                   atol=1e-7)


@pytest.mark.parametrize("B,T", [pytest.param(65536, 3, marks=pytest.mark.slow), (3, 5000), (2, 1), (1, 0), (0, 7)])
def test_edge_sizes_match_the_reference(device, B, T):
    # (on a GPU: empty batches, rows of one token, rows of many tiles, many rows of one tile each)
    g = torch.Generator().manual_seed(11)
    olp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 5).to(device)
    lp = olp + (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).to(device)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(device)
    for agg in spec.AGGS:
        a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        fused, ref = bandpo_lut.policy_loss(a, olp, adv, mask, agg=agg), spec.policy_loss(b, olp, adv, mask, agg=agg)
        compare(fused, ref, 1e-10)
        fused[0].backward()
        ref[0].backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)


def test_results_do_not_depend_on_the_thread_count():
    lp, olp, adv, mask = make_batch("cpu", torch.float32, B=37, T=300, seed=12)
    wmask = mask.float() * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            a = lp.clone().requires_grad_()
            loss, metrics = bandpo_lut.policy_loss(a, olp, adv, wmask, agg="seq-mean-token-mean")
            loss.backward()
            results.append((loss, metrics, a.grad))
    finally:
        torch.set_num_threads(threads)
    for loss, metrics, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][2])
        assert all(torch.equal(metrics[k], results[0][1][k]) for k in metrics)


def test_uint8_and_integer_masks_are_weights(device):
    lp, olp, adv, mask = make_batch(device, torch.float64, B=4, T=64, seed=13)
    weights = mask.to(torch.uint8) * 2
    for m in (weights, weights.to(torch.int32)):
        fused, ref = bandpo_lut.policy_loss(lp, olp, adv, m), spec.policy_loss(lp, olp, adv, m)
        compare(fused, ref, 1e-10)


def test_ratio_bounds_are_the_bounds_the_loss_applies():
    """`bandpo_lut.runtime.loss.ratio_bounds` (drawn by `plot` and `demo`) against independent references: the
    float64 table reader for the band, the closed forms for the baselines, their defaults and the cap."""
    import math

    from bandpo_lut.reference.bounds import bounds as reference_bounds
    from bandpo_lut.runtime.loss import ratio_bounds

    p = torch.cat([torch.logspace(-6, 0, 2001, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    for div in ("kl", "tv", "chi2", "hellinger"):
        lo, up = ratio_bounds(p, delta=0.05, divergence=div, max_ratio=10.0)
        rlo, rup = reference_bounds(p, 0.05, div)
        torch.testing.assert_close(lo, rlo, rtol=2e-6, atol=1e-12, msg=div)
        torch.testing.assert_close(up, rup.clamp(max=10.0), rtol=2e-6, atol=0, msg=div)
    q = p[:-1]   # p > 0 (DCPO's lower bound is 0/0 at p = 0)
    lo, up = ratio_bounds(q, clip="fixed")                       # PPO's defaults 0.2 / 0.2
    assert bool((lo == 0.8).all() and (up == 1.2).all())
    lo, up = ratio_bounds(q, clip="fixed", eps_low=0.2, eps_high=0.28, max_ratio=1.1)
    assert bool((lo == 0.8).all() and (up == 1.1).all())
    lo, up = ratio_bounds(q, clip="dcpo", max_ratio=10.0)        # DCPO's defaults 0.16 / 0.2
    for i in (0, 700, 1500, 2000):
        x = float(q[i])
        assert math.isclose(float(lo[i]), 0.5 + 0.5 * math.sqrt(max(1 - 0.64 / x, 0.0)), rel_tol=1e-15)
        assert math.isclose(float(up[i]), min(10.0, 0.5 + 0.5 * math.sqrt(1 + 0.8 / x)), rel_tol=1e-15)
    with pytest.raises(ValueError, match="clip"):
        ratio_bounds(q, clip="ppo")
    for clip in ("band", "fixed", "dcpo"):
        with pytest.raises(ValueError, match="max_ratio"):
            ratio_bounds(q, clip=clip, max_ratio=0.5)


@pytest.mark.parametrize("clip,mode,agg,dual", [s for s in SETTINGS if s[2] in ("token-mean", "seq-mean-token-mean")])
def test_cpu_eager_gradient_from_the_saved_factor_is_the_recomputed_gradient_bit_for_bit(clip, mode, agg, dual):
    # float32 eager calls on the CPU keep each token's gradient factor in the forward (policy_loss_fwd_grad) and
    # scale it in the backward; the traced route recomputes everything in policy_loss_bwd. Same bits, NaN included:
    # ignored tokens hold NaN inputs, a float mask holds fractional weights, and δ varies per token.
    from bandpo_lut.runtime import loss as loss_mod
    from bandpo_lut.runtime import settings as settings_mod
    lp, olp, adv, mask = make_batch("cpu", torch.float32, seed=5)
    lp[4, :7] = float("nan")
    mask[4, :7] = False
    weights = mask.float() * torch.rand(mask.shape, generator=torch.Generator().manual_seed(2))
    delta = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) * 0.2 + 0.01
    for m, d in ((mask, 0.05), (weights, 0.05), (None, 0.05), (mask, delta)):
        options = dict(clip=clip, mode=mode, agg=agg, dual_clip=dual, delta=d)
        a = lp.clone().requires_grad_()
        loss, _ = bandpo_lut.policy_loss(a, olp, adv, m, **options)
        s = settings_mod.resolve(None, options, "test")
        lp_, olp_, adv_, m_, d_, op_args = loss_mod.op_inputs(lp, olp, adv, m, s)
        assert type(loss.grad_fn).__name__ == "_EagerLossBackward"
        n_inputs = sum(t is not None for t in (lp_, olp_, adv_, m_, d_))
        assert len(loss.grad_fn.saved_tensors) == n_inputs + 2  # the inputs, the factor, row_scale
        grad_loss = torch.tensor(1.7)
        (loss * 1.7).backward()
        _, _, row_scale = torch.ops.bandpo_lut.policy_loss_fwd(lp_, olp_, adv_, m_, d_, *op_args,
                                                               bandpo_lut.runtime.loss_spec.AGG_ID[agg])
        recomputed = torch.ops.bandpo_lut.policy_loss_bwd(grad_loss, row_scale, lp_, olp_, adv_, m_, d_, *op_args)
        assert torch.equal(a.grad.isnan(), recomputed.isnan())
        assert torch.equal(a.grad.nan_to_num(), recomputed.nan_to_num()), (a.grad - recomputed).abs().max()


def test_opcheck_forward_with_gradient_factor():
    lp, olp, adv, mask = make_batch("cpu", torch.float32, B=4, T=64, seed=7)
    prep = bandpo_lut.runtime.band.table_args("kl")
    args = (lp, olp, adv, mask.view(torch.uint8), None, 0.05, prep.coefficients, prep.grid, 0, 0,
            0.0, 0.0, 10.0, 3.0, 0, 2)
    torch.library.opcheck(torch.ops.bandpo_lut.policy_loss_fwd_grad, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_ignored_tokens_gradient_is_plus_zero_whatever_grad_loss(device, dtype):
    # The reference's rule (its torch.where passes an ignored token no gradient): +0, not grad_loss · 0, which would be
    # -0 for a negative grad_loss and NaN for an infinite or NaN one. Every route: the eager autograd (on the CPU in
    # float32 the saved factor's product), the backward op the traced route calls, and per-token δ's rows.
    from bandpo_lut.runtime import loss as loss_mod
    from bandpo_lut.runtime import settings as settings_mod
    lp, olp, adv, mask = make_batch(device, dtype, B=4, T=100, seed=9)
    weights = mask.to(dtype) * torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    delta = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(6)) * 0.2 + 0.01).to(device)
    ignored = ~mask

    def plus_zero(g):
        return bool(((g == 0) & ~torch.signbit(g)).all())

    for m, d in ((mask, 0.05), (weights, 0.05), (mask, delta)):
        for g in (-1.3, float("inf"), float("-inf"), float("nan")):
            grad_loss = torch.tensor(g, dtype=dtype, device=device)
            a = lp.clone().requires_grad_()
            bandpo_lut.policy_loss(a, olp, adv, m, delta=d)[0].backward(grad_loss)
            r = lp.clone().requires_grad_()
            spec.policy_loss(r, olp, adv, m, delta=d)[0].backward(grad_loss)
            s = settings_mod.resolve(None, dict(delta=d), "test")
            lp_, olp_, adv_, m_, d_, op_args = loss_mod.op_inputs(lp, olp, adv, m, s)
            _, _, row_scale = torch.ops.bandpo_lut.policy_loss_fwd(lp_, olp_, adv_, m_, d_, *op_args, 0)
            direct = torch.ops.bandpo_lut.policy_loss_bwd(grad_loss, row_scale, lp_, olp_, adv_, m_, d_, *op_args)
            assert plus_zero(r.grad[ignored]), "the reference"
            assert plus_zero(a.grad[ignored]), (g, a.grad[ignored])
            assert plus_zero(direct[ignored]), (g, direct[ignored])
            # the kept tokens: g times each token's factor, the same in both routes (NaN and the zero's sign included)
            assert torch.equal(a.grad.isnan(), direct.isnan())
            assert torch.equal(torch.signbit(a.grad), torch.signbit(direct))
            assert torch.equal(a.grad.nan_to_num(), direct.nan_to_num())


def test_the_factor_backward_op_names_a_bad_argument():
    factor, row_scale, g = torch.zeros(2, 3), torch.ones(2, dtype=torch.float64), torch.tensor(1.0)
    op = torch.ops.bandpo_lut.policy_loss_bwd_factor
    for args, name in (((g, row_scale.float(), factor, None), "row_scale"),
                       ((g, torch.ones(3, dtype=torch.float64), factor, None), "row_scale"),
                       ((g, row_scale, factor.half(), None), "grad_factor"),
                       ((g, row_scale, factor[0], None), "grad_factor"),
                       ((torch.ones(2), row_scale, factor, None), "grad_loss"),
                       ((g, row_scale, factor, torch.ones(2, 3, dtype=torch.int32)), "mask")):
        with pytest.raises(RuntimeError, match=f"policy_loss_bwd_factor: {name}: expected"):
            op(*args)
