"""`bandpo-lut generate`: the command line of `bandpo_lut.tables.generate` (its arguments, the checks that
involve several of them, the atomic write). The math and the run time are in that module's docstring."""
from __future__ import annotations

import os
import stat
import sys

from bandpo_lut.tables import divergences, table_format
from bandpo_lut.tables.generate import (
    _COST_ARGS,
    COST_LIMIT,
    DEFAULTS,
    MAX_WORKERS,
    SECONDS_PER_SOLVE,
    T_MAX_LIMIT,
    GridError,
    _check_grid,
    estimated_cost,
    generate,
)


def add_arguments(parser):
    from bandpo_lut.cli.args import int_at_least, int_in, number_in

    parser.add_argument("--divergence", "-d", required=True, choices=divergences.names(),
                        help=f"one of {divergences.names()}")
    parser.add_argument("--out", "-o", default=None,
                        help="output file (default: tables/DIVERGENCE.bplut under the current directory, the "
                             "checkout's tables/ when run from its root)")
    parser.add_argument("--t-max", type=number_in(0, T_MAX_LIMIT, lo_open=True), default=DEFAULTS["t_max"],
                        help="grid covers |logit p| <= T; the tails need T large enough for the divergence and "
                             "delta range (the error says how large; default %(default)g)")
    parser.add_argument("--t-density", type=int_at_least(1), default=DEFAULTS["t_density"],
                        help="nodes per unit of logit p (a power of two keeps the spacing exact; default "
                             "%(default)s)")
    parser.add_argument("--delta-min", type=number_in(0, lo_open=True), default=DEFAULTS["delta_min"],
                        help="smallest delta the table covers (default %(default)g)")
    parser.add_argument("--delta-max", type=number_in(0, lo_open=True), default=DEFAULTS["delta_max"],
                        help="largest delta the table covers (default %(default)g)")
    parser.add_argument("--s-nodes", type=int_at_least(4), default=DEFAULTS["s_nodes"],
                        help="nodes in log(delta) (default %(default)s)")
    parser.add_argument("--ghost", type=int_at_least(0), default=DEFAULTS["ghost"],
                        help="extra fit nodes beyond each edge (default %(default)s)")
    parser.add_argument("--dps", type=int_at_least(30), default=DEFAULTS["dps"],
                        help="mpmath working digits (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=DEFAULTS["dtype"],
                        help="storage dtype of the coefficients (default %(default)s)")
    parser.add_argument("--accuracy-points", type=int_at_least(0), default=DEFAULTS["accuracy_points"],
                        help="random off-grid points the accuracy stamp is measured at against mpmath "
                             "(default %(default)s; 0: no stamp)")
    parser.add_argument("--workers", type=int_in(0, MAX_WORKERS, "processes: past the cores they only add memory"),
                        default=0, help="processes (default: all cores; never more than the table's rows of "
                                        "log(delta), --s-nodes + 2 --ghost)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out, a regular file only (its mode is kept; a symbolic link "
                             "stays one and its target is replaced); never a folder, FIFO, device or socket")
    parser.add_argument("--allow-expensive", action="store_true",
                        help="run a table past the cost limit (hours of CPU time; a consent of its own, apart "
                             "from --force's)")
    parser.add_argument("--allow-inaccurate", action="store_true",
                        help="exit 0 even when the measured error exceeds the tolerance stamped in the file")


def _check_args(a):
    """The checks that involve several arguments (argparse has checked each alone); raises UsageError."""
    from bandpo_lut.cli.args import UsageError

    div = divergences.get(a.divergence)
    cost = estimated_cost(a.t_max, a.t_density, a.s_nodes, a.ghost, a.dps, a.accuracy_points)
    if cost > COST_LIMIT and not a.allow_expensive:
        raise UsageError(
            f"--t-density/--s-nodes/--ghost/--dps/--accuracy-points: this table needs about {cost:.3g} node solves "
            f"(counted at 40 digits), about {cost * SECONDS_PER_SOLVE / 3600:.3g} CPU-hours and memory in "
            f"proportion, past the limit of {COST_LIMIT:.3g} (the default table: "
            f"{estimated_cost(**{k: DEFAULTS[k] for k in _COST_ARGS}):.3g}, a minute on 2 cores); "
            "add --allow-expensive to run it anyway")
    if not a.delta_min < a.delta_max:
        raise UsageError(f"--delta-min/--delta-max: expected min < max, got {a.delta_min:g} and {a.delta_max:g}")
    try:
        _check_grid(div, a.t_max, a.t_density, a.delta_min, a.delta_max)
    except GridError as e:
        raise UsageError(f"--t-max: {e.detail}") from None
    return div


# What `generate --force` will not replace: everything but a regular file (a link to one is written through).
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_a_regular_file(path: str) -> str | None:
    """What `path` (followed through links) is when it exists and is not a regular file, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:             # absent, or a dangling link: a new file
        return None
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _write_new(target: str, out: str, blob: bytes, mode: int) -> None:
    """Write `blob` to `target`, which did not exist when the run started, without replacing whatever another
    process put there since: the table is written beside it, then hard-linked into place (which fails where the
    name exists) and its temporary name removed. Where that happens, the table stays under its temporary name,
    and the error says where."""
    tmp = table_format.write_beside(target, blob, mode)
    keep = False
    try:
        try:
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise
            except OSError:      # no hard links on this file system: claim the name exclusively, then fill it
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
                os.replace(tmp, target)
        except FileExistsError:
            keep = True
            raise FileExistsError(
                f"--out: {out} was created by another process while this run computed (another generate to "
                f"the same file?); it was left as it is, and this run's table is in {tmp}: move it over {out} "
                "if it is the one you want") from None
    finally:
        if not keep and os.path.exists(tmp):
            os.unlink(tmp)


def run(args) -> int:
    from bandpo_lut.cli.args import UsageError

    if args.out == "":
        raise UsageError("--out: an empty path (an unset shell variable?); give a file name, or leave --out "
                         "out for tables/DIVERGENCE.bplut")
    div = _check_args(args)
    out = args.out or os.path.join("tables", f"{div.name}.bplut")
    target, mode, existed = out, 0o644, False
    what = _not_a_regular_file(out)
    if what is not None and what != "a folder":    # a folder: check_writable below says so
        link = "a symbolic link to " if os.path.islink(out) else ""
        raise UsageError(f"--out: {out} is {link}{what}, not a regular file; generate writes only a regular file "
                         "(or a link to one): give another path")
    if os.path.lexists(out) and what is None:
        if not args.force:
            raise UsageError(f"--out: {out} exists; add --force to replace it")
        target = os.path.realpath(out)   # write through a symbolic link: the link stays a link
        if os.path.exists(target):
            mode, existed = stat.S_IMODE(os.stat(target).st_mode), True
    try:
        table_format.check_writable(target)          # before the minutes of computing, not after
    except OSError as e:
        raise UsageError(f"--out: cannot write {out}: {e.strerror or e}") from None
    try:
        blob = generate(div.name, t_max=args.t_max, t_density=args.t_density, delta_min=args.delta_min,
                        delta_max=args.delta_max, s_nodes=args.s_nodes, ghost=args.ghost, dps=args.dps,
                        dtype=args.dtype, accuracy_points=args.accuracy_points, workers=args.workers,
                        progress=not args.quiet)
        if existed:
            what = _not_a_regular_file(target)     # again: minutes have passed since the check above
            if what is not None:
                raise FileExistsError(f"--out: {out} became {what} while this run computed; nothing was written")
            table_format.write_atomic(target, blob, mode=mode)
        else:
            _write_new(target, out, blob, mode)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"no table written ({out} unchanged)") from None
    h = table_format.decode(blob, out).header
    acc = h.get("accuracy", {})
    print(f"wrote {out} ({len(blob)} bytes, sha256 {h[table_format.CHECKSUM_KEY][:16]}...); measured upper "
          f"{acc.get('upper_max_rel_error', 'n/a')}, lower {acc.get('lower_max_error', 'n/a')}")
    worst = max(acc.get("upper_max_rel_error", 0.0), acc.get("lower_max_error", 0.0)) if acc else 0.0
    if acc and not worst <= acc["tolerance"]:
        # With --allow-inaccurate the run succeeds: a warning, not an error, so that the word matches the exit status.
        word, consent = (("warning", "exit 0 as --allow-inaccurate asks") if args.allow_inaccurate else
                         ("error", "--allow-inaccurate exits 0 for it"))
        print(f"bandpo-lut generate: {word}: the measured error {worst:.3g} exceeds the tolerance "
              f"{acc['tolerance']:g} stamped in {out} (a grid too coarse: raise --t-density or --s-nodes); "
              f"the table is written with its measured errors; {consent}", file=sys.stderr)
        return 0 if args.allow_inaccurate else 1
    return 0
