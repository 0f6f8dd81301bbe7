"""`bandpo-lut demo`: toy GRPO runs that show what BandPO changes, each in about a minute on a CPU.

This module holds the arguments of every task and their checks that involve several arguments; the tasks
themselves (their methods, defaults, own checks and runs) sit behind one interface in `registry`: the tabular
tasks are trained by `tasks` and reported by `report` (docs/demo.md says what each task asks and what it showed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bandpo_lut.cli.args import int_at_least, max_ratio_arg, number_in
from bandpo_lut.cli.demo.registry import ALL_METHODS, TASKS

# The figure's default name: in the current directory, and not the repository's tracked
# docs/demo.png (regenerate that one with `--out docs/demo.png`).
DEFAULT_OUT = "bandpo-demo.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=tuple(TASKS), default="rewarded",
                        help="; ".join(t.help for t in TASKS.values()) + " (docs/demo.md)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller run that finishes in well under a minute")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="GRPO steps (batches) per run (default 100, other tasks 200; --quick: 60, "
                             "other tasks 50)")
    parser.add_argument("--seeds", type=_positive_int, default=None,
                        help="number of seeds, averaged (default 5; --quick: 1, other tasks 2)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--methods", type=_methods, default=None,
                        help=f"comma-separated subset of {','.join(TASKS['rewarded'].methods)} (default: all), "
                             f"and no-clip for the other tasks; --task dag-paths: of "
                             f"{','.join(TASKS['dag-paths'].methods)}")
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
    parser.add_argument("--jobs", type=_positive_int, default=2,
                        help="worker processes for --task dag-paths, one seed each at a time (default 2; the results "
                             "do not depend on it)")
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
    task = TASKS[args.task]
    error = task.check(args)
    if error:
        return _usage_error(error)
    if args.out is not None and args.out.suffix.lower() not in (".png", ".svg"):
        return _usage_error(f"--out {args.out}: the figure's name must end in .png or .svg")
    methods = args.methods or list(task.methods)
    foreign = [m for m in methods if m not in task.methods]
    if foreign:
        return _usage_error(f"--methods: {','.join(foreign)} not in --task {args.task}")
    if args.out is not None:   # before the run, which the figure would otherwise outlive only to be lost
        out_error = _unwritable(args.out)
        if out_error:
            return _usage_error(out_error)
    default_steps, default_seeds = task.defaults(args.quick)
    seeds = list(range(args.seed, args.seed + (args.seeds or default_seeds)))
    return task.run(args, methods, seeds, args.steps or default_steps)


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
