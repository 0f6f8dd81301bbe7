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


# What a call does besides its one compiled op each way: the ops it dispatches, whether torch.library's Python
# autograd wrapper runs, and whether its keyword options are validated again.
# metadata only (no kernel on any device): dtype promotion and the metric vector's views
_HOST_ONLY = {"aten.promote_types.default", "aten.unbind.int"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_compiled_op_each_way_and_nothing_that_synchronises(dtype):
    """Eager fwd+bwd dispatches one compiled op forward and, besides, only host-side metadata ops; no tensor made
    per call, no .item()/host read (which on a GPU would be a launch or a synchronisation). The backward: the
    recomputing op, autograd's ones_like (the seed) and add_ (accumulating into an existing .grad); for float32 on
    the CPU, whose forward keeps each token's gradient factor (policy_loss_fwd_grad), the op that scales it by
    grad_loss · row_scale (policy_loss_bwd_factor) in place of the recomputing one."""
    lp, olp, adv, mask = (t.to(dtype) if t.is_floating_point() else t for t in batch(8, 32))
    a = lp.clone().requires_grad_()
    bandpo_lut.policy_loss(a, olp, adv, mask, dual_clip=3.0)[0].backward()   # warm caches; a.grad now exists
    with CountOps() as fwd:
        loss, _ = bandpo_lut.policy_loss(a, olp, adv, mask, dual_clip=3.0)
    with CountOps() as bwd:
        loss.backward()
    factor_route = dtype == torch.float32
    forward_op = "bandpo_lut.policy_loss_fwd_grad.default" if factor_route else "bandpo_lut.policy_loss_fwd.default"
    assert [op for op in fwd.ops if op not in _HOST_ONLY] == [forward_op], fwd.ops
    backward = ["bandpo_lut.policy_loss_bwd_factor.default" if factor_route else "bandpo_lut.policy_loss_bwd.default"]
    assert sorted(bwd.ops) == sorted(["aten.add_.Tensor", "aten.ones_like.default"] + backward), bwd.ops


def test_eager_forward_skips_the_python_autograd_wrapper():
    """The eager forward calls its op below the Autograd key (its autograd.Function is the autograd): the op's
    registered Autograd kernel, torch.library's Python wrapper (torch/_library/autograd.py, ~45 us a call on a
    2-core EPYC), does not run. Before, it ran once per forward."""
    import sys
    lp, olp, adv, mask = batch(4, 16)
    a = lp.clone().requires_grad_()
    bandpo_lut.policy_loss(a, olp, adv, mask)[0].backward()
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith("torch/_library/autograd.py"):
            entered.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        loss, _ = bandpo_lut.policy_loss(a, olp, adv, mask)
        loss.backward()
    finally:
        sys.setprofile(None)
    assert entered == [], entered
    ref, _ = spec.policy_loss(lp.clone().requires_grad_(), olp, adv, mask)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)


def test_keyword_options_validated_once(monkeypatch):
    """The same keyword options on every call (an eager training loop) are validated once: LossSettings is built
    on the first call and reused; a new value builds a new one; a tensor δ is never reused by value; a bad option
    is refused on every call (nothing stored). Before: built and validated on every call (~30 us)."""
    from bandpo_lut.runtime import settings as settings_module
    built = []
    real = settings_module._validate
    monkeypatch.setattr(settings_module, "_validate", lambda s: (built.append(s.delta), real(s))[1])
    monkeypatch.setattr(settings_module, "_BUILT", {}, raising=False)
    lp, olp, adv, mask = batch(2, 8)
    for _ in range(3):
        bandpo_lut.policy_loss(lp, olp, adv, mask, delta=0.07, dual_clip=3.0)
    assert built == [0.07]
    bandpo_lut.policy_loss(lp, olp, adv, mask, delta=0.08, dual_clip=3.0)
    assert built == [0.07, 0.08]
    delta = torch.full((2, 8), 0.07)
    for _ in range(2):
        bandpo_lut.policy_loss(lp, olp, adv, mask, delta=delta)
    assert len(built) == 4
    for _ in range(2):
        with pytest.raises(ValueError, match="dual_clip"):
            bandpo_lut.policy_loss(lp, olp, adv, mask, dual_clip=0.5)
    assert len(built) == 6
    # True == 1 and hash(True) == hash(1), but the type is part of the key: a bool still meets its own check
    bandpo_lut.policy_loss(lp, olp, adv, mask, max_ratio=1)
    with pytest.raises(ValueError, match="max_ratio"):
        bandpo_lut.policy_loss(lp, olp, adv, mask, max_ratio=True)


def test_op_arguments_formed_once_per_settings_and_device(monkeypatch):
    """An eager loop with one settings object (the same keywords every step, or a module) reads the table and forms
    the ops' arguments once, on its first call: later calls take them from the settings object. The values stay
    the specification's, also for a tensor δ changed in place between steps (a δ schedule's buffer). Before: the
    table was looked up and the arguments formed on every call."""
    from bandpo_lut.runtime import settings as settings_module
    from bandpo_lut.runtime import table_cache

    looked_up = []
    real = table_cache.table_for
    monkeypatch.setattr(table_cache, "table_for", lambda div, prob: (looked_up.append(div), real(div, prob))[1])
    monkeypatch.setattr(settings_module, "_BUILT", {}, raising=False)
    lp, olp, adv, mask = batch(2, 8)
    for _ in range(3):
        loss, _ = bandpo_lut.policy_loss(lp, olp, adv, mask, delta=0.06, dual_clip=3.0)
    assert looked_up == ["kl"]
    torch.testing.assert_close(loss, spec.policy_loss(lp, olp, adv, mask, delta=0.06, dual_clip=3.0)[0],
                               rtol=1e-5, atol=1e-7)
    delta = torch.full((2, 1), 0.05)
    module = bandpo_lut.BandPolicyLoss(delta=delta, divergence="tv")
    for value in (0.05, 0.1, 0.2):
        module.delta.fill_(value)
        loss, metrics = module(lp, olp, adv, mask)
        ref, ref_metrics = spec.policy_loss(lp, olp, adv, mask, delta=torch.full((2, 1), value), divergence="tv")
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(metrics["band_width_mean"], ref_metrics["band_width_mean"], rtol=1e-5, atol=1e-6)
    assert looked_up == ["kl", "tv"]


def test_cached_op_arguments_stay_out_of_pickles_and_fake_tensor_calls():
    """The cache holds device tensors (the table): a pickled or copied settings object carries none, and equals and
    computes as the original. A first call on FakeTensors (tracing) caches nothing, so a later eager call reads the
    real table, not the tracing's fake copy."""
    import copy
    import pickle

    from torch._subclasses.fake_tensor import FakeTensorMode

    from bandpo_lut.runtime import settings as settings_module

    lp, olp, adv, mask = batch(3, 16)
    settings = bandpo_lut.LossSettings(delta=0.08, max_ratio=10.0)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (lp, olp, adv, mask)]
        bandpo_lut.policy_loss(*fake, settings=settings)
    assert settings_module.OP_ARGS_CACHE not in settings.__dict__
    loss, _ = bandpo_lut.policy_loss(lp, olp, adv, mask, settings=settings)
    assert settings_module.OP_ARGS_CACHE in settings.__dict__
    ref = spec.policy_loss(lp, olp, adv, mask, delta=0.08, max_ratio=10.0)[0]
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    for clone in (pickle.loads(pickle.dumps(settings)), copy.deepcopy(settings), copy.copy(settings)):
        assert settings_module.OP_ARGS_CACHE not in clone.__dict__ and clone == settings
        assert torch.equal(bandpo_lut.policy_loss(lp, olp, adv, mask, settings=clone)[0], loss)
