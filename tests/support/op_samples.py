"""Sample inputs for every compiled op, as extension-cpp and torchvision write them: `band_samples(device, dtype)`
and `loss_samples(device, dtype)`.

A sample is a call of the public API (the settings a user gives, which the pure-PyTorch references take too), run
forward and backward, with the compiled-op calls it made recorded at the dispatcher: `bounds`, `clip` and
`clip_backward` (composite: its arguments as clip's autograd passes them) for a band sample, `policy_loss_fwd` and
`policy_loss_bwd` for a loss sample. The recorded
arguments are exactly those the package passes, so tests/runtime/test_op_samples.py checks each op's output against the
reference AND runs torch.library.opcheck on the same arguments, on every device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bandpo_lut
from bandpo_lut.reference import policy_loss as spec
from bandpo_lut.tables import store as tables

# Which argument of each op carries the gradient (opcheck then also checks the autograd registration).
DIFFERENTIABLE = {"clip": 0, "policy_loss_fwd": 0}


@dataclass
class Sample:
    id: str                                      # the test id
    settings: dict                               # the public call's arguments (what the reference takes)
    calls: dict = field(default_factory=dict)    # op name -> (args, kwargs) as the package called it


class _RecordOps(TorchDispatchMode):
    """Records every bandpo_lut op called under it (below autograd: the backward ops are seen too)."""

    def __init__(self, sample: Sample):
        super().__init__()
        self.sample = sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "bandpo_lut":
            name = func.overloadpacket.__name__
            assert name not in self.sample.calls, f"{self.sample.id}: {name} called twice"
            self.sample.calls[name] = (args, kwargs)
        return func(*args, **kwargs)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def band_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    """bounds, clip and clip_backward: every shipped divergence (table read and closed forms), p and log p inputs,
    a scalar, a per-token and a 0-dim host δ, with and without max_ratio; ratios include an exact tie with a bound
    and a NaN; the shapes broadcast (ratio (64,) against p (3, 64))."""
    samples = []
    for i, name in enumerate(tables.SHIPPED):
        g = _gen(100 + i)
        p = torch.sigmoid(torch.randn(3, 64, generator=g, dtype=torch.float64) * 3)
        d_token = torch.exp(torch.empty(3, 64, dtype=torch.float64).uniform_(math.log(2e-3), math.log(0.5),
                                                                              generator=g))
        ratio = torch.exp(torch.randn(64, generator=g, dtype=torch.float64) * 0.5)
        settings = [dict(id=f"{name}-p-scalar", x="p_old", delta=0.05, max_ratio=None),
                    dict(id=f"{name}-logp-token", x="log_p_old", delta=d_token, max_ratio=10.0)]
        if name == "kl":
            settings.append(dict(id="kl-p-host0dim", x="p_old", delta=torch.tensor(0.07, dtype=torch.float64),
                                 max_ratio=10.0))
        for s in settings:
            x = torch.log(p) if s["x"] == "log_p_old" else p
            delta = s["delta"]
            if isinstance(delta, torch.Tensor):   # a 0-dim δ stays on the CPU: read on the host
                delta = delta.to(device=device if delta.dim() else "cpu", dtype=dtype)
            kw = {s["x"]: x.to(device=device, dtype=dtype), "delta": delta, "divergence": name,
                  "max_ratio": s["max_ratio"]}
            sample = Sample(s["id"], kw)
            with torch.no_grad():
                lo, _ = bandpo_lut.bounds(**kw)
            r = ratio.to(device=device, dtype=dtype, copy=True)
            r[0] = lo[0, 0]                   # a tie with the lower bound: inside (gradient 1)
            r[1] = math.nan
            r = r.requires_grad_()
            w = torch.randn(64, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            with _RecordOps(sample):
                bandpo_lut.bounds(**kw)
                out = bandpo_lut.clip(r, **kw)
                out.backward(w.expand_as(out))
            # clip_backward is a composite op (one aten formula for every backend), so it is decomposed before the
            # dispatcher reaches the recorder; its arguments are those clip's autograd gives it.
            sample.calls["clip_backward"] = ((w.expand_as(out), r.detach(), out.detach()), {})
            sample.settings = dict(kw, ratio=r.detach())
            samples.append(sample)
    return samples


# (clip, mode, agg, dual_clip, mask kind, delta kind, divergence): every clip, mode, aggregation, mask kind and δ
# kind at least once, a table read and a closed form.
LOSS_SETTINGS = [
    ("band", "clip", "token-mean", None, "bool", "scalar", "kl"),
    ("band", "mask", "seq-mean-token-mean", 3.0, "weights", "token", "kl"),
    ("band", "clip", "seq-mean-token-sum", 3.0, "none", "token", "tv"),
    ("band", "mask", "token-sum", None, "bool", "scalar", "chi2"),
    ("fixed", "clip", "seq-mean-token-mean", 3.0, "weights", "scalar", "kl"),
    ("dcpo", "mask", "token-mean", 3.0, "bool", "scalar", "kl"),
]


def loss_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    """policy_loss_fwd and policy_loss_bwd over LOSS_SETTINGS, on a (4, 67) batch whose ratios cross both bounds
    and the dual-clip cap; the backward gets an upstream gradient of 0.7 (not 1)."""
    samples = []
    for i, (clip, mode, agg, dual, mask_kind, delta_kind, name) in enumerate(LOSS_SETTINGS):
        g = _gen(200 + i)
        B, T = 4, 67
        old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
        new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
        keep = torch.rand(B, T, generator=g) > 0.25
        mask = {"bool": keep, "none": None,
                "weights": keep.to(torch.float64) * torch.rand(B, T, generator=g, dtype=torch.float64)}[mask_kind]
        delta = 0.05 if delta_kind == "scalar" else \
            torch.rand(B, 1, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) * 0.2 + 0.01
        to = dict(device=device, dtype=dtype)
        if mask is not None:
            mask = mask.to(device=device, dtype=dtype if mask.is_floating_point() else None)
        kw = dict(delta=delta, divergence=name, max_ratio=10.0, dual_clip=dual, agg=agg, clip=clip, mode=mode)
        sample = Sample(f"{clip}-{mode}-{agg}-{name}-dual{dual}-{mask_kind}-{delta_kind}", kw)
        lp = new.to(**to, copy=True).requires_grad_()
        with _RecordOps(sample):
            loss, _ = bandpo_lut.policy_loss(lp, old.to(**to), adv.to(**to), mask, **kw)
            loss.backward(torch.tensor(0.7, **to))
        _record_the_other_loss_route(sample, torch.tensor(0.7, **to))
        sample.settings = dict(kw, log_prob=lp.detach(), old_log_prob=old.to(**to), advantages=adv.to(**to),
                               mask=mask, grad_loss=0.7)
        samples.append(sample)
    return samples


def _record_the_other_loss_route(sample: Sample, grad_loss: torch.Tensor):
    """A float32 eager call on the CPU runs policy_loss_fwd_grad (the gradient factor kept for the backward), every
    other call policy_loss_fwd and policy_loss_bwd: the ops the recorded call did not run, called with its arguments
    (policy_loss_fwd_grad exists on the CPU only)."""
    if "policy_loss_fwd_grad" in sample.calls:
        args, _ = sample.calls["policy_loss_fwd_grad"]
        with _RecordOps(sample):
            row_scale = torch.ops.bandpo_lut.policy_loss_fwd(*args)[2]
            torch.ops.bandpo_lut.policy_loss_bwd(grad_loss, row_scale, *args[:-1])   # all but agg
    elif grad_loss.device.type == "cpu":
        args, _ = sample.calls["policy_loss_fwd"]
        with _RecordOps(sample):
            _, _, row_scale, factor = torch.ops.bandpo_lut.policy_loss_fwd_grad(*args)
            torch.ops.bandpo_lut.policy_loss_bwd_factor(grad_loss, row_scale, factor, args[3])   # args[3]: the mask


def reference_loss(settings: dict):
    """The reference policy loss for a loss sample: (loss, metrics, gradient of grad_loss * loss to log_prob)."""
    s = dict(settings)
    lp = s.pop("log_prob").clone().requires_grad_()
    grad_loss = s.pop("grad_loss")
    loss, metrics = spec.policy_loss(lp, s.pop("old_log_prob"), s.pop("advantages"), s.pop("mask"), **s)
    (grad,) = torch.autograd.grad(loss * grad_loss, lp)
    return loss.detach(), metrics, grad
