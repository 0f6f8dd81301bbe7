"""The `bandpo-lut` command line: one subcommand per module, each module owning its arguments.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; importing them lazily
keeps `bandpo-lut --help` fast and keeps heavy imports (matplotlib, mpmath) out of unrelated commands.
"""
from __future__ import annotations

import argparse
import importlib
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


def max_ratio_arg(text: str) -> float | None:
    """argparse type of --max-ratio (demo, plot): a number >= 1, or 'none' for no cap."""
    if text.lower() == "none":
        return None
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'none', got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bandpo-lut", description="BandPO trust-region ratio bounds.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sp)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
