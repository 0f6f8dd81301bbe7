"""`bandpo-lut bench --fused-linear`: the unfused path against `fused_linear_policy_loss`, side by side.

    unfused: log_softmax(hidden @ weight.T) -> gather -> bandpo_lut.policy_loss   (the full logits)
    fused:   bandpo_lut.fused_linear_policy_loss(hidden, weight, ...)             (one chunk at a time)

For each vocabulary size, LM head frozen (LoRA-style: no weight gradient) and trained, each path runs in a
fresh process: one warm-up step, then one measured step for memory, then --fl-repeats timed steps
(fwd+bwd; the median is reported). Peak extra memory as `bandpo_lut.cli.bench.measure` reads it (CPU: the
resident-set high-water mark; CUDA: the caching allocator's peak). The gradients of hidden and weight (which any
path must hold) are subtracted and shown apart. A row whose estimated memory (`row_bytes`) exceeds what the
device has free is skipped before its child starts, saying why; each child is announced on stderr as it starts.
"""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from bandpo_lut.cli.bench import measure

# Upper end of --fl-repeats: each timed step of a large row takes seconds (the sizes are bounded by memory, row by
# row, in `run`).
MAX_FL_REPEATS = 10_000


def add_arguments(parser):
    from bandpo_lut.cli.args import int_at_least, int_in

    parser.add_argument("--fused-linear", action="store_true",
                        help="only the fused-linear section: unfused vs fused_linear_policy_loss, memory and time")
    parser.add_argument("--fl-tokens", type=int_at_least(1), default=4096, help="tokens N (default 4096)")
    parser.add_argument("--fl-hidden", type=int_at_least(1), default=1024, help="hidden size H (default 1024)")
    parser.add_argument("--fl-vocab", type=int_at_least(2), nargs="+", default=[32768, 131072],
                        help="vocabulary sizes V (default 32768 131072)")
    parser.add_argument("--fl-repeats", type=int_in(1, MAX_FL_REPEATS), default=3,
                        help="timed steps per row after the warm-up and the memory step (default 3)")
    parser.add_argument("--fl-chunk", type=int_at_least(1), default=None,
                        help="chunk_size of the fused path (default: fused_linear_policy_loss's)")


def make_inputs(tokens, hidden, vocab, device, train_head, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(1, tokens, hidden, generator=g)).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_(train_head)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    old = (-torch.rand(1, tokens, generator=g) * 12).to(device)     # log p_old of a vocabulary-size softmax
    adv = torch.randn(1, tokens, generator=g).to(device)
    mask = (torch.rand(1, tokens, generator=g) > 0.1).to(device)
    return h, w, ids, old, adv, mask


def step(kind, inputs, chunk=None):
    import bandpo_lut

    h, w, ids, old, adv, mask = inputs
    h.grad = w.grad = None
    kw = dict(max_ratio=10.0, dual_clip=10.0)
    if kind == "unfused":
        lp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        loss, _ = bandpo_lut.policy_loss(lp, old, adv, mask, **kw)
    else:
        loss, _ = bandpo_lut.fused_linear_policy_loss(h, w, ids, old, adv, mask, chunk_size=chunk, **kw)
    loss.backward()


def row_bytes(kind, tokens, hidden, vocab, train, chunk) -> int:
    """About the memory one configuration's child holds at its peak (float32): hidden and its gradient, the head
    (and its gradient when trained), and about four (tokens or chunk) x vocab tensors of logits, their log-softmax
    and the gradients of both (the unfused path holds the whole logits; the fused one a chunk at a time)."""
    rows = tokens if kind == "unfused" else min(chunk, tokens)
    return 4 * (2 * tokens * hidden + (1 + bool(train)) * vocab * hidden + 4 * rows * vocab)


def _too_big(tokens, hidden, vocab, train, chunk, device) -> str | None:
    """Why a row cannot run here (an estimate past the memory available), or None."""
    from bandpo_lut.cli.args import available_memory

    needs = [(device, f"the {kind} path", row_bytes(kind, tokens, hidden, vocab, train, chunk))
             for kind in ("unfused", "fused")]
    if device.type == "cuda":     # the inputs are drawn on the host first
        needs.append((torch.device("cpu"), "drawing the inputs", 4 * (tokens + vocab) * hidden))
    for where, what, need in needs:
        have = available_memory(where)
        if have is not None and need > have:
            return (f"skipped: {what} needs about {need / 2 ** 30:.3g} GiB on {where}, only "
                    f"{have / 2 ** 30:.3g} GiB is available")
    return None


def measure_row(kind, tokens, hidden, vocab, train, repeats, chunk, device, threads):
    """(peak extra bytes, median seconds) of one configuration, in a fresh process; None if it failed."""
    if device.type == "cpu" and not measure.cpu_peak_measurable():
        return None
    try:
        return tuple(measure.run_child("fused_linear", [kind, tokens, hidden, vocab, train, repeats, chunk,
                                                        str(device)], threads))
    except subprocess.CalledProcessError as err:
        last = err.stderr.strip().splitlines()[-1:] or [f"exit status {err.returncode}"]
        print(f"  ({kind}, V={vocab}, head {'trained' if train else 'frozen'}: failed: {last[0]})", file=sys.stderr)
        return None


def run(args, device) -> int:
    from bandpo_lut.runtime.fused_linear import default_chunk_size

    n, hdim, reps = args.fl_tokens, args.fl_hidden, args.fl_repeats
    accounting = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                  else "peak RSS (VmHWM after clear_refs), fresh process per row")
    print(f"fused-linear policy loss, float32, {device}, N = {n}, H = {hdim}, {args.threads} threads; "
          f"memory: {accounting}; time: median of {reps} fwd+bwd steps")
    print(f"{'V':>7s} {'head':>7s} {'chunk':>6s} {'grads MB':>9s} {'unfused MB':>11s} {'fused MB':>9s} "
          f"{'mem ratio':>9s} {'unfused s':>10s} {'fused s':>8s} {'time ratio':>10s}")
    rows, failed = [], []
    total, done = 2 * 2 * len(args.fl_vocab), 0
    for vocab in args.fl_vocab:
        chunk = args.fl_chunk or default_chunk_size(n, vocab)
        for train in (False, True):
            head = "trained" if train else "frozen"
            grads = 4 * (n * hdim + (vocab * hdim if train else 0))
            why = _too_big(n, hdim, vocab, train, chunk, device)
            if why is not None:
                done += 2
                print(f"  (V={vocab}, head {head}: {why})", file=sys.stderr)
                failed.append(f"V={vocab} head {head}")
                continue
            results = []
            for kind in ("unfused", "fused"):
                done += 1
                print(f"bench: [{done}/{total}] V={vocab}, head {head}, {kind} path (a child process)",
                      file=sys.stderr, flush=True)
                results.append(measure_row(kind, n, hdim, vocab, train, reps, args.fl_chunk, device, args.threads))
            un, fu = results
            if un is None or fu is None:
                failed.append(f"V={vocab} head {'trained' if train else 'frozen'}")
                continue
            mem_u, mem_f = (un[0] - grads) / 2 ** 20, (fu[0] - grads) / 2 ** 20
            row = dict(vocab=vocab, head="trained" if train else "frozen", chunk=chunk, grads_mb=grads / 2 ** 20,
                       unfused_mb=mem_u, fused_mb=mem_f, unfused_s=un[1], fused_s=fu[1])
            rows.append(row)
            print(f"{vocab:7d} {row['head']:>7s} {chunk:6d} {row['grads_mb']:9.0f} {mem_u:11.0f} {mem_f:9.0f} "
                  f"{mem_f / mem_u if mem_u > 0 else float('nan'):9.3f} {un[1]:10.2f} {fu[1]:8.2f} "
                  f"{fu[1] / un[1]:10.2f}")
    print("(MB: peak extra memory of one fwd+bwd step minus the gradients of hidden and weight, 'grads MB')")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"fused_linear_rows": rows}, fh, indent=1)
    if failed:
        # a bench whose rows failed measured nothing for them: say so and exit non-zero, never 0
        print(f"bandpo-lut bench: error: {len(failed)} of {len(failed) + len(rows)} fused-linear rows failed "
              f"({', '.join(failed)}; each one's reason is above): --fl-tokens {n} --fl-hidden {hdim} --fl-vocab "
              f"{' '.join(map(str, args.fl_vocab))} could not run here (sizes past this machine's memory?); lower "
              "them", file=sys.stderr)
        return 1
    return 0
