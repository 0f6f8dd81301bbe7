"""The `bandpo-lut` command line: one subcommand per module, each module owning its arguments.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; importing them lazily
keeps `bandpo-lut --help` fast and keeps heavy imports (matplotlib, mpmath) out of unrelated commands.

Errors a user can cause print one line and no traceback: a bad argument, found by argparse or by a
command's `run` (which raises `UsageError`), prints the usage and `bandpo-lut COMMAND: error: ...` and
exits 2, as argparse does; a file that cannot be read or written, a bad table, or a missing compiled extension prints
`bandpo-lut COMMAND: error: ...` and exits 1; Ctrl-C prints `bandpo-lut COMMAND: interrupted` and exits 130.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "generate": ("bandpo_lut.generate", "compute a bound table for one divergence with mpmath"),
    "verify": ("bandpo_lut.verify", "check table files against mpmath and for monotonicity"),
    "demo": ("bandpo_lut.demo", "toy GRPO run comparing canonical clip, clip-higher, DCPO and BandPO"),
    "plot": ("bandpo_lut.plot", "plot the bands against p, with the fixed clips overlaid"),
    "bench": ("bandpo_lut.bench", "time clip and the fused loss against torch baselines"),
    "info": ("bandpo_lut.info", "build information and each table's provenance"),
}


class UsageError(Exception):
    """A bad command-line argument that a command finds in `run` (e.g. one that depends on another, or an
    output path that cannot be written); the message names the argument. Reported like argparse's errors."""


def max_ratio_arg(text: str) -> float | None:
    """argparse type of --max-ratio (demo, plot): a number >= 1, or 'none' for no cap."""
    if text.lower() == "none":
        return None
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'none', got {text}")
    return value


def int_at_least(lo: int):
    """argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value
    return parse


def int_in(lo: int, hi: int, why: str = "the most one run can afford"):
    """argparse type: an integer in [lo, hi] (hi: what one run can afford, in memory or time)."""
    def parse(text: str) -> int:
        value = int_at_least(lo)(text)
        if value > hi:
            raise argparse.ArgumentTypeError(f"expected an integer <= {hi} ({why}), got {text!r}")
        return value
    return parse


def available_memory(device=None) -> int | None:
    """Bytes a run can still allocate on `device` (None or "cpu": MemAvailable of /proc/meminfo, else the
    physical pages free; a CUDA device: its free memory); None where unknown."""
    if device is not None and str(device).startswith("cuda"):
        import torch
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(flags: str, need: float, device=None) -> None:
    """Refuse (UsageError naming `flags`) a run whose estimated memory `need` (bytes) exceeds what is free."""
    have = available_memory(device)
    if have is not None and need > have:
        raise UsageError(f"{flags}: this run needs about {need / 2 ** 30:.3g} GiB of memory"
                         f"{' on ' + str(device) if device else ''}, but only {have / 2 ** 30:.3g} GiB is "
                         "available; lower it")


def number_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False):
    """argparse type: a finite number in [lo, hi] (or (lo, hi] with lo_open); a missing end is unbounded."""
    left = "(" if lo_open else "["
    what = ("a finite number" if lo is None and hi is None else
            f"a number > {lo:g}" if hi is None and lo_open else
            f"a number >= {lo:g}" if hi is None else
            f"a number in {left}{lo:g}, {hi:g}]")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (lo is None or (value > lo if lo_open else value >= lo)) and \
            (hi is None or value <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    try:
        parser = argparse.ArgumentParser(prog="bandpo-lut", description="BandPO trust-region ratio bounds.")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        sub.required = True
        parsers = {}
        for name, (module_name, help_text) in SUBCOMMANDS.items():
            sp = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
            if name == command:
                importlib.import_module(module_name).add_arguments(sp)
        args = parser.parse_args(argv)
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
        try:
            return int(module.run(args) or 0)
        except UsageError as e:
            parsers[args.command].error(str(e))     # usage + "bandpo-lut COMMAND: error: ...", exit 2
        except (OSError, ImportError) as e:         # a file that cannot be read or written; no compiled extension
            print(f"bandpo-lut {args.command}: error: {e}", file=sys.stderr)
            return 1
        except ValueError as e:
            from .table_format import TableFormatError
            if not isinstance(e, TableFormatError):
                raise
            print(f"bandpo-lut {args.command}: error: {e}", file=sys.stderr)
            return 1
    except KeyboardInterrupt as e:
        detail = f"; {e}" if str(e) else ""
        print(f"bandpo-lut{' ' + command if command else ''}: interrupted{detail}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run as `python -m bandpo_lut.cli`: call the main of the imported module `bandpo_lut.cli`, not of this
    # `__main__` copy, so that the commands' `UsageError` is the class `main` catches.
    from bandpo_lut.cli import main as _main
    sys.exit(_main())
