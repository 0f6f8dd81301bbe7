"""p_old = -0.0 (what `p.clamp(0, 1)` keeps for a -0 input) is p = 0: the same bits as +0.0 in `bounds`, `clip` and
`policy_loss`, for every divergence, dtype, CPU kernel variant this machine runs (each forced in a fresh process
with BANDPO_LUT_CPU_VARIANT), with and without max_ratio, scalar and per-token δ. The -0 once passed the domain
test `x < 0` and became 1/p = -inf (NaN for hellinger). log_p_old = -inf is p = 0 too, and old_log_prob = -0.0
is p = 1, as +0.0."""
from __future__ import annotations

import pytest
from helpers import fresh_env, run_fresh

import bandpo_lut  # noqa: F401  (the compiled library must load before facts() is asked)
from bandpo_lut.runtime import _extension

pytestmark = pytest.mark.subprocess

ORDER = ["baseline", "avx2", "avx512"]
SUPPORTED = ORDER[: ORDER.index(_extension.facts()["cpu"]["isa"]) + 1]

CHECK = r"""
import math
import torch
import bandpo_lut
from bandpo_lut.runtime import _extension
from bandpo_lut.reference.bounds import bounds as ref_bounds

INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

def bits(t):
    return t.contiguous().view(INT[t.dtype]) if t.is_floating_point() else t

def same_bits(a, b, what):
    differ = (bits(a) != bits(b)).flatten().nonzero().flatten()[:4]
    assert len(differ) == 0, (what, [(int(i), a.flatten()[i].item(), b.flatten()[i].item()) for i in differ])

n = 100                                   # long enough for the vector loops and their tails
g = torch.Generator().manual_seed(0)
base = torch.rand(n, generator=g, dtype=torch.float64)
zeros = torch.arange(n) % 7 == 3          # every 7th element is a zero
ratio = torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
checked = 0
for divergence in bandpo_lut.tables.divergences.compiled_names():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        pos = torch.where(zeros, torch.zeros_like(base), base).to(dtype)
        neg = torch.where(zeros, torch.full_like(base, -0.0), base).to(dtype)
        assert torch.signbit(neg[zeros]).all() and not torch.signbit(pos).any()
        r = ratio.to(dtype)
        for max_ratio in (None, 10.0):
            for delta in (0.05, torch.full((n,), 0.05, dtype=dtype)):
                what = (divergence, str(dtype), max_ratio, type(delta).__name__)
                lo_p, up_p = bandpo_lut.bounds(pos, delta, divergence, max_ratio=max_ratio)
                lo_n, up_n = bandpo_lut.bounds(neg, delta, divergence, max_ratio=max_ratio)
                same_bits(lo_n, lo_p, ("lower",) + what)
                same_bits(up_n, up_p, ("upper",) + what)
                assert (lo_p[zeros] == 0).all() and (up_p[zeros] == (max_ratio or math.inf)).all(), what
                same_bits(bandpo_lut.clip(r, neg, delta, divergence, max_ratio=max_ratio),
                          bandpo_lut.clip(r, pos, delta, divergence, max_ratio=max_ratio), ("clip",) + what)
                # log p = -inf is p = 0 as well
                lo_l, up_l = bandpo_lut.bounds(log_p_old=torch.log(pos), delta=delta, divergence=divergence,
                                               max_ratio=max_ratio)
                assert (lo_l[zeros] == 0).all() and (up_l[zeros] == (max_ratio or math.inf)).all(), what
                checked += 1
        if dtype in (torch.float32, torch.float64):     # the reference reader takes these; -0 is p = 0 there
            rlo, rup = ref_bounds(neg, 0.05, divergence)
            assert (rlo[zeros] == 0).all() and (rup[zeros] == math.inf).all(), divergence
        # the loss: old_log_prob = -0.0 is p = 1, as +0.0 (same loss, metrics and gradient bits)
        olp_pos = torch.where(zeros, torch.zeros_like(base), torch.log(base)).to(dtype).reshape(4, 25)
        olp_neg = torch.where(zeros, torch.full_like(base, -0.0), torch.log(base)).to(dtype).reshape(4, 25)
        adv = torch.randn(4, 25, generator=g, dtype=torch.float64).to(dtype)
        for max_ratio in (None, 10.0):
            out = []
            for olp in (olp_pos, olp_neg):
                lp = (olp.double() + 0.3 * torch.randn(4, 25, generator=torch.Generator().manual_seed(1),
                                                       dtype=torch.float64)).clamp(max=0).to(dtype)
                lp.requires_grad_()
                loss, metrics = bandpo_lut.policy_loss(lp, olp, adv, divergence=divergence, max_ratio=max_ratio)
                loss.backward()
                out.append((loss.detach(), lp.grad, metrics))
            what = ("policy_loss", divergence, str(dtype), max_ratio)
            same_bits(out[1][0], out[0][0], what)
            same_bits(out[1][1], out[0][1], what + ("grad",))
            for k in out[0][2]:
                same_bits(out[1][2][k], out[0][2][k], what + (k,))
print("ok", _extension.facts()["cpu"]["variant"], checked)
"""


@pytest.mark.parametrize("variant", SUPPORTED)
def test_negative_zero_is_p_zero(tmp_path, variant):
    env = fresh_env(BANDPO_LUT_CPU_VARIANT=variant)
    proc = run_fresh(["-c", CHECK], cwd=tmp_path, env=env, check=True)
    assert proc.stdout.strip().splitlines()[-1].startswith(f"ok {variant} "), proc.stdout[-2000:]
