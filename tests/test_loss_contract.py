"""The policy loss's Python<->C++ contract, checked in one place: the option ids, the metric list and its
fractions, the bucket edges, the low-probability threshold and the log-ratio clamp (bandpo_lut/loss_spec.py
against csrc/loss_element.h, through the "loss" entry of the library's facts, csrc/facts.h); the fake
kernels' outputs and the autograd tuples against the op schemas; production code never importing the test oracle."""
from __future__ import annotations

import ast
import pathlib

import torch

import bandpo_lut
from bandpo_lut import (
    _extension,
    _ops,  # noqa: F401  (registers the fake kernels and autograd)
    loss_spec,
)

ROOT = pathlib.Path(bandpo_lut.__file__).parent


def test_python_and_cpp_agree_on_every_named_fact():
    cpp = _extension.facts()["loss"]
    assert cpp["clip"] == loss_spec.CLIP_ID
    assert cpp["mode"] == loss_spec.MODE_ID
    assert cpp["agg"] == loss_spec.AGG_ID
    assert cpp["n_counts"] == len(loss_spec.COUNTS)
    assert cpp["n_metrics"] == len(loss_spec.METRICS)
    assert [tuple(f) for f in cpp["fractions"]] == list(loss_spec.FRACTION_INDICES)
    assert cpp["bucket_edges"] == [lo for _, lo, _ in loss_spec.BUCKETS]
    assert cpp["lowprob"] == loss_spec.LOWPROB
    assert cpp["log_ratio_clamp"] == loss_spec.LOG_RATIO_CLAMP


def test_fake_kernels_and_autograd_follow_the_schemas():
    fwd, bwd = torch.ops.bandpo_lut.policy_loss_fwd.default, torch.ops.bandpo_lut.policy_loss_bwd.default
    prep = bandpo_lut.api.table_args("kl")
    lp = torch.randn(3, 5, dtype=torch.float64).clamp(max=-0.01)
    args = (lp, lp - 0.1, torch.randn(3, 5, dtype=torch.float64), None, None, 0.05, prep.coefficients,
            prep.grid, 0, 0, 0.0, 0.0, 10.0, 0.0, 0, 0)
    assert len(args) == len(fwd._schema.arguments)
    real = fwd(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = fwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert len(fake) == len(real) == len(fwd._schema.returns)
    for f, r in zip(fake, real):
        assert f.shape == r.shape and f.dtype == r.dtype
    assert real[1].shape == (len(loss_spec.METRICS),)
    # the backward: one gradient per forward argument (checked by autograd itself), and bwd's schema takes
    # the forward's settings but agg, which row_scale carries
    fwd_names = [a.name for a in fwd._schema.arguments]
    bwd_names = [a.name for a in bwd._schema.arguments]
    assert bwd_names == ["grad_loss", "row_scale"] + [n for n in fwd_names if n != "agg"]
    a = lp.clone().requires_grad_()
    loss = fwd(a, *args[1:])[0]
    loss.backward()
    assert a.grad.shape == a.shape


def test_production_code_does_not_import_the_oracle():
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("reference/") or rel == "verify.py":
            continue   # the oracle itself, and the tool that compares tables against it (generate's accuracy
            # stamp is verify's measurement)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level and node.module is None:
                names = [a.name for a in node.names]
            if any("reference" in n for n in names):
                offenders.append(rel)
    assert offenders == []
