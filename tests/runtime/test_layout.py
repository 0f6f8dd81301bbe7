"""The same token gets the same bits whatever the layout of its batch: every op and the fused loss, forward and
backward, every dtype, scalar, per-token and per-row δ, every divergence, on every device, on transposed, strided,
offset, permuted, expanded and sequence-first inputs, equals the call on contiguous copies bit for bit (the kernels
read dense row-major copies and write the gradient in the layout it is allocated in)."""
from __future__ import annotations

import pytest
import torch

import bandpo_lut
from bandpo_lut.tables import store as tables

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included), shapes and dtypes too."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def probabilities(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=torch.float64).uniform_(-18, 18, generator=g)   # tails beyond the grid too
    p = torch.sigmoid(t)
    p.view(-1)[:3] = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.float64)
    return p.to(device=device, dtype=dtype)


def deltas(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1)
    d = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(-6.9, -0.01, generator=g))
    d.view(-1)[-1] = 2.0   # out of range: NaN
    return d.to(device=device, dtype=dtype)


def layouts(x: torch.Tensor):
    """(name, same values in another memory layout) for a 2-D (B, T) tensor x: every one a non-contiguous view."""
    B, T = x.shape
    new = dict(dtype=x.dtype, device=x.device)
    wide = torch.zeros(B, 2 * T, **new)
    wide[:, ::2] = x
    seq_first = x.t().contiguous().t()            # stored (T, B), viewed (B, T)
    padded = torch.zeros(B + 1, T + 3, **new)
    padded[1:, 3:] = x
    interleaved = torch.zeros(T, 2, B, **new)   # stored (T, 2, B): strides (1, 2B) once viewed (B, T)
    interleaved[:, 1, :] = x.t()
    views = [("strided", wide[:, ::2]), ("sequence-first", seq_first), ("offset", padded[1:, 3:]),
             ("permuted", interleaved[:, 1, :].t())]
    assert all(not v.is_contiguous() and same_bits(v, x) for _, v in views)
    return views


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_token", [False, True], ids=["scalar-delta", "token-delta"])
@pytest.mark.parametrize("log_input", [False, True], ids=["p", "logp"])
def test_bounds_and_clip_ignore_layout(device, divergence, dtype, per_token, log_input):
    B, T = 6, 300   # > one 256-element block per row
    p = probabilities((B, T), dtype, seed=11, device=device)
    x = torch.log(p.double()).to(dtype) if log_input else p
    d = deltas((B, T), dtype, seed=12, device=device) if per_token else 0.05
    g = torch.Generator().manual_seed(13)
    ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
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
def test_broadcast_delta_and_expanded_inputs(device, divergence, dtype):
    """A δ per row broadcast over the tokens, and an expanded p, equal their materialised copies."""
    B, T = 5, 270
    p_row = probabilities((1, T), dtype, seed=21, device=device)
    d_col = deltas((B, 1), dtype, seed=22, device=device)
    g = torch.Generator().manual_seed(23)
    ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
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
def test_clip_gradient_ignores_layout(device, divergence, dtype):
    B, T = 4, 300
    p = probabilities((B, T), dtype, seed=31, device=device)
    g = torch.Generator().manual_seed(32)
    base = (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
    up_grad = torch.randn(B, T, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    r0 = base.clone().requires_grad_()
    (bandpo_lut.clip(r0, p, 0.05, divergence) * up_grad).sum().backward()
    for name, rv in layouts(base):
        leaf = rv.detach().requires_grad_()   # keeps the view's strides: a non-contiguous leaf
        (bandpo_lut.clip(leaf, p, 0.05, divergence) * up_grad).sum().backward()
        assert same_bits(leaf.grad, r0.grad), f"gradient differs for {name} ratio"


def loss_batch(B, T, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    olp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp(min=1e-7))
    lp = (olp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.2
    to = dict(device=device, dtype=dtype)
    return lp.to(**to), olp.to(**to), adv.to(**to), mask.to(device)


def run_loss(lp, olp, adv, mask, delta, divergence, agg):
    leaf = lp.detach().requires_grad_()   # a view keeps its strides: the gradient is written in its layout
    loss, metrics = bandpo_lut.policy_loss(leaf, olp, adv, mask, delta=delta, divergence=divergence, max_ratio=10,
                                           dual_clip=3, agg=agg)
    loss.backward()
    return loss, metrics, leaf.grad


# δ per token, one per token; per row, a (B, 1) δ and a GRPO advantage (one per sequence) expanded over the tokens
# (stride 0 along T). Each δ mode takes another aggregation, so that every row_scale path is exercised.
DELTA_MODES = {"scalar-delta": "token-mean", "token-delta": "seq-mean-token-mean",
               "row-delta-expanded": "seq-mean-token-sum"}


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("delta_mode", DELTA_MODES)
def test_policy_loss_ignores_layout(device, divergence, dtype, delta_mode):
    B, T = 4, 270
    lp, olp, adv, mask = loss_batch(B, T, dtype, seed=41, device=device)
    compute = torch.promote_types(dtype, torch.float32)
    if delta_mode == "scalar-delta":
        d = 0.05
    elif delta_mode == "token-delta":
        d = deltas((B, T), compute, seed=42, device=device).clamp(max=0.9)
    else:
        d = deltas((B, 1), compute, seed=42, device=device).clamp(max=0.9).expand(B, T)
        adv = adv[:, :1].expand(B, T)
    agg = DELTA_MODES[delta_mode]
    dense = [x.contiguous() if torch.is_tensor(x) else x for x in (lp, olp, adv, mask, d)]
    w_loss, w_metrics, w_grad = run_loss(*dense, divergence, agg)

    def views(x):   # an expanded operand stays expanded: that is its layout
        return dict(layouts(x)) if torch.is_tensor(x) and x.stride(-1) != 0 else None

    per_operand = [views(x) for x in (lp, olp, adv, mask, d)]
    names = list(per_operand[0])
    # every layout for every operand, then mixtures: each operand in another layout
    combos = [(n,) * 5 for n in names] + [tuple(names[(i + k) % len(names)] for k in range(5)) for i in range(2)]
    for combo in combos:
        args = [x if v is None else v[n] for x, v, n in zip((lp, olp, adv, mask, d), per_operand, combo)]
        loss, metrics, grad = run_loss(*args, divergence, agg)
        assert torch.equal(loss, w_loss), f"loss differs for {combo}"
        assert torch.equal(grad, w_grad), f"gradient differs for {combo}"   # element by element, in the leaf's layout
        for k in w_metrics:
            assert torch.equal(metrics[k], w_metrics[k]), f"metric {k} differs for {combo}"


def test_transposed_log_prob_gets_its_own_gradient(device):
    # a sequence-first (T, B) tensor seen through .t()
    b = (torch.randn(3, 2, dtype=torch.float64, device=device) - 1).clamp(max=0).requires_grad_()
    olp = (b.t().detach() + 0.1).clamp(max=0)
    adv = torch.tensor([[1.0, 2, 3], [4, 5, 6]], dtype=torch.float64, device=device)
    bandpo_lut.policy_loss(b.t(), olp, adv)[0].backward()
    c = b.t().contiguous().detach().requires_grad_()
    bandpo_lut.policy_loss(c, olp, adv)[0].backward()
    assert torch.equal(b.grad.t(), c.grad)
