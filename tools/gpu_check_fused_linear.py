"""The CUDA part of tools/gpu_check.py for `bandpo_lut.fused_linear_policy_loss` (imported by it).

check(report, g): the fused loss on CUDA against the unfused path on CUDA (float32 to 1e-5, bfloat16 and a bf16
    hidden state next to a float32 head under autocast to the tolerance of tests/runtime/test_fused_linear.py) and
    against the fused loss on CPU; forward and backward under
    torch.cuda.set_sync_debug_mode("error") (any host synchronisation raises); torch.compile(fullgraph=True).
check_liger(report, g): where liger-kernel is installed, Liger's fused-linear GRPO loss as `bandpo-lut bench` calls
    it equals fused_linear_policy_loss(clip="fixed") (so that the bench's Liger row times the same loss).
timing(report): N = 4096 tokens (4 x 1024), H = 1024, V = 32768 and 131072, LM head frozen and trained, float32
    and bfloat16 (hidden and head in that dtype; the unfused path's log_softmax in float32): peak extra memory
    (torch.cuda.max_memory_allocated above what was allocated before the step, minus the gradients of hidden and
    weight) and fwd+bwd time of the unfused path, the fused one and, where liger-kernel is installed, Liger's.
    Fails if the fused path's extra memory exceeds 1/8 of the unfused path's at V = 131072. (On the GPU the table
    of record is `bandpo-lut bench --device cuda --fused-linear`, each path in a fresh process.)

Dry run without a GPU: `python tools/gpu_check_fused_linear.py --cpu` runs both on CPU at small sizes (no
memory figures, no sync check).
"""
from __future__ import annotations

import statistics
import sys
import time

MEMORY_RATIO_MAX = 1 / 8


def _inputs(g, rows, steps, hidden, vocab, device, dtype, train_head=True):
    import torch

    h = torch.randn(rows, steps, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device, dtype).requires_grad_(train_head)
    ids = torch.randint(0, vocab, (rows, steps), generator=g).to(device)
    old = (-torch.rand(rows, steps, generator=g) * 12).to(device)
    adv = torch.randn(rows, generator=g).to(device)
    mask = (torch.rand(rows, steps, generator=g) > 0.1).to(device)
    return h, w, ids, old, adv, mask


def _unfused(h, w, ids, old, adv, mask, **kw):
    import torch

    import bandpo_lut

    lp = torch.log_softmax((h @ w.t()).float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return bandpo_lut.policy_loss(lp, old, adv.unsqueeze(1).expand_as(old), mask, **kw)[0]


def _fused(h, w, ids, old, adv, mask, **kw):
    import bandpo_lut

    return bandpo_lut.fused_linear_policy_loss(h, w, ids, old, adv.unsqueeze(1).expand_as(old), mask, **kw)[0]


def _grads(fn, x, **kw):
    import torch

    h, w = x[0], x[1]
    loss = fn(*x, **kw)
    return (loss,) + torch.autograd.grad(loss, [t for t in (h, w) if t.requires_grad])


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().cpu().abs().max()).item()


def check(report, g, device="cuda") -> None:
    import torch

    print("[fused_linear_policy_loss]")
    kw = dict(max_ratio=10.0, dual_clip=10.0, chunk_size=48, agg="seq-mean-token-mean")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = _inputs(g, 3, 70, 64, 3000, device, dtype)
        got = _grads(_fused, x, **kw)
        want = _grads(_unfused, x, **{k: v for k, v in kw.items() if k != "chunk_size"})
        errs = [_rel(a, b) for a, b in zip(got, want)]
        report(f"fused == unfused on {device}, {dtype} (loss, d hidden, d weight)", max(errs) <= tol,
               " ".join(f"{e:.1e}" for e in errs))
        if dtype == torch.float32 and device != "cpu":
            cpu = tuple(t.detach().cpu().requires_grad_(t.requires_grad) if t.is_floating_point() else t.cpu()
                        for t in x)
            errs = [_rel(a, b) for a, b in zip(got, _grads(_fused, cpu, **kw))]
            report("fused on CUDA == fused on CPU", max(errs) <= 1e-5, " ".join(f"{e:.1e}" for e in errs))
    # a bf16 hidden state next to a float32 head under autocast (as a model under autocast hands them over)
    x = _inputs(g, 3, 70, 64, 3000, device, torch.float32)
    x = (x[0].detach().bfloat16().requires_grad_(),) + x[1:]
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        got = _grads(_fused, x, **kw)
        want = _grads(_unfused, x, **{k: v for k, v in kw.items() if k != "chunk_size"})
    errs = [_rel(a, b) for a, b in zip(got, want)]
    report(f"under autocast (bf16 hidden, float32 head) fused == unfused on {device}", max(errs) <= 2e-2,
           " ".join(f"{e:.1e}" for e in errs))
    for dtype in (torch.float32, torch.bfloat16) if device != "cpu" else ():
        x = _inputs(g, 3, 70, 64, 3000, device, dtype)
        _grads(_fused, x, **kw)            # first call (table upload, extension load) outside the check
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            _grads(_fused, x, **kw)
            ok, detail = True, ""
        except RuntimeError as err:
            ok, detail = False, str(err).splitlines()[0][:80]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        report(f"fused fwd+bwd, {dtype}, without host synchronisation (sync debug mode 'error')", ok, detail)
    x = _inputs(g, 2, 40, 32, 500, device, torch.float32)
    compiled = torch.compile(lambda *a: _fused(*a, **kw), fullgraph=True)
    errs = [_rel(a, b) for a, b in zip(_grads(compiled, x), _grads(_fused, x, **kw))]
    report("torch.compile(fullgraph=True) fused == eager", max(errs) <= 1e-6, " ".join(f"{e:.1e}" for e in errs))


def _liger():
    """Liger's fused-linear GRPO loss as `bandpo-lut bench` calls it (`liger_loss`: fixed eps 0.2, "bnpo", no KL), on
    this script's inputs (per-sequence advantages already); None where liger-kernel is not installed."""
    import torch

    from bandpo_lut.cli.bench.fused_linear import liger_loss

    try:
        loss = liger_loss()
    except ImportError as err:
        print(f"  (liger-kernel not importable: {err})")
        return None

    def run(h, w, ids, old, adv, mask):
        return loss(h, w, ids, old, adv, mask.to(torch.float32))

    return run


def check_liger(report, g, device="cuda") -> None:
    """The bench's Liger row computes the loss it is compared as: Liger's fused-linear GRPO loss equals
    fused_linear_policy_loss with clip="fixed" (eps 0.2), agg="token-mean" and each row's advantage on every token,
    in loss and both gradients (float32). Said, not failed, where liger-kernel is not installed."""
    import torch

    liger = _liger()
    if liger is None:
        print("  (Liger's loss not checked; the bench's Liger row says why too)")
        return
    x = _inputs(g, 3, 70, 64, 3000, device, torch.float32)
    errs = [_rel(a, b) for a, b in zip(_grads(liger, x), _grads(_fused, x, clip="fixed", agg="token-mean"))]
    report("Liger's fused-linear GRPO loss == fused_linear_policy_loss(clip='fixed')", max(errs) <= 1e-5,
           " ".join(f"{e:.1e}" for e in errs))


def _measure(fn, x, device, reps):
    """(peak extra bytes, median seconds) of fwd+bwd; bytes None on CPU."""
    import torch

    h, w = x[0], x[1]

    def step():
        h.grad = w.grad = None
        fn(*x).backward()

    step()
    h.grad = w.grad = None
    peak = None
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return peak, statistics.median(times)


def timing(report, device="cuda", rows=4, steps=1024, hidden=1024, vocabs=(32768, 131072), reps=5,
           dtypes=("float32", "bfloat16")) -> None:
    import torch

    paths = [("unfused", _unfused), ("fused", _fused)]
    liger = _liger()
    if liger is not None:
        paths.append(("liger (fixed eps)", liger))
    n = rows * steps
    print(f"\n[timing] fused-linear policy loss, N = {n} ({rows} x {steps}), H = {hidden}, {device}; "
          f"memory: max_memory_allocated above the step's start, minus the gradients of hidden and weight"
          + ("" if liger is not None else "; liger-kernel not installed"))
    print(f"  {'dtype':>8s} {'V':>7s} {'head':>7s} {'path':20s} {'extra MB':>9s} {'ms':>9s} {'x unfused':>9s}")
    for dtype, vocab, train in ((d, v, t) for d in dtypes for v in vocabs for t in (False, True)):
        g = torch.Generator().manual_seed(vocab + train)
        x = _inputs(g, rows, steps, hidden, vocab, device, getattr(torch, dtype), train_head=train)
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        grads = size * (n * hidden + (vocab * hidden if train else 0))
        results = {}
        for name, fn in paths:
            kw = {} if name.startswith("liger") else dict(max_ratio=10.0, dual_clip=10.0)
            peak, sec = _measure(lambda *a, fn=fn, kw=kw: fn(*a, **kw), x, device, reps)
            results[name] = (None if peak is None else (peak - grads) / 2 ** 20, sec)
            mb = "n/a" if peak is None else f"{results[name][0]:9.0f}"
            print(f"  {dtype:>8s} {vocab:7d} {'trained' if train else 'frozen':>7s} {name:20s} {mb:>9s} "
                  f"{sec * 1e3:9.1f} "
                  f"{sec / results['unfused'][1]:9.2f}", flush=True)
        (mu, _), (mf, _) = results["unfused"], results["fused"]
        if vocab == 131072 and mu is not None:
            report(f"fused extra memory <= 1/8 of unfused ({dtype}, V = {vocab}, head "
                   f"{'trained' if train else 'frozen'})", mf <= MEMORY_RATIO_MAX * mu, f"{mf:.0f} MB vs {mu:.0f} MB")
        del x


if __name__ == "__main__":   # the CPU dry run
    import torch

    failures = []

    def _report(label, ok, detail=""):
        print(f"  {'ok  ' if ok else 'FAIL'} {label:70s} {detail}", flush=True)
        if not ok:
            failures.append(label)

    if "--cpu" not in sys.argv:
        sys.exit("usage: python tools/gpu_check_fused_linear.py --cpu  (the CUDA run is part of tools/gpu_check.py)")
    check(_report, torch.Generator().manual_seed(0), device="cpu")
    check_liger(_report, torch.Generator().manual_seed(0), device="cpu")
    timing(_report, device="cpu", rows=2, steps=64, hidden=64, vocabs=(4096,), reps=1)
    sys.exit(1 if failures else 0)
