"""`bandpo-lut bench --fused-linear`: the unfused path against `fused_linear_policy_loss`, side by side.

    unfused: log_softmax(hidden @ weight.T) -> gather -> bandpo_lut.policy_loss   (the full logits; bfloat16:
                                                                                  the logits cast to float32)
    fused:   bandpo_lut.fused_linear_policy_loss(hidden, weight, ...)             (one chunk at a time)
    liger:   liger-kernel's LigerFusedLinearGRPOLoss (fixed clip eps 0.2, loss_type "bnpo", no KL, per-sequence
             advantages): the same GEMMs in another fused-linear loss, timed on CUDA where liger-kernel is
             installed; otherwise the table says why it is missing (`liger_missing`), and a failed Liger child
             never fails the bench.

For each dtype of --fl-dtype (hidden state and head in it), vocabulary size, LM head frozen (LoRA-style: no weight
gradient) and trained, each path runs in a fresh process: one warm-up step, then one measured step for memory, then
--fl-repeats timed steps (fwd+bwd; the median is reported). Peak extra memory as `bandpo_lut.cli.bench.measure`
reads it (CPU: the resident-set high-water mark; CUDA: the caching allocator's peak). The gradients of hidden and
weight (which any path must hold) are subtracted and shown apart. A row whose estimated memory (`row_bytes`) exceeds
what the device has free is skipped before its child starts, saying why; each child is announced on stderr as it
starts.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import torch

from bandpo_lut.cli.bench import measure

# Upper end of --fl-repeats: each timed step of a large row takes seconds (the sizes are bounded by memory, row by
# row, in `run`).
MAX_FL_REPEATS = 10_000
DTYPES = ("float32", "bfloat16")
LIGER_VERSION = "0.8.5"   # the liger-kernel whose API `liger_loss` calls (LigerFusedLinearGRPOLoss)

# The section's options and their defaults. Parsed with no default (argparse.SUPPRESS), so that one given without
# --fused-linear is refused rather than silently ignored; `check_args` fills in the defaults.
DEFAULTS = dict(fl_tokens=4096, fl_hidden=1024, fl_vocab=[32768, 131072], fl_repeats=3, fl_chunk=None,
                fl_dtype=["float32"])


def add_arguments(parser):
    from bandpo_lut.cli.args import int_at_least, int_in

    parser.add_argument("--fused-linear", action="store_true",
                        help="only the fused-linear section: unfused vs fused_linear_policy_loss (and Liger's "
                             "fused-linear GRPO loss on CUDA where liger-kernel is installed), memory and time")
    given = dict(default=argparse.SUPPRESS)
    parser.add_argument("--fl-tokens", type=int_at_least(1), help="tokens N (default 4096)", **given)
    parser.add_argument("--fl-hidden", type=int_at_least(1), help="hidden size H (default 1024)", **given)
    parser.add_argument("--fl-vocab", type=int_at_least(2), nargs="+",
                        help="vocabulary sizes V (default 32768 131072)", **given)
    parser.add_argument("--fl-repeats", type=int_in(1, MAX_FL_REPEATS),
                        help="timed steps per row after the warm-up and the memory step (default 3)", **given)
    parser.add_argument("--fl-chunk", type=int_at_least(1),
                        help="chunk_size of the fused path (default: fused_linear_policy_loss's)", **given)
    parser.add_argument("--fl-dtype", choices=DTYPES, nargs="+",
                        help="dtypes of the hidden state and the head, one set of rows each (default float32; "
                             "bfloat16: the unfused path's log-softmax in float32, as trainers run it)", **given)


def check_args(args) -> None:
    """Refuse (UsageError naming the option) a section option given without --fused-linear, or a dtype given
    twice; then fill in the defaults of those not given."""
    from bandpo_lut.cli.args import UsageError

    given = [name for name in DEFAULTS if hasattr(args, name)]
    if given and not getattr(args, "fused_linear", False):
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags}: the fused-linear section's options apply with --fused-linear only")
    for name, value in DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, list(value) if isinstance(value, list) else value)
    twice = sorted({d for d in args.fl_dtype if args.fl_dtype.count(d) > 1})
    if twice:
        raise UsageError(f"--fl-dtype: {', '.join(twice)} given more than once (each dtype is one set of rows)")


def liger_missing(device) -> str | None:
    """Why the Liger row cannot be timed on `device` (None: it can). Found without importing liger-kernel, which
    imports Triton."""
    if device.type != "cuda":
        return (f"this run is on {device.type}; Liger is compared on CUDA only, where its Triton kernels and "
                "compiled loss run as its users run them")
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger-kernel is not installed (pip install liger-kernel=={LIGER_VERSION} to compare with it)"
    return None


def make_inputs(tokens, hidden, vocab, device, train_head, seed=0, dtype="float32"):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h = (torch.randn(1, tokens, hidden, generator=g)).to(device, dt).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device, dt).requires_grad_(train_head)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    old = (-torch.rand(1, tokens, generator=g) * 12).to(device)     # log p_old of a vocabulary-size softmax
    adv = torch.randn(1, tokens, generator=g).to(device)
    mask = (torch.rand(1, tokens, generator=g) > 0.1).to(device)
    return h, w, ids, old, adv, mask


def liger_loss():
    """liger-kernel's fused-linear GRPO loss as `loss(hidden, weight, ids, old, adv, mask)`: a fixed clip (eps 0.2),
    loss_type "bnpo" (token-mean over the batch), no KL term; its advantages are per sequence (batch,), its mask
    floating. Raises ImportError where liger-kernel is not installed."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    module = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=0.2,
                                      epsilon_high=0.2)

    def loss(h, w, ids, old, adv, mask):
        return module(h, w, ids, mask, adv, old_per_token_logps=old)[0]

    return loss


def step(kind, inputs, chunk=None, liger=None):
    """One fwd+bwd of `kind` (unfused, fused, or liger: `liger` is `liger_loss()`, its inputs `liger_inputs`)."""
    import bandpo_lut

    h, w, ids, old, adv, mask = inputs
    h.grad = w.grad = None
    kw = dict(max_ratio=10.0, dual_clip=10.0)
    if kind == "unfused":
        # float32 logits for the softmax (a no-op cast in float32), as trainers compute bf16 models' log-probs
        lp = torch.log_softmax((h @ w.t()).float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        loss, _ = bandpo_lut.policy_loss(lp, old, adv, mask, **kw)
    elif kind == "fused":
        loss, _ = bandpo_lut.fused_linear_policy_loss(h, w, ids, old, adv, mask, chunk_size=chunk, **kw)
    else:
        loss = liger(*inputs)
    loss.backward()


def liger_inputs(inputs):
    """The inputs in the form LigerFusedLinearGRPOLoss takes them: per-sequence advantages (each row's first
    token's), a float32 mask (made once, outside the timed steps)."""
    h, w, ids, old, adv, mask = inputs
    return h, w, ids, old, adv[:, 0].contiguous(), mask.to(torch.float32)


def row_bytes(kind, tokens, hidden, vocab, train, chunk, itemsize=4) -> int:
    """About the memory one configuration's child holds at its peak: hidden and its gradient, the head (and its
    gradient when trained), `itemsize` bytes each, and about four float32 (tokens or chunk) x vocab tensors of
    logits, their log-softmax and the gradients of both (the unfused path holds the whole logits; the fused one a
    chunk at a time)."""
    rows = tokens if kind == "unfused" else min(chunk, tokens)
    return itemsize * (2 * tokens * hidden + (1 + bool(train)) * vocab * hidden) + 4 * 4 * rows * vocab


def _too_big(tokens, hidden, vocab, train, chunk, device, itemsize=4) -> str | None:
    """Why a row cannot run here (an estimate past the memory available), or None."""
    from bandpo_lut.cli.args import available_memory

    needs = [(device, f"the {kind} path", row_bytes(kind, tokens, hidden, vocab, train, chunk, itemsize))
             for kind in ("unfused", "fused")]
    if device.type == "cuda":     # the inputs are drawn on the host first
        needs.append((torch.device("cpu"), "drawing the inputs", 4 * (tokens + vocab) * hidden))
    for where, what, need in needs:
        have = available_memory(where)
        if have is not None and need > have:
            return (f"skipped: {what} needs about {need / 2 ** 30:.3g} GiB on {where}, only "
                    f"{have / 2 ** 30:.3g} GiB is available")
    return None


def measure_row(kind, tokens, hidden, vocab, train, repeats, chunk, device, threads, dtype="float32"):
    """(peak extra bytes, median seconds) of one configuration, in a fresh process; or the reason it failed (a
    string: the child's last line of stderr), which is also printed on stderr."""
    if device.type == "cpu" and not measure.cpu_peak_measurable():
        return "the peak memory is not measurable here (needs Linux /proc)"
    try:
        return tuple(measure.run_child("fused_linear", [kind, tokens, hidden, vocab, train, repeats, chunk,
                                                        str(device), dtype], threads))
    except subprocess.CalledProcessError as err:
        last = (err.stderr or "").strip().splitlines()[-1:] or [f"exit status {err.returncode}"]
        print(f"  ({dtype}, {kind}, V={vocab}, head {'trained' if train else 'frozen'}: failed: {last[0]})",
              file=sys.stderr)
        return last[0]


def _mb(x):
    return f"{x:.0f}" if x is not None else "-"


def run(args, device) -> int:
    from bandpo_lut.runtime.fused_linear import default_chunk_size

    n, hdim, reps = args.fl_tokens, args.fl_hidden, args.fl_repeats
    liger_why = liger_missing(device)
    accounting = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                  else "peak RSS (VmHWM after clear_refs), fresh process per row")
    print(f"fused-linear policy loss, {' and '.join(args.fl_dtype)}, {device}, N = {n}, H = {hdim}, "
          f"{args.threads} threads; memory: {accounting}; time: median of {reps} fwd+bwd steps")
    print(f"{'dtype':>8s} {'V':>7s} {'head':>7s} {'chunk':>6s} {'grads MB':>9s} {'unfused MB':>11s} {'fused MB':>9s} "
          f"{'mem ratio':>9s} {'unfused s':>10s} {'fused s':>8s} {'time ratio':>10s} {'liger MB':>9s} "
          f"{'liger s':>8s} {'fused/liger':>11s}")
    rows, failed = [], []
    configs = [(dtype, vocab, train) for dtype in args.fl_dtype for vocab in args.fl_vocab for train in (False, True)]
    total, done = len(configs) * (2 + (liger_why is None)), 0
    for index, (dtype, vocab, train) in enumerate(configs):
        chunk = args.fl_chunk or default_chunk_size(n, vocab, device)
        head = "trained" if train else "frozen"
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        grads = itemsize * (n * hdim + (vocab * hdim if train else 0))
        kinds = ("unfused", "fused") + (("liger",) if liger_why is None else ())
        why = _too_big(n, hdim, vocab, train, chunk, device, itemsize)
        if why is not None:
            done += len(kinds)
            print(f"  ({dtype}, V={vocab}, head {head}: {why})", file=sys.stderr)
            failed.append(f"{dtype} V={vocab} head {head}")
            continue
        results = {}
        for kind in kinds:
            done += 1
            print(f"bench: [{done}/{total}] {dtype}, V={vocab}, head {head}, {kind} path (a child process)",
                  file=sys.stderr, flush=True)
            results[kind] = measure_row(kind, n, hdim, vocab, train, reps, args.fl_chunk, device, args.threads, dtype)
        un, fu, li = results["unfused"], results["fused"], results.get("liger")
        if isinstance(li, str):
            # Liger is a comparison, not this package: its failure is reported, never the bench's; once is enough
            liger_why, total = f"its child failed: {li}", total - (len(configs) - index - 1)
        if isinstance(un, str) or isinstance(fu, str):
            failed.append(f"{dtype} V={vocab} head {head}")
            continue
        li = li if isinstance(li, tuple) else None
        mem_u, mem_f = (un[0] - grads) / 2 ** 20, (fu[0] - grads) / 2 ** 20
        mem_l = (li[0] - grads) / 2 ** 20 if li else None
        row = dict(dtype=dtype, vocab=vocab, head=head, chunk=chunk, grads_mb=grads / 2 ** 20, unfused_mb=mem_u,
                   fused_mb=mem_f, unfused_s=un[1], fused_s=fu[1], liger_mb=mem_l, liger_s=li[1] if li else None)
        rows.append(row)
        print(f"{dtype:>8s} {vocab:7d} {head:>7s} {chunk:6d} {row['grads_mb']:9.0f} {mem_u:11.0f} {mem_f:9.0f} "
              f"{mem_f / mem_u if mem_u > 0 else float('nan'):9.3f} {un[1]:10.3f} {fu[1]:8.3f} "
              f"{fu[1] / un[1]:10.2f} {_mb(mem_l):>9s} {f'{li[1]:.3f}' if li else '-':>8s} "
              f"{f'{fu[1] / li[1]:.2f}' if li else '-':>11s}", flush=True)
    print("(MB: peak extra memory of one fwd+bwd step minus the gradients of hidden and weight, 'grads MB')")
    print("(liger: LigerFusedLinearGRPOLoss, fixed clip eps 0.2, bnpo, no KL: " +
          ("timed)" if liger_why is None else f"not timed: {liger_why})"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"fused_linear_rows": rows, "liger_missing": liger_why}, fh, indent=1)
    if failed:
        # a bench whose rows failed measured nothing for them: say so and exit non-zero, never 0
        print(f"bandpo-lut bench: error: {len(failed)} of {len(failed) + len(rows)} fused-linear rows failed "
              f"({', '.join(failed)}; each one's reason is above): --fl-tokens {n} --fl-hidden {hdim} --fl-vocab "
              f"{' '.join(map(str, args.fl_vocab))} could not run here (sizes past this machine's memory?); lower "
              "them", file=sys.stderr)
        return 1
    return 0
