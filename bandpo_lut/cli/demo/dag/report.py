"""The dag-paths report: the pre-registered endpoints (each arm's final normalised entropy over the valid paths and
coverage, paired against the one-update reference per seed: mean difference ± SE, claimed only beyond 2 SE), the
per-seed values, the secondary metrics and clip rates, and a figure (mean ± SE over seeds against Adam updates)."""
from __future__ import annotations

from pathlib import Path

import torch

from bandpo_lut.cli.demo.dag.metrics import NAMES
from bandpo_lut.cli.demo.dag.train import REFERENCE
from bandpo_lut.cli.demo.tasks import P_BUCKETS

PRIMARY = ("entropy", "coverage")
LABELS = {"pass1": "pass@1 (exact)", "entropy": "entropy over valid paths / log|V|",
          "coverage": "coverage: distinct valid paths in 64 samples / |V|", "paths5": "valid paths with >= 5% of the "
          "correct mass", "noncanonical": "mass on non-canonical valid paths"}


def stack(results: dict, key: tuple, name: str) -> torch.Tensor:
    """(seeds, evals) of one quantity of one (setting, reward, arm), seeds in order."""
    return torch.stack([results[s][key][name] for s in sorted(results)])


def mean_se(x: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error over the first dimension (SE 0 for one seed)."""
    n = x.shape[0]
    return float(x.mean(0)), float(x.std(0) / n ** 0.5) if n > 1 else 0.0


def paired(arm: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, str]:
    """The pre-registered comparison: d = arm - reference per seed; (mean d, SE of d, verdict)."""
    d, se = mean_se(arm - ref)
    if arm.shape[0] < 2:
        return d, se, "one seed: no claim"
    if abs(d) > 2 * se:
        return d, se, "higher" if d > 0 else "lower"
    return d, se, "null (within 2 SE)"


def clip_rates(results: dict, key: tuple) -> dict:
    """Pooled over seeds: the clip fraction of all tokens and of the tokens with A != 0, and clip-up / clip-down
    rates per p_old bucket (up: A > 0 and r > upper bound among A > 0; down: A < 0 and r < lower among A < 0)."""
    def total(name):
        return sum(results[s][key][name] for s in results)

    def rate(a, b):
        return torch.where(b > 0, a / b.clamp(min=1), torch.zeros_like(a))

    signed = (total("n_high").sum() + total("n_low").sum()) / (total("n_pos").sum() + total("n_neg").sum())
    return {"all": float(total("n_clipped") / total("n_tokens")), "signed": float(signed),
            "up": rate(total("n_high"), total("n_pos")), "down": rate(total("n_low"), total("n_neg")),
            "dual": float(total("n_dual_clipped"))}


def print_report(results: dict, plan) -> None:
    seeds = sorted(results)
    warm = {k: mean_se(torch.stack([results[s]["warmup"][k] for s in seeds])) for k in NAMES}
    print(f"warm-up checkpoints ({len(seeds)} seeds): " + ", ".join(f"{k} {m:.3f} ± {se:.3f}"
                                                                for k, (m, se) in warm.items()))
    for setting in plan.settings:
        for reward in plan.rewards:
            _print_block(results, plan, setting, reward)


def _print_block(results: dict, plan, setting, reward: str) -> None:
    seeds = sorted(results)
    print()
    print(f"== {setting.name} ({setting.epochs} epochs x {setting.minibatches} minibatches, lr {setting.lr:g}), "
          f"{'reward = path' if reward == 'path' else 'random-reward control'}; final values, mean ± SE over "
          f"{len(seeds)} seed(s)")
    width = max(len(a) for a in plan.arms)
    head = (f"{'arm':<{width}}  {'pass@1':>13}  {'entropy':>13}  {'coverage':>13}  {'paths>=5%':>11}  "
            f"{'non-canon':>11}  {'clip':>6}  {'clip|A!=0':>9}  {'KL/batch':>8}")
    print(head)
    print("-" * len(head))
    for arm in plan.arms:
        key = (setting.name, reward, arm)
        final = {k: mean_se(stack(results, key, k)[:, -1]) for k in NAMES}
        kl = stack(results, key, "kl")[:, :-1].mean()
        c = clip_rates(results, key)
        print(f"{arm:<{width}}  " + "  ".join(f"{final[k][0]:6.3f}±{final[k][1]:.3f}" for k in NAMES[:3])
              + f"  {final['paths5'][0]:5.2f}±{final['paths5'][1]:.2f}  {final['noncanonical'][0]:5.3f}±"
              f"{final['noncanonical'][1]:.3f}  {100 * c['all']:5.1f}%  {100 * c['signed']:8.1f}%  {float(kl):8.4f}")
    print(f"clip-up / clip-down rates by p_old bucket ({', '.join(P_BUCKETS)}), pooled over seeds and updates:")
    for arm in plan.arms:
        c = clip_rates(results, (setting.name, reward, arm))
        print(f"  {arm:<{width}}  " + "  ".join(f"{100 * float(u):5.1f}/{100 * float(d):5.1f}%"
                                                for u, d in zip(c["up"], c["down"]))
              + (f"  (dual-clipped {int(c['dual'])})" if c["dual"] else ""))
    print(f"pre-registered endpoints vs {REFERENCE} (paired per seed; claimed only beyond 2 SE):")
    for name in PRIMARY:
        ref = stack(results, (setting.name, reward, REFERENCE), name)[:, -1]
        print(f"  {name}: {REFERENCE} per seed [{', '.join(f'{v:.3f}' for v in ref.tolist())}]")
        for arm in plan.arms:
            if arm == REFERENCE:
                continue
            x = stack(results, (setting.name, reward, arm), name)[:, -1]
            d, se, verdict = paired(x, ref)
            print(f"    {arm:<{width}}  {d:+.3f} ± {se:.3f}  {verdict:<20}  per seed "
                  f"[{', '.join(f'{v:.3f}' for v in x.tolist())}]")


def plot(results: dict, plan, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = [(s, r) for s in plan.settings for r in plan.rewards]
    rows = ("pass1",) + PRIMARY
    fig, axes = plt.subplots(len(rows), len(blocks), figsize=(3.6 * len(blocks), 2.6 * len(rows)),
                             constrained_layout=True, squeeze=False)
    colors = {a: f"C{i}" for i, a in enumerate(plan.arms)}
    n = len(results)
    for j, (setting, reward) in enumerate(blocks):
        for i, name in enumerate(rows):
            ax = axes[i, j]
            for arm in plan.arms:
                y = stack(results, (setting.name, reward, arm), name)
                updates = torch.arange(y.shape[1]) * plan.cfg.eval_every * setting.updates
                updates[-1] = plan.cfg.steps * setting.updates
                m = y.mean(0)
                ax.plot(updates, m, color=colors[arm], lw=1.5, label=arm, ls=":" if arm == REFERENCE else "-")
                if n > 1:
                    se = y.std(0) / n ** 0.5
                    ax.fill_between(updates, m - se, m + se, color=colors[arm], alpha=0.15, lw=0)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"{setting.name}, {'path reward' if reward == 'path' else 'random reward'}", fontsize=9)
            if i == len(rows) - 1:
                ax.set_xlabel("Adam updates")
            if j == 0:
                ax.set_ylabel(LABELS[name], fontsize=8)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"demo --task dag-paths: {n} seed(s), mean ± SE", fontsize=10)
    fig.savefig(out, dpi=70)
    plt.close(fig)
