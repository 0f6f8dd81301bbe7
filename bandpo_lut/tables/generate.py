"""`bandpo-lut generate`: compute one divergence's bound table with mpmath and write it atomically.

Math. Nodes lie on a uniform grid in t = logit(p) ∈ [-t_max, t_max] (step 1/t_density) and
s = log δ ∈ [log δ_min, log δ_max] (s_nodes nodes). At each node the generator solves the band equation
with `bandpo_lut.tables.exact` at `dps` significant digits and stores

* upper: q_up = p·r_up, the continued root past saturation (clamped to [p, 1] at lookup, and replaced by
  1/p where the exact saturation test holds), so saturation kinks are never interpolated across;
* lower: κ = -p·ln(r_lo)/δ for divergences whose lower bound never saturates (KL: bounded and smooth,
  r_lo = exp(-(δ/p)·κ) keeps relative precision down to underflow), else q_lo = p·r_lo, continued.

Both are fitted by a tensor-product uniform cubic B-spline (one coefficient per node plus one beyond
each edge). The fit is solved in mpmath on a grid extended by `ghost` nodes beyond every edge with
natural end conditions there; the end-condition error decays by 2 - √3 per node, so inside the table it
is below the storage precision. Each coefficient is rounded once, from the mpmath value, to the storage
dtype. The file records its provenance and the accuracy measured against mpmath at random off-grid
points through `bandpo_lut.reference.bounds`.

Run time: about 1 ms per node and core (40 digits); the shipped tables take about a minute each on 2 cores.
"""
from __future__ import annotations

import math
import multiprocessing as mp_proc
import os
import signal
import sys
import threading
import time

import mpmath
import numpy as np

from bandpo_lut._version import __version__
from bandpo_lut.tables import divergences, exact, table_format

DEFAULTS = dict(t_max=14.0, t_density=16, delta_min=1e-3, delta_max=1.0, s_nodes=113, ghost=12, dps=40,
                accuracy_points=1500, dtype="float32", seed=20261202)


# Largest --t-max: the tail checks evaluate p = sigmoid(±T) in float64, where exp(T) must stay finite.
T_MAX_LIMIT = 700.0


def _uneven_t_grid(t_max, t_density):
    """Why -t_max..t_max in steps of 1/t_density is not a grid, or None if it is."""
    steps = 2 * t_max * t_density
    if abs(steps - round(steps)) > 1e-9 * steps:
        return (f"the grid runs from -T to T in steps of 1/t_density, so 2 * T * t_density must be a whole number; "
                f"got 2 * {t_max:g} * {t_density} = {steps:g}")
    return None


class GridError(ValueError):
    """A (t_max, t_density, δ range) the readers cannot use; `detail` says why and what would do."""

    def __init__(self, detail: str):
        super().__init__(f"generate: t_max: {detail}")
        self.detail = detail


def _check_grid(div, t_max, t_density, delta_min, delta_max) -> None:
    """Raise GridError unless -t_max..t_max is a grid of step 1/t_density on which the readers' tail rules
    hold for the whole δ range (cheap: checked before the long computation)."""
    uneven = _uneven_t_grid(t_max, t_density)
    if uneven:
        raise GridError(uneven)
    if not _tails_hold(div, t_max, delta_min, delta_max):
        need = _smallest_t_max(div, t_max, delta_min, delta_max)
        if need is not None:    # the smallest such T on this grid (2 * T * t_density whole), so that it is usable
            need = math.ceil(need * 2 * t_density - 1e-9) / (2 * t_density)
        valid = (f"need T >= {need:g} (with --t-density {t_density}); valid: {need:g} <= T <= {T_MAX_LIMIT:g}, "
                 f"2 * T * t_density a whole number" if need is not None and need <= T_MAX_LIMIT else
                 f"do not hold for any T <= {T_MAX_LIMIT:g}; narrow the delta range")
        raise GridError(f"{t_max:g} is too small for {div.name!r} with delta in [{delta_min:g}, {delta_max:g}]: "
                        f"the readers' tail rules (upper = 1/p above T, lower = 0 below -T) {valid}")


# The cost of a table, in mpmath root solves at 40 digits (~1.5 ms each on one core; the cost grows about as
# the square of the digits): every node of the ghost-extended grid, and three per accuracy point.
SECONDS_PER_SOLVE = 1.5e-3
COST_LIMIT = 4e6          # ~1.7 CPU-hours, 60 times the default table; --allow-expensive runs past it
# Most worker processes a run may ask for (each holds an interpreter with mpmath: tens of MB); a run never starts
# more than it has rows of log(delta) to hand out.
MAX_WORKERS = 256
_COST_ARGS = ("t_max", "t_density", "s_nodes", "ghost", "dps", "accuracy_points")


def estimated_cost(t_max, t_density, s_nodes, ghost, dps, accuracy_points) -> float:
    nodes = (2 * t_max * t_density + 1 + 2 * ghost) * (s_nodes + 2 * ghost)
    return (nodes + 3 * accuracy_points) * (dps / 40) ** 2


# --- node values (run in worker processes) -------------------------------------------------------------

def _row(job):
    """Stored values (q_up, lower value) at every t node of one s row, as decimal strings."""
    name, ts, s, dps = job
    div = divergences.get(name)
    out = []
    with mpmath.workdps(dps):
        d = mpmath.exp(mpmath.mpf(s))
        q_guess = kappa_prev = None
        for t in ts:
            t = mpmath.mpf(t)
            p = 1 / (1 + mpmath.exp(-t))
            q_up = exact.upper_q(div, p, d, continued=True, guess=q_guess)
            q_guess = q_up if (p < q_up < 1) else None
            if div.lower_value == "kappa":
                # ℓ = κ·δ/p, and κ varies slowly: the neighbour's κ gives an excellent starting bracket.
                guess = kappa_prev * d / p if kappa_prev is not None else None
                v_lo = kappa_prev = p * exact.lower_ell(div, p, d, guess=guess) / d
            else:
                v_lo = exact.lower_q(div, p, d, continued=True)
            out.append((mpmath.nstr(q_up, dps, strip_zeros=False), mpmath.nstr(v_lo, dps, strip_zeros=False)))
    return out


# --- the spline fit (mpmath) ---------------------------------------------------------------------------

def _natural_bspline_coefficients(y):
    """Coefficients c_{-1..N} of the uniform cubic B-spline interpolating y_0..y_{N-1}, natural ends."""
    n = len(y)
    c = [mpmath.mpf(0)] * n
    c[0], c[-1] = y[0], y[-1]
    # Interior: c_{i-1} + 4 c_i + c_{i+1} = 6 y_i, i = 1..n-2, with c_0 and c_{n-1} known (Thomas algorithm).
    m = n - 2
    rhs = [6 * y[i + 1] for i in range(m)]
    rhs[0] -= c[0]
    rhs[-1] -= c[-1]
    cp, dp = [mpmath.mpf(0)] * m, [mpmath.mpf(0)] * m
    cp[0], dp[0] = mpmath.mpf(1) / 4, rhs[0] / 4
    for i in range(1, m):
        den = 4 - cp[i - 1]
        cp[i], dp[i] = 1 / den, (rhs[i] - dp[i - 1]) / den
    x = [mpmath.mpf(0)] * m
    x[-1] = dp[-1]
    for i in range(m - 2, -1, -1):
        x[i] = dp[i] - cp[i] * x[i + 1]
    c[1:-1] = x
    return [2 * c[0] - c[1]] + c + [2 * c[-1] - c[-2]]


def _fit(values, ghost_t, ghost_s):
    """values[j][i] at (t_i, s_j) on the extended grid -> kept coefficients, shape (n_t+2, n_s+2)."""
    rows = [_natural_bspline_coefficients(row) for row in values]       # along t, per s
    n_coef_t = len(rows[0])
    keep_t = range(ghost_t, n_coef_t - ghost_t)                        # c_{-1} .. c_{n_t} of the core
    out = []
    for i in keep_t:
        col = _natural_bspline_coefficients([rows[j][i] for j in range(len(rows))])
        out.append(col[ghost_s: len(col) - ghost_s])
    return out


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pool_ignoring_sigint(ctx, workers):
    """A process pool whose workers ignore SIGINT. Ctrl-C reaches the terminal's whole process group; only
    the parent should react (with one KeyboardInterrupt, which terminates the pool on leaving its `with`),
    not every worker with a traceback of its own. Forked workers inherit the ignoring disposition from
    their birth (no window before the initializer runs); spawned ones get it from the initializer."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        return ctx.Pool(workers, initializer=_ignore_sigint)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def generate(divergence, *, t_max, t_density, delta_min, delta_max, s_nodes, ghost, dps, dtype,
             accuracy_points, workers=0, progress=True, seed=DEFAULTS["seed"], command=None):
    """Compute the table; returns the encoded file bytes (deterministic for given arguments)."""
    div = divergences.get(divergence)
    _check_grid(div, t_max, t_density, delta_min, delta_max)   # again for API callers: 0.1 s, before minutes
    h_t = 1.0 / t_density
    n_t = int(round(2 * t_max * t_density)) + 1
    s_min, s_max = math.log(delta_min), math.log(delta_max)
    h_s = (s_max - s_min) / (s_nodes - 1)
    with mpmath.workdps(dps):
        ts = [mpmath.nstr(mpmath.mpf(-t_max) + (i - ghost) * mpmath.mpf(1) / t_density, dps)
              for i in range(n_t + 2 * ghost)]
        ss = [mpmath.nstr(mpmath.log(delta_min) + (j - ghost) * (mpmath.log(delta_max) - mpmath.log(delta_min))
                          / (s_nodes - 1), dps) for j in range(s_nodes + 2 * ghost)]
    jobs = [(div.name, ts, s, dps) for s in ss]
    workers = min(workers or os.cpu_count() or 1, len(jobs))     # a worker per row at the most: the rest would idle
    started = time.time()
    results = []
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(jobs), desc=f"{div.name}: rows of log(delta)", unit="row", file=sys.stderr)
        except ImportError:
            bar = None
    try:
        if workers > 1:
            ctx = mp_proc.get_context("spawn" if sys.platform == "darwin" else "fork")
            with _pool_ignoring_sigint(ctx, workers) as pool:
                for r in pool.imap(_row, jobs, chunksize=1):
                    results.append(r)
                    if bar:
                        bar.update()
        else:
            for job in jobs:
                results.append(_row(job))
                if bar:
                    bar.update()
    finally:
        if bar:
            bar.close()
    with mpmath.workdps(dps):
        up_vals = [[mpmath.mpf(a) for a, _ in row] for row in results]
        lo_vals = [[mpmath.mpf(b) for _, b in row] for row in results]
        np_dtype = np.float32 if dtype == "float32" else np.float64
        arrays = {}
        for key, vals in (("upper", up_vals), ("lower", lo_vals)):
            coef = _fit(vals, ghost, ghost)
            # Round once, from the mpmath value (via its 17-digit decimal image, exact for float64).
            arrays[key] = np.array([[float(mpmath.nstr(c, 17)) for c in col] for col in coef],
                                   dtype=np.float64).astype(np_dtype)
    inclusive = div.delta_max_inclusive
    header = {
        "banner": "GENERATED FILE - do not edit. Produced by `bandpo-lut generate`; regenerate with the "
                  "command under generator.command.",
        "format": {"name": "bandpo_lut bound table", "version": table_format.FORMAT_VERSION},
        # The generator's recorded name is 0.1's module path, kept so that the shipped tables regenerate byte for
        # byte (CI checks it); the code lives in bandpo_lut.tables.generate (library) and bandpo_lut.cli.generate.
        "generator": {"name": "bandpo_lut.generate", "version": __version__,
                      "command": command or _command_line(div.name, t_max, t_density, delta_min, delta_max,
                                                          s_nodes, ghost, dps, dtype, accuracy_points)},
        "divergence": {"name": div.name, "formula": div.formula, "description": div.description,
                       "f_at_zero": div.f_at_zero},
        "grid": {"t": {"coordinate": "t = logit(p) = log(p) - log(1 - p)", "min": -t_max, "max": t_max,
                       "n": n_t, "step": h_t},
                 "s": {"coordinate": "s = log(delta)", "min": s_min, "max": s_max, "n": s_nodes, "step": h_s}},
        "delta_range": {"min": delta_min, "max": delta_max, "max_inclusive": inclusive},
        "values": {
            "upper": {"kind": "q", "definition": "q_up = p * r_up (continued root past saturation); "
                      "r_up = clamp(q_up, p, 1) / p, and 1/p where p*f(1/p) + (1-p)*f(0) <= delta"},
            "lower": {"kind": div.lower_value, "definition":
                      "kappa = -p * ln(r_lo) / delta; r_lo = exp(-(delta / p) * kappa)" if div.lower_value == "kappa"
                      else "q_lo = p * r_lo (continued root past saturation); r_lo = clamp(q_lo, 0, p) / p, "
                           "and 0 where p*f(0) + (1-p)*f(1/(1-p)) <= delta"},
        },
        "interpolation": {"scheme": table_format.INTERPOLATION_SCHEME,
                          "coefficients": "array[i, j] is the coefficient of the B-spline centred at node "
                                          "(i - 1, j - 1); shape (n_t + 2, n_s + 2)",
                          "fit": f"interpolating at every node; natural end conditions imposed {ghost} ghost "
                                 "nodes beyond each edge; solved in mpmath", "ghost_nodes": ghost},
        "storage_dtype": dtype,
        "working_precision": {"library": "mpmath", "version": mpmath.__version__, "dps": dps},
        "refinement": {"upper_newton_steps": div.polish_upper, "lower_newton_steps": div.polish_lower,
                       "equation": "Newton steps in q on D_f(Bernoulli(q) || Bernoulli(p)) = delta"},
        "tails": {
            "upper_for_t_above_max": "1/p (saturated or equal to 1/p in float64; checked at generation)",
            "lower_for_t_below_min": "0 (saturated or below the float64 range; checked at generation)",
            "upper_for_t_below_min": "closed form" if div.closed_form else
                                     "Newton steps on the exact equation from lim_{p->0} p*r_up",
            "lower_for_t_above_max": "closed form" if div.closed_form else
                                     "Newton steps on the exact equation from lim_{p->1} r_lo",
        },
    }
    blob = table_format.encode(header, arrays)
    if accuracy_points:
        header["accuracy"] = _measure(blob, div, accuracy_points, seed, t_max)
        blob = table_format.encode(header, arrays)
    if progress:
        print(f"{div.name}: {n_t}x{s_nodes} nodes (+{ghost} ghost per edge), {len(blob) / 1024:.0f} KiB, "
              f"{time.time() - started:.0f} s", file=sys.stderr)
    return blob


def _command_line(name, t_max, t_density, delta_min, delta_max, s_nodes, ghost, dps, dtype, points):
    return (f"bandpo-lut generate --divergence {name} --t-max {t_max:g} --t-density {t_density} "
            f"--delta-min {delta_min:g} --delta-max {delta_max:g} --s-nodes {s_nodes} --ghost {ghost} "
            f"--dps {dps} --dtype {dtype} --accuracy-points {points}")


def _table_from_blob(blob, div):
    from bandpo_lut.tables import store as tables
    return tables.Table.from_file(table_format.decode(blob), f"<generated {div.name}>")


def _tail_deltas(delta_min, delta_max, inclusive):
    """17 values of δ spread evenly in log δ over the table's range (the top one inside an open range)."""
    hi = delta_max if inclusive else math.nextafter(delta_max, 0)
    return [min(max(math.exp(s), delta_min), hi)
            for s in np.linspace(math.log(delta_min), math.log(delta_max), 17)]


def _tails_hold(div, t_max, delta_min, delta_max):
    """The readers' tail rules hold for a grid |t| <= t_max: at p = sigmoid(t_max) the upper bound is 1/p,
    and at p = sigmoid(-t_max) the lower bound is below 1e-300, for every δ of the range (17 checked)."""
    p_hi = 1 / (1 + math.exp(-t_max))
    p_lo = 1 / (1 + math.exp(t_max))
    with mpmath.workdps(40):
        for d in _tail_deltas(delta_min, delta_max, div.delta_max_inclusive):
            lo, _ = exact.bounds(p_lo, d, div.name)
            _, up = exact.bounds(p_hi, d, div.name)
            if not (lo < 1e-300 and abs(up * p_hi - 1) < 1e-16):
                return False
    return True


def _smallest_t_max(div, t_max, delta_min, delta_max):
    """The smallest T > t_max (to 0.01, rounded up) for which the tail rules hold; None if none up to
    T_MAX_LIMIT does."""
    if not _tails_hold(div, T_MAX_LIMIT, delta_min, delta_max):
        return None
    lo, hi = t_max, T_MAX_LIMIT
    probe = max(2 * t_max, 8.0)
    while probe < hi and not _tails_hold(div, probe, delta_min, delta_max):
        lo, probe = probe, 2 * probe
    hi = min(probe, hi)
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _tails_hold(div, mid, delta_min, delta_max) else (mid, hi)
    return math.ceil(hi * 100) / 100


def _measure(blob, div, n, seed, t_max):
    from bandpo_lut.tables.verify import measure

    eu, el, *_ = measure(_table_from_blob(blob, div), n, seed, t_max)
    return {"points": n, "seed": seed, "reader": "bandpo_lut.reference.bounds (float64)",
            "upper_max_rel_error": float(f"{eu:.3g}"), "lower_max_error": float(f"{el:.3g}"),
            "lower_error_measure": "|r - r*| / (r* (1 + |ln r*|))",
            "tolerance": 1e-6}


