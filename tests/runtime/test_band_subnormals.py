"""The float32 KL band computes through no subnormal float, whatever p: on Intel cores every instruction that
produces or reads one takes a microcode assist, and in a SIMD vector one rare token would make the whole vector
pay. Each CPU variant this machine can run, forced in a fresh process, single-threaded (the op then runs on the
calling thread), for p log-uniform from 1e-30 to 1, as p and as log p, with a scalar and a per-token δ, bounds
and clip:
  * the CPU's sticky flags (MXCSR: denormal operand, underflow) stay clear around the op, on any x86 CPU, AMD
    included (where timing alone cannot show the subnormal path);
  * with flush-to-zero and denormals-are-zero set (`torch.set_flush_denormal(True)`) every result has the same
    bits, the subnormal lower bounds included: they are assembled from their bits, not flushed;
  * those subnormal lower bounds (present in the sample) are as accurate as the documented bar against the float64
    reference reader: 3e-7·(1 + |ln r|) relative, or two subnormal spacings (`accuracy.float32_worst`), the bar
    tests/runtime/test_cpu_variants.py holds every lower bound to."""
from __future__ import annotations

import json

import fp_status
import pytest
from helpers import fresh_env, run_fresh

import bandpo_lut  # noqa: F401  (the compiled library must load before facts() is asked)
from bandpo_lut.runtime import _extension

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not fp_status.available(), reason="the MXCSR flags exist only on x86-64 Linux"),
]

ORDER = ["baseline", "avx2", "avx512"]
SUPPORTED = ORDER[: ORDER.index(_extension.facts()["cpu"]["isa"]) + 1]

CHECK = r"""
import json, math, sys
import torch
import bandpo_lut
from bandpo_lut.reference.bounds import bounds as ref_bounds
from bandpo_lut.tables import accuracy
import fp_status

torch.set_num_threads(1)
g = torch.Generator().manual_seed(5)
n = 6000
u = torch.rand(n, dtype=torch.float64, generator=g)
p = torch.exp(math.log(1e-30) * u).float()
p[:6] = torch.tensor([1e-30, 1.1754944e-38 * 2, 0.5, 1.0, 1 - 2 ** -24, 1e-3])
logp = torch.log(p.double()).float()
ratio = torch.exp(torch.randn(n, generator=g) * 3)
dtok = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-3), 0.0, generator=g)).float()
cases = {}
for delta in (1e-3, 0.05, 1.0):
    cases[f"bounds p {delta}"] = lambda d=delta: bandpo_lut.bounds(p, d)
    cases[f"clip p {delta}"] = lambda d=delta: (bandpo_lut.clip(ratio, p, d),)
    cases[f"bounds logp {delta}"] = lambda d=delta: bandpo_lut.bounds(log_p_old=logp, delta=d)
    cases[f"clip logp {delta}"] = lambda d=delta: (bandpo_lut.clip(ratio, log_p_old=logp, delta=d),)
cases["bounds p token"] = lambda: bandpo_lut.bounds(p, dtok)
cases["clip p token"] = lambda: (bandpo_lut.clip(ratio, p, dtok),)
cases["bounds logp token"] = lambda: bandpo_lut.bounds(log_p_old=logp, delta=dtok)
for fn in cases.values():
    fn()  # first calls (the cell cache, the dispatcher) outside the measured window
mask = fp_status.DENORMAL | fp_status.UNDERFLOW
out = {"flags": {k: fp_status.describe(fp_status.flags_raised(fn) & mask) for k, fn in cases.items()}}
plain = {k: [t.clone() for t in fn()] for k, fn in cases.items()}
torch.set_flush_denormal(True)
flushed = {k: [t.clone() for t in fn()] for k, fn in cases.items()}
torch.set_flush_denormal(False)
out["same_bits_flushed"] = {k: all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                   for a, b in zip(plain[k], flushed[k])) for k in cases}
tiny = torch.finfo(torch.float32).tiny
sub = {}
for key, lo, d in [(str(d), plain[f"bounds p {d}"][0], d) for d in (1e-3, 0.05, 1.0)] + \
        [("token", plain["bounds p token"][0], dtok.double())]:
    rlo, rup = ref_bounds(p.double(), d)
    s = (lo > 0) & (lo < tiny)
    _, el = accuracy.float32_worst(lo[s].numpy(), rup[s].numpy(), rlo[s].numpy(), rup[s].numpy())
    sub[key] = [int(s.sum()), el]
out["subnormal_lower"] = sub
print(json.dumps(out))
"""


@pytest.mark.parametrize("variant", SUPPORTED)
def test_kl_band_touches_no_subnormal(tmp_path, variant):
    env = fresh_env(BANDPO_LUT_CPU_VARIANT=variant)
    env["PYTHONPATH"] = str(fp_status.__file__).rsplit("/", 1)[0] + ":" + env["PYTHONPATH"]
    proc = run_fresh(["-c", CHECK], cwd=tmp_path, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    touched = {k: v for k, v in out["flags"].items() if v != "none"}
    assert not touched, f"{variant}: subnormal flags raised: {touched}"
    changed = [k for k, same in out["same_bits_flushed"].items() if not same]
    assert not changed, f"{variant}: results change under flush-to-zero / denormals-are-zero: {changed}"
    for key, (count, worst) in out["subnormal_lower"].items():
        assert count > 0, f"{variant}: no subnormal lower bound in the sample at δ = {key}"
        assert worst <= 3e-7, f"{variant}, δ = {key}: subnormal lower bounds {worst} from the reference"
