"""DPPO's binary policy loss (arXiv 2602.04879, "DPPO-Binary-KL / -TV"), in plain PyTorch, as verl 0.9.1 applies it
(`loss_mode=dppo_kl` / `dppo_tv`); written from the formulas, for the demo's DPPO row, the `--dppo` overlay of
`bandpo-lut plot` and the comparison in docs/dppo.md. Not used by any trainer integration.

Per token, with μ = π_old(token) = exp(old_log_prob), π = exp(log_prob), A the advantage:

    binary divergence   kl: D = μ·log(μ/π) + (1-μ)·log((1-μ+1e-8)/(1-π+1e-8))      (KL(old ‖ new), binary)
                        tv: D = π - μ                                              (signed; |π - μ| is binary TV)
    valid (A > 0)       kl: D ≤ δ_high or π ≤ μ          tv: π - μ ≤ δ_high
    valid (A ≤ 0)       kl: D ≤ δ_low  or π ≥ μ          tv: π - μ ≥ -δ_low
    w                   = min(exp(clamp(log π - log μ, -20, 20)), tis_cap), detached  (truncated IS weight)
    loss                = -A · w · log π · valid

So the gradient of a valid token is -A·w·∇log π, which is the gradient of -A·r while r ≤ tis_cap, and an invalid
token (outside the region in the direction its advantage pushes) contributes nothing. The 1e-8 is verl's, kept so
that this is verl's region near μ = 1 too. verl takes δ_low/δ_high from the actor's clip_ratio_low/high (default
0.2) and tis_cap from clip_ratio_c (the ActorConfig default is 3.0; the loss's own fallback, 20, applies only to
a config without that field).
"""
from __future__ import annotations

import math

import torch

from bandpo_lut.runtime.loss_spec import LOG_RATIO_CLAMP, LOWPROB

DIVERGENCES = ("kl", "tv")
_EPS = 1e-8  # verl's guard in log((1-μ+ε)/(1-π+ε))


def binary_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """KL(Bern(μ) ‖ Bern(π)) with verl's 1e-8 guard on the complementary term."""
    mu, pi = torch.exp(old_log_prob), torch.exp(log_prob)
    return mu * (old_log_prob - log_prob) + (1 - mu) * torch.log((1 - mu + _EPS) / (1 - pi + _EPS))


def valid_mask(log_prob, old_log_prob, advantages, *, divergence="kl", delta_low=0.05, delta_high=0.05):
    """Tokens that keep their gradient: inside the region, or outside it on the side the advantage does not push."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: DPPO's binary losses are {DIVERGENCES}, got {divergence!r}")
    pi, mu = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "kl":
        d = binary_kl(old_log_prob, log_prob)
        up_ok, down_ok = (d <= delta_high) | (pi <= mu), (d <= delta_low) | (pi >= mu)
    else:
        up_ok, down_ok = (pi - mu) <= delta_high, (pi - mu) >= -delta_low
    return torch.where(advantages > 0, up_ok, down_ok)


def dppo_loss(log_prob, old_log_prob, advantages, mask=None, *, divergence="kl", delta=0.05, delta_low=None,
              delta_high=None, tis_cap=20.0):
    """DPPO's token-mean loss and counts named as `bandpo_lut.policy_loss`'s (a masked token counts as clipped:
    n_clipped_upper for A > 0, n_clipped_lower for A < 0; n_dual_clipped is 0, DPPO having no dual clip;
    n_truncated: valid tokens whose IS weight was truncated at tis_cap). Computed in float64."""
    if not (isinstance(tis_cap, (int, float)) and tis_cap > 0):
        raise ValueError(f"tis_cap: expected a positive number, got {tis_cap!r}")
    d_lo = delta if delta_low is None else delta_low
    d_hi = delta if delta_high is None else delta_high
    lp = log_prob.to(torch.float64)
    olp = old_log_prob.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    w = torch.ones_like(lp) if mask is None else mask.detach().to(torch.float64)
    with torch.no_grad():
        ratio = torch.exp(torch.clamp(lp - olp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        valid = valid_mask(lp, olp, adv, divergence=divergence, delta_low=d_lo, delta_high=d_hi)
        weight = torch.clamp(ratio, max=float(tis_cap)) * valid
    per_token = -adv * weight * lp
    loss = (w * per_token).sum() / w.sum().clamp(min=1.0)
    pos, neg, masked = adv > 0, adv < 0, ~valid
    lowprob_pos = (torch.exp(olp) < LOWPROB) & pos

    def count(sel):
        return torch.where(sel, w, torch.zeros_like(w)).sum()

    counts = {"n_tokens": w.sum(), "n_clipped": count(masked & (pos | neg)),
              "n_clipped_upper": count(masked & pos), "n_clipped_lower": count(masked & neg),
              "n_dual_clipped": torch.zeros((), dtype=torch.float64), "n_lowprob_pos": count(lowprob_pos),
              "n_clipped_upper_lowprob": count(masked & lowprob_pos), "n_truncated": count(valid & (ratio > tis_cap))}
    return loss, counts


@torch.no_grad()
def ratio_region(p_old: torch.Tensor, *, divergence="kl", delta=0.05, iters=200):
    """DPPO's region as ratio bounds [lo, up] at old probability p_old (float64): the ratios r = π/μ whose token
    `valid_mask` keeps (up for A > 0, lo for A < 0). tv: [max(0, 1 - δ/μ), min(1/μ, 1 + δ/μ)]; kl: the two roots of
    the binary KL (with verl's guard) = δ, by bisection in log r (no table involved, so the plot's overlay is
    an independent computation of the region)."""
    mu = p_old.to(torch.float64)
    if divergence == "tv":
        return torch.clamp(1 - delta / mu, min=0.0), torch.minimum(1 / mu, 1 + delta / mu)
    if divergence != "kl":
        raise ValueError(f"divergence: DPPO's binary losses are {DIVERGENCES}, got {divergence!r}")
    log_mu = torch.log(mu)

    def excess(log_r):
        return binary_kl(log_mu, log_mu + log_r) - delta

    # upper root in log r ∈ [0, -log μ] (π ≤ 1); at π = 1 the guard keeps D finite, so the whole edge may fit
    a, b = torch.zeros_like(mu), -log_mu
    whole_up = excess(b) <= 0
    for _ in range(iters):
        m = (a + b) / 2
        inside = excess(m) <= 0
        a, b = torch.where(inside, m, a), torch.where(inside, b, m)
    up = torch.where(whole_up, 1 / mu, torch.exp(a))
    # lower root in log r ∈ [log(1e-300), 0]: D → ∞ as π → 0 (μ > 0), so a root always exists
    a, b = torch.full_like(mu, math.log(1e-300)), torch.zeros_like(mu)
    for _ in range(iters):
        m = (a + b) / 2
        inside = excess(m) <= 0
        a, b = torch.where(inside, a, m), torch.where(inside, m, b)
    lo = torch.exp(b)
    return lo, up
