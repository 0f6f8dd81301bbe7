"""`--task dag-paths` behind the demo registry's interface: its defaults, its argument checks, and the run that prints
the design, the progress (stderr), the report and writes the figure."""
from __future__ import annotations

import argparse
import resource
import time

from bandpo_lut.cli.demo.dag.train import ARMS, REFERENCE, DagConfig

# The tabular tasks' options and their defaults: dag-paths fixes its own sizes (docs/demo.md), so a value given for
# one of these would be silently ignored; it is refused instead.
TABULAR_ONLY = {"contexts": 32, "vocab": 2000, "good": 8, "good_ranks": (10, 100), "tokens": 16, "group": 8,
                "epochs": 2, "minibatches": 4, "lr": None, "init_scale": 4.0, "max_ratio": 10.0, "every": None}


class DagPathsTask:
    name = "dag-paths"
    help = ("dag-paths: a small GPT trained from scratch on paths through a random layered graph, then GRPO "
            "under each clip")
    methods = tuple(ARMS)

    def defaults(self, quick: bool) -> tuple[int, int]:
        return DagConfig.steps, 1 if quick else 5

    def check(self, args: argparse.Namespace) -> str | None:
        given = [k for k, default in TABULAR_ONLY.items() if getattr(args, k) != default]
        if given:
            name = "--" + given[0].replace("_", "-")
            return (f"{name}: an option of the tabular tasks; --task dag-paths fixes its own sizes and settings "
                    f"(docs/demo.md)")
        if args.methods is not None and REFERENCE not in args.methods:
            return (f"--methods: --task dag-paths compares every arm with {REFERENCE}, the reference; include it "
                    f"(got {','.join(args.methods)})")
        if args.optimizer != "adam":
            return "--optimizer sgd: --task dag-paths trains with Adam only"
        return None

    def run(self, args: argparse.Namespace, methods: list[str], seeds: list[int], steps: int) -> int:
        from bandpo_lut.cli.demo.dag import experiment, report

        base = DagConfig()
        cfg = DagConfig(steps=steps)
        settings = base.settings[:1] if args.quick else base.settings
        rewards = ("path",) if args.quick else experiment.REWARDS
        plan = experiment.Plan(cfg=cfg, arms=tuple(methods), settings=settings, rewards=rewards)
        g = cfg.graph
        print(f"BandPO demo --task dag-paths{' --quick' if args.quick else ''}: {len(seeds)} seed(s) "
              f"({seeds[0]}..{seeds[-1]}); per seed one random graph of {g.layers} layers x {g.width} nodes (edge "
              f"probability {g.edge_prob}), prompts = (start, target) pairs with >= 2 paths, answer = the "
              f"{g.layers - 2} inner nodes; a GPT of {cfg.depth} layers, width {cfg.dim}, {cfg.heads} heads, from "
              f"scratch; warm-up: {cfg.warmup_steps} Adam steps (lr {cfg.warmup_lr:g}, batch {cfg.warmup_batch}) on "
              f"targets canonical {cfg.canonical_share:.0%} / other valid {cfg.alt_share:.0%} / wrong "
              f"{1 - cfg.canonical_share - cfg.alt_share:.0%}; GRPO: every prompt, groups of {cfg.group}, "
              f"{steps} rollout batches, token-mean, no KL, no entropy bonus; {REFERENCE}: one update per batch of "
              f"a minibatch's prompts, as many updates as the others; loss: bandpo_lut.policy_loss for every arm; "
              f"settings: " + "; ".join(f"{s.name} {s.epochs} epochs x {s.minibatches} minibatches, lr {s.lr:g}"
                                        for s in settings)
              + f"; rewards: {', '.join(rewards)}; {min(args.jobs, len(seeds))} worker process(es), CPU", flush=True)
        for arm in methods:
            print(f"  {arm}: " + ", ".join(f"{k}={v}" for k, v in ARMS[arm].items()), flush=True)
        start = time.perf_counter()
        results = experiment.run(plan, seeds, args.jobs)
        elapsed = time.perf_counter() - start
        report.print_report(results, plan)
        cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        print(f"({elapsed:.1f} s wall for the runs; {cpu:.1f} s CPU for the whole command, workers included)")
        if args.out is not None:
            report.plot(results, plan, args.out)
            print(f"figure written to {args.out}")
        return 0
