"""The fused loss issues a small, fixed number of ops per direction (counted with a TorchDispatchMode on
CPU: what an eager training step dispatches, each at most one kernel launch on a GPU), whatever the batch,
with the values of the reference."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bandpo_lut
from bandpo_lut.reference import policy_loss as spec

MAX_OPS = 10


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 5
    new = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    return new, old, adv, mask


@pytest.mark.parametrize("kw", [dict(), dict(agg="seq-mean-token-mean", dual_clip=3.0),
                                dict(clip="fixed", mode="mask"), dict(delta=torch.full((1, 64), 0.1))])
@pytest.mark.parametrize("shape", [(4, 64), (64, 64)])
def test_forward_and_backward_issue_few_ops(kw, shape):
    lp, olp, adv, mask = batch(*shape)
    bandpo_lut.policy_loss(lp, olp, adv, mask, **kw)   # warm the table caches
    a = lp.clone().requires_grad_()
    with CountOps() as fwd:
        loss, metrics = bandpo_lut.policy_loss(a, olp, adv, mask, **kw)
    with CountOps() as bwd:
        loss.backward()
    assert len(fwd.ops) <= MAX_OPS, fwd.ops
    assert len(bwd.ops) <= MAX_OPS, bwd.ops
    # the same values as the specification
    b = lp.clone().requires_grad_()
    ref, ref_metrics = spec.policy_loss(b, olp, adv, mask, **kw)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)
    assert list(metrics) == list(ref_metrics)
    for k in metrics:
        torch.testing.assert_close(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, msg=k)


def test_op_count_does_not_grow_with_the_batch():
    counts = []
    for B in (2, 300):
        lp, olp, adv, mask = batch(B, 17)
        a = lp.clone().requires_grad_()
        with CountOps() as mode:
            loss, _ = bandpo_lut.policy_loss(a, olp, adv, mask, agg="seq-mean-token-sum")
            loss.backward()
        counts.append(len(mode.ops))
    assert counts[0] == counts[1]


def test_metrics_from_counts_is_vectorised():
    lp, olp, adv, mask = batch(4, 64)
    _, m = bandpo_lut.policy_loss(lp, olp, adv, mask)
    counts = {k: m[k] for k in bandpo_lut.COUNTS}
    with CountOps() as mode:
        out = bandpo_lut.metrics_from_counts(counts)
    assert len(mode.ops) <= MAX_OPS, mode.ops
    for k in bandpo_lut.FRACTIONS:
        assert torch.equal(out[k], m[k]), k   # the kernel's fractions are exactly the quotients of its counts
