"""Fresh-process uses of the package through torch's other ways in, run by tests/runtime/test_torch_modes.py (one
scenario a process): a δ schedule under torch.compile with the real backends, a first call in inference
mode or under torch.jit.trace, programs saved by torch.export / torch.jit and loaded after `import bandpo_lut`
alone. Values are compared with the pure-PyTorch float64 references, which share no code with the ops.

    python tests/support/torch_modes_scenarios.py SCENARIO [DIR]     # exits 0 and prints "ok SCENARIO" on success
"""
from __future__ import annotations

import sys

import torch

import bandpo_lut

TOL = 2e-6   # float32 ops against the float64 references


def batch(rows=4, cols=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    olp = torch.log(torch.rand(rows, cols, generator=g).clamp(min=1e-6))
    lp = (olp + 0.3 * torch.randn(rows, cols, generator=g)).clamp(max=0.0)
    adv = torch.randn(rows, cols, generator=g)
    return lp.to(dtype), olp.to(dtype), adv.to(dtype)


def ratio_and_p(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return 0.7 + 0.6 * torch.rand(n, generator=g), torch.rand(n, generator=g)


def close(ours, ref, what, tol=TOL):
    assert type(ours) is torch.Tensor, f"{what}: expected a real tensor, got {type(ours).__name__}"
    err = ((ours.double() - ref.double()) / ref.double().abs().clamp(min=1e-30)).abs().max().item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def ref_clip(ratio, p, delta):
    from bandpo_lut.reference.bounds import bounds
    lo, up = bounds(p.double(), float(delta))
    return torch.clamp(ratio.double(), lo, up)


def ref_loss(lp, olp, adv, delta):
    from bandpo_lut.reference.policy_loss import policy_loss
    return policy_loss(lp.double(), olp.double(), adv.double(), delta=float(delta))[0]


def scenario_delta_schedule():
    """A trainer's δ schedule: torch.compile(dynamic=True, fullgraph=True) with inductor and aot_eager, 60
    python-float values, forward and backward through clip, bounds, policy_loss and BandPolicyLoss (δ set on
    the module between steps, and a 0-dim tensor δ buffer filled in place): one graph per backend."""
    from torch._dynamo.utils import counters

    ratio, p = ratio_and_p()
    lp, olp, adv = batch()
    module = bandpo_lut.BandPolicyLoss()
    tensor_module = bandpo_lut.BandPolicyLoss(delta=torch.tensor(0.05))
    schedule = [0.02 + 0.004 * k for k in range(60)]
    for backend in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        counters.clear()

        @torch.compile(backend=backend, dynamic=True, fullgraph=True)
        def step(r, lp, delta):
            clipped = bandpo_lut.clip(r, p, delta)
            lo, up = bandpo_lut.bounds(p, delta)
            loss = bandpo_lut.policy_loss(lp, olp, adv, delta=delta)[0]
            return clipped, up, loss + module(lp, olp, adv)[0] + tensor_module(lp, olp, adv)[0]

        for k, delta in enumerate(schedule):
            module.settings["delta"] = delta
            tensor_module.delta.fill_(delta)
            r, x = ratio.clone().requires_grad_(), lp.clone().requires_grad_()
            clipped, up, total = step(r, x, delta)
            (clipped.sum() + total).backward()
            if k % 20 == 0:    # the values follow δ (a graph that kept the first δ would fail here)
                close(clipped, ref_clip(ratio, p, delta), f"{backend} clip at delta={delta}")
                close(up, torch.clamp(ref_clip(torch.full_like(p, 1e30), p, delta), max=1e30), f"{backend} upper")
                close(total, 3 * ref_loss(lp, olp, adv, delta), f"{backend} losses at delta={delta}", 1e-5)
                inside = (clipped == ratio)
                assert torch.equal(r.grad, inside.float()), f"{backend}: clip's gradient at delta={delta}"
                assert x.grad.abs().sum() > 0
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 1, f"{backend}: {graphs} graphs compiled for {len(schedule)} values of delta (want 1)"


def scenario_fixed_shape_delta_dynamic():
    """A δ tensor of fixed shape (a module buffer per sequence, a constant per position) against log-probs whose
    sizes torch.compile(dynamic=True, fullgraph=True) makes symbolic: accepted as in eager (the broadcast check
    compares each size with == : `int in (1, SymInt)` is False under Dynamo even where the sizes are equal), for
    BandPolicyLoss, policy_loss and fused_linear_policy_loss, against the reference with the δ broadcast."""
    from bandpo_lut.reference.policy_loss import policy_loss as reference

    rows, hidden_size, vocab = 2, 8, 11
    per_row = torch.tensor([[0.03], [0.08]])
    module = bandpo_lut.BandPolicyLoss(delta=per_row.clone())
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)

    @torch.compile(backend="aot_eager", dynamic=True, fullgraph=True)
    def step(lp, olp, adv, per_position, hidden, ids, fused_olp):
        fused = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, fused_olp, adv, delta=per_row)[0]
        return module(lp, olp, adv)[0], bandpo_lut.policy_loss(lp, olp, adv, delta=per_position)[0], fused

    for cols in (5, 9, 13):   # three sizes of T: symbolic after the first recompile, as in training
        lp, olp, adv = batch(rows=rows, cols=cols, seed=cols, dtype=torch.float64)
        per_position = torch.linspace(0.01, 0.2, cols, dtype=torch.float64)[None]
        hidden = torch.randn(rows, cols, hidden_size, generator=g, dtype=torch.float64)
        ids = torch.randint(0, vocab, (rows, cols), generator=g)
        fused_lp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
        fused_olp = (fused_lp + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)).clamp(max=0.0)
        got = step(lp, olp, adv, per_position, hidden, ids, fused_olp)
        want = (reference(lp, olp, adv, delta=per_row.double().expand(rows, cols))[0],
                reference(lp, olp, adv, delta=per_position.expand(rows, cols))[0],
                reference(fused_lp, fused_olp, adv, delta=per_row.double().expand(rows, cols))[0])
        for what, ours, ref in zip(("BandPolicyLoss, (B, 1) buffer", "policy_loss, (1, T) delta",
                                    "fused_linear_policy_loss, (B, 1) delta"), got, want):
            close(ours, ref, f"{what} at T={cols}", 1e-9)


def scenario_inference_mode_first():
    """The process's first calls are an evaluation pass in inference mode; training afterwards (eager and
    compiled, forward and backward) must work and be right."""
    ratio, p = ratio_and_p()
    lp, olp, adv = batch()
    with torch.inference_mode():
        close(bandpo_lut.clip(ratio, p, 0.05), ref_clip(ratio, p, 0.05), "clip in inference mode")
        bandpo_lut.bounds(p, 0.05, "tv")
        close(bandpo_lut.policy_loss(lp, olp, adv)[0], ref_loss(lp, olp, adv, 0.05), "loss in inference mode")
    from bandpo_lut.runtime import table_cache
    cached = table_cache._COEFFICIENTS.values()
    assert not any(t.is_inference() for t in cached), "a cached table is an inference tensor"
    for backend in ("aot_eager", None):
        x = lp.clone().requires_grad_()
        fn = (lambda f: f) if backend is None else torch.compile(backend=backend, fullgraph=True)
        loss = fn(lambda x: bandpo_lut.policy_loss(x, olp, adv)[0] + bandpo_lut.clip(x.exp(), p[:32], 0.05).sum())(x)
        loss.backward()
        assert x.grad is not None and x.grad.abs().sum() > 0, backend


def scenario_jit_trace_first():
    """The process's first call is inside torch.jit.trace (its default check_trace reruns the function and
    compares graphs); the traced function then gives the references' values on new inputs."""
    ratio, p = ratio_and_p()

    def fn(r, q):
        return bandpo_lut.clip(r, q, 0.05) + bandpo_lut.bounds(q, 0.05)[0]

    traced = torch.jit.trace(fn, (ratio, p))
    r2, p2 = ratio_and_p(seed=7)
    from bandpo_lut.reference.bounds import bounds
    close(traced(r2, p2), ref_clip(r2, p2, 0.05) + bounds(p2.double(), 0.05)[0], "traced clip + lower")


class _Programs(torch.nn.Module):
    def forward(self, ratio, p, lp, olp, adv):
        return bandpo_lut.clip(ratio, p, 0.05), bandpo_lut.policy_loss(lp, olp, adv)[0]


def scenario_save_programs(folder):
    ratio, p = ratio_and_p()
    lp, olp, adv = batch()
    inputs = (ratio, p, lp, olp, adv)
    torch.export.save(torch.export.export(_Programs(), inputs), f"{folder}/exported.pt2")
    torch.jit.trace(_Programs(), inputs).save(f"{folder}/traced.pt")


def scenario_load_programs(folder):
    """After `import bandpo_lut` alone (no call), torch.export.load and torch.jit.load find its ops, and the
    loaded programs train: their gradients are the references' (clip's: torch.clamp's rule)."""
    ratio, p = ratio_and_p(seed=3)
    lp, olp, adv = batch(seed=4)
    want_grad = torch.func.grad(lambda x: ref_loss(x, olp, adv, 0.05))(lp.double())
    for what, program in (("exported", torch.export.load(f"{folder}/exported.pt2").module()),
                          ("traced", torch.jit.load(f"{folder}/traced.pt"))):
        r, x = ratio.clone().requires_grad_(), lp.clone().requires_grad_()
        clipped, loss = program(r, p, x, olp, adv)
        close(clipped, ref_clip(ratio, p, 0.05), f"{what} program's clip")
        close(loss, ref_loss(lp, olp, adv, 0.05), f"{what} program's loss", 1e-5)
        (clipped.sum() + loss).backward()
        assert torch.equal(r.grad, (clipped == ratio).float()), f"{what} program: clip's gradient"
        err = (x.grad.double() - want_grad).abs().max().item()
        assert err <= 1e-6 * want_grad.abs().max().item(), f"{what} program: the loss's gradient is off by {err:.3g}"


if __name__ == "__main__":
    name = sys.argv[1]
    globals()[f"scenario_{name}"](*sys.argv[2:])
    print(f"ok {name}")
