"""The argument types and checks the subcommands share (argparse `type=` callables, `UsageError`, the memory
check), below every subcommand so that none imports the command-line entry point."""
from __future__ import annotations

import argparse
import math
import os


class UsageError(Exception):
    """A bad command-line argument that a command finds in `run` (e.g. one that depends on another, or an
    output path that cannot be written); the message names the argument. Reported like argparse's errors."""


def max_ratio_arg(text: str) -> float | None:
    """argparse type of --max-ratio (demo, plot): a number >= 1, or 'none' for no cap."""
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1 or 'none', got {text!r}")
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
