"""fused_linear_policy_loss against the unfused path: log_softmax((h @ W.T + b) / T) -> gather ->
bandpo_lut.policy_loss (itself tested against the pure-PyTorch reference), plus beta times the k3 KL
aggregated by the reference's `_aggregate`. Loss, metrics and the gradients of hidden, weight and bias."""
from __future__ import annotations

import itertools
import math
import weakref

import pytest
import torch
from helpers import run_fresh
from torch.utils._python_dispatch import TorchDispatchMode

import bandpo_lut
from bandpo_lut.reference.policy_loss import _aggregate
from bandpo_lut.runtime.loss_spec import AGGS, CLIPS, MODES

B, T, H, V = 3, 7, 16, 50


def unfused(hidden, weight, ids, old, adv, mask, *, bias=None, temperature=1.0, ref=None, beta=0.0, **kw):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    ids = ids.clamp(0, weight.shape[0] - 1)   # the -100 labels of the adversarial batch are all masked
    lp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    loss, metrics = bandpo_lut.policy_loss(lp, old, adv, mask, **kw)
    if ref is not None:
        w = torch.ones_like(lp) if mask is None else mask.to(lp.dtype)
        d = torch.where(w != 0, ref - lp, torch.zeros_like(lp))   # garbage on ignored tokens stays out
        k3 = w * (torch.exp(d) - d - 1)
        loss = loss + beta * _aggregate(k3, w, kw.get("agg", "token-mean"))
    return loss, metrics, lp


def batch(seed=0, adversarial=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 2).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        lp = unfused(hidden, weight, ids, torch.zeros(B, T), torch.zeros(B, T), None, bias=bias)[2]
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    if adversarial:
        old[0, :3] = lp[0, :3] + torch.tensor([8.0, -8.0, 30.0])   # ratios far outside any band
        old[0, 3:] = -40.0                                         # p_old -> 0
        old[2, :4] = -1e-7                                         # p_old -> 1
        adv[0] = torch.tensor([1.0, -1.0, -2.0, 1.0, -1.0, 2.0, -3.0])
        mask[1] = False                                            # an empty row
        old[1] = math.nan                                          # ... whose inputs are garbage
        ids[1, 0] = -100                                           # ... including an ignored label
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    return hidden, weight, bias, ids, old.clamp(max=0.0), adv, mask, ref.clamp(max=0.0)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def check_equal(kw, *, seed=0, adversarial=False, beta=0.0, temperature=1.0, chunk_size=5, use_bias=True, tol=1e-5):
    hidden, weight, bias, ids, old, adv, mask, ref = batch(seed, adversarial)
    bias = bias if use_bias else None
    extra = dict(ref=ref, beta=beta) if beta else {}
    loss0, m0, _ = unfused(hidden, weight, ids, old, adv, mask, bias=bias, temperature=temperature, **extra, **kw)
    params = (hidden, weight) + ((bias,) if use_bias else ())
    g0 = torch.autograd.grad(loss0, params)
    loss1, m1 = bandpo_lut.fused_linear_policy_loss(
        hidden, weight, ids, old, adv, mask, bias=bias, temperature=temperature, chunk_size=chunk_size,
        ref_log_prob=ref if beta else None, beta=beta, **kw)
    g1 = torch.autograd.grad(loss1, params)
    assert torch.isfinite(loss0)
    assert abs(loss1.item() - loss0.item()) <= tol * max(abs(loss0.item()), 1e-6), (loss1, loss0)
    for name, a, b in zip(("hidden", "weight", "bias"), g1, g0):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    for k, v in m0.items():
        assert torch.allclose(m1[k], v, rtol=1e-5, atol=1e-6), (k, m1[k], v)


@pytest.mark.parametrize("agg,clip", list(itertools.product(AGGS, CLIPS)))
def test_equals_unfused_every_option(agg, clip):
    for i, (mode, dual_clip, adversarial) in enumerate(itertools.product(MODES, (None, 3.0), (False, True))):
        check_equal(dict(agg=agg, clip=clip, mode=mode, dual_clip=dual_clip), seed=i, adversarial=adversarial,
                    beta=0.04 * (i % 2), temperature=(1.0, 0.7)[i % 2], chunk_size=(5, 4, 21, 64)[i % 4])


def test_equals_unfused_band_options():
    _, _, _, _, old, _, _, _ = batch()
    per_token_delta = torch.linspace(0.02, 0.2, B * T).reshape(B, T)
    for kw in (dict(max_ratio=2.0, dual_clip=10.0), dict(divergence="tv", delta=0.1),
               dict(delta=per_token_delta), dict(delta=per_token_delta[:1])):
        check_equal(kw, adversarial=True, beta=0.1)
    check_equal(dict(clip="fixed", eps_low=0.2, eps_high=0.28), use_bias=False, chunk_size=1)
    check_equal(dict(), chunk_size=None)   # default chunk: all tokens at this size


def test_metrics_entropy_and_kl():
    hidden, weight, bias, ids, old, adv, mask, ref = batch(3, adversarial=True)
    loss, metrics, entropy = bandpo_lut.fused_linear_policy_loss(
        hidden, weight, ids, old, adv, mask, bias=bias, temperature=0.5, chunk_size=4, ref_log_prob=ref,
        return_entropy=True)
    logq = torch.log_softmax((hidden @ weight.t() + bias).double() / 0.5, dim=-1)
    assert torch.allclose(entropy.double(), -(logq.exp() * logq).sum(-1), rtol=1e-5, atol=1e-6)
    lp = logq.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    w = mask.double()
    d = torch.where(mask, ref.double() - lp, torch.zeros_like(lp))
    kl = ((torch.exp(d) - d - 1) * w).sum() / w.sum()
    assert torch.allclose(metrics["kl"].double(), kl, rtol=1e-5)
    # beta = 0 with a reference: the KL is reported, the loss is policy_loss's alone
    loss0, _, _ = unfused(hidden, weight, ids, old, adv, mask, bias=bias, temperature=0.5)
    assert torch.allclose(loss, loss0, rtol=1e-5)


def test_frozen_head_and_no_grad():
    hidden, weight, bias, ids, old, adv, mask, _ = batch(1)
    weight.requires_grad_(False)
    loss0, _, _ = unfused(hidden, weight, ids, old, adv, mask)
    loss1, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, chunk_size=4)
    (g0,), (g1,) = torch.autograd.grad(loss0, hidden), torch.autograd.grad(loss1, hidden)
    assert rel_err(g1, g0) <= 1e-5
    with torch.no_grad():
        loss2, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, chunk_size=4)
    assert loss2.item() == loss1.item() and not loss2.requires_grad
    # the incoming gradient scales every gradient
    loss3, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, chunk_size=4)
    (g3,) = torch.autograd.grad(2.5 * loss3, hidden)
    assert rel_err(g3, 2.5 * g0) <= 1e-5


def test_bfloat16():
    """bf16 hidden/head: bf16 matmuls, float32 softmax, against the unfused path on the same bf16 tensors (its
    logits rounded to bf16 once, then float32). The paths differ by where bf16 rounding happens: the chunked
    matmuls may round a logit or a gradient entry one bf16 ulp (2**-8 relative) differently, and the weight's
    gradient is summed over chunks in float32 here but rounded once to bf16 there. 2e-2 of the largest entry
    is a few such ulps; a wrong formula is off by O(1)."""
    hidden, weight, bias, ids, old, adv, mask, ref = batch(4, adversarial=True, dtype=torch.bfloat16)
    kw = dict(agg="seq-mean-token-mean", dual_clip=3.0)
    loss0, m0, _ = unfused(hidden, weight, ids, old, adv, mask, bias=bias, ref=ref, beta=0.1, **kw)
    g0 = torch.autograd.grad(loss0, (hidden, weight, bias))
    loss1, m1 = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, bias=bias, chunk_size=5,
                                                    ref_log_prob=ref, beta=0.1, **kw)
    g1 = torch.autograd.grad(loss1, (hidden, weight, bias))
    assert loss1.dtype == torch.float32
    assert abs(loss1.item() - loss0.item()) <= 1e-3 * abs(loss0.item())
    for a, b in zip(g1, g0):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) <= 2e-2, rel_err(a, b)
    assert m1["n_tokens"] == m0["n_tokens"]


def test_out_of_range_token_ids_give_nan_not_a_sync():
    hidden, weight, bias, ids, old, adv, mask, _ = batch(5)
    bad = ids.clone()
    bad[0, 0], bad[2, 1] = V, -1
    mask[0, 0], mask[2, 1] = True, False
    loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, bad, old, adv, mask, chunk_size=4)
    (g,) = torch.autograd.grad(loss, hidden)
    assert torch.isnan(loss)
    # the NaN log-prob gets policy_loss's gradient at a NaN log-prob (its log-ratio clamp's: zero)
    lp = torch.full((1, 1), math.nan, requires_grad=True)
    (g_nan,) = torch.autograd.grad(bandpo_lut.policy_loss(lp, old[:1, :1], adv[:1, :1])[0], lp)
    assert torch.all(g[0, 0] == g_nan)
    # masked out-of-range ids (e.g. -100 on padding) are ignored like any masked token's inputs
    mask[0, 0] = False
    loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, bad, old, adv, mask, chunk_size=4)
    loss0, _, _ = unfused(hidden, weight, bad.clamp(0, V - 1), old, adv, mask)
    assert torch.allclose(loss, loss0, rtol=1e-5)


def test_errors():
    hidden, weight, bias, ids, old, adv, mask, ref = batch(6)
    f = bandpo_lut.fused_linear_policy_loss
    cases = [
        ((hidden[0], weight, ids, old, adv), {}, ValueError, "hidden must have shape"),
        ((hidden, weight[:, :3], ids, old, adv), {}, ValueError, "weight must have shape"),
        ((hidden, weight.double(), ids, old, adv), {}, ValueError, "weight is torch.float64"),
        ((hidden, weight, ids.float(), old, adv), {}, TypeError, "token_ids must be an integer"),
        ((hidden, weight, ids[:, :3], old, adv), {}, ValueError, "token_ids has shape"),
        ((hidden, weight, ids, old[:, :3], adv), {}, ValueError, "old_log_prob has shape"),
        ((hidden, weight, ids, old, adv), dict(bias=bias[:3]), ValueError, "bias must be None or a"),
        ((hidden, weight, ids, old, adv), dict(temperature=0.0), ValueError, "temperature"),
        ((hidden, weight, ids, old, adv), dict(chunk_size=0), ValueError, "chunk_size"),
        ((hidden, weight, ids, old, adv), dict(beta=0.1), ValueError, "needs ref_log_prob"),
        ((hidden, weight, ids, old, adv), dict(ref_log_prob=ref[:1]), ValueError, "ref_log_prob must have"),
        ((hidden, weight, ids, old, adv), dict(agg="mean"), ValueError, "agg='mean' is not one of"),
        ((hidden, weight.to("meta"), ids, old, adv), {}, ValueError, "on meta"),
        ((hidden, weight, ids.to("meta"), old, adv), {}, ValueError, "token_ids is on meta"),
    ]
    for args, kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            f(*args, **kw)


class _LargestAllocation(TorchDispatchMode):
    """The largest tensor any op returns (numel), i.e. the largest single allocation."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(fn, *args, **kw):
    with _LargestAllocation() as mode:
        loss = fn(*args, **kw)[0]
        loss.backward()
    return mode.largest


def test_memory_bounded_by_the_chunk():
    """No tensor of tokens x vocab: every allocation is at most a chunk's logits or a gradient's size, at N
    and at 2N tokens, while the unfused path allocates the full logits."""
    vocab, width, chunk = 2000, 4, 8
    for steps in (64, 128):
        g = torch.Generator().manual_seed(steps)
        hidden = torch.randn(2, steps, width, generator=g, requires_grad=True)
        weight = torch.randn(vocab, width, generator=g, requires_grad=True)
        ids = torch.randint(0, vocab, (2, steps), generator=g)
        old, adv = -torch.rand(2, steps, generator=g), torch.randn(2, steps, generator=g)
        fused = _largest(bandpo_lut.fused_linear_policy_loss, hidden, weight, ids, old, adv, chunk_size=chunk)
        assert fused <= chunk * vocab, fused
        assert _largest(unfused, hidden, weight, ids, old, adv, None) >= 2 * steps * vocab


@pytest.mark.slow
@pytest.mark.subprocess
def test_compiles_fullgraph_in_a_fresh_process(tmp_path):
    code = """
import torch, bandpo_lut
g = torch.Generator().manual_seed(0)
h = torch.randn(2, 5, 8, generator=g, requires_grad=True); W = torch.randn(30, 8, generator=g, requires_grad=True)
ids = torch.randint(0, 30, (2, 5), generator=g)
old, adv = -torch.rand(2, 5, generator=g), torch.randn(2, 5, generator=g)
mask = torch.rand(2, 5, generator=g) > 0.2
def f(h, W):
    loss, m, ent = bandpo_lut.fused_linear_policy_loss(h, W, ids, old, adv, mask, chunk_size=4, dual_clip=3.0,
                                                       return_entropy=True)
    return loss, m["clip_frac"], ent
compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
l1, c1, e1 = compiled(h, W); g1 = torch.autograd.grad(l1, (h, W))
l0, c0, e0 = f(h, W); g0 = torch.autograd.grad(l0, (h, W))
assert torch.equal(l1, l0) and torch.equal(c1, c0) and torch.allclose(e1, e0)
assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(g1, g0))
print("OK")
"""
    out = run_fresh(["-c", code], cwd=tmp_path, check=True)
    assert "OK" in out.stdout


def test_inductor_cpu_unequal_chunks_match_unfused_eager(tmp_path):
    """Inductor on CPU, 80 tokens in chunks of 48 + 32 (T = 40 does not divide 48). The per-token copy of
    row_scale (and of any per-row value: a per-sequence delta, advantages expanded from (batch, 1)) was a
    generated loop reading row token // T, which Inductor's floor-division loop split cut to 40 iterations:
    tokens 40..47 of the first chunk got uninitialised scales, hence NaN or wrong gradients (the first case
    below failed so before the fix; the second covers the broadcast inputs). Reference: the unfused eager loss
    (log_softmax + policy_loss, autograd)."""
    code = """
import torch, bandpo_lut
g = torch.Generator().manual_seed(0)
B, T, H, V = 2, 40, 32, 500
h = torch.randn(B, T, H, generator=g, requires_grad=True)
W = (torch.randn(V, H, generator=g) / 10).requires_grad_()
ids = torch.randint(0, V, (B, T), generator=g)
old = -torch.rand(B, T, generator=g) * 3 - 1
adv_row = torch.randn(B, 1, generator=g)
mask = torch.rand(B, T, generator=g) > 0.2
cases = {"dense": (adv_row.expand(B, T).clone(), 0.05),
         "per-sequence adv and delta": (adv_row.expand(B, T), torch.tensor([[0.05], [0.1]]))}
for name, (adv, delta) in cases.items():
    def fused(h, W):
        return bandpo_lut.fused_linear_policy_loss(h, W, ids, old, adv, mask, delta=delta, chunk_size=48)[0]
    def unfused(h, W):
        lp = torch.log_softmax(h @ W.t(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return bandpo_lut.policy_loss(lp, old, adv, mask, delta=delta)[0]
    l1 = torch.compile(fused, fullgraph=True, backend="inductor")(h, W); g1 = torch.autograd.grad(l1, (h, W))
    l0 = unfused(h, W); g0 = torch.autograd.grad(l0, (h, W))
    assert torch.allclose(l1, l0, rtol=1e-5), (name, l1, l0)
    for what, a, b in zip(("hidden", "weight"), g1, g0):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, (name, what, err)
print("OK")
"""
    out = run_fresh(["-c", code], cwd=tmp_path, check=True)
    assert "OK" in out.stdout


# ---- compile with varying lengths, second order, empty batches, token-id dtypes, func transforms, peak memory

@pytest.mark.subprocess
def test_compiled_dynamic_one_graph_for_every_token_count(tmp_path):
    """torch.compile(fullgraph=True, dynamic=True) over 12 distinct token counts: one graph (a recompile raises
    through error_on_recompile; Dynamo's unique-graph counter says 1), each length's loss and gradients equal
    to the unfused log_softmax + policy_loss in eager mode. Before, the Python chunk loop specialised the graph
    on the token count: the second length recompiled (the 9th raised FailOnRecompileLimitHit)."""
    code = """
import torch, bandpo_lut, torch._dynamo
from torch._dynamo.utils import counters
B, H, V = 2, 8, 40
W = torch.randn(V, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
def fused(h, W, ids, old, adv, mask):
    loss, m, ent = bandpo_lut.fused_linear_policy_loss(h, W, ids, old, adv, mask, chunk_size=4, dual_clip=3.0,
                                                       return_entropy=True)
    return loss, m["clip_frac"], ent
def unfused(h, W, ids, old, adv, mask):
    logq = torch.log_softmax(h @ W.t(), dim=-1)
    lp = logq.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    loss, m = bandpo_lut.policy_loss(lp, old, adv, mask, dual_clip=3.0)
    return loss, m["clip_frac"], -(logq.exp() * logq).sum(-1)
comp = torch.compile(fused, fullgraph=True, dynamic=True, backend="aot_eager")
for i, T in enumerate(range(3, 15)):
    torch._dynamo.config.error_on_recompile = i > 0
    g = torch.Generator().manual_seed(T)
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    old, adv = -torch.rand(B, T, generator=g) * 3, torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    l1, c1, e1 = comp(h, W, ids, old, adv, mask); g1 = torch.autograd.grad(l1, (h, W))
    l0, c0, e0 = unfused(h, W, ids, old, adv, mask); g0 = torch.autograd.grad(l0, (h, W))
    assert torch.allclose(l1, l0, rtol=1e-5, atol=1e-7), (T, l1, l0)
    assert torch.equal(c1, c0) and torch.allclose(e1, e0, rtol=1e-5, atol=1e-6), T
    for a, b in zip(g1, g0):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5, T
assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
print("OK")
"""
    out = run_fresh(["-c", code], cwd=tmp_path, check=True)
    assert "OK" in out.stdout


def test_double_backward_refused():
    """As policy_loss: first order under create_graph=True works, a second derivative raises (before: the
    gradient came back with no graph, a silent zero second-order term)."""
    hidden, weight, bias, ids, old, adv, mask, _ = batch(7)
    loss0, _, _ = unfused(hidden, weight, ids, old, adv, mask, bias=bias)
    g0 = torch.autograd.grad(loss0, (hidden, weight, bias))
    loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, bias=bias, chunk_size=4)
    g1 = torch.autograd.grad(loss, (hidden, weight, bias), create_graph=True)
    for a, b in zip(g1, g0):
        assert rel_err(a, b) <= 1e-5
    for target in (hidden, weight):
        with pytest.raises(NotImplementedError, match="fused_linear_policy_loss has no second derivative"):
            torch.autograd.grad((g1[0] ** 2).sum() + (g1[1] ** 2).sum(), target)
    # policy_loss refuses the same way (the behaviour matched)
    lp = torch.randn(2, 3).clamp(max=-0.1).requires_grad_()
    (glp,) = torch.autograd.grad(bandpo_lut.policy_loss(lp, lp.detach() - 0.1, torch.randn(2, 3))[0], lp,
                                 create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.autograd.grad(glp.sum(), lp)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batch_as_policy_loss(shape):
    """B = 0 or T = 0: policy_loss's answer (loss 0, counts 0, zero gradients of the right shapes), not
    torch.cat's error."""
    hidden = torch.randn(*shape, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    ids = torch.zeros(shape, dtype=torch.long)
    lp = torch.zeros(shape, requires_grad=True)
    ref_loss, ref_m = bandpo_lut.policy_loss(lp, torch.zeros(shape), torch.zeros(shape))
    loss, m, ent = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, torch.zeros(shape), torch.zeros(shape),
                                                       return_entropy=True)
    loss.backward()
    assert loss.item() == ref_loss.item() == 0.0 and ent.shape == shape
    assert all(m[k].item() == v.item() for k, v in ref_m.items())
    assert hidden.grad.shape == hidden.shape and torch.count_nonzero(weight.grad) == 0


def test_token_id_dtypes():
    hidden, weight, bias, ids, old, adv, mask, _ = batch(8)
    f = bandpo_lut.fused_linear_policy_loss
    for bad in (torch.int16, torch.uint8, torch.int8, torch.bool):
        with pytest.raises(TypeError, match=r"token_ids must be an integer tensor of dtype int64 or int32, got "
                                            + str(bad).replace(".", r"\.")):
            f(hidden, weight, ids.to(bad), old, adv, mask)
    loss0, _, _ = unfused(hidden, weight, ids, old, adv, mask)
    loss32, _ = f(hidden, weight, ids.to(torch.int32), old, adv, mask, chunk_size=4)
    assert abs(loss32.item() - loss0.item()) <= 1e-5 * abs(loss0.item())


def test_func_transforms_and_forward_mode_refused():
    """torch.func transforms and forward-mode AD: a NotImplementedError naming the fused loss (before: torch's
    error about setup_context)."""
    import torch.autograd.forward_ad as fwad
    hidden, weight, bias, ids, old, adv, mask, _ = batch(9)
    h = hidden.detach()

    def f(x):
        return bandpo_lut.fused_linear_policy_loss(x, weight, ids, old, adv, mask)[0]
    for run in (lambda: torch.func.grad(f)(h), lambda: torch.func.vjp(f, h),
                lambda: torch.func.jvp(f, (h,), (torch.ones_like(h),)), lambda: torch.func.vmap(f)(h[None])):
        with pytest.raises(NotImplementedError, match="fused_linear_policy_loss does not run under torch.func"):
            run()
    with fwad.dual_level():
        with pytest.raises(NotImplementedError, match="fused_linear_policy_loss has no forward-mode"):
            f(fwad.make_dual(h, torch.ones_like(h)))


class _LiveBytes(TorchDispatchMode):
    """The high-water mark of the bytes held by tensors that ops create (a storage counted once, released when
    the tensor that first held it is collected). The chunk op is run through its Python body so that the
    mode sees each allocation inside it."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.held = 0, 0, {}

    def _release(self, key):
        self.live -= self.held.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from bandpo_lut.runtime import fused_linear
        if str(func) == "bandpo_lut.fused_linear_chunks.default":
            with self:
                return fused_linear._chunked_pass_impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                key = t.untyped_storage().data_ptr()
                if key and key not in self.held:
                    self.held[key] = t.untyped_storage().nbytes()
                    self.live += self.held[key]
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._release, key)
        return out


@pytest.mark.parametrize("dtype,entropy,buffers", [(torch.float32, False, 1), (torch.float32, True, 2),
                                                   (torch.bfloat16, False, 1.5)])
def test_peak_memory_chunk_buffers(dtype, entropy, buffers):
    """Peak live bytes of the forward, gradients and O(tokens) vectors aside: one chunk x vocab float32 buffer
    (two with return_entropy; bf16 adds half a buffer: the chunk's logit gradient in bf16, and on the CPU the
    bf16 product before its float32 copy, never both at once), as docs/fused_linear.md says. Before: the previous
    chunk's buffer was still referenced when the next chunk's logits were allocated (two, three with entropy)."""
    vocab, width, steps, chunk = 4000, 4, 256, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, steps, width, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (2, steps), generator=g)
    old, adv = -torch.rand(2, steps, generator=g), torch.randn(2, steps, generator=g)
    with _LiveBytes() as mode:
        bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, chunk_size=chunk, return_entropy=entropy)
    buffer = chunk * vocab * 4
    grads = (hidden.numel() + weight.numel()) * hidden.element_size()
    extra = mode.peak - grads
    assert buffers * buffer <= extra < (buffers + 0.5) * buffer, extra / buffer


# ---- autocast, a temperature schedule under compile, the log-probs as an output, the bf16 weight gradient ----

def test_autocast_bf16_hidden_fp32_head_as_unfused_under_autocast():
    """Under torch.autocast('cpu', bfloat16) a bf16 hidden state next to a float32 head (what a model under autocast
    hands the loss) runs as `hidden @ weight.T` does there: both cast to bf16, the head's gradient back in
    float32. Reference: the unfused matmul under the same autocast, then float32 log_softmax + policy_loss.
    Outside autocast the same pair is refused (no silent upcast). Before: refused under autocast too."""
    hidden, weight, bias, ids, old, adv, mask, ref = batch(10)
    hidden = hidden.detach().to(torch.bfloat16).requires_grad_()
    kw = dict(agg="seq-mean-token-mean", dual_clip=3.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0, m0, _ = unfused(hidden, weight, ids, old, adv, mask, bias=bias, ref=ref, beta=0.1, **kw)
        loss1, m1 = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, bias=bias, chunk_size=5,
                                                        ref_log_prob=ref, beta=0.1, **kw)
    g0 = torch.autograd.grad(loss0, (hidden, weight, bias))
    g1 = torch.autograd.grad(loss1, (hidden, weight, bias))
    assert abs(loss1.item() - loss0.item()) <= 1e-3 * abs(loss0.item())
    for x, a, b in zip((hidden, weight, bias), g1, g0):
        assert a.dtype == x.dtype and rel_err(a, b) <= 2e-2, (x.dtype, rel_err(a, b))
    assert m1["n_tokens"] == m0["n_tokens"]
    # the float32 path differs from the bf16 one by far more than the tolerance above (so the cast is seen)
    loss32, _ = bandpo_lut.fused_linear_policy_loss(hidden.float(), weight, ids, old, adv, mask, bias=bias,
                                                    chunk_size=5, ref_log_prob=ref, beta=0.1, **kw)
    assert loss32.item() != loss1.item()
    with pytest.raises(ValueError, match="weight is torch.float32 on cpu but hidden is torch.bfloat16"):
        bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask)


def test_autocast_float64_left_alone():
    """Autocast does not cast float64 (F.linear's rule): float64 inputs under autocast keep their dtype."""
    hidden, weight, bias, ids, old, adv, mask, _ = batch(11)
    h64, w64 = hidden.detach().double(), weight.detach().double()
    loss0, _ = bandpo_lut.fused_linear_policy_loss(h64, w64, ids, old, adv, mask, chunk_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss1, _ = bandpo_lut.fused_linear_policy_loss(h64, w64, ids, old, adv, mask, chunk_size=4)
    assert loss1.item() == loss0.item()


def test_return_log_prob_and_entropy_order():
    """return_log_prob: the log-probs of token_ids (log_softmax + gather, float64 reference), after the entropy
    when both are asked for; without gradient."""
    hidden, weight, bias, ids, old, adv, mask, _ = batch(12)
    logq = torch.log_softmax((hidden @ weight.t() + bias).double() / 0.8, dim=-1)
    lp_ref = logq.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    out = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, mask, bias=bias, temperature=0.8,
                                              chunk_size=4, return_log_prob=True)
    assert len(out) == 3 and not out[2].requires_grad
    torch.testing.assert_close(out[2].double(), lp_ref, rtol=1e-5, atol=1e-6)
    loss, metrics, entropy, lp = bandpo_lut.fused_linear_policy_loss(
        hidden, weight, ids, old, adv, mask, bias=bias, temperature=0.8, chunk_size=4, return_entropy=True,
        return_log_prob=True)
    torch.testing.assert_close(lp, out[2], rtol=0, atol=0)
    torch.testing.assert_close(entropy.double(), -(logq.exp() * logq).sum(-1), rtol=1e-5, atol=1e-6)
    assert loss.item() == out[0].item()


class _CountLarge(TorchDispatchMode):
    """Tensors of at least `numel` elements that ops create (the chunk op run through its Python body)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from bandpo_lut.runtime import fused_linear
        if str(func) == "bandpo_lut.fused_linear_chunks.default":
            with self:
                return fused_linear._chunked_pass_impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # a new storage: not a view of an input, nor an input written in place
            if (isinstance(t, torch.Tensor) and t.numel() >= self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.made.append((str(func), t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_one_buffer_accumulated_in_place(dtype):
    """Over 8 chunks, the weight's gradient is one (V, H) buffer in the weight's dtype that each chunk's GEMM adds
    into (addmm_): no (V, H) product per chunk, no float32 copy of it. Before, bf16 made a bf16 product and its
    float32 copy per chunk (16 tensors of V x H here) and a float32 buffer."""
    vocab, width, steps, chunk = 64, 48, 32, 4
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, steps, width, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (1, steps), generator=g)
    old, adv = -torch.rand(1, steps, generator=g) * 4, torch.randn(1, steps, generator=g)
    with _CountLarge(vocab * width) as mode:
        loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, chunk_size=chunk)
    assert [made_dtype for _, made_dtype in mode.made] == [dtype], mode.made
    loss.backward()
    assert weight.grad.dtype == dtype


def test_bfloat16_weight_gradient_near_float64_truth():
    """The bf16 weight gradient, rounded to bf16 once per chunk (here 128 chunks of one token: the most roundings),
    against the float64 gradient of the same bf16 inputs (relative Frobenius error): as close as the unfused bf16
    path's (one GEMM, one rounding), whose error the bf16 logits and logit gradients dominate. Measured: unfused
    7.2e-3; fused 7.4e-3 at chunk 1 and 8 (the float32 accumulation it replaced: 7.5e-3 and 7.6e-3)."""
    vocab, width, steps = 256, 32, 128
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, steps, width, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) / 2).bfloat16().requires_grad_()
    ids = torch.randint(0, vocab, (1, steps), generator=g)
    old, adv = -torch.rand(1, steps, generator=g) * 6, torch.randn(1, steps, generator=g)
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    lp = torch.log_softmax(h @ w.t(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    truth = torch.autograd.grad(bandpo_lut.policy_loss(lp, old.double(), adv.double())[0], (h, w))

    def fro(grads):
        return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(grads, truth)]
    u_loss, _, _ = unfused(hidden, weight, ids, old, adv, None)
    base = fro(torch.autograd.grad(u_loss, (hidden, weight)))
    for chunk in (1, 8):
        loss, _ = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, chunk_size=chunk)
        err = fro(torch.autograd.grad(loss, (hidden, weight)))
        assert all(e <= 1.25 * b for e, b in zip(err, base)), (chunk, err, base)


def test_default_chunk_size_per_device():
    """CPU: 2**25 logits a chunk; CUDA: 2**26, in multiples of 64 tokens (at least 1 token, at most all)."""
    from bandpo_lut.runtime.fused_linear import default_chunk_size
    assert default_chunk_size(4096, 131072) == 256
    assert default_chunk_size(4096, 131072, "cuda") == 512
    assert default_chunk_size(4096, 151936, "cuda") == 384     # 441 rounded down to a multiple of 64
    assert default_chunk_size(100, 32768, torch.device("cuda", 0)) == 100
    assert default_chunk_size(4096, 2 ** 21, "cuda") == 32
    assert default_chunk_size(4096, 2 ** 28, "cuda") == 1


@pytest.mark.subprocess
def test_compiled_dynamic_one_graph_for_every_temperature(tmp_path):
    """torch.compile(fullgraph=True, dynamic=True) over 10 distinct temperatures (a schedule): one graph, no
    recompile (error_on_recompile after the first call; Dynamo's unique-graph counter says 1), each value's loss
    and gradients equal to the unfused eager loss at that temperature. Before: one graph per temperature (a float
    argument of the chunk op is specialised), the 9th raised FailOnRecompileLimitHit."""
    code = """
import torch, bandpo_lut, torch._dynamo
from torch._dynamo.utils import counters
g = torch.Generator().manual_seed(0)
B, T, H, V = 2, 6, 8, 40
h = torch.randn(B, T, H, generator=g, requires_grad=True)
W = torch.randn(V, H, generator=g, requires_grad=True)
ids = torch.randint(0, V, (B, T), generator=g)
old, adv = -torch.rand(B, T, generator=g) * 3, torch.randn(B, T, generator=g)
mask = torch.rand(B, T, generator=g) > 0.2
def fused(h, W, temperature):
    return bandpo_lut.fused_linear_policy_loss(h, W, ids, old, adv, mask, temperature=temperature, chunk_size=4)[0]
def unfused(h, W, temperature):
    lp = torch.log_softmax(h @ W.t() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return bandpo_lut.policy_loss(lp, old, adv, mask)[0]
comp = torch.compile(fused, fullgraph=True, dynamic=True, backend="aot_eager")
for i, temperature in enumerate([1.0, 0.9, 0.8, 0.7, 0.6, 1.1, 1.25, 0.55, 0.95, 1.5]):
    torch._dynamo.config.error_on_recompile = i > 0
    l1 = comp(h, W, temperature); g1 = torch.autograd.grad(l1, (h, W))
    l0 = unfused(h, W, temperature); g0 = torch.autograd.grad(l0, (h, W))
    assert torch.allclose(l1, l0, rtol=1e-5, atol=1e-7), (temperature, l1, l0)
    for a, b in zip(g1, g0):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5, temperature
assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
print("OK")
"""
    out = run_fresh(["-c", code], cwd=tmp_path, check=True)
    assert "OK" in out.stdout
