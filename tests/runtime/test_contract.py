"""The Python↔C++ contract: facts written on both sides must agree (a test fails when they drift). The C++
side is read from the compiled library's facts (`_extension.facts()`, csrc/facts.h), the one way they reach Python:
the divergences, grid fields and table placeholders of bounds/clip; the policy loss's option ids, metric list and
fractions, bucket edges, low-probability threshold and log-ratio clamp (bandpo_lut/runtime/loss_spec.py against
csrc/loss_element.h); the fake kernels' outputs and the autograd tuples against the op schemas; production code
never importing the test oracle."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import bandpo_lut
from bandpo_lut.runtime import (
    _extension,  # _ops: registers the fake kernels and autograd
    _ops,
    loss_spec,
)
from bandpo_lut.tables import divergences


def test_compiled_divergence_ids_match_the_registry():
    compiled = _extension.facts()["divergences"]          # csrc/divergence.h, as built
    registry = {name: divergences.get(name).compiled_id for name in divergences.names()
                if divergences.get(name).compiled_id is not None}
    assert compiled == registry


def test_closed_form_divergences_agree():
    # the kernels' closed forms are the registry's (test_closed_form_lists_agree: for the same divergences)
    p = torch.tensor([0.3], dtype=torch.float64)
    for name in _extension.facts()["closed_form_divergences"]:
        lo, up = bandpo_lut.bounds(p, 0.05, name)
        q_lo, q_up = divergences.get(name).closed_form(p, 1 - p, 0.05, divergences.torch_math())
        assert torch.allclose(up, q_up / p, rtol=1e-14) and torch.allclose(lo, q_lo / p, rtol=1e-14), name


def test_closed_form_lists_agree():
    # the kernels evaluate in closed form exactly the compiled divergences the registry gives a closed form
    compiled = _extension.facts()["divergences"]
    assert set(_extension.facts()["closed_form_divergences"]) == {
        name for name in compiled if divergences.get(name).closed_form is not None}


@pytest.mark.subprocess
def test_only_a_table_read_divergence_puts_its_table_on_the_device(fresh):
    """Closed forms take an empty placeholder (they need only the δ range), the baseline clips no table at all;
    in a fresh process, so that no other test has loaded the KL table before."""

    code = """
import torch, bandpo_lut
from bandpo_lut.runtime import table_cache
z = torch.zeros(2, 3)
bandpo_lut.policy_loss(z, z - 0.1, z + 1, clip="fixed")
bandpo_lut.policy_loss(z, z - 0.1, z + 1, clip="dcpo")
for name in ("tv", "chi2", "hellinger"):
    bandpo_lut.clip(torch.ones(3), torch.rand(3), 0.05, name)
print(sorted((str(k[0]), tuple(v.shape)) for k, v in table_cache._COEFFICIENTS.items()))
bandpo_lut.bounds(torch.rand(3), 0.05, "kl")
print(tuple(table_cache._COEFFICIENTS[("kl", "cpu")].shape))
"""
    out = fresh(["-c", code], check=True).stdout.splitlines()
    assert out[0] == str(sorted([("None", (2, 0, 0)), ("chi2", (2, 0, 0)), ("hellinger", (2, 0, 0)),
                                 ("tv", (2, 0, 0))]))
    table = bandpo_lut.tables.store.get("kl")
    assert out[1] == str((2, table.t.n + 2, table.s.n + 2))


@pytest.mark.subprocess
def test_placeholders_do_not_follow_the_default_dtype(fresh):
    """A process whose default dtype is float64 (set before the first call) still gets float32 placeholders:
    closed forms and baseline clips work, and agree with the references."""

    code = """
import torch, bandpo_lut
from bandpo_lut.reference import policy_loss as spec
from bandpo_lut.reference.bounds import bounds as reference_bounds
torch.set_default_dtype(torch.float64)
p = torch.rand(50) * 0.98 + 0.01
for name in ("tv", "chi2", "hellinger"):
    lo, up = bandpo_lut.bounds(p, 0.05, name)
    rlo, rup = reference_bounds(p, 0.05, name)
    torch.testing.assert_close((lo, up), (rlo, rup), rtol=1e-6, atol=1e-12)
g = torch.Generator().manual_seed(0)
lp, olp, adv = (torch.randn(4, 9, generator=g) * 0.3 - 1 for _ in range(3))
for clip in ("fixed", "dcpo"):
    loss, _ = bandpo_lut.policy_loss(lp, olp, adv, clip=clip)
    torch.testing.assert_close(loss, spec.policy_loss(lp, olp, adv, clip=clip)[0])
print("ok")
"""
    r = fresh(["-c", code])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_table_read_divergence_refuses_a_placeholder_table():
    p = torch.rand(4)
    meta, _ = bandpo_lut.runtime.band.table_for("kl", p)
    with pytest.raises(RuntimeError, match="too small for kl, which reads its table"):
        torch.ops.bandpo_lut.bounds(p, None, 0.05, torch.empty(2, 0, 0), list(meta.grid), 0, False, float("inf"))


def test_an_unknown_divergence_id_is_refused_by_the_op():
    p = torch.rand(4)
    meta, coefficients = bandpo_lut.runtime.band.table_for("kl", p)
    n = len(_extension.facts()["divergences"])
    with pytest.raises(RuntimeError, match="unknown divergence id"):
        torch.ops.bandpo_lut.bounds(p, None, 0.05, coefficients, list(meta.grid), n, False, float("inf"))


def test_grid_fields_are_packed_by_name():
    # every field the C++ side reads is packed by Python under that name, in the C++ order
    grid_fields = _extension.facts()["grid_fields"]
    meta, _ = bandpo_lut.runtime.band.table_for("tv", torch.rand(2))
    table = bandpo_lut.tables.store.get("tv")
    want = {"t_min": table.t.min, "t_step": table.t.step, "s_min": table.s.min, "s_step": table.s.step,
            "delta_min": table.delta_min, "delta_max": table.delta_max, "delta_max_inclusive": 0.0}
    assert set(grid_fields) == set(want)
    assert meta.grid == tuple(want[name] for name in grid_fields)


def test_band_fake_kernels_and_autograd_follow_the_schemas():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, returns in (("bounds", 2), ("clip", 1)):
        schema = getattr(torch.ops.bandpo_lut, name).default._schema
        assert len(schema.returns) == returns
        assert len(_ops.no_grads(name)) == len(schema.arguments)
    p, r = torch.rand(3, 1, dtype=torch.float64), torch.rand(1, 5, dtype=torch.float64)
    meta, coefficients = bandpo_lut.runtime.band.table_for("kl", p)
    args = (p, None, 0.05, coefficients, list(meta.grid), 0, False, 10.0)
    real = (torch.ops.bandpo_lut.bounds(*args), torch.ops.bandpo_lut.clip(r, *args))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = (torch.ops.bandpo_lut.bounds(mode.from_tensor(p), *args[1:]),
                torch.ops.bandpo_lut.clip(mode.from_tensor(r), mode.from_tensor(p), *args[1:]))
    flat_real = [*real[0], real[1]]
    flat_fake = [*fake[0], fake[1]]
    for a, b in zip(flat_real, flat_fake):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    # the gradient tuple of clip has one entry per schema argument and reaches the ratio
    ratio = r.clone().requires_grad_()
    torch.ops.bandpo_lut.clip(ratio, *args).sum().backward()
    assert ratio.grad.shape == ratio.shape


# ---- the policy loss ------------------------------------------------------------------------------------------

ROOT = pathlib.Path(bandpo_lut.__file__).parent


def test_loss_facts_agree_with_loss_spec():
    """Option ids, metric list and fractions, bucket edges, low-probability threshold, log-ratio clamp."""
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


def test_loss_fake_kernels_and_autograd_follow_the_schemas():
    fwd, bwd = torch.ops.bandpo_lut.policy_loss_fwd.default, torch.ops.bandpo_lut.policy_loss_bwd.default
    prep = bandpo_lut.runtime.band.table_args("kl")
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
        if rel.startswith(("reference/", "cli/")):
            continue   # the oracles themselves, and the command line, which draws them (plot --dppo) and runs
            # DPPO as a demo baseline; table verification reads tables/reader.py, the oracle's home
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level and node.module is None:
                names = [a.name for a in node.names]
            if any("reference" in n for n in names):
                offenders.append(rel)
    assert offenders == []
