#!/usr/bin/env python
"""The KL clip's CPU cost per decade of p, to show that it does not depend on how rare a token is.

    python tools/perf_decades.py [--n 4194304] [--threads 1] [--rounds 7] [--reps 2] [--delta 0.05]

For every decade of p from [1e-30, 1e-29) to [0.5, 1), p drawn log-uniform inside it (random order, float32), it
times `clip(ratio, p, δ)` (p input), `clip(ratio, log_p_old=log p, delta=δ)` (log-p input) and `clip(ratio, p, δ_i)`
with a per-token δ_i uniform in [0.01, 0.1], and prints ns per element and each decade's ratio to the [0.1, 0.5)
decade (the fastest call over interleaved rounds). Then the same three on p log-uniform in [4.5e-5, 1] (the review's
distribution, tools/perf_ratios.py) as ratios to torch.clamp, and the per-token clip against the scalar-δ one.

Timing shows the subnormal penalty only on CPUs that take it: Intel cores run a microcode assist for each
instruction that produces or reads a subnormal float, AMD Zen cores barely slow down. So each row also says
whether the kernel computed through a subnormal at all, read from the CPU's sticky floating-point flags (MXCSR:
denormal operand, underflow; tests/support/fp_status.py) around one single-threaded call: on any x86 CPU a row
with no flag raised has no assist to take. Exit status 0 when no row raised one.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import fp_status  # noqa: E402  (tests/support, on the path above)

import bandpo_lut as bl  # noqa: E402
from bandpo_lut.runtime import _extension  # noqa: E402

REFERENCE = "[0.1, 0.5)"


def decades():
    rows = [(f"[1e{k}, 1e{k + 1})", 10.0**k, 10.0 ** (k + 1)) for k in range(-30, -1)]
    return rows + [(REFERENCE, 0.1, 0.5), ("[0.5, 1)", 0.5, 1.0)]


def log_uniform(n, lo, hi, gen):
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    return torch.exp(math.log(lo) * (1 - u) + math.log(hi) * u).float()


def best_time(fn, reps):
    """The fastest of `reps` calls: on a shared machine the other processes only ever add time."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cases(ratio, p, dtok, delta):
    logp = torch.log(p.double()).float()
    return {
        "p": lambda: bl.clip(ratio, p, delta),
        "logp": lambda: bl.clip(ratio, log_p_old=logp, delta=delta),
        "token": lambda: bl.clip(ratio, p, dtok),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1 << 22, help="elements per call (default 2^22, as tools/perf_ratios.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the timings (default 1)")
    # Many short visits rather than a few long ones: a busy spell of a shared machine lasts seconds, and a case whose
    # calls all fall in one (three rounds of three calls each: 1.5-1.8x in some decades) reads slow.
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds, ~3 s each (default 7)")
    ap.add_argument("--reps", type=int, default=2,
                    help="timed calls per case and round; the fastest of all counts (default 2)")
    ap.add_argument("--delta", type=float, default=0.05, help="the scalar δ (default 0.05)")
    args = ap.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    n = args.n
    ratio = torch.exp(torch.randn(n, generator=gen) * 0.3)
    dtok = torch.rand(n, generator=gen) * 0.09 + 0.01
    rows = decades()
    data = {label: cases(ratio, log_uniform(n, lo, hi, gen), dtok, args.delta) for label, lo, hi in rows}
    mixed = cases(ratio, log_uniform(n, 4.5e-5, 1.0, gen), dtok, args.delta)

    # The flags first, on the calling thread (one thread: the op then runs here), on a slice of each row.
    torch.set_num_threads(1)
    k = min(n, 8192)
    flags = {}
    if fp_status.available():
        for label, lo, hi in rows:
            small = cases(ratio[:k], log_uniform(k, lo, hi, gen), dtok[:k], args.delta)
            flags[label] = {m: fp_status.flags_raised(fn) for m, fn in small.items()}

    torch.set_num_threads(args.threads)
    best = {}
    for _ in range(args.rounds):
        for label, fns in list(data.items()) + [("mixed", mixed), ("clamp", {"clamp": lambda: ratio.clamp(0.8, 1.28)})]:
            for mode, fn in fns.items():
                t = best_time(fn, args.reps) / n * 1e9
                best[(label, mode)] = min(best.get((label, mode), 1e9), t)

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    variant = _extension.facts()["cpu"]["variant"]
    print(f"{cpu}; CPU variant {variant}; torch {torch.__version__}; {args.threads} thread(s); N = {n}; "
          f"δ = {args.delta} (per-token δ uniform in [0.01, 0.1]); ns per element, (ratio to the {REFERENCE} decade)")
    flag_note = "" if flags else "  (subnormal flags not readable here)"
    print(f"{'p decade':<18}{'p input':>16}{'log-p input':>16}{'per-token δ':>16}   subnormals touched{flag_note}")
    touched = 0
    worst = {m: 0.0 for m in ("p", "logp", "token")}
    for label, _, _ in rows:
        cells = []
        for mode in ("p", "logp", "token"):
            t, ref = best[(label, mode)], best[(REFERENCE, mode)]
            worst[mode] = max(worst[mode], t / ref)
            cells.append(f"{t:7.2f} ({t / ref:4.2f}x)")
        if flags:
            raised = {m: f for m, f in flags[label].items() if f & (fp_status.DENORMAL | fp_status.UNDERFLOW)}
            touched += bool(raised)
            note = "; ".join(f"{m}: {fp_status.describe(f)}" for m, f in raised.items()) or "none"
        else:
            note = "?"
        print(f"{label:<18}" + "".join(f"{c:>16}" for c in cells) + f"   {note}")
    clamp = best[("clamp", "clamp")]
    print("worst decade / reference decade: " + ", ".join(f"{m} {w:.2f}x" for m, w in worst.items()))
    # torch.clamp is memory bound and its time moves with the machine's memory traffic; the clip's is compute
    # bound: each ratio is printed with the clip's own time, which is the figure that stays put between runs.
    mixed = {m: best[("mixed", m)] for m in ("p", "logp", "token")}
    print(f"p log-uniform in [4.5e-5, 1], random order: torch.clamp {clamp:.2f} ns; clip from p "
          f"{mixed['p'] / clamp:.1f}x clamp ({mixed['p']:.2f} ns), from log p {mixed['logp'] / clamp:.1f}x clamp "
          f"({mixed['logp']:.2f} ns), per-token δ {mixed['token'] / clamp:.1f}x clamp ({mixed['token']:.2f} ns) = "
          f"{mixed['token'] / mixed['p']:.1f}x the scalar-δ clip")
    if flags:
        print(f"decades whose kernel touched a subnormal: {touched} of {len(rows)}")
    return 1 if touched else 0


if __name__ == "__main__":
    sys.exit(main())
