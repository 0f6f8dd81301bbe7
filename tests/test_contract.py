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
