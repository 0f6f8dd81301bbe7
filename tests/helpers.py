"""Shared test helpers (imported as `from helpers import ...`): one device list, and float-aware error measures."""
from __future__ import annotations

import functools
import math

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALL_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="no CUDA device"))]


def rel_error_upper(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|r - r*| / r*, with inf == inf counting as exact; NaN counts as infinitely wrong."""
    ours, ref = ours.double().cpu(), ref.double().cpu()
    same_inf = torch.isinf(ours) & torch.isinf(ref) & (ours == ref)
    err = (ours - ref).abs() / ref
    err = torch.where(same_inf, torch.zeros_like(err), err)
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


def rel_error_lower(ours: torch.Tensor, ref: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """|r - r*| / (r*(1 + |ln r*|)) against the truth rounded to `dtype`; an absolute floor of two
    subnormal spacings of `dtype` (no float can do better at the bottom of its range)."""
    ours = ours.double().cpu()
    ref = ref.to(dtype).double().cpu()
    floor = 2 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    excess = ((ours - ref).abs() - floor).clamp(min=0)
    err = torch.where(ref == 0, excess / floor, excess / (ref * (1 + ref.log().abs())))
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


# A small but valid kl table (the tail rules need |logit p| >= ~10 for δ >= 0.05): seconds of mpmath, made once
# per test session for every module that needs one.
SMALL_KL = dict(t_max=10.0, t_density=4, delta_min=0.05, delta_max=0.5, s_nodes=6, ghost=6, dps=30,
                dtype="float32", accuracy_points=20, workers=1, progress=False)


@functools.cache
def small_kl_blob() -> bytes:
    from bandpo_lut.generate import generate

    return generate("kl", **SMALL_KL)
