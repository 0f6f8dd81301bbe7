"""The reference policy loss against a deliberately naive float64 implementation (python loops).

The naive version below is written from the loss's definition (max of the two surrogates, dual
cap, then the aggregation), not from the reference's where-chains, so the two check each other.
BandPO's bounds come from `bandpo_lut.reference.bounds` (the table reader, tested on its own), called
token by token in the naive version.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

pl = importlib.import_module("bandpo_lut.reference.policy_loss")


def chi2_closed_form(p: float, delta: float) -> tuple[float, float]:
    """χ²'s band in plain floats: |r - 1| <= sqrt(δ(1-p)/p), within the simplex [0, 1/p]."""
    if p == 0.0:
        return 0.0, math.inf
    half = math.sqrt(delta * (1.0 - p) / p)
    return max(1.0 - half, 0.0), min(1.0 + half, 1.0 / p)


def _chi2_torch(log_p_old, delta):
    p_old = torch.exp(log_p_old)
    half = torch.sqrt(delta * (1.0 - p_old) / p_old)
    return torch.clamp(1.0 - half, min=0.0), torch.minimum(1.0 + half, 1.0 / p_old)


_real_band_bounds = pl._band_bounds


def _bounds_or_chi2_stand_in(log_p_old, delta, divergence):
    """The table reader; while the χ² table is not shipped yet (FileNotFoundError), its closed
    form stands in for "chi2" only, so that these tests run during development."""
    try:
        return _real_band_bounds(log_p_old, delta, divergence)
    except FileNotFoundError:
        if divergence != "chi2":
            raise
        return _chi2_torch(log_p_old, delta)


@pytest.fixture(autouse=True)
def band_bounds(monkeypatch):
    monkeypatch.setattr(pl, "_band_bounds", _bounds_or_chi2_stand_in)
    yield


def naive_bounds(clip, log_p, *, delta, divergence, max_ratio, eps_low, eps_high):
    p = math.exp(log_p)
    if clip == "fixed":
        lo, up = 1.0 - eps_low, 1.0 + eps_high
    elif clip == "dcpo":
        lo = 0.5 + 0.5 * math.sqrt(max(1.0 - 4.0 * eps_low / p, 0.0)) if p > 0 else 0.5
        up = 0.5 + 0.5 * math.sqrt(1.0 + 4.0 * eps_high / p) if p > 0 else math.inf
    else:  # the same bounds function as the reference, one token at a time, in float64
        lo_t, up_t = pl._band_bounds(torch.tensor([log_p], dtype=torch.float64), delta, divergence)
        lo, up = float(lo_t[0]), float(up_t[0])
    if max_ratio is not None:
        up = min(up, max_ratio)
    return lo, up


def naive_policy_loss(lp, olp, adv, mask, *, delta=0.05, divergence="kl", max_ratio=None,
                      dual_clip=None, agg="token-mean", clip="band", mode="clip",
                      eps_low=None, eps_high=None):
    """Loss, d loss / d log_prob and the counts, token by token in float64."""
    if clip in pl.DEFAULT_EPS:
        eps_low = pl.DEFAULT_EPS[clip][0] if eps_low is None else eps_low
        eps_high = pl.DEFAULT_EPS[clip][1] if eps_high is None else eps_high
    B, T = lp.shape
    lp, olp, adv = lp.double().tolist(), olp.double().tolist(), adv.double().tolist()
    w = [[1.0] * T for _ in range(B)] if mask is None else mask.double().tolist()
    c = {k: 0.0 for k in pl.COUNTS}
    vals = [[0.0] * T for _ in range(B)]
    grads = [[0.0] * T for _ in range(B)]  # d(per-token loss)/d(log_prob)
    for b in range(B):
        for t in range(T):
            wt = w[b][t]
            if wt == 0:
                continue
            raw = lp[b][t] - olp[b][t]
            d = min(max(raw, -20.0), 20.0)
            r, p, a = math.exp(d), math.exp(olp[b][t]), adv[b][t]
            dl = delta if not isinstance(delta, torch.Tensor) else float(delta[b][t])
            lo, up = naive_bounds(clip, olp[b][t], delta=dl, divergence=divergence, max_ratio=max_ratio,
                                  eps_low=eps_low, eps_high=eps_high)
            unclipped = -a * r
            clipped_value = -a * min(max(r, lo), up)
            value = max(unclipped, clipped_value)
            is_clipped = clipped_value > unclipped
            is_dual = dual_clip is not None and a < 0 and value > -a * dual_clip
            if is_dual:
                value = -a * dual_clip
            keeps_grad = not (is_clipped or is_dual)
            vals[b][t] = value if mode == "clip" else unclipped
            grads[b][t] = unclipped if keeps_grad and -20.0 <= raw <= 20.0 else 0.0
            c["n_tokens"] += wt
            c["n_clipped"] += wt * is_clipped
            c["n_clipped_upper"] += wt * (is_clipped and a > 0)
            c["n_clipped_lower"] += wt * (is_clipped and a < 0)
            c["n_dual_clipped"] += wt * is_dual
            if p < 0.2 and a > 0:
                c["n_lowprob_pos"] += wt
                c["n_clipped_upper_lowprob"] += wt * is_clipped
            c["ppo_kl_sum"] += wt * -d
            if math.isfinite(up):
                c["band_width_sum"] += wt * (up - lo)
                c["n_band_finite"] += wt
            # p's bucket by explicit edge comparisons (the last one includes p = 1)
            suffix = next(s for i, (s, e0, e1) in enumerate(pl.BUCKETS)
                          if e0 <= p and (p < e1 or i == len(pl.BUCKETS) - 1))
            c[f"n_tokens_{suffix}"] += wt
            c[f"n_clipped_{suffix}"] += wt * is_clipped

    # aggregate value and gradient together: loss = sum_bt coef[b][t] * vals[b][t]
    row_w = [sum(row) for row in w]
    coef = [[0.0] * T for _ in range(B)]
    nonempty = [b for b in range(B) if row_w[b] > 0]
    for b in range(B):
        for t in range(T):
            if agg == "token-mean":
                coef[b][t] = w[b][t] / sum(row_w) if sum(row_w) > 0 else 0.0
            elif agg == "token-sum":
                coef[b][t] = w[b][t]
            elif b in nonempty:
                per_row = w[b][t] / row_w[b] if agg == "seq-mean-token-mean" else w[b][t]
                coef[b][t] = per_row / len(nonempty)
    loss = sum(coef[b][t] * vals[b][t] for b in range(B) for t in range(T))
    grad = [[coef[b][t] * grads[b][t] for t in range(T)] for b in range(B)]
    fractions = {}
    for name, (num, den) in pl.FRACTIONS.items():
        fractions[name] = c[num] / c[den] if c[den] != 0 else 0.0
    return loss, torch.tensor(grad, dtype=torch.float64), {**c, **fractions}


def make_inputs(seed, B=4, T=9, dtype=torch.float64, empty_row=True):
    """Old probabilities over many decades (plus p = 1), ratios mostly in [0.3, 3], a few log-ratios
    beyond the ±20 clamp, some zero advantages, a random mask with one empty row."""
    g = torch.Generator().manual_seed(seed)
    logit = torch.randn(B, T, generator=g, dtype=torch.float64) * 3.0
    olp = torch.nn.functional.logsigmoid(logit)
    olp[0, 0] = 0.0  # p_old = 1 (padding often looks like this)
    lp = olp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    lp[1, 1] = olp[1, 1] + 25.0  # beyond the log-ratio clamp
    lp[1, 2] = olp[1, 2] - 25.0
    lp = torch.clamp(lp, max=0.0)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[2, 3] = 0.0
    mask = torch.rand(B, T, generator=g) < 0.8
    if empty_row:
        mask[B - 1] = False
    return lp.to(dtype), olp.to(dtype), adv.to(dtype), mask


CLIP_SETTINGS = {
    "band-kl": dict(clip="band", divergence="kl"),
    "band-chi2-cap": dict(clip="band", divergence="chi2", delta=0.1, max_ratio=3.0),
    "fixed": dict(clip="fixed"),
    "clip-higher": dict(clip="fixed", eps_low=0.2, eps_high=0.28),
    "dcpo-cap": dict(clip="dcpo", max_ratio=10.0),
}


def check_against_naive(lp, olp, adv, mask, rtol, atol, **kw):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = pl.policy_loss(lp, olp, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    want_loss, want_grad, want_metrics = naive_policy_loss(lp.detach(), olp, adv, mask, **kw)
    assert loss.dim() == 0
    torch.testing.assert_close(loss.double(), torch.tensor(want_loss, dtype=torch.float64),
                               rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double(), want_grad, rtol=rtol, atol=atol)
    assert set(metrics) == set(pl.COUNTS) | set(pl.FRACTIONS)
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, name
        torch.testing.assert_close(value.double(), torch.tensor(want_metrics[name], dtype=torch.float64),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dual_clip", [None, 2.0])
@pytest.mark.parametrize("agg", pl.AGGS)
@pytest.mark.parametrize("mode", pl.MODES)
@pytest.mark.parametrize("setting", list(CLIP_SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_naive(setting, mode, agg, dual_clip, dtype):
    kw = dict(CLIP_SETTINGS[setting], mode=mode, agg=agg, dual_clip=dual_clip)
    rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (1e-5, 1e-6)
    for seed in range(3):
        lp, olp, adv, mask = make_inputs(seed, dtype=dtype)
        check_against_naive(lp, olp, adv, mask, rtol, atol, **kw)


def test_clipping_actually_happens():
    """The random inputs must exercise every branch, or the comparison above proves little."""
    totals = {k: 0.0 for k in ("n_clipped_upper", "n_clipped_lower", "n_dual_clipped")}
    for seed in range(3):
        lp, olp, adv, mask = make_inputs(seed)
        for setting in CLIP_SETTINGS.values():
            _, m = pl.policy_loss(lp, olp, adv, mask, dual_clip=2.0, **setting)
            for k in totals:
                totals[k] += float(m[k])
    assert all(v > 0 for v in totals.values()), totals


def test_no_mask_and_per_token_delta():
    lp, olp, adv, _ = make_inputs(5)
    check_against_naive(lp, olp, adv, None, 1e-10, 1e-12)
    delta = torch.rand(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    delta = 0.01 + 0.2 * delta
    check_against_naive(lp, olp, adv, None, 1e-10, 1e-12, delta=delta, divergence="chi2")


def test_nan_bounds_give_nan_loss_unless_masked():
    """A per-token delta outside the table's range makes that token's bounds NaN."""
    lp, olp, adv, mask = make_inputs(12)
    mask[:] = True
    mask[0, 1] = False
    delta = torch.full(lp.shape, 0.05, dtype=torch.float64)
    delta[0, 1] = 50.0  # ignored token: harmless
    loss, _ = pl.policy_loss(lp, olp, adv, mask, delta=delta)
    assert torch.isfinite(loss)
    delta[0, 2] = 50.0  # counted token: NaN, not silently unclipped
    loss, _ = pl.policy_loss(lp, olp, adv, mask, delta=delta)
    assert torch.isnan(loss)


def test_chi2_band_matches_closed_form():
    """An independent check of the band itself, through the loss (loosely: tables are ~1e-7)."""
    lp, olp, adv, mask = make_inputs(7)
    kw = dict(divergence="chi2", delta=0.1)
    loss, _ = pl.policy_loss(lp, olp, adv, mask, **kw)
    want = 0.0
    w = mask.double()
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        p, a = math.exp(olp[b, t]), float(adv[b, t])
        r = math.exp(min(max(float(lp[b, t] - olp[b, t]), -20), 20))
        lo, up = chi2_closed_form(p, 0.1)
        want += max(-a * r, -a * min(max(r, lo), up))
    assert abs(float(loss) - want / float(w.sum())) <= 1e-6 * (1 + abs(want))


def test_weighted_and_integer_masks():
    lp, olp, adv, mask = make_inputs(3)
    as_int = mask.to(torch.int64)
    as_float = mask.to(torch.float32)
    ref_loss, ref_m = pl.policy_loss(lp, olp, adv, mask)
    for m in (as_int, as_float, mask.to(torch.uint8)):
        loss, metrics = pl.policy_loss(lp, olp, adv, m)
        torch.testing.assert_close(loss, ref_loss)
        for k in ref_m:
            torch.testing.assert_close(metrics[k], ref_m[k])
    weights = mask.double() * torch.rand(mask.shape, dtype=torch.float64,
                                         generator=torch.Generator().manual_seed(0)) * 2
    for agg in pl.AGGS:
        check_against_naive(lp, olp, adv, weights, 1e-10, 1e-12, agg=agg)


@pytest.mark.parametrize("agg", pl.AGGS)
def test_empty_rows_and_empty_mask(agg):
    lp, olp, adv, mask = make_inputs(2)
    mask[0] = False
    lp = lp.requires_grad_(True)
    loss, m = pl.policy_loss(lp, olp, adv, mask, agg=agg)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert (g[~mask] == 0).all()
    # an all-empty mask: loss 0, zero gradient, all metrics 0, nothing NaN
    empty = torch.zeros_like(mask)
    loss, m = pl.policy_loss(lp, olp, adv, empty, agg=agg)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(loss.detach()) == 0.0 and (g == 0).all()
    assert all(float(v) == 0.0 for v in m.values())
    # zero-size inputs
    z = torch.zeros(0, 5, dtype=torch.float64, requires_grad=True)
    loss, m = pl.policy_loss(z, z.detach(), z.detach(), agg=agg)
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in m.values())


def test_garbage_in_masked_positions_is_ignored():
    lp, olp, adv, mask = make_inputs(4)
    ref = pl.policy_loss(lp, olp, adv, mask)[0]
    lp2, olp2, adv2 = lp.clone(), olp.clone(), adv.clone()
    lp2[~mask], olp2[~mask], adv2[~mask] = float("nan"), float("inf"), float("nan")
    lp2.requires_grad_(True)
    loss, m = pl.policy_loss(lp2, olp2, adv2, mask)
    (g,) = torch.autograd.grad(loss, lp2)
    torch.testing.assert_close(loss, ref)
    assert torch.isfinite(g).all() and all(torch.isfinite(v) for v in m.values())


def test_zero_old_probability():
    """p_old = 0 (old_log_prob = -inf): the band's upper bound is +inf; band_width skips it."""
    lp = torch.tensor([[-3.0, -1.0]], dtype=torch.float64, requires_grad=True)
    olp = torch.tensor([[-math.inf, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    for clip in ("band", "dcpo"):
        loss, m = pl.policy_loss(lp, olp, adv, clip=clip)
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert float(m["n_band_finite"]) == 1.0 and float(m["n_tokens"]) == 2.0
        assert float(g[0, 0]) == 0.0  # the log-ratio sits at the +20 clamp: no gradient
        # clamped log-ratio: exp(20) * A is the loss of the first token
        assert math.isclose(-2 * float(loss), math.exp(20.0) + 1.0, rel_tol=1e-12)


def test_bfloat16_inputs():
    lp, olp, adv, mask = make_inputs(6, dtype=torch.bfloat16)
    lp = lp.requires_grad_(True)
    for setting in CLIP_SETTINGS.values():
        loss, m = pl.policy_loss(lp, olp, adv, mask, **setting)
        (g,) = torch.autograd.grad(loss, lp)
        assert loss.dtype == torch.float32 and g.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for v in m.values())
        lp32 = lp.detach().float().requires_grad_(True)
        loss32, m32 = pl.policy_loss(lp32, olp.float(), adv.float(), mask, **setting)
        (g32,) = torch.autograd.grad(loss32, lp32)
        torch.testing.assert_close(loss, loss32)
        torch.testing.assert_close(g, g32.to(torch.bfloat16))
        for k in m:
            torch.testing.assert_close(m[k], m32[k])


def test_gradient_reaches_log_prob_only():
    lp, olp, adv, mask = make_inputs(1)
    lp, olp, adv = (x.requires_grad_(True) for x in (lp, olp, adv))
    loss, m = pl.policy_loss(lp, olp, adv, mask, dual_clip=3.0)
    g_lp, g_olp, g_adv = torch.autograd.grad(loss, (lp, olp, adv), allow_unused=True)
    assert g_lp is not None and g_olp is None and g_adv is None
    assert all(not v.requires_grad for v in m.values())


def test_mask_mode_same_gradient_unclipped_value():
    lp, olp, adv, mask = make_inputs(8)
    lp = lp.requires_grad_(True)
    l_clip, _ = pl.policy_loss(lp, olp, adv, mask, mode="clip", dual_clip=2.0)
    l_mask, m = pl.policy_loss(lp, olp, adv, mask, mode="mask", dual_clip=2.0)
    g_clip, = torch.autograd.grad(l_clip, lp)
    g_mask, = torch.autograd.grad(l_mask, lp)
    torch.testing.assert_close(g_clip, g_mask, rtol=0, atol=0)
    ratio = torch.exp(torch.clamp(lp - olp, -20, 20))
    unclipped = ((-adv * ratio) * mask).sum() / mask.sum()
    torch.testing.assert_close(l_mask, unclipped)
    assert float(m["clip_frac"]) > 0  # something was clipped, so the values differ
    assert float(l_mask) != float(l_clip)


def test_fixed_and_dcpo_bounds_spot_values():
    p = torch.tensor([1e-3, 0.1, 0.5, 1.0], dtype=torch.float64)
    lo, up = pl.ratio_bounds(p.log(), clip="fixed", eps_low=0.2, eps_high=0.28)
    assert torch.allclose(lo, torch.full_like(p, 0.8)) and torch.allclose(up, torch.full_like(p, 1.28))
    lo, up = pl.ratio_bounds(p.log(), clip="dcpo", eps_low=0.16, eps_high=0.2, max_ratio=10.0)
    # p = 0.5: lo = 0.5 + 0.5*sqrt(1 - 1.28) -> 0.5 ; up = 0.5 + 0.5*sqrt(2.6)
    assert float(lo[2]) == 0.5 and math.isclose(float(up[2]), 0.5 + 0.5 * math.sqrt(2.6))
    assert math.isclose(float(lo[3]), 0.8) and math.isclose(float(up[3]), 0.5 + 0.5 * math.sqrt(1.8))
    assert float(up[0]) == 10.0  # capped


def test_counts_add_up_over_micro_batches():
    """Summing counts over pieces, then metrics_from_counts, gives the whole batch's fractions."""
    lp, olp, adv, mask = make_inputs(9, B=6, T=11)
    _, whole = pl.policy_loss(lp, olp, adv, mask, dual_clip=2.0, clip="fixed")
    parts = [pl.policy_loss(lp[i:i + 2], olp[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                            dual_clip=2.0, clip="fixed")[1] for i in range(0, 6, 2)]
    summed = {k: sum(p[k] for p in parts) for k in pl.COUNTS}
    merged = pl.metrics_from_counts(summed)
    for k in whole:
        torch.testing.assert_close(merged[k], whole[k])


BAD = [
    (dict(log_prob=[[0.0]]), TypeError, "log_prob must be a torch.Tensor"),
    (dict(log_prob=torch.zeros(3)), ValueError, "log_prob must have shape"),
    (dict(log_prob=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "log_prob must have a floating"),
    (dict(old_log_prob=torch.zeros(2, 4)), ValueError, "old_log_prob has shape"),
    (dict(advantages=torch.zeros(2, 1)), ValueError, "advantages has shape"),
    (dict(mask=torch.zeros(3, 3, dtype=torch.bool)), ValueError, "mask has shape"),
    (dict(mask=torch.zeros(2, 3, dtype=torch.complex64)), TypeError, "mask must be bool"),
    (dict(agg="mean"), ValueError, "agg='mean' is not one of"),
    (dict(clip="ppo"), ValueError, "clip='ppo' is not one of"),
    (dict(mode="drop"), ValueError, "mode='drop' is not one of"),
    (dict(dual_clip=1.0), ValueError, "dual_clip must be"),
    (dict(dual_clip=0.5), ValueError, "dual_clip must be"),
    (dict(max_ratio=0.9), ValueError, "max_ratio must be"),
    (dict(delta=0.0), ValueError, "delta must be"),
    (dict(delta=-1.0), ValueError, "delta must be"),
    (dict(eps_low=0.2), ValueError, "eps_low applies to clip='fixed' or 'dcpo' only"),
    (dict(clip="fixed", eps_low=1.5), ValueError, "eps_low must be"),
    (dict(clip="fixed", eps_high=-0.1), ValueError, "eps_high must be"),
    (dict(clip="dcpo", eps_low=0.0), ValueError, "eps_low must be"),
    (dict(clip="dcpo", eps_high=math.inf), ValueError, "eps_high must be"),
]


@pytest.mark.parametrize("kw,exc,match", BAD, ids=[b[2] for b in BAD])
def test_bad_inputs(kw, exc, match):
    args = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3),
                advantages=torch.zeros(2, 3))
    for k in ("log_prob", "old_log_prob", "advantages"):
        if k in kw:
            args[k] = kw.pop(k)
    with pytest.raises(exc, match=match):
        pl.policy_loss(args["log_prob"], args["old_log_prob"], args["advantages"], **kw)


def _compiled_matches_eager(backend, settings):
    lp, olp, adv, mask = make_inputs(11, dtype=torch.float32)

    def run(loss_fn):  # forward compiled (or not), backward through autograd outside
        x = lp.clone().requires_grad_(True)
        loss, metrics = loss_fn(x, olp, adv, mask)
        (g,) = torch.autograd.grad(loss, x)
        return loss, g, metrics

    for kw in settings:
        torch._dynamo.reset()

        def eager(a, b, c, d, kw=kw):
            return pl.policy_loss(a, b, c, d, **kw)

        want = run(eager)
        got = run(torch.compile(eager, fullgraph=True, backend=backend))
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        for k in want[2]:
            torch.testing.assert_close(got[2][k], want[2][k], msg=lambda m: f"{k}: {m}")


COMPILE_SETTINGS = [dict(setting, mode=mode, agg=agg, dual_clip=2.0)
                    for setting, mode, agg in zip(CLIP_SETTINGS.values(), pl.MODES * 3, pl.AGGS * 2)]


@pytest.fixture
def traceable_band(monkeypatch):
    """The policy loss's own code under torch.compile, with a pure-tensor band (χ²'s closed form):
    the reference table reader is not meant to be traced (the compiled ops are: tests/runtime/test_loss.py)."""
    monkeypatch.setattr(pl, "_band_bounds", lambda lp, delta, divergence: _chi2_torch(lp, delta))


@pytest.mark.slow
def test_torch_compile_fullgraph_aot_eager(traceable_band):
    _compiled_matches_eager("aot_eager", COMPILE_SETTINGS)


@pytest.mark.slow
def test_torch_compile_fullgraph_inductor(traceable_band):
    _compiled_matches_eager("inductor", [dict(clip="band", agg="seq-mean-token-mean", dual_clip=3.0),
                                         dict(clip="dcpo", mode="mask", max_ratio=10.0)])
