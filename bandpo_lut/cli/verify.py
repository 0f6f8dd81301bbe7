"""`bandpo-lut verify FILE...`: the command line of `bandpo_lut.tables.verify` (what is checked, and how, is
in that module's docstring)."""
from __future__ import annotations

from bandpo_lut.tables.verify import MAX_DENSE, MAX_POINTS, verify_file


def add_arguments(parser):
    from bandpo_lut.cli.args import int_at_least, int_in, number_in

    parser.add_argument("files", nargs="+", metavar="FILE", help=".bplut table files")
    parser.add_argument("--points", type=int_in(1, MAX_POINTS), default=2000, help="random off-grid points per table")
    parser.add_argument("--seed", type=int_at_least(0), default=12345,
                        help="seed of the random points (default %(default)s)")
    parser.add_argument("--dense-p", type=int_in(2, MAX_DENSE), default=4000, help="p values of the monotonicity grid")
    parser.add_argument("--dense-delta", type=int_in(2, MAX_DENSE), default=200,
                        help="delta values of the monotonicity grid")
    parser.add_argument("--tolerance", type=number_in(0), default=None,
                        help="largest error allowed, overriding the table's stated tolerance (default: its "
                             "header's, else 1e-6); 0 demands exact agreement with mpmath in float64")


def run(args) -> int:
    """Every file is checked and reported, whatever happened to the ones before; exit 1 if any failed."""
    from bandpo_lut.cli.args import check_memory

    check_memory("--dense-p/--dense-delta", 80 * args.dense_p * args.dense_delta)
    results = [verify_file(f, args.points, args.seed, args.dense_p, args.dense_delta, args.tolerance)
               for f in args.files]
    failed = [f for f, ok in zip(args.files, results) if not ok]
    if len(args.files) > 1:
        print(f"verify: {len(args.files) - len(failed)} of {len(args.files)} files ok"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
