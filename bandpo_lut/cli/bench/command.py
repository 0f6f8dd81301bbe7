"""`bandpo-lut bench`: one table of time per call, and ratio to torch.clamp, on CPU or CUDA.

Rows (float32, N = 2**22 elements by default, p_old drawn like LM token probabilities: logit ~ N(0, 3²)):
  torch.clamp(ratio, 0.8, 1.28)             the fixed clip every trainer runs (the unit of the ratios)
  tv / chi2 closed form, plain PyTorch      what a hand-written band costs without this package
  bisection, 50 steps (published approach)  a vectorised 50-step bisection of g_f for both KL bounds
                                            (without the published code's per-step host syncs)
  bandpo_lut.clip, scalar δ / per-token δ   this package (kl, and tv/chi2/hellinger closed forms)
  fused loss vs canonical eager PPO loss    (batch, T) = (64, 8192), forward + backward, with metrics
With --fused-linear, only the section of `bandpo_lut.cli.bench.fused_linear` (unfused vs fused_linear_policy_loss,
in float32 and/or bfloat16 (--fl-dtype), and Liger's fused-linear GRPO loss on CUDA where liger-kernel is installed).
Then the accuracy of `clip`'s bounds against mpmath at random points, and (CPU) the peak extra memory of
the fused and the eager loss, measured in fresh subprocesses from the resident-set high-water mark.

Times are the median of --repeats calls after a warm-up; ratios are taken within this one run. Each row says on
stderr when it is done (a default run takes about a minute); the table comes at the end, on stdout.
"""
from __future__ import annotations

import errno
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from bandpo_lut.cli.bench import fused_linear as bench_fused_linear
from bandpo_lut.cli.bench import measure

# Upper ends of the size arguments. Memory is checked against the device before anything is allocated (sizes are
# bounded by that); these bound the rest: time (--repeats, mpmath's ~ms per --accuracy-points point) and threads.
MAX_ELEMENTS = 2 ** 40
MAX_REPEATS = 100_000
MAX_ACCURACY_POINTS = 1_000_000
MAX_THREADS = 1024

def add_arguments(parser):
    from bandpo_lut.cli.args import int_in

    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--n", type=int_in(1, MAX_ELEMENTS), default=2 ** 22, help="elements for the clip rows")
    parser.add_argument("--batch", type=int_in(1, MAX_ELEMENTS), default=64,
                        help="rows of the loss rows' batch (default 64)")
    parser.add_argument("--tokens", type=int_in(1, MAX_ELEMENTS), default=8192,
                        help="tokens per row of the loss rows' batch (default 8192)")
    parser.add_argument("--repeats", type=int_in(1, MAX_REPEATS), default=20,
                        help="timed calls per row after a warm-up; the median is reported (default 20)")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--accuracy-points", type=int_in(0, MAX_ACCURACY_POINTS), default=300,
                        help="0 skips the accuracy rows")
    parser.add_argument("--skip-bisection", action="store_true", help="the bisection row takes seconds")
    parser.add_argument("--skip-memory", action="store_true",
                        help="skip the peak-memory rows (CPU; two fresh processes)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    bench_fused_linear.add_arguments(parser)


def _check_args(args):
    """The checks argparse cannot make alone (the fused-linear section's options, the device, the --json path);
    raises UsageError before any timing starts. Returns the torch.device."""
    from bandpo_lut.cli.args import UsageError, check_memory

    bench_fused_linear.check_args(args)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {args.device!r} (expected cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda, got {args.device!r}")
    # The clip rows hold about a dozen float32 tensors of N elements (the bisection's included), the loss rows
    # about sixteen of batch x tokens: refuse before allocating what the device does not have.
    check_memory("--n/--batch/--tokens", 4 * (12 * args.n + 16 * args.batch * args.tokens), device)
    if args.json is not None:
        check_json_path(args.json)
    return device


def check_json_path(path: str) -> None:
    """Raise UsageError naming --json unless `path` can be written, found before any row runs: an existing file
    is opened for appending (nothing written), a new one created and removed again."""
    from bandpo_lut.cli.args import UsageError

    if os.path.isdir(path):
        raise UsageError(f"--json: cannot write {path}: is a directory")
    special = os.path.exists(path) and not os.path.isfile(path)     # /dev/stdout, a FIFO
    if not special and not path.lower().endswith(".json"):
        # as plot's and demo's --out take only their figure suffixes: a stray path (a table, a source file) is
        # never replaced by the rows
        raise UsageError(f"--json {path!r}: the name must end in .json (an existing .json file is replaced)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--json: cannot write {path}: folder {folder} does not exist")
    try:
        if os.path.isfile(path):
            open(path, "ab").close()
        elif os.path.exists(path):         # /dev/stdout, a FIFO: opening one could wait for a reader
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, "permission denied")
        else:                              # new (a dangling link: its target is new)
            target = os.path.realpath(path)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(target)
    except OSError as e:
        raise UsageError(f"--json: cannot write {path}: {e.strerror or e}") from None


def progress(step: int, total: int, what: str) -> None:
    """One line per finished row on stderr (the table goes to stdout at the end), so that a run of a minute is
    seen to advance."""
    print(f"bench: [{step}/{total}] {what}", file=sys.stderr, flush=True)


# Bytes each clip row must move per element at the least (float32): what it reads (ratio, p or log p, a per-token δ)
# and writes (the clipped ratio, or the two bounds). A row's share of copy bandwidth is its bytes per second over a
# device copy's (8 bytes per element: one read, one write): on a GPU the measure of a memory-bound kernel.
ROW_BYTES = {
    "torch.clamp(ratio, 0.8, 1.28)": 8,
    "bandpo_lut.bounds kl, scalar delta": 12,
    "bandpo_lut.clip kl, scalar delta": 12,
    "bandpo_lut.clip kl, log_p_old, scalar delta": 12,
    "bandpo_lut.clip kl, per-token delta": 16,
    "bandpo_lut.clip tv, scalar delta": 12,
    "bandpo_lut.clip chi2, scalar delta": 12,
    "bandpo_lut.clip hellinger, scalar delta": 12,
}


def copy_bandwidth_share(name: str, seconds: float, copy_seconds: float) -> float | None:
    """Percent of copy bandwidth a row reaches (None for the rows whose traffic is not a fixed count: the
    plain-PyTorch baselines' temporaries)."""
    if name not in ROW_BYTES:
        return None
    return 100.0 * (ROW_BYTES[name] / seconds) / (8 / copy_seconds)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, repeats):
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- baselines, written here in plain PyTorch ---------------------------------------------------------

def chi2_closed_form(ratio, p, delta):
    w = torch.sqrt(delta * (1 - p) / p)
    lo = torch.where(p <= delta * (1 - p), torch.zeros_like(p), 1 - w)
    up = torch.where(1 - p <= delta * p, 1 / p, 1 + w)
    return torch.clamp(ratio, lo, up)


def tv_closed_form(ratio, p, delta):
    lo = torch.clamp(1 - delta / p, min=0)
    up = torch.minimum(1 + delta / p, 1 / p)
    return torch.clamp(ratio, lo, up)


def kl_bisection(p, delta, steps=50):
    """Both KL bounds by bisection of g(p, r) = p·f(r) + (1-p)·f((1-rp)/(1-p)) = δ, f(u) = u - 1 - log u."""
    omp = 1 - p

    def g(r):
        u = (1 - r * p) / omp
        return p * (r - 1 - torch.log(r)) + omp * (u - 1 - torch.log(u))

    lo_a, lo_b = torch.zeros_like(p), torch.ones_like(p)
    up_a, up_b = torch.ones_like(p), 1 / p
    for _ in range(steps):
        m = (lo_a + lo_b) / 2
        inside = g(m) <= delta
        lo_b, lo_a = torch.where(inside, m, lo_b), torch.where(inside, lo_a, m)
        m = (up_a + up_b) / 2
        inside = g(m) <= delta
        up_a, up_b = torch.where(inside, m, up_a), torch.where(inside, up_b, m)
    return lo_b, up_a


def canonical_ppo_loss(log_prob, old_log_prob, advantages, mask, eps_low=0.2, eps_high=0.2):
    """The fixed-clip PPO loss as trainers write it in eager PyTorch, with its usual metrics."""
    m = mask.to(log_prob.dtype)
    n = m.sum().clamp(min=1)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    loss = (pg * m).sum() / n
    clipfrac = ((pg2 > pg1).to(m.dtype) * m).sum() / n
    ppo_kl = (-log_ratio * m).sum() / n
    return loss, {"clip_frac": clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


# ---- measurements -------------------------------------------------------------------------------------

def _lm_like_probs(n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(n, generator=g) * 3).to(device)


def _loss_batch(batch, tokens, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    old = torch.nn.functional.logsigmoid(torch.randn(batch, tokens, generator=g) * 3)
    new = old + torch.randn(batch, tokens, generator=g) * 0.1
    adv = torch.randn(batch, tokens, generator=g)
    mask = torch.rand(batch, tokens, generator=g) > 0.1
    return [t.to(device) for t in (new, old, adv, mask)]


def _loss_step(kind, batch):
    import bandpo_lut

    new, old, adv, mask = batch
    lp = new.detach().requires_grad_()
    if kind == "fused":
        loss, _ = bandpo_lut.policy_loss(lp, old, adv, mask, max_ratio=10.0)
    elif kind == "fused-fixed":
        loss, _ = bandpo_lut.policy_loss(lp, old, adv, mask, clip="fixed")
    else:
        loss, _ = canonical_ppo_loss(lp, old, adv, mask)
    loss.backward()


def peak_extra_memory_mb(kind, batch, tokens):
    """Peak resident-memory growth during one forward+backward (CPU), in a fresh process (`measure`: how);
    None where this cannot be measured."""
    if not measure.cpu_peak_measurable():
        return None
    try:
        return float(measure.run_child("loss", [kind, batch, tokens], threads=2))
    except (subprocess.CalledProcessError, OSError):
        return None


CPU_VARIANT_TARGETS = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": "x86-64"}


def cpu_kernel_line() -> str:
    """Where a CPU figure was measured: the CPU's vector ISA and the kernel variant the library dispatched
    (csrc/cpu/cpu_variant.h; BANDPO_LUT_CPU_VARIANT forces a slower one)."""
    from bandpo_lut.runtime import _extension

    cpu = _extension.facts()["cpu"]
    variant = cpu.get("variant")
    if variant is None:
        return f"CPU kernels: vector ISA {cpu['isa']}; {cpu.get('variant_error')}"
    fused = {"avx512": "fused AVX-512 kernel, wide cells in t", "avx2": "fused AVX2 kernel, cells in p's bits"}
    kl = fused.get(variant, f"blocked loops for {CPU_VARIANT_TARGETS[variant]}")
    return (f"CPU kernels: vector ISA {cpu['isa']}, variant {variant} (kl scalar delta: {kl}; "
            f"other rows: blocked loops for {CPU_VARIANT_TARGETS[variant]})")


def run(args) -> int:
    import bandpo_lut
    from bandpo_lut.tables import accuracy

    device = _check_args(args)
    if getattr(args, "fused_linear", False):   # its own section: fresh processes, see bench_fused_linear
        return bench_fused_linear.run(args, device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    n, reps = args.n, args.repeats
    p = _lm_like_probs(n, device)
    ratio = torch.exp(torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.3).to(device)
    delta_t = torch.full((n,), 0.05, device=device)
    rows = []
    memory = device.type == "cpu" and not args.skip_memory
    # the clip rows, the copy, the three loss rows, the accuracy rows, the two memory rows
    total = 10 + (not args.skip_bisection) + 1 + 3 + bool(args.accuracy_points) + 2 * memory
    done = 0

    def advance(what, seconds=None):
        nonlocal done
        done += 1
        progress(done, total, what + (f": {seconds * 1e3:.3f} ms/call" if seconds is not None else ""))
        return seconds

    def row(name, fn, repeats=reps):
        rows.append((name, advance(name, timeit(fn, device, repeats))))

    log_p = torch.log(p)
    row("torch.clamp(ratio, 0.8, 1.28)", lambda: torch.clamp(ratio, 0.8, 1.28))
    row("tv closed form, plain PyTorch", lambda: tv_closed_form(ratio, p, 0.05))
    row("chi2 closed form, plain PyTorch", lambda: chi2_closed_form(ratio, p, 0.05))
    if not args.skip_bisection:
        print("bench: the kl bisection row is next, the slowest by far (seconds to minutes; --skip-bisection skips "
              "it)", file=sys.stderr, flush=True)
        row("kl bisection, 50 steps (published approach)",
            lambda: torch.clamp(ratio, *kl_bisection(p, 0.05)), repeats=max(1, min(reps, 2)))
    row("bandpo_lut.bounds kl, scalar delta", lambda: bandpo_lut.bounds(p, 0.05))
    row("bandpo_lut.clip kl, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05))
    row("bandpo_lut.clip kl, log_p_old, scalar delta", lambda: bandpo_lut.clip(ratio, log_p_old=log_p))
    row("bandpo_lut.clip kl, per-token delta", lambda: bandpo_lut.clip(ratio, p, delta_t))
    row("bandpo_lut.clip tv, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05, "tv"))
    row("bandpo_lut.clip chi2, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05, "chi2"))
    row("bandpo_lut.clip hellinger, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05, "hellinger"))
    # The bandwidth unit: a device-to-device copy of one float32 tensor (read + write, 8 bytes per element).
    copy_t = advance("ratio.clone() (the bandwidth unit)", timeit(lambda: ratio.clone(), device, reps))
    batch = _loss_batch(args.batch, args.tokens, device)
    loss_rows = []
    for kind, name in (("eager", f"canonical eager PPO loss ({args.batch}x{args.tokens}), fwd+bwd"),
                       ("fused", f"bandpo_lut.policy_loss band ({args.batch}x{args.tokens}), fwd+bwd"),
                       ("fused-fixed", f"bandpo_lut.policy_loss fixed clip ({args.batch}x{args.tokens}), fwd+bwd")):
        loss_rows.append((name, advance(name, timeit(lambda: _loss_step(kind, batch), device, reps))))

    clamp_t = rows[0][1]
    eager_t = loss_rows[0][1]
    print(f"bandpo_lut {bandpo_lut.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f" ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
          + f", float32, N = {n}")
    if device.type == "cpu":
        print(cpu_kernel_line())
    print(f"{'what':58s} {'ms/call':>10s} {'x clamp':>9s} {'% copy bw':>10s}")
    for name, t in rows:
        share = copy_bandwidth_share(name, t, copy_t)
        print(f"{name:58s} {t * 1e3:10.3f} {t / clamp_t:9.1f} "
              + (f"{share:10.1f}" if share is not None else f"{'-':>10s}"))
    print(f"(% copy bw: the row's memory traffic per second, as a share of a {device.type} copy's: "
          f"ratio.clone() took {copy_t * 1e3:.3f} ms for {8 * n / 2 ** 20:.1f} MiB read + written)")
    print(f"{'what':58s} {'ms/call':>10s} {'x eager':>9s}")
    for name, t in loss_rows:
        print(f"{name:58s} {t * 1e3:10.3f} {t / eager_t:9.2f}")

    if args.accuracy_points:
        worst = []
        for name in ("kl", "tv", "chi2"):
            pa, da = accuracy.sample_points(args.accuracy_points, 1e-3, 0.999, seed=99)
            p32 = torch.from_numpy(pa).float()
            d32 = torch.from_numpy(da).float()
            lo, up = bandpo_lut.bounds(p32.to(device), d32.to(device), name)
            rlo, rup = accuracy.exact_bounds_f64(p32.double().numpy(), d32.double().numpy(), name)
            eu, el = accuracy.float32_worst(lo.cpu().numpy(), up.cpu().numpy(), rlo, rup)
            worst.append((name, eu, el))
        advance(f"accuracy vs mpmath, {args.accuracy_points} points per divergence")
        print("accuracy of bandpo_lut.bounds (float32 in, per-token delta) vs mpmath, "
              f"{args.accuracy_points} random points each:")
        for name, eu, el in worst:
            print(f"  {name:5s} upper max rel err {eu:.2e}   lower max err {el:.2e} (|dr|/(r(1+|ln r|)))")
    if memory:
        size_mb = args.batch * args.tokens * 4 / 2 ** 20
        fused = peak_extra_memory_mb("fused", args.batch, args.tokens)
        advance("peak memory of the fused loss (a child process)")
        eager = peak_extra_memory_mb("eager", args.batch, args.tokens)
        advance("peak memory of the eager loss (a child process)")
        if fused is None or eager is None:
            print("peak extra memory: not measurable here (needs Linux /proc)")
        else:
            print(f"peak extra memory, fwd+bwd: fused {fused:.1f} MB, eager {eager:.1f} MB "
                  f"(one float32 tensor of the input's size: {size_mb:.1f} MB)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "loss_rows": loss_rows, "copy_seconds": copy_t, "n": n,
                       "bytes_per_element": ROW_BYTES}, fh, indent=1)
    return 0
