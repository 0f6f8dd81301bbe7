"""The reports of `bandpo-lut demo`'s tabular tasks (trained by `tasks`): a table per step, summary lines and a
figure. The default task (rewarded) has its own columns and figure (entropy, reward and the low-probability clip-high
rate; the bounds each method applies); random-reward and rare-correct share theirs (entropy against step; the second
quantity against step; the clip-high and clip-low rates by old-probability bucket)."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from bandpo_lut.cli.demo.progress import Progress
from bandpo_lut.cli.demo.tasks import (
    METHODS,
    P_BUCKETS,
    REWARDED_METHODS,
    TaskConfig,
    method_bounds,
    method_kwargs,
    run_method,
)


def run(methods: list[str], seeds: list[int], tcfg: TaskConfig, out: Path | None, every: int | None) -> int:
    """Train `methods` on `tcfg.task` for `seeds` and report."""
    if tcfg.task == "rewarded":
        return run_rewarded(methods, seeds, tcfg, out, every)
    task, optimizer = tcfg.task, tcfg.optimizer
    opt_name = "Adam" if optimizer == "adam" else "SGD"
    what = ("reward = a fair coin per response, independent of its tokens" if task == "random-reward" else
            f"correct = each context's top token and {tcfg.good} rare tokens from initial ranks "
            f"{tcfg.good_ranks[0]}..{tcfg.good_ranks[1] - 1}, reward = fraction of correct tokens")
    print(f"BandPO demo --task {task}: {len(seeds)} seed(s) ({seeds[0]}..{seeds[-1]}) x {tcfg.steps} steps; "
          f"{tcfg.contexts} contexts, vocab {tcfg.vocab} (initial logits ~ N(0, {tcfg.init_scale}^2)); {what}; "
          f"groups of {tcfg.group} responses x {tcfg.tokens} tokens; {tcfg.epochs * tcfg.minibatches} {opt_name} "
          f"updates (lr {tcfg.lr}) per batch; loss: bandpo_lut.policy_loss (dppo: bandpo_lut.reference.dppo)",
          flush=True)
    for m in methods:
        print(f"  {m}: " + ", ".join(f"{k}={v}" for k, v in method_kwargs(m, tcfg).items()), flush=True)
    start = time.perf_counter()
    progress = Progress(len(methods) * len(seeds))
    history = {m: run_method(m, seeds, tcfg, progress) for m in methods}
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


# ---------------------------------------------------------------------------------------------
# the default task (rewarded)

RECORDED = ("entropy", "reward", "clip_frac", "lowprob_clip_high")
# line styles in the figure; dcpo is dashed because in this toy it often runs on top of bandpo
REWARDED_STYLES = {"ppo-clip": "-", "clip-higher": "-", "dcpo": (0, (4, 2)), "bandpo": "-", "dppo": (0, (1, 1.5))}
LABELS = {
    "entropy": "policy entropy (nats)",
    "reward": "mean reward",
    "clip_frac": "clip fraction (all tokens)",
    "lowprob_clip_high": "clip-high rate, p_old < 0.2, A > 0",
}


def run_rewarded(methods: list[str], seeds: list[int], cfg: TaskConfig, out: Path | None, every: int | None) -> int:
    print(f"BandPO demo: {len(seeds)} seed(s) x {cfg.steps} steps; {cfg.contexts} contexts, vocab "
          f"{cfg.vocab} (initial logits ~ N(0, {cfg.init_scale}^2)), {cfg.good} rewarded tokens per "
          f"context drawn from initial ranks {cfg.good_ranks[0]}..{cfg.good_ranks[1] - 1}; groups of "
          f"{cfg.group} responses x {cfg.tokens} tokens; {cfg.epochs * cfg.minibatches} Adam updates "
          f"(lr {cfg.lr}) per batch; max_ratio {cfg.max_ratio} for dcpo and bandpo; loss: bandpo_lut.policy_loss "
          f"(dppo: bandpo_lut.reference.dppo, verl's dppo_kl)", flush=True)
    start = time.perf_counter()
    history = {}  # method -> quantity -> tensor (seeds, steps)
    progress = Progress(len(methods) * len(seeds))
    for method in methods:
        h = run_method(method, seeds, cfg, progress)
        h["clip_frac"] = _rate(h["n_clipped"], h["n_tokens"])
        h["lowprob_clip_high"] = _rate(h["n_clipped_upper_lowprob"], h["n_lowprob_pos"])
        history[method] = h
    elapsed = time.perf_counter() - start

    every = every or max(1, cfg.steps // 10)
    print_rewarded_table(history, cfg.steps, every)
    print(rewarded_summary_line(history))
    print(f"({elapsed:.1f} s of training, {torch.get_num_threads()} thread(s))")
    if out is not None:
        plot_rewarded(history, out, cfg, len(seeds))
        print(f"figure written to {out}")
    return 0


def _windowed_rate(num: torch.Tensor, den: torch.Tensor, window: int) -> torch.Tensor:
    """sum(num) / sum(den) over the trailing `window` steps, per seed (rows)."""
    kernel = torch.ones(1, 1, window)
    pad = torch.nn.functional.pad

    def trailing_sum(x):
        return torch.nn.functional.conv1d(pad(x[:, None], (window - 1, 0)), kernel)[:, 0]

    return _rate(trailing_sum(num), trailing_sum(den))


def print_rewarded_table(history: dict, steps: int, every: int) -> None:
    rows = sorted(set(range(0, steps, every)) | {steps - 1})
    width = max(len(m) for m in history)
    head = f"{'step':>5}  {'method':<{width}}  {'entropy':>8}  {'reward':>7}  {'clip_frac':>9}  " \
           f"{'lowprob_clip_high':>17}"
    print(head)
    print("-" * len(head))
    for step in rows:
        for i, (method, h) in enumerate(history.items()):
            mean = {k: float(h[k][:, step].mean()) for k in RECORDED}
            print(f"{step if i == 0 else '':>5}  {method:<{width}}  {mean['entropy']:8.3f}  "
                  f"{mean['reward']:7.3f}  {mean['clip_frac']:9.4f}  {mean['lowprob_clip_high']:17.4f}")
    print("(means over seeds; clip_frac and lowprob_clip_high over all of a step's updates; "
          "lowprob_clip_high = share of tokens with p_old < 0.2 and A > 0 whose ratio was above "
          "the upper bound)")


def rewarded_summary(history: dict) -> dict:
    """Per method: final entropy and reward, and run-wide rates from the summed counts."""
    out = {}
    for method, h in history.items():
        out[method] = dict(
            entropy=float(h["entropy"][:, -1].mean()),
            reward=float(h["reward"][:, -max(1, h["reward"].shape[1] // 10):].mean()),
            clip_frac=float(_rate(h["n_clipped"].sum(), h["n_tokens"].sum())),
            lowprob_clip_high=float(_rate(h["n_clipped_upper_lowprob"].sum(), h["n_lowprob_pos"].sum())),
        )
    return out


def rewarded_summary_line(history: dict) -> str:
    parts = [f"{m}: final entropy {s['entropy']:.3f}, low-prob clip-high rate {s['lowprob_clip_high']:.4f}"
             f" (clip_frac {s['clip_frac']:.4f}, final reward {s['reward']:.3f})"
             for m, s in rewarded_summary(history).items()]
    return "summary (rates over the whole run, reward over the last tenth): " + "; ".join(parts)


def plot_rewarded(history: dict, out: Path, cfg: TaskConfig, n_seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), constrained_layout=True)
    steps = torch.arange(cfg.steps)
    colors = {m: f"C{i}" for i, m in enumerate(REWARDED_METHODS)}
    # The rates are noisy per step when few low-probability tokens are sampled, so the figure pools
    # the counts over a short trailing window (the table prints the per-step values).
    window = max(1, cfg.steps // 30)
    curves = {m: {"reward": h["reward"], "entropy": h["entropy"],
                  "clip_frac": _windowed_rate(h["n_clipped"], h["n_tokens"], window),
                  "lowprob_clip_high": _windowed_rate(h["n_clipped_upper_lowprob"],
                                                      h["n_lowprob_pos"], window)}
              for m, h in history.items()}
    panels = [("reward", axes[0, 0]), ("entropy", axes[0, 1]), ("clip_frac", axes[1, 0]),
              ("lowprob_clip_high", axes[1, 1])]
    for key, ax in panels:
        for method, c in curves.items():
            ax.plot(steps, c[key].mean(0), label=method, lw=1.8, color=colors[method],
                    ls=REWARDED_STYLES[method])
            if n_seeds > 1:
                ax.fill_between(steps, c[key].min(0).values, c[key].max(0).values,
                                color=colors[method], alpha=0.15, lw=0)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(LABELS[key] + (f"\n(counts pooled over {window} steps)"
                                     if key in ("clip_frac", "lowprob_clip_high") and window > 1
                                     else ""))
        ax.grid(alpha=0.3)
    axes[0, 1].axhline(math.log(cfg.good), color="grey", ls=":", lw=1)
    axes[0, 1].annotate(f"log {cfg.good}: uniform over the rewarded tokens",
                        (cfg.steps - 1, math.log(cfg.good)), xytext=(0, 3), textcoords="offset points",
                        ha="right", fontsize=8, color="0.35")
    axes[0, 0].legend(loc="lower right", fontsize=10)

    ax = axes[0, 2]  # entropy against reward: how much diversity each method pays for progress
    for method, h in history.items():
        ax.plot(h["reward"].mean(0), h["entropy"].mean(0), marker=".", ms=3, lw=1, label=method,
                color=colors[method], ls=REWARDED_STYLES[method])
    ax.set_xlabel("mean reward")
    ax.set_ylabel(LABELS["entropy"])
    ax.set_title("entropy against reward", fontsize=10)
    ax.grid(alpha=0.3)

    _plot_upper_bounds(axes[1, 2], history, cfg, colors)
    spread = f"mean of {n_seeds} seeds, shaded: min..max" if n_seeds > 1 else "1 seed"
    fig.suptitle(f"Toy GRPO: softmax policy over {cfg.vocab} tokens, {cfg.good} rewarded tokens per "
                 f"context starting at low probability ({spread})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_upper_bounds(ax, history: dict, cfg: TaskConfig, colors: dict) -> None:
    """Each method's ratio bounds against p_old, to read the clip rates above."""
    p = torch.logspace(-4, 0, 400, dtype=torch.float64)
    for method in history:
        lo, up = method_bounds(p, method_kwargs(method, cfg))
        ax.plot(p, up, color=colors[method], lw=1.8, label=method, ls=REWARDED_STYLES[method])
        ax.plot(p, lo, color=colors[method], lw=1.2, ls=":")
    ax.plot(p, 1 / p, color="black", lw=1, ls=(0, (1, 3)), label="simplex limit 1/p")
    ax.axvspan(p[0], 0.2, color="grey", alpha=0.08, lw=0)
    ax.text(1.3e-4, 0.07, "low probability: p_old < 0.2", fontsize=8, color="0.3")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(0.05, 20)
    ax.set_xlabel("p_old (old probability of the token)")
    ax.set_ylabel("ratio bound (upper lines; dotted: lower)")
    ax.set_title("the bounds each method applies", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3, which="both")
