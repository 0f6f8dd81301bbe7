"""`bandpo-lut demo`'s tabular tasks: a softmax policy (one row of logits per context, initial logits
N(0, init_scale^2), so each row is peaked on a few tokens), GRPO groups with group-normalised advantages given to
every token of a response, and `epochs x minibatches` Adam updates per batch, so the ratio pi/pi_old moves away
from 1 and the clip matters (`--optimizer sgd`: plain gradient steps, under which an unclipped update moves each
logit by its own gradient only; Adam rescales every logit's step, also those of tokens that were never sampled).
The report is `report`.

  * rewarded (the default): in each context a handful of "good" tokens that start with low probability (drawn
    from the initial ranks `--good-ranks`); a response's reward is the fraction of good tokens in it. Its methods
    (REWARDED_METHODS): canonical PPO clipping (0.2), clip-higher (0.2 / 0.28), DCPO, BandPO (KL, delta 0.05) and
    DPPO. What it showed when written (defaults, 5 seeds): canonical clipping stops about 5% of the upward moves
    of low-probability tokens with a positive advantage (clip-higher about 2%), BandPO and DCPO almost none (their
    upper bound is far above 1.2 for p_old < 0.5), which is the paper's mechanism; they reach the reward a few
    steps sooner and lose entropy sooner: plotted against the reward, entropy is the same curve for all methods.
    This toy does not show BandPO preserving entropy.
  * random-reward (arXiv 2509.26114): each response's reward is a fair coin, drawn independently of
    its tokens. The expected policy gradient is zero, so an unclipped policy gradient only diffuses;
    a clip that stops upward moves (ratio > up, A > 0) of rare tokens more often than downward ones
    (ratio < lo, A < 0) takes probability from the rare tokens and lowers the entropy.
  * rare-correct (arXiv 2505.22617, entropy change ~ -Cov(log pi, A)): the correct answers of a
    context are its initially most likely token and `--good` rare tokens (initial ranks
    `--good-ranks`), all rewarded equally (reward = fraction of correct tokens in the response). The
    policy can reach full reward on the common token alone; whether the rare correct answers keep up
    depends on how far their ratios may rise.

Methods of the last two (METHODS), all through `bandpo_lut.policy_loss` on the same seeds (same initial policy, same
sampling and reward streams): "no-clip" is the unclipped surrogate -A*r, expressed as clip="fixed" with
eps_low = 1 (lower bound 0, which a ratio never goes below) and an eps_high whose bound 1 + eps_high
lies above exp(20), the largest ratio the loss forms (it clamps |log ratio| at 20); then PPO's clip,
clip-higher, DCPO, and BandPO with the paper's settings (kl, delta 0.05, max_ratio 10, dual clip 10). "dppo" is
DPPO-Binary-KL as verl's `dppo_kl` applies it (`bandpo_lut.reference.dppo`, held to verl's own loss by
tests/integrations/test_dppo.py): the same KL region at delta 0.05, no cap, no dual clip, the IS weight truncated at 20
(docs/dppo.md says why it is not `policy_loss(mode="mask")`).

What they showed when written (docs/demo.md, 5 seeds x 200 steps): PPO's clip binds more on the rare
tokens' upward moves than on their downward ones (random-reward: 6.6% against 4.6%), BandPO and DCPO
almost never clip and follow the unclipped reference; but that reference itself loses entropy (the
logits random-walk), every clip slows the loss, and BandPO preserves neither entropy nor, on
rare-correct, the rare correct answers' mass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bandpo_lut.reference import dppo
from bandpo_lut.runtime.loss import policy_loss, ratio_bounds

NO_CLIP = dict(clip="fixed", eps_low=1.0, eps_high=1e9)   # bounds [0, 1e9 + 1] contain every ratio
METHODS = {
    "no-clip": NO_CLIP,
    "ppo-clip": dict(clip="fixed", eps_low=0.2, eps_high=0.2),
    "clip-higher": dict(clip="fixed", eps_low=0.2, eps_high=0.28),
    "dcpo": dict(clip="dcpo", eps_low=0.16, eps_high=0.2),
    "bandpo": dict(clip="band", divergence="kl", delta=0.05, dual_clip=10.0),
    "dppo": dict(dppo=True, divergence="kl", delta=0.05, tis_cap=20.0),
}
# DPPO's settings (verl dppo_kl: clip_ratio 0.05 = BandPO's delta, clip_ratio_c 20, the loss's own fallback and
# on the large side the DPPO paper recommends; verl's ActorConfig default would be 3).
DPPO = METHODS["dppo"]
# The default task's methods: no no-clip reference, and BandPO without the dual clip (as its figure was made).
REWARDED_METHODS = {
    "ppo-clip": METHODS["ppo-clip"],
    "clip-higher": METHODS["clip-higher"],
    "dcpo": METHODS["dcpo"],
    "bandpo": dict(clip="band", divergence="kl", delta=0.05),
    "dppo": DPPO,
}
TASKS = ("rewarded", "random-reward", "rare-correct")

# Old-probability buckets of the clip rates: [0, .01), [.01, .1), [.1, .5), [.5, 1].
P_EDGES = (0.01, 0.1, 0.5)
P_BUCKETS = ("p<0.01", "0.01-0.1", "0.1-0.5", "p>=0.5")

# Per-step counts, summed over the step's updates; each bucketed one has a last dimension of len(P_BUCKETS).
#   pos/neg: tokens with A > 0 / A < 0; high: A > 0 and ratio > up; low: A < 0 and ratio < lo.
BUCKETED = ("n_pos", "n_neg", "n_high", "n_low")
# The loss's own counts, kept to check the split above (their sums over buckets must agree) and for the default
# task's rates (n_clipped / n_tokens; low-probability clip-high: n_clipped_upper_lowprob / n_lowprob_pos).
FROM_LOSS = ("n_tokens", "n_clipped", "n_clipped_upper", "n_clipped_lower", "n_dual_clipped", "n_lowprob_pos",
             "n_clipped_upper_lowprob")


@dataclass
class Config:
    """The sizes and optimiser of a demo run, every task's (`bandpo-lut demo --help` says what each is)."""
    steps: int
    contexts: int
    vocab: int
    good: int
    good_ranks: tuple[int, int]
    tokens: int
    group: int
    epochs: int
    minibatches: int
    lr: float
    init_scale: float
    max_ratio: float | None


@dataclass
class TaskConfig(Config):
    """A run of one tabular task (rewarded, random-reward, rare-correct): the common sizes, the task and its
    optimiser."""
    task: str
    optimizer: str = "adam"


def task_methods(task: str) -> dict:
    """The methods a tabular task compares: name -> policy_loss (or DPPO) keyword arguments."""
    return REWARDED_METHODS if task == "rewarded" else METHODS


def method_kwargs(method: str, cfg: TaskConfig) -> dict:
    """Keyword arguments of `method` in `cfg.task`: policy_loss's (max_ratio from the config for dcpo and bandpo),
    or DPPO's (marked dppo=True; DPPO has no cap)."""
    kwargs = dict(task_methods(cfg.task)[method])
    if kwargs.get("clip") in ("dcpo", "band"):
        kwargs["max_ratio"] = cfg.max_ratio
    return kwargs


def method_loss(log_prob, old_log_prob, adv, kwargs: dict):
    """(loss, counts) of one update: DPPO's loss for a dppo=True method, policy_loss otherwise."""
    if kwargs.get("dppo"):
        return dppo.dppo_loss(log_prob, old_log_prob, adv, **{k: v for k, v in kwargs.items() if k != "dppo"})
    return policy_loss(log_prob, old_log_prob, adv, **kwargs)


def method_bounds(p_old: torch.Tensor, kwargs: dict):
    """The ratio bounds [lo, up] a method clips (or, for DPPO, masks) at: up acts on A > 0, lo on A < 0."""
    if kwargs.get("dppo"):
        lo, up = dppo.ratio_region(p_old, divergence=kwargs["divergence"], delta=kwargs["delta"])
        return lo.to(p_old.dtype), up.to(p_old.dtype)
    return ratio_bounds(p_old, **{k: v for k, v in kwargs.items() if k != "dual_clip"})


def make_task(seed: int, cfg: TaskConfig):
    """Initial logits (contexts, vocab) and the masks of the common and of the rare correct tokens, from `seed`
    alone: rare-correct has both, rewarded only the rare ones (its rewarded tokens; common is None), random-reward
    neither."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(cfg.contexts, cfg.vocab, generator=g) * cfg.init_scale
    if cfg.task == "random-reward":
        return logits, None, None
    ranks = torch.argsort(logits, dim=1, descending=True)
    lo, hi = cfg.good_ranks
    pick = torch.stack([torch.randperm(hi - lo, generator=g)[:cfg.good] for _ in range(cfg.contexts)]) + lo
    rare = torch.zeros(cfg.contexts, cfg.vocab, dtype=torch.bool)
    rare.scatter_(1, torch.gather(ranks, 1, pick), True)
    if cfg.task == "rewarded":
        return logits, None, rare
    common = torch.zeros_like(rare)
    common.scatter_(1, ranks[:, :1], True)
    return logits, common, rare


def group_advantages(reward: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage: (reward - group mean) / (group std + 1e-6), per group (rows of `reward`)."""
    return (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)


def rollout(theta: torch.Tensor, correct, sampler: torch.Generator, rewarder: torch.Generator, cfg: TaskConfig):
    """Sample `group` responses of `tokens` tokens per context from softmax(theta) and reward them.

    Returns tokens (C*G, T), their old log-probabilities (C*G, T), the advantages (C*G, T) and the
    mean reward. Random-reward draws one fair coin per response from `rewarder` (the same number of draws
    whatever the policy, so every method sees the same coins)."""
    C, G, T = cfg.contexts, cfg.group, cfg.tokens
    with torch.no_grad():
        logp_all = torch.log_softmax(theta, dim=1)
        tokens = torch.multinomial(logp_all.exp(), G * T, replacement=True, generator=sampler)
        old_lp = torch.gather(logp_all, 1, tokens).view(C * G, T)
        if correct is None:
            reward = torch.randint(0, 2, (C, G), generator=rewarder).float()
        else:
            reward = torch.gather(correct, 1, tokens).view(C, G, T).float().mean(-1)
        adv = group_advantages(reward).reshape(C * G, 1).expand(C * G, T)
    return tokens.view(C * G, T), old_lp, adv, reward.mean()


def token_log_probs(theta: torch.Tensor, context_of: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(theta)[context, token] for each response's tokens: (responses, T), differentiable."""
    return torch.gather(torch.log_softmax(theta, dim=1)[context_of], 1, tokens)


def clip_counts(log_prob, old_log_prob, adv, bucket, lo, up) -> dict:
    """The BUCKETED counts of one update, split by the tokens' old-probability bucket.

    Clipped means what policy_loss counts (see bandpo_lut.reference.policy_loss): A > 0 and r > up,
    or A < 0 and r < lo, with r = exp(clamp(log_prob - old_log_prob, -20, 20))."""
    r = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    pos, neg = adv > 0, adv < 0
    n = len(P_BUCKETS)

    def per_bucket(sel):
        return torch.bincount(bucket[sel], minlength=n).to(torch.float64)

    return {"n_pos": per_bucket(pos), "n_neg": per_bucket(neg),
            "n_high": per_bucket(pos & (r > up)), "n_low": per_bucket(neg & (r < lo))}


def train(method: str, seed: int, cfg: TaskConfig) -> dict:
    """One GRPO run of `cfg.task` under `method`. Returns per-step tensors: entropy, reward, the mass of
    each context's initially most likely token ("top_mass"), the mass of the rare and of the common
    correct tokens (0 where the task has none), the BUCKETED counts (steps, buckets; not for the default task,
    whose report does not use them and whose --quick run must stay quick) and the FROM_LOSS counts."""
    logits0, common, rare = make_task(seed, cfg)
    correct = rare if common is None else common | rare
    theta = torch.nn.Parameter(logits0.clone())
    opt = (torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.SGD)([theta], lr=cfg.lr)
    kwargs = method_kwargs(method, cfg)
    # separate streams, the same for every method: sampling and minibatches, and the random rewards
    sampler = torch.Generator().manual_seed(10_000 + seed)
    rewarder = torch.Generator().manual_seed(20_000 + seed)
    C, G = cfg.contexts, cfg.group
    context_of = torch.arange(C).repeat_interleave(G)
    edges = torch.tensor(P_EDGES, dtype=torch.float32)
    nb = len(P_BUCKETS)
    top = logits0.argmax(1, keepdim=True)
    out = {k: torch.zeros(cfg.steps) for k in ("entropy", "reward", "top_mass", "rare_mass", "common_mass") + FROM_LOSS}
    bucketed = cfg.task != "rewarded"
    if bucketed:
        out.update({k: torch.zeros(cfg.steps, nb, dtype=torch.float64) for k in BUCKETED})
    for step in range(cfg.steps):
        with torch.no_grad():
            p_all = torch.softmax(theta, dim=1)
            out["entropy"][step] = -(p_all * torch.log_softmax(theta, dim=1)).sum(1).mean()
            out["top_mass"][step] = torch.gather(p_all, 1, top).mean()
            if rare is not None:
                out["rare_mass"][step] = (p_all * rare).sum(1).mean()
            if common is not None:
                out["common_mass"][step] = (p_all * common).sum(1).mean()
        tokens, old_lp, adv, mean_reward = rollout(theta, correct, sampler, rewarder, cfg)
        out["reward"][step] = mean_reward
        if bucketed:
            p_old = old_lp.exp()
            lo, up = method_bounds(p_old, kwargs)    # fixed for the batch's updates
            bucket = torch.bucketize(p_old, edges, right=True)
        for _ in range(cfg.epochs):
            for idx in torch.randperm(C * G, generator=sampler).chunk(cfg.minibatches):
                lp = token_log_probs(theta, context_of[idx], tokens[idx])
                loss, metrics = method_loss(lp, old_lp[idx], adv[idx], kwargs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if bucketed:
                    counts = clip_counts(lp.detach(), old_lp[idx], adv[idx], bucket[idx], lo[idx], up[idx])
                    for k, v in counts.items():
                        out[k][step] += v
                for k in FROM_LOSS:
                    out[k][step] += metrics[k].detach()
    return out


def run_method(method: str, seeds: list[int], cfg: TaskConfig, progress=None) -> dict:
    """`train` on each seed; every tensor stacked with a leading seed dimension. `progress`: a
    `progress.Progress` told of each finished seed."""
    runs = []
    for seed in seeds:
        runs.append(train(method, seed, cfg))
        if progress is not None:
            progress.step(f"{method} seed {seed}")
    return {k: torch.stack([r[k] for r in runs]) for k in runs[0]}
