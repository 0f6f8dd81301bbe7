"""Every task of `bandpo-lut demo` behind one interface (`Task`): its methods, its default length, the checks of
its arguments and its run. `command` parses the arguments and hands them to the task named by --task."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Protocol

# Sizes past these are refused before any work: the tabular tasks hold the logits and their Adam states
# (contexts x vocab) and a batch's sampled tokens (contexts x group x tokens) in memory several times over.
MAX_LOGITS = 10_000_000
MAX_BATCH_TOKENS = 1_000_000


class Task(Protocol):
    name: str
    help: str                  # one phrase for --task's help
    methods: tuple[str, ...]   # the --methods names it compares, in the order it reports them

    def defaults(self, quick: bool) -> tuple[int, int]:
        """(steps, seeds) when --steps / --seeds are not given."""

    def check(self, args: argparse.Namespace) -> str | None:
        """A usage error message for arguments this task cannot run with, else None (checked before any work)."""

    def run(self, args: argparse.Namespace, methods: list[str], seeds: list[int], steps: int) -> int:
        """Train `methods` on `seeds` for `steps` steps, print the report, write the figure at args.out (unless
        None); the exit status."""


@dataclass(frozen=True)
class TabularTask:
    """A task on the tabular softmax policy (`tasks`), reported by `report`."""
    name: str
    help: str
    steps: tuple[int, int]    # (--quick, full)
    seeds: tuple[int, int]

    @property
    def methods(self) -> tuple[str, ...]:
        from bandpo_lut.cli.demo.tasks import task_methods
        return tuple(task_methods(self.name))

    def defaults(self, quick: bool) -> tuple[int, int]:
        return self.steps[not quick], self.seeds[not quick]

    def check(self, args: argparse.Namespace) -> str | None:
        lo, hi = args.good_ranks
        if self.name == "rare-correct" and lo < 1:
            return (f"--good-ranks {lo},{hi}: rank 0 is the common correct token of --task rare-correct; the rare "
                    f"ones start at rank 1 or later")
        if self.name != "random-reward" and (hi > args.vocab or hi - lo < args.good):
            return (f"--good-ranks {lo},{hi} must lie within the vocabulary (--vocab {args.vocab}) and hold at least "
                    f"--good {args.good} tokens")
        if args.minibatches > args.contexts * args.group:
            return (f"--minibatches {args.minibatches} exceeds the number of responses per batch (--contexts x "
                    f"--group = {args.contexts * args.group})")
        if args.optimizer == "sgd" and (self.name == "rewarded" or args.lr is None):
            return ("--optimizer sgd: only with --task random-reward or rare-correct, and with --lr (plain gradient "
                    "steps need a far larger rate than Adam's 0.05)")
        logits = args.contexts * args.vocab
        if logits > MAX_LOGITS:
            return (f"--contexts {args.contexts} x --vocab {args.vocab} = {logits} logits exceeds this toy's limit "
                    f"of {MAX_LOGITS}")
        batch = args.contexts * args.group * args.tokens
        if batch > MAX_BATCH_TOKENS:
            return (f"--contexts {args.contexts} x --group {args.group} x --tokens {args.tokens} = {batch} sampled "
                    f"tokens per batch exceeds this toy's limit of {MAX_BATCH_TOKENS}")
        return None

    def run(self, args: argparse.Namespace, methods: list[str], seeds: list[int], steps: int) -> int:
        from bandpo_lut.cli.demo import report
        from bandpo_lut.cli.demo.tasks import TaskConfig

        cfg = TaskConfig(
            task=self.name, optimizer=args.optimizer, steps=steps, contexts=args.contexts, vocab=args.vocab,
            good=args.good, good_ranks=args.good_ranks, tokens=args.tokens, group=args.group, epochs=args.epochs,
            minibatches=args.minibatches, lr=args.lr or 0.05, init_scale=args.init_scale, max_ratio=args.max_ratio)
        return report.run(methods, seeds, cfg, args.out, args.every)


def _dag_paths() -> Task:
    from bandpo_lut.cli.demo.dag.task import DagPathsTask
    return DagPathsTask()


TASKS: dict[str, Task] = {t.name: t for t in (
    TabularTask("rewarded", "rewarded (default): rewarded tokens that start rare", steps=(60, 100), seeds=(1, 5)),
    TabularTask("random-reward", "random-reward: a coin flip per response (zero expected gradient)",
                steps=(50, 200), seeds=(2, 5)),
    TabularTask("rare-correct", "rare-correct: the top token and rare tokens are equally correct",
                steps=(50, 200), seeds=(2, 5)),
    _dag_paths(),
)}
# every --methods name of every task (the later tasks' first: no-clip leads the list)
ALL_METHODS = tuple(dict.fromkeys(m for t in reversed(TASKS.values()) for m in t.methods))
