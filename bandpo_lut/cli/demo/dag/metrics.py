"""Exact metrics of a dag-paths policy from its probability of every answer (no sampling).

For one prompt with valid set V, p_y the model's probability of answer y and q = p restricted to V, renormalised:
  pass@1            sum_{y in V} p_y
  entropy           H(q) / log |V|   (1: uniform over the valid paths; 0: one path)
  coverage          E[# distinct valid paths among N samples] / |V| = mean_{y in V} (1 - (1 - p_y)^N)
  paths >= 5%       # {y in V : q_y >= 0.05}
  non-canonical     sum_{y in V, y != canonical} p_y (a collapse onto one non-canonical path raises it too)
Each is averaged over the prompts."""
from __future__ import annotations

import torch

COVERAGE_SAMPLES = 64
SHARE = 0.05
NAMES = ("pass1", "entropy", "coverage", "paths5", "noncanonical")


def exact_metrics(logp: torch.Tensor, valid: torch.Tensor, canonical: torch.Tensor,
                  samples: int = COVERAGE_SAMPLES) -> dict:
    """NAMES, each a 0-dim float64 tensor, from log pi(answer | prompt) (P, A), the valid sets (P, A) and the
    canonical answers (P,)."""
    logp = logp.double()
    p = logp.exp() * valid
    pass1 = p.sum(1)
    q = p / pass1[:, None]
    # 0 log 0 = 0: invalid answers and valid ones with q = 0 contribute nothing
    plogq = torch.where(q > 0, q * torch.log(q.clamp(min=1e-300)), torch.zeros_like(q))
    n_valid = valid.sum(1).double()
    entropy = -plogq.sum(1) / torch.log(n_valid)
    seen = torch.where(valid, -torch.expm1(samples * torch.log1p(-p.clamp(max=1.0))), torch.zeros_like(p))
    coverage = seen.sum(1) / n_valid
    paths5 = ((q >= SHARE) & valid).sum(1).double()
    canon = torch.gather(p, 1, canonical[:, None])[:, 0]
    return {"pass1": pass1.mean(), "entropy": entropy.mean(), "coverage": coverage.mean(),
            "paths5": paths5.mean(), "noncanonical": (pass1 - canon).mean()}


def sequence_kl(logp_old: torch.Tensor, logp_new: torch.Tensor) -> torch.Tensor:
    """KL(pi_old || pi_new) over whole answers, averaged over prompts (rows), exactly: (P, A) log-probs in."""
    lo, ln = logp_old.double(), logp_new.double()
    return (lo.exp() * (lo - ln)).sum(1).mean()
