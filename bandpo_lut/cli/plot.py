"""`bandpo-lut plot`: BandPO's bands against the old probability p, next to the fixed clips.

Two panels share a log-scale p axis:
  * the ratio bounds [lo(p), up(p)] (symlog y: linear on [0, 1], logarithmic above, so that both the
    simplex floor r >= 0 and the ceiling r <= 1/p are visible);
  * the allowed change of the token's probability, p*(r - 1): up to p*(up - 1) upwards, down to
    p*(lo - 1) downwards, with the simplex limits 1 - p and -p.
Overlaid: canonical PPO clip [0.8, 1.2], clip-higher [0.8, 1.28] and DCPO (eps 0.16 / 0.2); with `--dppo`, DPPO's
binary regions (verl's `dppo_kl` / `dppo_tv` with clip_ratio = δ) for the divergences it has (kl, tv), solved
from verl's formula without the tables (`bandpo_lut.reference.dppo.ratio_region`) and never capped.
Bounds are what the loss applies (`bandpo_lut.runtime.loss.ratio_bounds`: the compiled band, evaluated in float64).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from bandpo_lut.cli.args import max_ratio_arg
from bandpo_lut.runtime.loss import ratio_bounds

BASELINES = (  # label, clip, eps_low, eps_high, colour, line style
    ("PPO clip 0.8 / 1.2", "fixed", 0.2, 0.2, "0.25", (0, (5, 2))),
    ("clip-higher 0.8 / 1.28", "fixed", 0.2, 0.28, "0.5", (0, (1, 1.5))),
    ("DCPO (0.16 / 0.2)", "dcpo", 0.16, 0.2, "0.35", (0, (6, 2, 1, 2))),
)
DELTA_STYLES = ("-", "--", "-.", ":")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--divergences", type=_names, default=["kl", "tv", "chi2"],
                        help="comma-separated compiled divergences (default kl,tv,chi2)")
    parser.add_argument("--deltas", type=_deltas, default=[0.05, 0.1],
                        help="comma-separated trust-region radii (default 0.05,0.1)")
    parser.add_argument("--p-min", type=_p_min, default=1e-4,
                        help="smallest p on the axis, in (0, 0.5) (default 1e-4)")
    parser.add_argument("--max-ratio", type=max_ratio_arg, default=None,
                        help="cap the upper bounds of the bands and DCPO (default: none)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="leave out PPO clip, clip-higher and DCPO")
    parser.add_argument("--dppo", action="store_true",
                        help="overlay DPPO's regions (verl dppo_kl / dppo_tv, clip_ratio = each delta; uncapped) "
                             "for the divergences among kl,tv (docs/dppo.md)")
    parser.add_argument("--out", type=Path, default=Path("bandpo-bands.png"),
                        help="output file, .png or .svg by suffix (default bandpo-bands.png in the current "
                             "directory; the README's figure is made with --out docs/bands.png)")


def run(args: argparse.Namespace) -> int:
    if args.out.suffix.lower() not in (".png", ".svg"):
        print(f"bandpo-lut plot: error: --out {args.out}: the name must end in .png or .svg",
              file=sys.stderr)
        return 2
    from bandpo_lut.cli.args import UsageError
    from bandpo_lut.tables.table_format import TableFormatError

    try:
        curves = band_curves(args.divergences, args.deltas, args.p_min, args.max_ratio)
    except TableFormatError:       # a damaged table: the command line reports it as a file error (exit 1)
        raise
    except ValueError as err:      # a δ outside a table's range
        raise UsageError(f"--deltas: {err}") from None
    draw(curves, args)
    print(f"bands of {','.join(args.divergences)} at delta {','.join(map(str, args.deltas))} "
          f"written to {args.out}")
    return 0


def band_curves(divergences, deltas, p_min: float, max_ratio):
    """p and, per (divergence, delta), the (lower, upper) ratio bounds in float64."""
    p = torch.cat([torch.logspace(math.log10(p_min), 0, 800, dtype=torch.float64)[:-1],
                   torch.ones(1, dtype=torch.float64)])
    curves = {}
    for div in divergences:
        for delta in deltas:
            curves[div, delta] = ratio_bounds(p, clip="band", delta=delta, divergence=div, max_ratio=max_ratio)
    return p, curves


def draw(curves, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, bands = curves
    fig, (ax_r, ax_q) = plt.subplots(1, 2, figsize=(14, 7), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, div in enumerate(args.divergences):
        for j, delta in enumerate(args.deltas):
            lo, up = bands[div, delta]
            style = dict(color=colours[i % len(colours)], ls=DELTA_STYLES[j % len(DELTA_STYLES)], lw=2)
            label = f"BandPO {div}, δ = {delta:g}"
            ax_r.plot(p, up, label=label, **style)
            ax_r.plot(p, lo, **style)
            ax_q.plot(p, p * (up - 1), label=label, **style)
            ax_q.plot(p, p * (lo - 1), **style)
    if args.dppo:
        _draw_dppo(ax_r, ax_q, p, args, colours)
    if not args.no_baselines:
        for label, clip, eps_low, eps_high, colour, ls in BASELINES:
            lo, up = ratio_bounds(p, clip=clip, eps_low=eps_low, eps_high=eps_high,
                                  max_ratio=args.max_ratio)
            style = dict(color=colour, ls=ls, lw=1.5)
            ax_r.plot(p, up, label=label, **style)
            ax_r.plot(p, lo, **style)
            ax_q.plot(p, p * (up - 1), label=label, **style)
            ax_q.plot(p, p * (lo - 1), **style)

    simplex = dict(color="black", lw=1, ls=":")
    ax_r.plot(p, 1 / p, label="simplex limits (r ≤ 1/p, r ≥ 0; p' ≤ 1, p' ≥ 0)", **simplex)
    ax_r.axhline(0, **simplex)
    ax_r.axhline(1, color="0.7", lw=0.8)
    ax_r.set_yscale("symlog", linthresh=1, linscale=2)
    ax_r.set_ylim(0, 1.3 / args.p_min)
    decades = [10.0 ** k for k in range(1, int(math.log10(1.3 / args.p_min)) + 1)]
    ax_r.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1] + decades)
    ax_r.set_yticklabels(["0", "0.2", "0.4", "0.6", "0.8", "1"] + [f"$10^{{{k}}}$" for k in
                                                                  range(1, len(decades) + 1)])
    ax_r.minorticks_off()
    ax_r.set_ylabel("ratio bound r = π_new / π_old  (upper and lower curves)")
    ax_r.set_title("ratio bounds (symlog: linear below 1)", fontsize=11)

    ax_q.plot(p, 1 - p, **simplex)
    ax_q.plot(p, -p, **simplex)
    ax_q.axhline(0, color="0.7", lw=0.8)
    ax_q.set_ylim(-0.42, 0.42)  # the simplex limits run off the chart where they are far away
    ax_q.set_ylabel("allowed probability change p·(r − 1)")
    ax_q.set_title("allowed change of the token's probability", fontsize=11)
    for ax in (ax_r, ax_q):
        ax.set_xscale("log")
        ax.set_xlim(args.p_min, 1)
        ax.set_xlabel("p = π_old(token)")
        ax.grid(alpha=0.3, which="both")
    handles, labels = ax_r.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 3 if args.dppo else 5), fontsize=10,
               handlelength=3.5, frameon=False)
    cap = f", upper bounds capped at {args.max_ratio:g}" if args.max_ratio is not None else ""
    versus = " and DPPO's binary regions (never capped)" if args.dppo else ""
    fig.suptitle(f"BandPO trust-region bands{versus} against p{cap}", fontsize=13)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)


def _draw_dppo(ax_r, ax_q, p, args, colours) -> None:
    """DPPO's regions: thin black-edged dots over the band of the same divergence and δ, so that where the two
    coincide the band shows through and where the band is capped DPPO's region goes on."""
    from bandpo_lut.reference.dppo import DIVERGENCES, ratio_region

    for i, div in enumerate(args.divergences):
        if div not in DIVERGENCES:
            continue
        for delta in args.deltas:
            lo, up = ratio_region(p, divergence=div, delta=delta)
            style = dict(color="black", ls="none", marker="o", ms=2.2, markevery=(i * 7 % 23, 23),
                         mfc=colours[i % len(colours)], mew=0.4)
            label = f"DPPO {div} (verl dppo_{div}), clip_ratio = {delta:g}"
            ax_r.plot(p, up, label=label, **style)
            ax_r.plot(p, lo, **style)
            ax_q.plot(p, p * (up - 1), label=label, **style)
            ax_q.plot(p, p * (lo - 1), **style)


# ---------------------------------------------------------------------------------------------
# argument types (argparse turns ArgumentTypeError into an exit-2 error naming the option)


def _names(text: str) -> list[str]:
    from bandpo_lut.tables import divergences

    names = [t.strip() for t in text.split(",") if t.strip()]
    known = divergences.compiled_names()    # the figure draws the band the compiled ops apply
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown divergence(s) {unknown or text!r}; the compiled ones: "
                                         f"{','.join(known)}")
    return list(dict.fromkeys(names))


def _deltas(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"deltas must be positive numbers, got {text!r}")
    return list(dict.fromkeys(values))


def _p_min(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 0.5:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 0.5), got {text!r}")
    return value
