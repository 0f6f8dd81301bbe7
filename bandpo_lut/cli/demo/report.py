"""The report of `bandpo-lut demo --task random-reward | rare-correct` (trained by `demo_tasks`): a table
per step, one summary line per method, and a figure (entropy against step; the second quantity against
step; the clip-high and clip-low rates by old-probability bucket)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from bandpo_lut.cli.demo.tasks import METHODS, P_BUCKETS, TaskConfig, method_kwargs, run_method


def run(task: str, methods: list[str], seeds: list[int], cfg, out: Path | None, every: int | None,
        optimizer: str = "adam") -> int:
    """Train `methods` on `task` for `seeds` (cfg: the default demo's Config, same fields) and report."""
    tcfg = TaskConfig(task=task, optimizer=optimizer, **vars(cfg))
    opt_name = "Adam" if optimizer == "adam" else "SGD"
    what = ("reward = a fair coin per response, independent of its tokens" if task == "random-reward" else
            f"correct = each context's top token and {tcfg.good} rare tokens from initial ranks "
            f"{tcfg.good_ranks[0]}..{tcfg.good_ranks[1] - 1}, reward = fraction of correct tokens")
    print(f"BandPO demo --task {task}: {len(seeds)} seed(s) ({seeds[0]}..{seeds[-1]}) x {tcfg.steps} steps; "
          f"{tcfg.contexts} contexts, vocab {tcfg.vocab} (initial logits ~ N(0, {tcfg.init_scale}^2)); {what}; "
          f"groups of {tcfg.group} responses x {tcfg.tokens} tokens; {tcfg.epochs * tcfg.minibatches} {opt_name} "
          f"updates (lr {tcfg.lr}) per batch; loss: bandpo_lut.policy_loss (dppo: bandpo_lut.reference.dppo)")
    for m in methods:
        print(f"  {m}: " + ", ".join(f"{k}={v}" for k, v in method_kwargs(m, tcfg).items()))
    start = time.perf_counter()
    history = {m: run_method(m, seeds, tcfg) for m in methods}
    elapsed = time.perf_counter() - start
    print_table(history, tcfg, every or max(1, tcfg.steps // 10))
    for line in summary_lines(history, tcfg):
        print(line)
    print(f"({elapsed:.1f} s of training, {torch.get_num_threads()} thread(s))")
    if out is not None:
        plot(history, out, tcfg, len(seeds))
        print(f"figure written to {out}")
    return 0


def _rate(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num))


def bucket_rates(h: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run-wide clip-high and clip-low rates per old-probability bucket, from the counts summed over
    seeds and steps: high = #(A > 0, r > up) / #(A > 0), low = #(A < 0, r < lo) / #(A < 0)."""
    s = {k: h[k].sum((0, 1)) for k in ("n_high", "n_pos", "n_low", "n_neg")}
    return _rate(s["n_high"], s["n_pos"]), _rate(s["n_low"], s["n_neg"])


def step_rates(h: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per seed and step, the clip-high and clip-low rates over all buckets: (seeds, steps) each."""
    def total(k):
        return h[k].sum(-1)
    return _rate(total("n_high"), total("n_pos")), _rate(total("n_low"), total("n_neg"))


def print_table(history: dict, cfg: TaskConfig, every: int) -> None:
    rows = sorted(set(range(0, cfg.steps, every)) | {cfg.steps - 1})
    width = max(len(m) for m in history)
    extra = "rare_mass" if cfg.task == "rare-correct" else "reward"
    head = (f"{'step':>5}  {'method':<{width}}  {'entropy (mean ± sd)':>19}  {extra:>9}  "
            f"{'clip_high':>9}  {'clip_low':>8}")
    print(head)
    print("-" * len(head))
    for step in rows:
        for i, (method, h) in enumerate(history.items()):
            high, low = step_rates(h)
            ent = h["entropy"][:, step]
            sd = float(ent.std()) if ent.numel() > 1 else 0.0
            value = h["rare_mass" if cfg.task == "rare-correct" else "reward"][:, step].mean()
            print(f"{step if i == 0 else '':>5}  {method:<{width}}  {float(ent.mean()):11.3f} ± {sd:5.3f}  "
                  f"{float(value):9.4f}  {float(high[:, step].mean()):9.4f}  {float(low[:, step].mean()):8.4f}")
    print("(means over seeds; clip_high = share of A > 0 tokens with ratio above the upper bound, clip_low = "
          "share of A < 0 tokens below the lower bound, over all of a step's updates)")


def summary_lines(history: dict, cfg: TaskConfig) -> list[str]:
    lines = []
    for method, h in history.items():
        ent = h["entropy"]
        sd = float(ent[:, -1].std()) if ent.shape[0] > 1 else 0.0
        high, low = bucket_rates(h)
        part = (f"{method}: entropy {float(ent[:, 0].mean()):.3f} -> {float(ent[:, -1].mean()):.3f} ± {sd:.3f}; "
                f"clip-high / clip-low at p_old < 0.01: {100 * float(high[0]):.2f}% / {100 * float(low[0]):.2f}%, "
                f"at p_old >= 0.5: {100 * float(high[-1]):.2f}% / {100 * float(low[-1]):.2f}%")
        if cfg.task == "rare-correct":
            part += (f"; rare correct mass {float(h['rare_mass'][:, 0].mean()):.2e} -> "
                     f"{float(h['rare_mass'][:, -1].mean()):.2e}, common correct "
                     f"{float(h['common_mass'][:, -1].mean()):.3f}, final reward "
                     f"{float(h['reward'][:, -max(1, cfg.steps // 10):].mean()):.3f}")
        else:
            part += (f"; mass on the initially most likely token {float(h['top_mass'][:, 0].mean()):.3f} -> "
                     f"{float(h['top_mass'][:, -1].mean()):.3f}")
        if float(h["n_dual_clipped"].sum()) > 0:
            part += f"; dual-clipped {int(h['n_dual_clipped'].sum())} tokens"
        lines.append("summary " + part)
    return lines


STYLES = {"no-clip": (0, (1, 1.5)), "ppo-clip": "-", "clip-higher": "-", "dcpo": (0, (4, 2)), "bandpo": "-",
          "dppo": (0, (6, 1.5, 1, 1.5))}


def plot(history: dict, out: Path, cfg: TaskConfig, n_seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), constrained_layout=True)
    steps = torch.arange(cfg.steps)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    second = "rare_mass" if cfg.task == "rare-correct" else None
    for ax, key in ((axes[0, 0], "entropy"), (axes[0, 1], second)):
        for method, h in history.items():
            if key is None:      # random-reward: the clip-high and clip-low rates over time
                high, low = step_rates(h)
                w = max(1, cfg.steps // 25)   # pooled over a few steps: per-step rates are noisy
                smooth = torch.nn.functional.avg_pool1d
                ax.plot(steps[: cfg.steps - w + 1], smooth(high.mean(0)[None], w, 1)[0], color=colors[method],
                        ls="-", lw=1.6, label=f"{method} high")
                ax.plot(steps[: cfg.steps - w + 1], smooth(low.mean(0)[None], w, 1)[0], color=colors[method],
                        ls=":", lw=1.6)
                continue
            y = h[key]
            ax.plot(steps, y.mean(0), color=colors[method], ls=STYLES[method], lw=1.8, label=method)
            if n_seeds > 1:
                ax.fill_between(steps, y.min(0).values, y.max(0).values, color=colors[method], alpha=0.12, lw=0)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("policy entropy (nats)")
    axes[0, 0].legend(fontsize=9)
    if second:
        axes[0, 1].set_ylabel("probability mass on the rare correct tokens")
        axes[0, 1].set_yscale("log")
    else:
        w = max(1, cfg.steps // 25)
        axes[0, 1].set_ylabel(f"clip rate (solid: high, A > 0; dotted: low, A < 0)\nmean over {w} steps")
        axes[0, 1].legend(fontsize=8, ncol=2)

    for ax, which in ((axes[1, 0], 0), (axes[1, 1], 1)):
        x = torch.arange(len(P_BUCKETS), dtype=torch.float64)
        width = 0.8 / len(history)
        for i, (method, h) in enumerate(history.items()):
            rate = bucket_rates(h)[which]
            ax.bar(x + (i - (len(history) - 1) / 2) * width, 100 * rate, width, color=colors[method], label=method)
        ax.set_xticks(x, [f"p_old {b}" if i == 0 else b for i, b in enumerate(P_BUCKETS)])
        ax.set_ylabel(("clip-high rate: % of A > 0 tokens with ratio > upper bound" if which == 0 else
                       "clip-low rate: % of A < 0 tokens with ratio < lower bound"))
        ax.set_xlabel("old probability of the token (whole run, all seeds)")
        ax.grid(alpha=0.3, axis="y")
    top = max(axes[1, 0].get_ylim()[1], axes[1, 1].get_ylim()[1])
    axes[1, 0].set_ylim(0, top)
    axes[1, 1].set_ylim(0, top)
    axes[1, 0].legend(fontsize=9)

    spread = f"mean of {n_seeds} seeds, shaded: min..max" if n_seeds > 1 else "1 seed"
    what = ("reward = a fair coin per response, independent of its tokens" if cfg.task == "random-reward" else
            f"correct = the top token and {cfg.good} rare tokens (initial ranks {cfg.good_ranks[0]}.."
            f"{cfg.good_ranks[1] - 1}), equally rewarded")
    fig.suptitle(f"demo --task {cfg.task}: softmax policy over {cfg.vocab} tokens, {cfg.contexts} contexts;\n"
                 f"{what};\n{cfg.epochs * cfg.minibatches} {'Adam' if cfg.optimizer == 'adam' else 'SGD'} updates "
                 f"(lr {cfg.lr:g}) per batch ({spread})", fontsize=10)
    fig.savefig(out, dpi=100)
    plt.close(fig)
