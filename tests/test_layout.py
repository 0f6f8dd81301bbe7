"""The same token gets the same bits whatever the layout of its batch: every op, forward and backward,
every dtype, scalar and per-token δ, every divergence, on transposed, strided, permuted, expanded and
sequence-first inputs, equals the call on contiguous copies bit for bit."""
from __future__ import annotations

import pytest
import torch

import bandpo_lut
from bandpo_lut import tables

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included), shapes and dtypes too."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def probabilities(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=torch.float64).uniform_(-18, 18, generator=g)   # tails beyond the grid too
    p = torch.sigmoid(t)
    p.view(-1)[:3] = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.float64)
    return p.to(dtype)


def deltas(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    d = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(-6.9, -0.01, generator=g))
    d.view(-1)[-1] = 2.0   # out of range: NaN
    return d.to(dtype)


def layouts(x: torch.Tensor):
    """(name, same values in another memory layout) for a 2-D (B, T) tensor x: every one a non-contiguous view."""
    B, T = x.shape
    wide = torch.zeros(B, 2 * T, dtype=x.dtype)
    wide[:, ::2] = x
    seq_first = x.t().contiguous().t()            # stored (T, B), viewed (B, T)
    padded = torch.zeros(B + 1, T + 3, dtype=x.dtype)
    padded[1:, 3:] = x
    interleaved = torch.zeros(T, 2, B, dtype=x.dtype)   # stored (T, 2, B): strides (1, 2B) once viewed (B, T)
    interleaved[:, 1, :] = x.t()
    views = [("strided", wide[:, ::2]), ("sequence-first", seq_first), ("offset", padded[1:, 3:]),
             ("permuted", interleaved[:, 1, :].t())]
    assert all(not v.is_contiguous() and same_bits(v, x) for _, v in views)
    return views


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_token", [False, True], ids=["scalar-delta", "token-delta"])
@pytest.mark.parametrize("log_input", [False, True], ids=["p", "logp"])
def test_bounds_and_clip_ignore_layout(divergence, dtype, per_token, log_input):
    B, T = 6, 300   # > one 256-element block per row
    p = probabilities((B, T), dtype, seed=11)
    x = torch.log(p.double()).to(dtype) if log_input else p
    d = deltas((B, T), dtype, seed=12) if per_token else 0.05
    g = torch.Generator().manual_seed(13)
    ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype)
    key = "log_p_old" if log_input else "p_old"

    def run(xx, dd, rr):
        lo, up = bandpo_lut.bounds(delta=dd, divergence=divergence, **{key: xx})
        return lo, up, bandpo_lut.clip(rr, delta=dd, divergence=divergence, **{key: xx})

    want = run(x, d, ratio)
    for name, xv in layouts(x):
        dv = dict(layouts(d))[name] if per_token else d
        rv = dict(layouts(ratio))[name]
        got = run(xv, dv, rv)
        for w, o, what in zip(want, got, ("lower", "upper", "clip")):
            assert same_bits(w, o), f"{what} differs for {name} inputs"


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_delta_and_expanded_inputs(divergence, dtype):
    """A δ per row broadcast over the tokens, and an expanded p, equal their materialised copies."""
    B, T = 5, 270
    p_row = probabilities((1, T), dtype, seed=21)
    d_col = deltas((B, 1), dtype, seed=22)
    g = torch.Generator().manual_seed(23)
    ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype)
    p_full = p_row.expand(B, T)
    d_full = d_col.expand(B, T)
    for xx, dd in ((p_full, d_full), (p_row, d_col)):
        lo, up = bandpo_lut.bounds(xx, dd, divergence)
        out = bandpo_lut.clip(ratio, xx, dd, divergence)
        want_lo, want_up = bandpo_lut.bounds(p_full.contiguous(), d_full.contiguous(), divergence)
        want_out = bandpo_lut.clip(ratio, p_full.contiguous(), d_full.contiguous(), divergence)
        assert same_bits(lo, want_lo) and same_bits(up, want_up) and same_bits(out, want_out)


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clip_gradient_ignores_layout(divergence, dtype):
    B, T = 4, 300
    p = probabilities((B, T), dtype, seed=31)
    g = torch.Generator().manual_seed(32)
    base = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype)
    up_grad = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    r0 = base.clone().requires_grad_()
    (bandpo_lut.clip(r0, p, 0.05, divergence) * up_grad).sum().backward()
    for name, rv in layouts(base):
        leaf = rv.detach().requires_grad_()   # keeps the view's strides: a non-contiguous leaf
        (bandpo_lut.clip(leaf, p, 0.05, divergence) * up_grad).sum().backward()
        assert same_bits(leaf.grad, r0.grad), f"gradient differs for {name} ratio"


def loss_batch(B, T, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    olp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp(min=1e-7))
    lp = (olp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.2
    return lp.to(dtype), olp.to(dtype), adv.to(dtype), mask


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_token", [False, True], ids=["scalar-delta", "token-delta"])
def test_policy_loss_ignores_layout(divergence, dtype, per_token):
    B, T = 4, 270
    lp, olp, adv, mask = loss_batch(B, T, dtype, seed=41)
    d = deltas((B, T), dtype, seed=42).clamp(max=0.9) if per_token else 0.05

    def run(a, b, c, m, dd):
        leaf = a.detach().requires_grad_()   # keeps the view's strides
        loss, metrics = bandpo_lut.policy_loss(leaf, b, c, m, delta=dd, divergence=divergence, max_ratio=10,
                                               dual_clip=3)
        loss.backward()
        return loss, metrics, leaf.grad

    w_loss, w_metrics, w_grad = run(lp, olp, adv, mask, d)
    views = {k: dict(layouts(v)) for k, v in (("lp", lp), ("olp", olp), ("adv", adv), ("mask", mask))}
    if per_token:
        views["d"] = dict(layouts(d))
    for name in views["lp"]:
        dd = views["d"][name] if per_token else d
        loss, metrics, grad = run(views["lp"][name], views["olp"][name], views["adv"][name],
                                  views["mask"][name], dd)
        assert same_bits(loss, w_loss), f"loss differs for {name} inputs"
        assert same_bits(grad, w_grad), f"gradient differs for {name} inputs"
        for k in w_metrics:
            assert same_bits(metrics[k], w_metrics[k]), f"metric {k} differs for {name} inputs"
