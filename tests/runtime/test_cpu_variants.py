"""Every CPU kernel variant this machine can run (csrc/cpu/cpu_variant.h: the fused AVX-512 wide-cell kernel for
KL with a scalar δ, the x86-64-v3 and baseline loops), each forced in a fresh process with BANDPO_LUT_CPU_VARIANT:
accurate against the float64 reference reader and mpmath, clip equal to clamp(bounds), the same bits for a token
whatever its batch's layout, NaN in NaN out. And a variant the CPU cannot run, or a misspelt one, is refused."""
from __future__ import annotations

import json

import pytest
from helpers import fresh_env, run_fresh

import bandpo_lut  # noqa: F401  (the compiled library must load before facts() is asked)
from bandpo_lut.runtime import _extension

pytestmark = pytest.mark.subprocess

ORDER = ["baseline", "avx2", "avx512"]
SUPPORTED = ORDER[: ORDER.index(_extension.facts()["cpu"]["isa"]) + 1]

CHECK = r"""
import json, math, sys
import numpy as np, torch
import bandpo_lut
from bandpo_lut.runtime import _extension
from bandpo_lut.tables import accuracy
from bandpo_lut.reference.bounds import bounds as ref_bounds

out = {"variant": _extension.facts()["cpu"]["variant"]}
p64, _ = accuracy.sample_points(40000, 1e-3, 1.0, seed=7)          # a fifth in each tail beyond |t| = 14
p64[:8] = [0.0, 1.0, 1e-45, 1e-39, 1 - 2 ** -24, 0.5, 2 ** -126, 1e-30]
p32 = torch.from_numpy(p64).float()
worst = {}
for delta in (1e-3, 0.05, 0.3, 1.0):
    for log_input in (False, True):
        x = torch.log(p32) if log_input else p32
        kw = {"log_p_old": x} if log_input else {"p_old": x}
        lo, up = bandpo_lut.bounds(delta=delta, **kw)
        rlo, rup = ref_bounds(delta=delta, **{k: v.double() for k, v in kw.items()})
        eu, el = accuracy.float32_worst(lo.numpy(), up.numpy(), rlo.numpy(), rup.numpy())
        worst[f"{delta}/{'logp' if log_input else 'p'}"] = [eu, el]
        ratio = torch.exp(torch.randn(len(x), generator=torch.Generator().manual_seed(3)) * 2)
        clipped = bandpo_lut.clip(ratio, delta=delta, **kw)
        assert torch.equal(clipped, torch.minimum(torch.maximum(ratio, lo), up)), (delta, log_input)
        # The same token, the same bits: transposed, strided, expanded, and every offset in a short run.
        m = x[: 64 * 33].reshape(64, 33)
        kw2 = {("log_p_old" if log_input else "p_old"): m.t().contiguous().t()}
        lo2, up2 = bandpo_lut.bounds(delta=delta, **kw2)
        assert torch.equal(lo2, lo[: 64 * 33].reshape(64, 33)) and torch.equal(up2, up[: 64 * 33].reshape(64, 33))
        for start in range(17):
            kw3 = {("log_p_old" if log_input else "p_old"): x[start:start + 21]}
            lo3, up3 = bandpo_lut.bounds(delta=delta, **kw3)
            assert torch.equal(lo3, lo[start:start + 21]) and torch.equal(up3, up[start:start + 21]), start
        nan_in = x.clone()
        nan_in[5::97] = float("nan")
        lo4, up4 = bandpo_lut.bounds(delta=delta, **{("log_p_old" if log_input else "p_old"): nan_in})
        assert lo4[5::97].isnan().all() and up4[5::97].isnan().all()
        bad = torch.tensor([1.5, -0.25]) if not log_input else torch.tensor([0.5, 3.0])
        lo5, up5 = bandpo_lut.bounds(delta=delta, **{("log_p_old" if log_input else "p_old"): bad})
        assert lo5.isnan().all() and up5.isnan().all()
out["worst"] = worst
# mpmath at a few hundred points, scalar δ = 0.05, p input
pm, _ = accuracy.sample_points(400, 1e-3, 1.0, seed=11)
pm32 = torch.from_numpy(pm).float()
lo, up = bandpo_lut.bounds(pm32, 0.05)
rlo, rup = accuracy.exact_bounds_f64(pm32.double().numpy(), np.full(len(pm), 0.05), "kl")
out["mpmath"] = list(accuracy.float32_worst(lo.numpy(), up.numpy(), rlo, rup))
print(json.dumps(out))
"""


@pytest.mark.parametrize("variant", SUPPORTED)
def test_each_variant_is_accurate_and_layout_exact(tmp_path, variant):
    env = fresh_env()
    env["BANDPO_LUT_CPU_VARIANT"] = variant
    proc = run_fresh(["-c", CHECK], cwd=tmp_path, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["variant"] == variant
    for key, (eu, el) in out["worst"].items():
        # The reference reader shares the table, so this bounds the kernels' own float32 error: well inside the
        # end-to-end bars against mpmath (upper 7e-7, lower 3e-7·(1+|ln r|); README).
        assert eu <= 6e-7 and el <= 3e-7, (variant, key, eu, el)
    eu, el = out["mpmath"]
    assert eu <= 7e-7 and el <= 3e-7, (variant, eu, el)


def test_an_unknown_or_unsupported_variant_is_refused(tmp_path):
    code = "import torch, bandpo_lut; bandpo_lut.clip(torch.ones(3), torch.full((3,), 0.5), 0.05)"
    unsupported = [v for v in ORDER if v not in SUPPORTED]
    for value in ["avx1024", *unsupported]:
        env = fresh_env()
        env["BANDPO_LUT_CPU_VARIANT"] = value
        proc = run_fresh(["-c", code], cwd=tmp_path, env=env)
        assert proc.returncode != 0, value
        assert "BANDPO_LUT_CPU_VARIANT" in proc.stderr and value in proc.stderr, proc.stderr[-2000:]
