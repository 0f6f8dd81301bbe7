"""BandPO next to DPPO (docs/dppo.md): `policy_loss(mode="mask")` against verl 0.9.1's own `dppo_kl` / `dppo_tv`
losses, and the plain-PyTorch DPPO of `bandpo_lut.reference.dppo` (the demo's DPPO row, the plot's overlay)
against the same verl functions.

The mapping checked: verl `loss_mode=dppo_kl|dppo_tv` with `clip_ratio_low = clip_ratio_high = δ` is
`policy_loss(clip="band", divergence="kl"|"tv", delta=δ, mode="mask", max_ratio=None, dual_clip=None)`; unequal
clip_ratio_low/high are a per-token δ tensor, δ_high where A > 0 and δ_low elsewhere. Equal gradients on every token
whose ratio is at most verl's clip_ratio_c, whose |log-ratio| is at most 20 and which is not within rounding of
the region's edge; the differences by design are asserted on constructed tokens.

A missing verl is an error, not a skip (CI installs it); BANDPO_SKIP_INTEGRATIONS=1 skips this module.
"""
from __future__ import annotations

import math
import os

import pytest

if os.environ.get("BANDPO_SKIP_INTEGRATIONS") == "1":
    pytest.skip("BANDPO_SKIP_INTEGRATIONS=1", allow_module_level=True)

import torch  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

import bandpo_lut  # noqa: E402
from bandpo_lut.reference import dppo  # noqa: E402
from bandpo_lut.reference.bounds import bounds as reference_bounds  # noqa: E402

pytestmark = pytest.mark.integration


def verl_config(delta_low, delta_high, clip_ratio_c=20.0):
    return FSDPActorConfig(strategy="fsdp", clip_ratio=delta_high, clip_ratio_low=delta_low,
                           clip_ratio_high=delta_high, clip_ratio_c=clip_ratio_c, ppo_micro_batch_size_per_gpu=2,
                           rollout_n=1)


def verl_loss(divergence, old, new, adv, cfg):
    """verl's dppo_<divergence> loss (token-mean over all tokens), its gradient and its metrics."""
    lp = new.clone().requires_grad_(True)
    fn = core_algos.get_policy_loss_fn(f"dppo_{divergence}")
    loss, metrics = fn(old, lp, adv, torch.ones_like(adv), "token-mean", cfg)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def band_mask_loss(old, new, adv, **kw):
    lp = new.clone().requires_grad_(True)
    loss, metrics = bandpo_lut.policy_loss(lp, old, adv, clip="band", mode="mask", **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def tokens(seed, n=4000, spread=1.0):
    """float64 tokens over p_old ∈ [1e-4, 1), log-ratios ~ N(0, spread²), A ~ N(0, 1) (never 0)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(10 ** (-4 * torch.rand(n, generator=g, dtype=torch.float64)))
    new = (old + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return old.view(40, -1), new.view(40, -1), adv.view(40, -1)


def away_from_edges(old, new, adv, divergence, d_lo, d_hi, cap):
    """Keep the tokens both losses define alike: ratio ≤ cap (verl truncates its IS weight above), and the ratio not
    within 1e-5 (relative) of the region's edge on its advantage's side (the shipped KL table is accurate to about
    5e-7 relative, docs/performance.md; rounding decides the side within that)."""
    r = (new - old).exp()
    p = old.exp()
    lo, _ = dppo.ratio_region(p, divergence=divergence, delta=d_lo)
    _, up = dppo.ratio_region(p, divergence=divergence, delta=d_hi)
    edge = torch.where(adv > 0, up, lo)
    keep = ((r / edge - 1).abs() > 1e-5) & (r <= cap)
    return torch.where(keep, new, old)      # a dropped token becomes ratio 1: defined alike, in both regions


def rel_err(x, ref):
    """|x - ref| / (ref·(1 + |ln ref|)): the tables' accuracy measure (docs/performance.md)."""
    return ((x - ref).abs() / (ref * (1 + ref.log().abs()))).max()


@pytest.mark.parametrize("divergence", ["kl", "tv"])
@pytest.mark.parametrize("delta", [0.05, 0.2])
def test_mask_mode_has_verls_dppo_gradient(divergence, delta):
    """mode="mask" with the band of the same divergence and δ = verl's clip_ratio: verl's gradient on every token,
    the same masked-token fraction, and the loss values differ (verl's surrogate is -A·w·log π, ours -A·r)."""
    old, new, adv = tokens(1)
    new = away_from_edges(old, new, adv, divergence, delta, delta, 20.0)
    want, want_grad, want_m = verl_loss(divergence, old, new, adv, verl_config(delta, delta))
    loss, grad, m = band_mask_loss(old, new, adv, divergence=divergence, delta=delta)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-15)
    assert want_m["actor/pg_clipfrac"] == pytest.approx(float(m["clip_frac"]), abs=1e-12)
    assert 0.02 < float(m["clip_frac"]) < 0.6                                  # both sides of the edge are there
    assert float(m["n_clipped_upper"]) > 0 and float(m["n_clipped_lower"]) > 0
    assert not torch.isclose(loss, want, rtol=1e-3)                             # values differ by design
    lp = new.clone().requires_grad_(True)                                       # clip mode: the same gradient
    (clip_grad,) = torch.autograd.grad(bandpo_lut.policy_loss(lp, old, adv, divergence=divergence, delta=delta)[0], lp)
    torch.testing.assert_close(clip_grad, want_grad, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(loss, (-adv * (new - old).exp()).mean())         # ours: the PPO surrogate


@pytest.mark.parametrize("divergence", ["kl", "tv"])
def test_unequal_clip_ratio_low_high_is_a_per_token_delta(divergence):
    """verl's clip_ratio_low ≠ clip_ratio_high: the band reads δ_high for A > 0 and δ_low otherwise (only the upper
    bound acts on A > 0 tokens and only the lower one on A < 0 tokens)."""
    d_lo, d_hi = 0.03, 0.12
    old, new, adv = tokens(2)
    new = away_from_edges(old, new, adv, divergence, d_lo, d_hi, 20.0)
    _, want_grad, want_m = verl_loss(divergence, old, new, adv, verl_config(d_lo, d_hi))
    per_token = torch.where(adv > 0, torch.full_like(adv, d_hi), torch.full_like(adv, d_lo))
    _, grad, m = band_mask_loss(old, new, adv, divergence=divergence, delta=per_token)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-15)
    assert want_m["actor/pg_clipfrac"] == pytest.approx(float(m["clip_frac"]), abs=1e-12)
    # and a single δ cannot do it: either side then masks different tokens
    _, grad_one, _ = band_mask_loss(old, new, adv, divergence=divergence, delta=d_hi)
    assert not torch.allclose(grad_one, want_grad)


def _one_token(p_old, ratio, adv):
    old = torch.tensor([[math.log(p_old)]], dtype=torch.float64)
    return old, old + math.log(ratio), torch.tensor([[adv]], dtype=torch.float64)


def test_where_they_differ_by_design():
    """Constructed tokens, each inside DPPO-KL's region at δ = 0.05 (so verl keeps its gradient):
    (a) A > 0, p_old = 1e-3, r = 15: inside (the region's upper bound there is ~40), above the paper's cap 10:
        BandPO with max_ratio=10 stops it, DPPO keeps -A·r·∇log π;
    (b) A < 0, p_old = 0.01, r = 30: DPPO truncates the IS weight at clip_ratio_c = 20 (gradient -A·20); BandPO
        without dual clip keeps -A·30, with dual_clip=10 (the paper's) stops it;
    (c) A > 0, |log-ratio| = 25: BandPO's log-ratio clamp at 20 stops the gradient, DPPO keeps -A·e^-20 (its clamp
        acts on the IS weight only)."""
    cfg = verl_config(0.05, 0.05)
    old, new, adv = _one_token(1e-3, 15.0, 1.0)
    lo, up = reference_bounds(log_p_old=old, delta=0.05, divergence="kl")
    assert 20 < float(up) < 100
    _, g_verl, _ = verl_loss("kl", old, new, adv, cfg)
    _, g_band, _ = band_mask_loss(old, new, adv, divergence="kl", delta=0.05, max_ratio=10.0)
    _, g_uncapped, _ = band_mask_loss(old, new, adv, divergence="kl", delta=0.05)
    assert float(g_verl) == pytest.approx(-15.0, rel=1e-12) and float(g_band) == 0.0
    assert float(g_uncapped) == pytest.approx(-15.0, rel=1e-12)

    old, new, adv = _one_token(0.01, 30.0, -1.0)
    _, g_verl, _ = verl_loss("kl", old, new, adv, cfg)
    _, g_band, _ = band_mask_loss(old, new, adv, divergence="kl", delta=0.05)
    _, g_dual, m = band_mask_loss(old, new, adv, divergence="kl", delta=0.05, dual_clip=10.0)
    assert float(g_verl) == pytest.approx(20.0, rel=1e-12)
    assert float(g_band) == pytest.approx(30.0, rel=1e-12)
    assert float(g_dual) == 0.0 and float(m["n_dual_clipped"]) == 1

    old, new, adv = _one_token(0.5, math.exp(-25.0), 1.0)
    _, g_verl, _ = verl_loss("kl", old, new, adv, cfg)
    _, g_band, _ = band_mask_loss(old, new, adv, divergence="kl", delta=0.05)
    assert float(g_verl) == pytest.approx(-math.exp(-20.0), rel=1e-12) and float(g_band) == 0.0


@pytest.mark.parametrize("divergence", ["kl", "tv"])
@pytest.mark.parametrize("deltas,cap", [((0.05, 0.05), 20.0), ((0.03, 0.12), 3.0)], ids=["symmetric", "asym-cap3"])
def test_reference_dppo_is_verls(divergence, deltas, cap):
    """The demo's DPPO (bandpo_lut.reference.dppo.dppo_loss) is verl's: the same loss value, gradient and
    masked fraction, with IS-weight truncation acting (cap 3, verl's ActorConfig default)."""
    d_lo, d_hi = deltas
    old, new, adv = tokens(3)
    new = away_from_edges(old, new, adv, divergence, d_lo, d_hi, math.inf)
    want, want_grad, want_m = verl_loss(divergence, old, new, adv, verl_config(d_lo, d_hi, cap))
    lp = new.clone().requires_grad_(True)
    loss, counts = dppo.dppo_loss(lp, old, adv, divergence=divergence, delta_low=d_lo, delta_high=d_hi, tis_cap=cap)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert want_m["actor/pg_clipfrac"] == pytest.approx(float(counts["n_clipped"] / counts["n_tokens"]), abs=1e-12)
    assert float(counts["n_truncated"]) > 0


@pytest.mark.parametrize("divergence", ["kl", "tv"])
@pytest.mark.parametrize("delta", [0.05, 0.2])
def test_dppo_region_is_the_band(divergence, delta):
    """DPPO's region, solved from verl's binary divergence by bisection (no table), is BandPO's uncapped band read
    from the shipped table; and verl's own mask flips at it: a token just inside keeps its gradient, just outside
    not."""
    p = torch.logspace(-4, math.log10(0.999), 300, dtype=torch.float64)
    lo, up = dppo.ratio_region(p, divergence=divergence, delta=delta)
    b_lo, b_up = reference_bounds(p, delta=delta, divergence=divergence)
    # tv: lo = 0 where 1 - δ/μ < 0; kl: lo underflows (exp(-δ/μ·...)), and the bisection stops at 1e-300
    pos = b_lo > 1e-250
    assert rel_err(up, b_up) < 1e-6 and rel_err(lo[pos], b_lo[pos]) < 1e-6  # the table's accuracy (kl); tv: exact
    assert (lo[~pos] <= 1e-250).all() and (b_lo[~pos] <= 1e-250).all()
    cfg = verl_config(delta, delta)
    interior = (up < 1 / p * (1 - 1e-5)) & (lo > 1e-6)              # an edge that is not the simplex's
    for bound, adv_sign, outward in ((up, 1.0, 1 + 1e-5), (lo, -1.0, 1 - 1e-5)):
        old = torch.log(p[interior])[None]
        adv = torch.full_like(old, adv_sign)
        for factor, masked in ((2 - outward, False), (outward, True)):
            new = old + torch.log(bound[interior] * factor)[None]
            _, _, m = verl_loss(divergence, old, new, adv, cfg)
            # verl's masked_mean divides by count + 1e-8
            assert m["actor/pg_clipfrac"] == pytest.approx(1.0 if masked else 0.0, abs=1e-6), (divergence, factor)


def test_plot_with_the_dppo_overlay(tmp_path, capsys):
    """`bandpo-lut plot --dppo` (the command of docs/dppo.md's figure) runs; a divergence DPPO lacks (chi2) is drawn
    without an overlay rather than refused."""
    from bandpo_lut.cli import main

    out = tmp_path / "dppo.png"
    assert main(["plot", "--divergences", "kl,tv,chi2", "--deltas", "0.05", "--max-ratio", "10", "--dppo",
                 "--no-baselines", "--p-min", "1e-3", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "written to" in capsys.readouterr().out
