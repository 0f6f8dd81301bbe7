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
import sys

from bandpo_lut.cli.args import UsageError

# name -> (module, one-line help)
SUBCOMMANDS = {
    "generate": ("bandpo_lut.cli.generate", "compute a bound table for one divergence with mpmath"),
    "verify": ("bandpo_lut.cli.verify", "check table files against mpmath and for monotonicity"),
    "demo": ("bandpo_lut.cli.demo.command",
             "toy GRPO run comparing canonical clip, clip-higher, DCPO, DPPO and BandPO"),
    "plot": ("bandpo_lut.cli.plot", "plot the bands against p, with the fixed clips overlaid"),
    "bench": ("bandpo_lut.cli.bench.command", "time clip and the fused loss against torch baselines"),
    "info": ("bandpo_lut.cli.info", "build information and each table's provenance"),
}


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
            from bandpo_lut.tables.table_format import TableFormatError
            if not isinstance(e, TableFormatError):
                raise
            print(f"bandpo-lut {args.command}: error: {e}", file=sys.stderr)
            return 1
    except KeyboardInterrupt as e:
        detail = f"; {e}" if str(e) else ""
        print(f"bandpo-lut{' ' + command if command else ''}: interrupted{detail}", file=sys.stderr)
        return 130

