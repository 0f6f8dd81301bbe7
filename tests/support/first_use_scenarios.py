"""First uses of the package in a fresh process, run by tests/runtime/test_first_use.py (one scenario a process).

Each scenario makes its first call to bandpo_lut in the way a training script may (torch.compile with or
without fullgraph/dynamic, torch.export, a FakeTensorMode, a δ schedule under fullgraph), then checks
that eager calls in the same process still give real tensors with the right values. The values are
compared with the pure-PyTorch float64 reference reader, which shares no code path with the ops.

    python tests/support/first_use_scenarios.py SCENARIO      # exits 0 and prints "ok SCENARIO" on success
"""
from __future__ import annotations

import sys

import torch

import bandpo_lut
from bandpo_lut.reference.bounds import bounds as ref_bounds
from bandpo_lut.reference.policy_loss import policy_loss as ref_policy_loss

TOL = 2e-6   # float32 ops against the float64 reference


def batch(rows=4, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    olp = torch.log(torch.rand(rows, cols, generator=g).clamp(min=1e-6))
    lp = olp + 0.3 * torch.randn(rows, cols, generator=g)
    lp = lp.clamp(max=0.0)
    adv = torch.randn(rows, cols, generator=g)
    return lp, olp, adv


def expected_clip(ratio, p, delta=0.05):
    lo, up = ref_bounds(p.double(), delta)
    return torch.clamp(ratio.double(), lo, up)


def close(ours, ref, what):
    assert type(ours) is torch.Tensor, f"{what}: expected a real tensor, got {type(ours).__name__}"
    err = ((ours.double() - ref) / ref.abs().clamp(min=1e-30)).abs().max().item()
    assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL}"


def check_eager_afterwards():
    g = torch.Generator().manual_seed(1)
    ratio, p = torch.rand(257, generator=g) * 3, torch.rand(257, generator=g)
    close(bandpo_lut.clip(ratio, p, 0.05), expected_clip(ratio, p), "eager clip after the first use")
    lo, up = bandpo_lut.bounds(p, 0.05)
    rlo, rup = ref_bounds(p.double(), 0.05)
    close(up, rup, "eager upper bounds after the first use")
    close(lo, rlo, "eager lower bounds after the first use")
    lp, olp, adv = batch()
    loss, metrics = bandpo_lut.policy_loss(lp, olp, adv, delta=0.05)
    ref_loss, ref_metrics = ref_policy_loss(lp.double(), olp.double(), adv.double(), delta=0.05)
    close(loss, ref_loss, "eager policy_loss after the first use")
    assert float(metrics["n_clipped"]) == float(ref_metrics["n_clipped"]), (metrics["n_clipped"], ref_metrics)


def compile_clip(**kw):
    g = torch.Generator().manual_seed(2)
    ratio = (torch.rand(64, generator=g) * 2).requires_grad_()
    p = torch.rand(64, generator=g)
    f = torch.compile(lambda r, q: bandpo_lut.clip(r, q, 0.05), **kw)
    out = f(ratio, p)
    close(out.detach(), expected_clip(ratio.detach(), p), f"compiled clip {kw}")
    out.sum().backward()
    lo, up = ref_bounds(p.double(), 0.05)
    inside = ((ratio.detach().double() >= lo) & (ratio.detach().double() <= up)).float()
    assert torch.equal(ratio.grad, inside), "compiled clip: gradient is not 1 inside the band and 0 outside"


def scenario_compile_default():
    compile_clip()


def scenario_compile_fullgraph():
    compile_clip(fullgraph=True)


def scenario_compile_dynamic_loss():
    # The first call's sizes coincide with the KL table's sizes (2, 451, 115): a table tensor that took part
    # in shape specialisation would couple its sizes to the batch's and break the next call.
    table = bandpo_lut.tables.store.get("kl")
    sizes = [(2, table.t.n), (2, table.s.n + 2), (3, 100), (table.t.n + 2, 7)]
    f = torch.compile(lambda a, b, c: bandpo_lut.policy_loss(a, b, c, delta=0.05), fullgraph=True, dynamic=True)
    for rows, cols in sizes:
        lp, olp, adv = batch(rows, cols, seed=rows * cols)
        lp.requires_grad_()
        loss, metrics = f(lp, olp, adv)
        loss.backward()
        lp2 = lp.detach().clone().requires_grad_()
        ref_loss, ref_metrics = bandpo_lut.policy_loss(lp2, olp, adv, delta=0.05)
        ref_loss.backward()
        assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0), (rows, cols, loss, ref_loss)
        assert torch.allclose(lp.grad, lp2.grad, rtol=1e-6, atol=0), (rows, cols)
        for name in ("clip_frac", "ppo_kl", "band_width_mean"):
            assert torch.allclose(metrics[name], ref_metrics[name], rtol=1e-6), name


def scenario_compile_dynamic_clip():
    table = bandpo_lut.tables.store.get("kl")
    f = torch.compile(lambda r, q: bandpo_lut.clip(r, q, 0.05), fullgraph=True, dynamic=True)
    for shape in [(2, table.t.n + 2, table.s.n + 2), (table.t.n + 2,), (5, 3), (2, 2, 2)]:
        g = torch.Generator().manual_seed(len(shape))
        ratio, p = torch.rand(shape, generator=g) * 3, torch.rand(shape, generator=g)
        close(f(ratio, p), expected_clip(ratio, p), f"dynamic clip {shape}")


def scenario_export():
    class Clip(torch.nn.Module):
        def forward(self, r, q):
            return bandpo_lut.clip(r, q, 0.05)

    g = torch.Generator().manual_seed(3)
    ratio, p = torch.rand(64, generator=g) * 3, torch.rand(64, generator=g)
    ep = torch.export.export(Clip(), (ratio, p))
    close(ep.module()(ratio, p), expected_clip(ratio, p), "exported clip")


def scenario_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        r, p = mode.from_tensor(torch.rand(8, 5) * 2), mode.from_tensor(torch.rand(8, 5))
        out = bandpo_lut.clip(r, p, 0.05)
        lo, up = bandpo_lut.bounds(p, 0.05, log_p_old=None)
        lp, olp, adv = (mode.from_tensor(t) for t in batch())
        loss, _ = bandpo_lut.policy_loss(lp, olp, adv)
    assert out.shape == (8, 5) and lo.shape == (8, 5) and loss.shape == ()


def scenario_delta_schedule():
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm

    g = torch.Generator().manual_seed(4)
    ratio, p = torch.rand(64, generator=g) * 3, torch.rand(64, generator=g)
    lp, olp, adv = batch()
    f = torch.compile(lambda r, q, d: bandpo_lut.clip(r, q, d), fullgraph=True, backend=backend)
    h = torch.compile(lambda a, b, c, d: bandpo_lut.policy_loss(a, b, c, delta=d)[0], fullgraph=True)
    deltas = [0.05, 0.06, 0.07, 0.08, 0.09, 0.1]
    for d in deltas:
        close(f(ratio, p, d), expected_clip(ratio, p, d), f"clip under a δ schedule, δ = {d}")
        ref = bandpo_lut.policy_loss(lp, olp, adv, delta=d)[0]
        assert torch.allclose(h(lp, olp, adv, d), ref, rtol=1e-6, atol=0), d
    # a constant first graph, then one with a symbolic δ: not one graph per value
    assert len(compiles) <= 2, f"{len(compiles)} compilations for {len(deltas)} δ values"
    try:
        f(ratio, p, 2.0)
    except Exception as e:   # under fullgraph=True, Dynamo wraps our ValueError; its message stays
        assert "delta: 2.0 is outside the 'kl' table's range" in str(e), e
    else:
        raise AssertionError("a δ outside the table's range was accepted under torch.compile")


def scenario_readme_loss_dynamic():
    # the README's own call, with its default δ, under dynamic=True
    lp, olp, adv = batch()
    mask = torch.ones_like(lp, dtype=torch.bool)
    f = torch.compile(lambda a, b, c, m: bandpo_lut.policy_loss(a, b, c, m), fullgraph=True, dynamic=True)
    for rows, cols in ((4, 64), (3, 50)):
        lp, olp, adv = batch(rows, cols)
        mask = torch.ones_like(lp, dtype=torch.bool)
        assert torch.allclose(f(lp, olp, adv, mask)[0], bandpo_lut.policy_loss(lp, olp, adv, mask)[0], rtol=1e-6)


def scenario_two_divergences_one_frame():
    # The first call in the process compiles a frame that reads two tables (the second key was once missing
    # from Dynamo's snapshot of the table cache: KeyError).
    g = torch.Generator().manual_seed(5)
    p = torch.rand(64, generator=g, dtype=torch.float64) * 0.98 + 0.01
    f = torch.compile(lambda q: (bandpo_lut.bounds(q, 0.05, "kl"), bandpo_lut.bounds(q, 0.2, "chi2")), fullgraph=True)
    (klo, kup), (clo, cup) = f(p)
    for (lo, up), (rlo, rup), name in (((klo, kup), ref_bounds(p, 0.05, "kl"), "kl"),
                                       ((clo, cup), ref_bounds(p, 0.2, "chi2"), "chi2")):
        close(up, rup, f"compiled {name} upper bounds next to another divergence")
        close(lo, rlo, f"compiled {name} lower bounds next to another divergence")


def scenario_fixed_clip_next_to_band():
    # the loss's baseline clip (no table) and the band in the first compiled frame of the process
    lp, olp, adv = batch()
    f = torch.compile(lambda a, b, c: (bandpo_lut.policy_loss(a, b, c, clip="fixed")[0],
                                       bandpo_lut.policy_loss(a, b, c, delta=0.05)[0]), fullgraph=True)
    fixed, band = f(lp, olp, adv)
    close(fixed, ref_policy_loss(lp.double(), olp.double(), adv.double(), clip="fixed")[0], "compiled fixed clip")
    close(band, ref_policy_loss(lp.double(), olp.double(), adv.double(), delta=0.05)[0], "compiled band loss")


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    check_eager_afterwards()
    print("ok", name)
