"""policy_loss, forward and backward, is bit-identical for transposed, strided, permuted and expanded inputs
and for the contiguous call (every divergence, dtype and δ mode): the kernels read dense row-major copies
and write the gradient in the layout it is allocated in."""
from __future__ import annotations

import itertools

import pytest
import torch

import bandpo_lut
from bandpo_lut import tables

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
B, T = 5, 67


def inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6
    new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    adv_row = torch.randn(B, 1, generator=g, dtype=torch.float64)          # GRPO: one advantage per sequence
    mask = torch.rand(B, T, generator=g) > 0.2
    delta_row = torch.rand(B, 1, generator=g, dtype=torch.float64) * 0.2 + 0.01
    to = dict(device=device, dtype=dtype)
    return new.to(**to), old.to(**to), adv_row.to(**to), mask.to(device), delta_row.to(device)


def transposed(x):      # sequence-first storage, seen as (B, T)
    return x.t().contiguous().t()


def strided(x):         # every other column of a wider buffer
    buf = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype, device=x.device)
    buf[:, ::2] = x
    return buf[:, ::2]


def permuted(x):        # a (T, 3, B) buffer, permuted and sliced
    buf = torch.zeros(x.shape[1], 3, x.shape[0], dtype=x.dtype, device=x.device)
    buf[:, 1, :] = x.t()
    return buf.permute(2, 1, 0)[:, 1, :]


LAYOUTS = {"transposed": transposed, "strided": strided, "permuted": permuted}


def run(lp, olp, adv, mask, delta, divergence):
    leaf = lp.detach().clone().requires_grad_() if lp.is_contiguous() else None
    if leaf is None:   # keep the layout: the leaf is the strided view's own storage
        leaf = lp.detach().requires_grad_()
    loss, metrics = bandpo_lut.policy_loss(leaf, olp, adv, mask, delta=delta, divergence=divergence,
                                           max_ratio=10.0, dual_clip=3.0, agg="seq-mean-token-mean")
    loss.backward()
    return loss, metrics, leaf.grad


@pytest.mark.parametrize("divergence", tables.SHIPPED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta_mode", ["scalar", "per-token", "per-row expanded"])
def test_every_layout_gives_the_contiguous_bits(device, divergence, dtype, delta_mode):
    lp, olp, adv_row, mask, delta_row = inputs(dtype, device)
    compute = torch.promote_types(dtype, torch.float32)
    delta_full = (delta_row.expand(B, T) + torch.linspace(0, 0.05, T, device=device, dtype=torch.float64)).to(compute)
    delta = {"scalar": 0.07, "per-token": delta_full,
             "per-row expanded": delta_row.to(compute).expand(B, T)}[delta_mode]
    adv = adv_row.expand(B, T)                                          # expanded: stride 0 along T
    ref = run(lp, olp, adv.contiguous(), mask, delta.contiguous() if torch.is_tensor(delta) else delta, divergence)
    for (name, f_lp), (_, f_olp), (_, f_mask) in itertools.product(LAYOUTS.items(), repeat=3):
        if len({f_lp, f_olp, f_mask}) < 3 and name != "transposed":
            continue   # every layout for every operand at least once, without the full product
        d = f_lp(delta) if delta_mode == "per-token" else delta
        got = run(f_lp(lp), f_olp(olp), adv, f_mask(mask), d, divergence)
        assert torch.equal(got[0], ref[0]), name
        for k in ref[1]:
            assert torch.equal(got[1][k], ref[1][k]), (name, k)
        assert torch.equal(got[2], ref[2]), name   # the gradient, element by element, in the leaf's layout


def test_transposed_log_prob_gets_its_own_gradient(device):
    # issue 10, item 1: a (T, B) tensor seen through .t()
    b = (torch.randn(3, 2, dtype=torch.float64, device=device) - 1).clamp(max=0).requires_grad_()
    olp = (b.t().detach() + 0.1).clamp(max=0)
    adv = torch.tensor([[1.0, 2, 3], [4, 5, 6]], dtype=torch.float64, device=device)
    bandpo_lut.policy_loss(b.t(), olp, adv)[0].backward()
    c = b.t().contiguous().detach().requires_grad_()
    bandpo_lut.policy_loss(c, olp, adv)[0].backward()
    assert torch.equal(b.grad.t(), c.grad)
