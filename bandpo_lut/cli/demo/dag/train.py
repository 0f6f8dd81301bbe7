"""dag-paths training: the supervised warm-up on skewed data (one checkpoint per seed, shared by every arm), then a
GRPO run per arm, every arm's loss through `bandpo_lut.policy_loss`.

GRPO: every prompt each step, `group` sampled answers per prompt, reward 1 iff the answer is a path (or, for the
random-reward control, a fair coin per answer), advantages normalised within the group and given to each of the
answer's tokens, token-mean loss, no KL term, no entropy bonus; `epochs` x `minibatches` Adam updates per rollout
batch, so ratios leave 1. The one-update reference takes a single update per rollout batch and as many rollout
batches as the others take updates, each of as many prompts as the others' minibatches hold, so every arm makes the
same number of Adam updates (at the same rate, on as many answers each) and every update of the reference is
on-policy: no clip can act on it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bandpo_lut.cli.demo.dag.graph import Graph, GraphConfig
from bandpo_lut.cli.demo.dag.metrics import NAMES, exact_metrics, sequence_kl
from bandpo_lut.cli.demo.dag.model import PathGPT, all_answer_log_probs
from bandpo_lut.cli.demo.tasks import NO_CLIP, P_BUCKETS, P_EDGES, clip_counts, group_advantages
from bandpo_lut.runtime.loss import policy_loss, ratio_bounds

REFERENCE = "one-update"
# arm -> policy_loss keyword arguments. DPPO-KL is BandPO's KL region without the cap or the dual clip, masking the
# out-of-region tokens' gradient (mode="mask"; docs/dppo.md: verl's dppo_kl gradient, less its IS truncation at 20).
ARMS = {
    REFERENCE: NO_CLIP,
    "no-clip": NO_CLIP,
    "ppo-clip": dict(clip="fixed", eps_low=0.2, eps_high=0.2),
    "clip-higher": dict(clip="fixed", eps_low=0.2, eps_high=0.28),
    "bandpo": dict(clip="band", divergence="kl", delta=0.05, max_ratio=10.0, dual_clip=10.0),
    "dppo-kl": dict(clip="band", divergence="kl", delta=0.05, mode="mask"),
}
BOUND_KEYS = ("clip", "delta", "divergence", "max_ratio", "eps_low", "eps_high")
COUNTS = ("n_tokens", "n_clipped", "n_clipped_upper", "n_clipped_lower", "n_dual_clipped")
BUCKETED = ("n_pos", "n_neg", "n_high", "n_low")


@dataclass(frozen=True)
class Setting:
    """How off-policy the GRPO updates are: epochs x minibatches Adam updates per rollout batch at rate lr."""
    name: str
    epochs: int
    minibatches: int
    lr: float

    @property
    def updates(self) -> int:
        return self.epochs * self.minibatches


@dataclass(frozen=True)
class DagConfig:
    graph: GraphConfig = GraphConfig()
    dim: int = 64
    depth: int = 2
    heads: int = 4
    group: int = 8
    steps: int = 40            # rollout batches of the clipped arms (the reference takes steps x updates)
    eval_every: int = 5        # in rollout batches of the clipped arms
    warmup_steps: int = 250
    warmup_batch: int = 128
    warmup_lr: float = 3e-3
    canonical_share: float = 0.5     # of the warm-up targets; the other valid paths share alt_share, the rest
    alt_share: float = 0.2           # are corrupted (a random wrong answer)
    settings: tuple = field(default_factory=lambda: (Setting("standard", 2, 2, 1e-3),
                                                     Setting("off-policy", 4, 4, 2e-3)))


def new_model(cfg: DagConfig, seed: int) -> PathGPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PathGPT(cfg.graph.layers, cfg.graph.width, cfg.dim, cfg.depth, cfg.heads)


def answer_index(answers: torch.Tensor, width: int) -> torch.Tensor:
    """The lexicographic index (graph.answers' row) of each answer (B, K)."""
    K = answers.shape[1]
    return (answers * width ** torch.arange(K - 1, -1, -1)).sum(1)


def warm_up(seed: int, graph: Graph, cfg: DagConfig) -> dict:
    """Supervised training on skewed targets: canonical path (canonical_share), another valid path (alt_share), a
    wrong answer (the rest). Returns the checkpoint (a state dict) every arm of this seed starts from."""
    model = new_model(cfg, seed)
    g = torch.Generator().manual_seed(30_000 + seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warmup_lr)
    P, A = graph.valid.shape
    canon = torch.zeros_like(graph.valid)
    canon[torch.arange(P), graph.canonical] = True
    weights = {"canonical": canon.double(), "alt": (graph.valid & ~canon).double(), "wrong": (~graph.valid).double()}
    for _ in range(cfg.warmup_steps):
        prompt = torch.randint(P, (cfg.warmup_batch,), generator=g)
        kind = torch.bucketize(torch.rand(cfg.warmup_batch, generator=g),
                               torch.tensor([cfg.canonical_share, cfg.canonical_share + cfg.alt_share]), right=True)
        pick = torch.stack([torch.multinomial(weights[k][prompt], 1, generator=g)[:, 0]
                            for k in ("canonical", "alt", "wrong")], 1)
        target = graph.answers[pick.gather(1, kind[:, None])[:, 0]]
        loss = -model.token_log_probs(graph.prompts[prompt], target).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def sample_answers(model: PathGPT, prompts: torch.Tensor, K: int, g: torch.Generator):
    """One answer per prompt row, node by node from the model (causal: a position never sees the zeros after it),
    and its token log-probabilities (B, K): the last forward has seen every sampled node before each position."""
    answers = torch.zeros(prompts.shape[0], K, dtype=torch.long)
    for k in range(K):
        logp = model(prompts, answers)
        answers[:, k] = torch.multinomial(logp[:, k].exp(), 1, generator=g)[:, 0]
    return answers, torch.gather(logp, 2, answers[..., None])[..., 0]


def grpo_step_loss(model: PathGPT, prompts, answers, old_log_prob, adv, kwargs: dict):
    """One update's (loss, policy_loss's metrics, the token log-probs it saw): the answers' token log-probs under
    `model` through policy_loss."""
    log_prob = model.token_log_probs(prompts, answers)
    loss, metrics = policy_loss(log_prob, old_log_prob, adv, **kwargs)
    return loss, metrics, log_prob


def run_arm(arm: str, setting: Setting, seed: int, checkpoint: dict, graph: Graph, cfg: DagConfig,
            random_reward: bool = False) -> dict:
    """One GRPO run from `checkpoint`. Returns the exact metrics (NAMES) and KL(pi_old || pi) per rollout batch at
    the evaluation points (tensors (evals,)), the batch reward per step, and the clip counts summed over the run
    (COUNTS, and BUCKETED per old-probability bucket)."""
    model = new_model(cfg, seed)
    model.load_state_dict(checkpoint)
    opt = torch.optim.Adam(model.parameters(), lr=setting.lr)
    kwargs = ARMS[arm]
    reference = arm == REFERENCE
    epochs, minibatches = (1, 1) if reference else (setting.epochs, setting.minibatches)
    scale = setting.updates if reference else 1       # reference: as many rollout batches as the others' updates
    steps, eval_every = cfg.steps * scale, cfg.eval_every * scale
    sampler = torch.Generator().manual_seed(10_000 + seed)     # the same streams for every arm of the seed
    rewarder = torch.Generator().manual_seed(20_000 + seed)
    P, K, G = graph.prompts.shape[0], graph.answers.shape[1], cfg.group
    # the reference's batches: the prompts in turn, as many per batch as a minibatch of the others holds
    per_batch = -(-P // setting.minibatches) if reference else P
    edges = torch.tensor(P_EDGES, dtype=torch.float32)
    bounds = {k: v for k, v in kwargs.items() if k in BOUND_KEYS}
    evals = list(range(0, steps, eval_every)) + [steps]
    out = {k: torch.zeros(len(evals), dtype=torch.float64) for k in (*NAMES, "kl")}
    out["reward"] = torch.zeros(steps)
    out.update({k: torch.zeros((), dtype=torch.float64) for k in COUNTS})
    out.update({k: torch.zeros(len(P_BUCKETS), dtype=torch.float64) for k in BUCKETED})

    def evaluate(i: int):
        with torch.no_grad():
            logp = all_answer_log_probs(model, graph.prompts, graph.answers)
        for k, v in exact_metrics(logp, graph.valid, graph.canonical).items():
            out[k][i] = v
        return logp

    for step in range(steps):
        i = step // eval_every
        before = evaluate(i) if step % eval_every == 0 else None
        if reference:
            first = (step * per_batch) % P
            row = torch.arange(first, first + per_batch) % P
        else:
            row = torch.arange(P)
        B = row.shape[0] * G
        row = row.repeat_interleave(G)
        prompts = graph.prompts[row]
        answers, old_lp = sample_answers(model, prompts, K, sampler)
        if random_reward:
            reward = torch.randint(0, 2, (B,), generator=rewarder).float()
        else:
            reward = graph.valid[row, answer_index(answers, cfg.graph.width)].float()
        out["reward"][step] = reward.mean()
        adv = group_advantages(reward.view(-1, G)).reshape(B, 1).expand(B, K)
        p_old = old_lp.exp()
        lo, up = ratio_bounds(p_old, **bounds)
        bucket = torch.bucketize(p_old, edges, right=True)
        for _ in range(epochs):
            for idx in torch.randperm(B, generator=sampler).chunk(minibatches):
                loss, metrics, lp = grpo_step_loss(model, prompts[idx], answers[idx], old_lp[idx], adv[idx], kwargs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                for k in COUNTS:
                    out[k] += metrics[k].detach().double()
                for k, v in clip_counts(lp.detach(), old_lp[idx], adv[idx], bucket[idx], lo[idx], up[idx]).items():
                    out[k] += v
        if before is not None:
            with torch.no_grad():
                out["kl"][i] = sequence_kl(before, all_answer_log_probs(model, graph.prompts, graph.answers))
    evaluate(len(evals) - 1)
    out["kl"][-1] = float("nan")        # no rollout batch follows the last evaluation
    return out
