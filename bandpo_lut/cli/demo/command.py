"""`bandpo-lut demo`: a toy GRPO run that shows what BandPO changes, in about a minute on a CPU.

The task (no downloads, nothing learned beforehand):
  * a tabular softmax policy pi(token | context) over a large vocabulary: one row of logits per
    context, initialised at random so that each row is peaked on a few tokens;
  * in each context a handful of "good" tokens that start with low probability (drawn from the
    initial ranks `--good-ranks`); a response is `--tokens` tokens sampled from pi(. | context) and
    its reward is the fraction of good tokens in it;
  * GRPO: `--group` responses per context, advantages normalised within the group and given to
    every token of the response; each batch is used for `--epochs` passes of `--minibatches`
    Adam updates, so the ratio pi/pi_old moves away from 1 and the clip matters.

The same seeds (same initial policy, same task, same sampling stream) are trained with canonical
PPO clipping (0.2), clip-higher (0.2 / 0.28), DCPO and BandPO (KL, delta = 0.05), all through the
same `policy_loss` call, and DPPO-Binary-KL as verl's `dppo_kl` applies it (delta 0.05, IS weight
truncated at 20; `bandpo_lut.reference.dppo`, see docs/dppo.md). Per step we record the policy
entropy, the mean reward, the overall clip fraction and the clip-high rate of low-probability
tokens (among tokens with p_old < 0.2 and A > 0, the fraction with ratio above the upper bound),
from counts summed over all of the step's updates.

What it showed when written (defaults, 5 seeds; `--quick` is one seed of the same task): canonical
clipping stops about 5% of the upward moves of low-probability tokens with a positive advantage
(clip-higher about 2%), BandPO and DCPO almost none (their upper bound is far above 1.2 for
p_old < 0.5, and a batch's updates rarely move a ratio that far), which is the paper's mechanism.
Because they barely clip at all here, BandPO and DCPO run almost on top of each other, reach the
reward a few steps sooner, and lose entropy sooner: plotted against the reward, entropy is the same
curve for all four methods, and every method ends far below log(rewarded tokens). This toy does not
show BandPO preserving entropy.

`--task random-reward` and `--task rare-correct` are two further tasks, built to show what the clip
rather than the reward does to entropy (`demo_tasks`, reported by `demo_tasks_report`; docs/demo.md). This
module keeps the default task (`--task rewarded`) and the arguments of all three.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from bandpo_lut.cli.args import int_at_least, max_ratio_arg, number_in
from bandpo_lut.cli.demo.tasks import DPPO, TASKS, Config, method_bounds, method_loss
from bandpo_lut.cli.demo.tasks import METHODS as TASK_METHODS
from bandpo_lut.cli.demo.tasks import method_kwargs as _task_method_kwargs

# name -> policy_loss keyword arguments (dppo: DPPO's, see demo_tasks.method_loss); max_ratio is added from
# --max-ratio for dcpo and band.
METHODS = {
    "ppo-clip": dict(clip="fixed", eps_low=0.2, eps_high=0.2),
    "clip-higher": dict(clip="fixed", eps_low=0.2, eps_high=0.28),
    "dcpo": dict(clip="dcpo", eps_low=0.16, eps_high=0.2),
    "bandpo": dict(clip="band", divergence="kl", delta=0.05),
    "dppo": DPPO,
}
ALL_METHODS = tuple(dict.fromkeys([*TASK_METHODS, *METHODS]))  # every --methods name of every task
# Sizes past these are refused before any work: the demo holds the logits and their Adam states
# (contexts x vocab) and a batch's sampled tokens (contexts x group x tokens) in memory several times over.
MAX_LOGITS = 10_000_000
MAX_BATCH_TOKENS = 1_000_000
RECORDED = ("entropy", "reward", "clip_frac", "lowprob_clip_high")
# line styles in the figure; dcpo is dashed because in this toy it often runs on top of bandpo
STYLES = {"ppo-clip": "-", "clip-higher": "-", "dcpo": (0, (4, 2)), "bandpo": "-", "dppo": (0, (1, 1.5))}
LABELS = {
    "entropy": "policy entropy (nats)",
    "reward": "mean reward",
    "clip_frac": "clip fraction (all tokens)",
    "lowprob_clip_high": "clip-high rate, p_old < 0.2, A > 0",
}

# The figure's default name: in the current directory, and not the repository's tracked
# docs/demo.png (regenerate that one with `--out docs/demo.png`).
DEFAULT_OUT = "bandpo-demo.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=("rewarded",) + TASKS, default="rewarded",
                        help="rewarded (default): rewarded tokens that start rare; random-reward: a coin "
                             "flip per response (zero expected gradient); rare-correct: the top "
                             "token and rare tokens are equally correct (docs/demo.md)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller run that finishes in well under a minute")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="GRPO steps (batches) per run (default 100, other tasks 200; --quick: 60, "
                             "other tasks 50)")
    parser.add_argument("--seeds", type=_positive_int, default=None,
                        help="number of seeds, averaged (default 5; --quick: 1, other tasks 2)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--methods", type=_methods, default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all), and "
                             f"no-clip for the other tasks")
    parser.add_argument("--contexts", type=_positive_int, default=32, help="contexts (default 32)")
    parser.add_argument("--vocab", type=_positive_int, default=2000, help="vocabulary size (default 2000)")
    parser.add_argument("--good", type=_positive_int, default=8,
                        help="rewarded tokens per context (default 8)")
    parser.add_argument("--good-ranks", type=_rank_range, default=(10, 100), metavar="LO,HI",
                        help="initial probability ranks LO..HI-1 the rewarded tokens are drawn from "
                             "(default 10,100: p_old ~ 1e-4 to 1e-2)")
    parser.add_argument("--tokens", type=_positive_int, default=16, help="tokens per response (default 16)")
    parser.add_argument("--group", type=_group_size, default=8,
                        help="responses per context, at least 2 (default 8)")
    parser.add_argument("--epochs", type=_positive_int, default=2, help="passes over each batch (default 2)")
    parser.add_argument("--minibatches", type=_positive_int, default=4,
                        help="Adam updates per pass (default 4)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="learning rate (default 0.05 for Adam; required with --optimizer sgd)")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="adam (default), or sgd for --task random-reward / rare-correct")
    parser.add_argument("--init-scale", type=_positive_float, default=4.0,
                        help="std of the initial logits (default 4: the top token has p ~ 0.4)")
    parser.add_argument("--max-ratio", type=max_ratio_arg, default=10.0,
                        help="cap on the upper bound of DCPO and BandPO, 'none' for no cap (default 10)")
    parser.add_argument("--every", type=_positive_int, default=None,
                        help="print every N steps (default: about 10 rows per method)")
    parser.add_argument("--out", type=_out_path, default=Path(DEFAULT_OUT),
                        help=f"figure path, .png or .svg (default {DEFAULT_OUT} in the current "
                             f"directory); 'none' to skip")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch CPU threads (default 1: the toy's tensors are small, and more "
                             "threads only add synchronisation)")


def run(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _usage_error(message: str) -> int:
    """Errors that involve several arguments, reported like argparse's own (exit status 2)."""
    print(f"bandpo-lut demo: error: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    default_steps = (60 if args.quick else 100) if args.task == "rewarded" else (50 if args.quick else 200)
    cfg = Config(
        steps=args.steps or default_steps,
        contexts=args.contexts, vocab=args.vocab, good=args.good, good_ranks=args.good_ranks,
        tokens=args.tokens, group=args.group, epochs=args.epochs, minibatches=args.minibatches,
        lr=args.lr or 0.05, init_scale=args.init_scale, max_ratio=args.max_ratio)
    if args.task == "rare-correct" and cfg.good_ranks[0] < 1:
        return _usage_error(f"--good-ranks {cfg.good_ranks[0]},{cfg.good_ranks[1]}: rank 0 is the common correct "
                            f"token of --task rare-correct; the rare ones start at rank 1 or later")
    if args.task != "random-reward" and (cfg.good_ranks[1] > cfg.vocab
                                         or cfg.good_ranks[1] - cfg.good_ranks[0] < cfg.good):
        return _usage_error(f"--good-ranks {cfg.good_ranks[0]},{cfg.good_ranks[1]} must lie within "
                            f"the vocabulary (--vocab {cfg.vocab}) and hold at least --good {cfg.good} "
                            f"tokens")
    if cfg.minibatches > cfg.contexts * cfg.group:
        return _usage_error(f"--minibatches {cfg.minibatches} exceeds the number of responses per "
                            f"batch (--contexts x --group = {cfg.contexts * cfg.group})")
    if args.out is not None and args.out.suffix.lower() not in (".png", ".svg"):
        return _usage_error(f"--out {args.out}: the figure's name must end in .png or .svg")
    if args.optimizer == "sgd" and (args.task == "rewarded" or args.lr is None):
        return _usage_error("--optimizer sgd: only with --task random-reward or rare-correct, and with --lr "
                            "(plain gradient steps need a far larger rate than Adam's 0.05)")
    size_error = _size_error(cfg)
    if size_error:
        return _usage_error(size_error)
    methods = args.methods or (list(METHODS) if args.task == "rewarded" else list(TASK_METHODS))
    foreign = [m for m in methods if m not in (METHODS if args.task == "rewarded" else TASK_METHODS)]
    if foreign:
        return _usage_error(f"--methods: {','.join(foreign)} not in --task {args.task}")
    if args.out is not None:   # before the run, which the figure would otherwise outlive only to be lost
        out_error = _unwritable(args.out)
        if out_error:
            return _usage_error(out_error)
    n_seeds = args.seeds or ((1 if args.quick else 5) if args.task == "rewarded" else (2 if args.quick else 5))
    seeds = list(range(args.seed, args.seed + n_seeds))
    if args.task != "rewarded":
        from bandpo_lut.cli.demo import report as demo_tasks_report
        return demo_tasks_report.run(args.task, methods, seeds, cfg, args.out, args.every, args.optimizer)
    print(f"BandPO demo: {len(seeds)} seed(s) x {cfg.steps} steps; {cfg.contexts} contexts, vocab "
          f"{cfg.vocab} (initial logits ~ N(0, {cfg.init_scale}^2)), {cfg.good} rewarded tokens per "
          f"context drawn from initial ranks {cfg.good_ranks[0]}..{cfg.good_ranks[1] - 1}; groups of "
          f"{cfg.group} responses x {cfg.tokens} tokens; {cfg.epochs * cfg.minibatches} Adam updates "
          f"(lr {cfg.lr}) per batch; max_ratio {cfg.max_ratio} for dcpo and bandpo; loss: bandpo_lut.policy_loss "
          f"(dppo: bandpo_lut.reference.dppo, verl's dppo_kl)")

    start = time.perf_counter()
    history = {}  # method -> quantity -> tensor (seeds, steps)
    for method in methods:
        runs = [train(method, seed, cfg) for seed in seeds]
        history[method] = {k: torch.stack([r[k] for r in runs]) for k in runs[0]}
    elapsed = time.perf_counter() - start

    every = args.every or max(1, cfg.steps // 10)
    print_table(history, cfg.steps, every)
    print(summary_line(history))
    print(f"({elapsed:.1f} s of training, {torch.get_num_threads()} thread(s))")
    if args.out is not None:
        plot_history(history, args.out, cfg, len(seeds))
        print(f"figure written to {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# the task and the training loop

# counts kept per step; the rates are ratios of their sums (exact over updates, steps and seeds)
KEPT = ("n_tokens", "n_clipped", "n_lowprob_pos", "n_clipped_upper_lowprob")


def make_task(seed: int, cfg: Config):
    """Initial logits (contexts, vocab) and the rewarded-token indicator, from `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(cfg.contexts, cfg.vocab, generator=g) * cfg.init_scale
    ranks = torch.argsort(logits, dim=1, descending=True)
    lo, hi = cfg.good_ranks
    pick = torch.stack([torch.randperm(hi - lo, generator=g)[:cfg.good] for _ in range(cfg.contexts)]) + lo
    good = torch.zeros(cfg.contexts, cfg.vocab, dtype=torch.bool)
    good.scatter_(1, torch.gather(ranks, 1, pick), True)
    return logits, good


def method_kwargs(method: str, cfg: Config) -> dict:
    return _task_method_kwargs(method, cfg, METHODS)


def train(method: str, seed: int, cfg: Config) -> dict:
    """One GRPO run; returns per-step tensors: entropy, reward, rates and the KEPT counts."""
    logits0, good = make_task(seed, cfg)
    theta = torch.nn.Parameter(logits0.clone())
    opt = torch.optim.Adam([theta], lr=cfg.lr)
    kwargs = method_kwargs(method, cfg)
    sampler = torch.Generator().manual_seed(10_000 + seed)  # same sampling stream for every method
    C, G, T = cfg.contexts, cfg.group, cfg.tokens
    context_of = torch.arange(C).repeat_interleave(G)  # response -> its context
    out = {k: torch.zeros(cfg.steps) for k in ("entropy", "reward") + KEPT}
    for step in range(cfg.steps):
        with torch.no_grad():  # roll out: G responses of T tokens per context
            logp_all = torch.log_softmax(theta, dim=1)
            out["entropy"][step] = -(logp_all.exp() * logp_all).sum(1).mean()
            tokens = torch.multinomial(logp_all.exp(), G * T, replacement=True, generator=sampler)
            old_lp = torch.gather(logp_all, 1, tokens).view(C * G, T)
            reward = torch.gather(good, 1, tokens).view(C, G, T).float().mean(-1)
            adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
            adv = adv.view(C * G, 1).expand(C * G, T)  # every token gets its response's advantage
            tokens = tokens.view(C * G, T)
            out["reward"][step] = reward.mean()
        for _ in range(cfg.epochs):  # PPO: minibatches of responses drawn across all contexts
            for idx in torch.randperm(C * G, generator=sampler).chunk(cfg.minibatches):
                lp = torch.gather(torch.log_softmax(theta, dim=1)[context_of[idx]], 1, tokens[idx])
                loss, metrics = method_loss(lp, old_lp[idx], adv[idx], kwargs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                for k in KEPT:
                    out[k][step] += metrics[k].detach()
    out["clip_frac"] = _rate(out["n_clipped"], out["n_tokens"])
    out["lowprob_clip_high"] = _rate(out["n_clipped_upper_lowprob"], out["n_lowprob_pos"])
    return out


def _windowed_rate(num: torch.Tensor, den: torch.Tensor, window: int) -> torch.Tensor:
    """sum(num) / sum(den) over the trailing `window` steps, per seed (rows)."""
    kernel = torch.ones(1, 1, window)
    pad = torch.nn.functional.pad

    def trailing_sum(x):
        return torch.nn.functional.conv1d(pad(x[:, None], (window - 1, 0)), kernel)[:, 0]

    return _rate(trailing_sum(num), trailing_sum(den))


def _rate(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num))


# ---------------------------------------------------------------------------------------------
# reporting


def print_table(history: dict, steps: int, every: int) -> None:
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


def summary(history: dict) -> dict:
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


def summary_line(history: dict) -> str:
    parts = [f"{m}: final entropy {s['entropy']:.3f}, low-prob clip-high rate {s['lowprob_clip_high']:.4f}"
             f" (clip_frac {s['clip_frac']:.4f}, final reward {s['reward']:.3f})"
             for m, s in summary(history).items()]
    return "summary (rates over the whole run, reward over the last tenth): " + "; ".join(parts)


def plot_history(history: dict, out: Path, cfg: Config, n_seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), constrained_layout=True)
    steps = torch.arange(cfg.steps)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
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
                    ls=STYLES[method])
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
                color=colors[method], ls=STYLES[method])
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


def _plot_upper_bounds(ax, history: dict, cfg: Config, colors: dict) -> None:
    """Each method's ratio bounds against p_old, to read the clip rates above."""
    p = torch.logspace(-4, 0, 400, dtype=torch.float64)
    for method in history:
        lo, up = method_bounds(p, method_kwargs(method, cfg))
        ax.plot(p, up, color=colors[method], lw=1.8, label=method, ls=STYLES[method])
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


# ---------------------------------------------------------------------------------------------
# argument types (argparse turns their ValueErrors/ArgumentTypeErrors into exit-2 errors)


_positive_int = int_at_least(1)
_positive_float = number_in(0, lo_open=True)


def _methods(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or text!r}; choose from "
                                         f"{','.join(ALL_METHODS)}")
    return list(dict.fromkeys(names))


def _group_size(text: str) -> int:
    """--group: GRPO normalises advantages by the group's standard deviation, undefined for one response."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (advantages are normalised within a "
                                         f"group, which needs two responses), got {text!r}")
    return value


def _size_error(cfg: Config) -> str | None:
    """A message if the run would hold more than the demo's limits (MAX_LOGITS, MAX_BATCH_TOKENS)."""
    logits = cfg.contexts * cfg.vocab
    if logits > MAX_LOGITS:
        return (f"--contexts {cfg.contexts} x --vocab {cfg.vocab} = {logits} logits exceeds this toy's limit "
                f"of {MAX_LOGITS}")
    batch = cfg.contexts * cfg.group * cfg.tokens
    if batch > MAX_BATCH_TOKENS:
        return (f"--contexts {cfg.contexts} x --group {cfg.group} x --tokens {cfg.tokens} = {batch} sampled "
                f"tokens per batch exceeds this toy's limit of {MAX_BATCH_TOKENS}")
    return None


def _unwritable(out: Path) -> str | None:
    """A message if the figure cannot be written at `out` (checked before the run; creates its folder)."""
    if out.is_dir():
        return f"--out {out}: is a folder; give a file name ending in .png or .svg"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        existed = out.exists()
        with open(out, "ab"):
            pass
        if not existed:
            out.unlink()
    except OSError as e:
        return f"--out {out}: cannot write the figure there ({e.strerror or e})"
    return None


def _out_path(text: str) -> Path | None:
    return None if text.lower() == "none" else Path(text)


def _rank_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI, got {text!r}")
    return lo, hi
