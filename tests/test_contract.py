"""The Python↔C++ contract: facts written on both sides must agree (a test fails when they drift)."""
from __future__ import annotations

import torch

import bandpo_lut
from bandpo_lut import _extension, divergences


def test_compiled_divergence_ids_match_the_registry():
    compiled = _extension.load().divergences          # csrc/divergence.h, as built
    registry = {name: divergences.get(name).compiled_id for name in divergences.names()
                if divergences.get(name).compiled_id is not None}
    assert compiled == registry


def test_closed_form_divergences_agree():
    # the kernels evaluate a closed form exactly where the registry has one
    for name, div_id in _extension.load().divergences.items():
        p = torch.tensor([0.3], dtype=torch.float64)
        lo, up = bandpo_lut.bounds(p, 0.05, name)
        div = divergences.get(name)
        if div.closed_form is not None:
            q_lo, q_up = div.closed_form(p, 1 - p, 0.05, divergences.torch_math())
            assert torch.allclose(up, q_up / p, rtol=1e-14) and torch.allclose(lo, q_lo / p, rtol=1e-14), name


def test_an_unknown_divergence_id_is_refused_by_the_op():
    p = torch.rand(4)
    meta, coefficients = bandpo_lut.api.table_for("kl", p)
    n = len(_extension.load().divergences)
    try:
        torch.ops.bandpo_lut.bounds(p, None, 0.05, coefficients, list(meta.grid), n, False, float("inf"))
    except RuntimeError as e:
        assert "unknown divergence id" in str(e)
    else:
        raise AssertionError("an unknown divergence id was accepted")


def test_grid_fields_are_packed_by_name():
    # every field the C++ side reads is packed by Python under that name, in the C++ order
    ext = _extension.load()
    meta, _ = bandpo_lut.api.table_for("tv", torch.rand(2))
    table = bandpo_lut.tables.get("tv")
    want = {"t_min": table.t.min, "t_step": table.t.step, "s_min": table.s.min, "s_step": table.s.step,
            "delta_min": table.delta_min, "delta_max": table.delta_max, "delta_max_inclusive": 0.0}
    assert set(ext.grid_fields) == set(want)
    assert meta.grid == tuple(want[name] for name in ext.grid_fields)


def test_fake_kernels_and_autograd_follow_the_schemas():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bandpo_lut import _ops

    for name, returns in (("bounds", 2), ("clip", 1)):
        schema = getattr(torch.ops.bandpo_lut, name).default._schema
        assert len(schema.returns) == returns
        assert len(_ops.no_grads(name)) == len(schema.arguments)
    p, r = torch.rand(3, 1, dtype=torch.float64), torch.rand(1, 5, dtype=torch.float64)
    meta, coefficients = bandpo_lut.api.table_for("kl", p)
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
