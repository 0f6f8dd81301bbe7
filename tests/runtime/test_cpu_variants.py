"""Every CPU kernel variant this machine can run (csrc/cpu/cpu_variant.h, the one CPU dispatcher: the fused AVX-512
wide-cell kernel and the AVX2 kernel with cells in p's bits for KL with a scalar δ, the x86-64-v3 and baseline loops,
and the loss's token pass), each forced in a fresh process with BANDPO_LUT_CPU_VARIANT: the band accurate against
the float64 reference reader and mpmath, clip equal to clamp(bounds), the same bits for a token whatever its batch's
layout, NaN in NaN out; the fused loss (its float32 token pass) against the reference loss, and its p_old buckets
at the edges against float64. A variant the CPU cannot run, or a misspelt one, is refused with a Python error at
every op that reads the variable (float64 included), never an abort."""
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
# Per-token δ: the same checks with a δ per element (inside and beyond the table's range, NaN).
d64 = np.exp(np.random.default_rng(8).uniform(math.log(1e-3), math.log(1.0), len(p64)))
d32 = torch.from_numpy(d64).float()
d32[9:40:7] = torch.tensor([0.0, 2.0, float("nan"), -0.1, 1e-4])
for log_input in (False, True):
    x = torch.log(p32) if log_input else p32
    key = "log_p_old" if log_input else "p_old"
    lo, up = bandpo_lut.bounds(delta=d32, **{key: x})
    rlo, rup = ref_bounds(delta=d32.double(), **{key: x.double()})
    assert torch.equal(lo.isnan(), rlo.isnan()) and torch.equal(up.isnan(), rup.isnan()), log_input
    ok = ~rlo.isnan()
    eu, el = accuracy.float32_worst(lo[ok].numpy(), up[ok].numpy(), rlo[ok].numpy(), rup[ok].numpy())
    worst[f"token/{'logp' if log_input else 'p'}"] = [eu, el]
    m, dm = x[: 64 * 33].reshape(64, 33), d32[: 64 * 33].reshape(64, 33)
    lo2, up2 = bandpo_lut.bounds(delta=dm.t().contiguous().t(), **{key: m.t().contiguous().t()})
    same = lambda a, b: torch.equal(a.view(torch.int32), b.reshape(a.shape).view(torch.int32))
    assert same(lo2, lo[: 64 * 33]) and same(up2, up[: 64 * 33]), log_input
    for start in range(17):
        lo3, up3 = bandpo_lut.bounds(delta=d32[start:start + 21], **{key: x[start:start + 21]})
        assert same(lo3, lo[start:start + 21]) and same(up3, up[start:start + 21]), (log_input, start)
out["worst"] = worst
# A block with no element beyond the grid skips the tails' pass (and the p = 1 select): its tokens get the same bits
# as in a block that runs it. p on the grid (|t| <= 13) in whole blocks, then one element beyond (p = 1e-9, p = 1,
# 1 - p tiny) put in at several places, and NaN there too: every other token unchanged.
g0 = np.random.default_rng(13)
p_in = torch.sigmoid(torch.from_numpy(g0.uniform(-13.0, 13.0, 1024))).float()
d_in = torch.from_numpy(np.exp(g0.uniform(math.log(1e-3), 0.0, 1024))).float()
for log_input in (False, True):
    key = "log_p_old" if log_input else "p_old"
    for delta in (0.05, d_in):
        base = torch.log(p_in) if log_input else p_in
        lo, up = bandpo_lut.bounds(delta=delta, **{key: base})
        for where in (0, 17, 255, 256, 300, 1023):
            for odd in (1e-9, 1.0, 1 - 2 ** -24, float("nan")):
                x = p_in.clone()
                x[where] = odd
                x = torch.log(x) if log_input else x
                lo1, up1 = bandpo_lut.bounds(delta=delta, **{key: x})
                keep = torch.arange(1024) != where
                assert torch.equal(lo1[keep].view(torch.int32), lo[keep].view(torch.int32)), (log_input, where, odd)
                assert torch.equal(up1[keep].view(torch.int32), up[keep].view(torch.int32)), (log_input, where, odd)
                one = slice(where, where + 1)
                if math.isnan(odd):
                    assert lo1[one].isnan().all() and up1[one].isnan().all()
                    continue
                d1 = delta[one] if torch.is_tensor(delta) else delta
                rlo, rup = ref_bounds(delta=d1.double() if torch.is_tensor(d1) else d1, **{key: x[one].double()})
                eu, el = accuracy.float32_worst(lo1[one].numpy(), up1[one].numpy(), rlo.numpy(), rup.numpy())
                assert eu <= 6e-7 and el <= 3e-7, (log_input, where, odd, eu, el)
                alone = bandpo_lut.bounds(delta=d1, **{key: x[one]})
                assert torch.equal(alone[0].view(torch.int32), lo1[one].view(torch.int32)), (log_input, where, odd)
                assert torch.equal(alone[1].view(torch.int32), up1[one].view(torch.int32)), (log_input, where, odd)
# mpmath at a few hundred points, scalar δ = 0.05, p input
pm, _ = accuracy.sample_points(400, 1e-3, 1.0, seed=11)
pm32 = torch.from_numpy(pm).float()
lo, up = bandpo_lut.bounds(pm32, 0.05)
rlo, rup = accuracy.exact_bounds_f64(pm32.double().numpy(), np.full(len(pm), 0.05), "kl")
out["mpmath"] = list(accuracy.float32_worst(lo.numpy(), up.numpy(), rlo, rup))
# mpmath, per-token δ, where the upper bound is most sensitive to the s position: p << δ (there q_up ≈ 1 - e^{-δ},
# whose log-derivative in s = log δ is ≈ 1), δ small (|s| large, its float rounding largest)
g = np.random.default_rng(12)
pt32 = torch.sigmoid(torch.from_numpy(g.uniform(-14.0, -6.0, 300))).float()
dt32 = torch.from_numpy(np.exp(g.uniform(math.log(1e-3), math.log(2e-2), 300))).float()
lo, up = bandpo_lut.bounds(pt32, dt32)
rlo, rup = accuracy.exact_bounds_f64(pt32.double().numpy(), dt32.double().numpy(), "kl")
out["mpmath_token"] = list(accuracy.float32_worst(lo.numpy(), up.numpy(), rlo, rup))
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
    # Per-token δ, end to end: the s position is taken without rounding log δ or the nodes, and the patch sum of
    # differences (bandpo_math.h TokenSAxis, spline2d_cells); rounding either way costs up to ~4e-7 here.
    eu, el = out["mpmath_token"]
    assert eu <= 4.5e-7 and el <= 2.5e-7, (variant, eu, el)


LOSS_CHECK = r"""
import itertools
import torch
import bandpo_lut
from bandpo_lut.runtime import _extension
from bandpo_lut.reference import policy_loss as spec

assert _extension.facts()["cpu"]["variant"] == VARIANT
g = torch.Generator().manual_seed(5)
B, T = 5, 601                                        # rows longer than one 256-token block, a partial last block
old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6
old[0, :40] = -torch.rand(40, generator=g, dtype=torch.float64) * 1e-6
new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
adv = torch.randn(B, T, generator=g, dtype=torch.float64)
mask = torch.rand(B, T, generator=g) > 0.25
mask[3] = False
tok_delta = 0.01 + 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64)
cases = [dict(clip=c, mode=m, agg=a, dual_clip=d, max_ratio=10.0)
         for c, m, a, d in itertools.product(spec.CLIPS, spec.MODES, spec.AGGS, (None, 3.0))]
cases += [dict(delta=tok_delta), dict(divergence="tv"), dict(divergence="hellinger", delta=tok_delta)]
for kw in cases:
    for m in (mask, mask.float() * 0.5, None):
        a = new.float().requires_grad_()
        b = new.clone().requires_grad_()
        kw32 = {k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()}
        loss, metrics = bandpo_lut.policy_loss(a, old.float(), adv.float(), m, **kw32)
        ref, ref_metrics = spec.policy_loss(b, old, adv, None if m is None else m.double() if m.is_floating_point()
                                            else m, **kw)
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7, msg=str(kw))
        for k in ("n_clipped", "n_clipped_upper", "n_clipped_lower", "n_tokens"):
            if k in ref_metrics:
                assert abs(float(metrics[k]) - float(ref_metrics[k])) <= 2, (kw, k, metrics[k], ref_metrics[k])
        ga, = torch.autograd.grad(loss, a)
        gb, = torch.autograd.grad(ref, b)
        torch.testing.assert_close(ga.double(), gb, rtol=1e-4, atol=1e-7, msg=str(kw))
print("ok", len(cases))
"""


@pytest.mark.parametrize("variant", SUPPORTED)
def test_each_variant_runs_the_loss_token_pass_accurately(tmp_path, variant):
    # The loss's float32 token pass is compiled per variant like the band (BANDPO_CPU_VARIANTS): forcing a
    # variant runs that variant's token loop, which is checked here against the reference loss.
    env = fresh_env()
    env["BANDPO_LUT_CPU_VARIANT"] = variant
    proc = run_fresh(["-c", f"VARIANT = {variant!r}\n" + LOSS_CHECK], cwd=tmp_path, env=env, check=True)
    assert proc.stdout.split()[0] == "ok", proc.stdout


BAD_VARIABLE = r"""
import torch
import bandpo_lut
lp = torch.randn(3, 40, dtype=DTYPE)
p = torch.rand(40, dtype=DTYPE)
calls = {
    "bounds": lambda: bandpo_lut.bounds(p, 0.05),
    "clip": lambda: bandpo_lut.clip(torch.ones_like(p), p, 0.05),
    "bounds per-token delta": lambda: bandpo_lut.bounds(p, torch.full_like(p, 0.05)),
    "bounds tv": lambda: bandpo_lut.bounds(p, 0.05, "tv"),
    "policy_loss": lambda: bandpo_lut.policy_loss(lp, lp - 0.1, torch.randn_like(lp)),
    "policy_loss fixed": lambda: bandpo_lut.policy_loss(lp, lp - 0.1, torch.randn_like(lp), clip="fixed"),
}
for name, call in calls.items():
    try:
        call()
    except ValueError as e:
        msg = str(e)
        assert "BANDPO_LUT_CPU_VARIANT" in msg and repr(VALUE)[1:-1] in msg, (name, msg)
        assert "auto" in msg and "baseline" in msg, (name, msg)
    else:
        raise SystemExit(f"{name}: no error for BANDPO_LUT_CPU_VARIANT={VALUE!r}")
print("refused", len(calls))
"""


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_an_invalid_variant_is_a_python_error_at_every_op(tmp_path, dtype):
    # Not an interpreter abort from the loss (the check runs on the calling thread before any parallel region),
    # and not ignored by float64 (one implementation, but the variable is still checked).
    unsupported = [v for v in ORDER if v not in SUPPORTED]
    for value in ["avx1024", *unsupported]:
        env = fresh_env()
        env["BANDPO_LUT_CPU_VARIANT"] = value
        code = f"DTYPE = __import__('torch').{dtype}\nVALUE = {value!r}\n" + BAD_VARIABLE
        proc = run_fresh(["-c", code], cwd=tmp_path, env=env)
        assert proc.returncode == 0 and "refused" in proc.stdout, (value, proc.returncode, proc.stderr[-2000:])


def test_an_unknown_or_unsupported_variant_is_refused(tmp_path):
    code = "import torch, bandpo_lut; bandpo_lut.clip(torch.ones(3), torch.full((3,), 0.5), 0.05)"
    unsupported = [v for v in ORDER if v not in SUPPORTED]
    for value in ["avx1024", *unsupported]:
        env = fresh_env()
        env["BANDPO_LUT_CPU_VARIANT"] = value
        proc = run_fresh(["-c", code], cwd=tmp_path, env=env)
        assert proc.returncode != 0, value
        assert "BANDPO_LUT_CPU_VARIANT" in proc.stderr and value in proc.stderr, proc.stderr[-2000:]


READ_AT_IMPORT = r"""
import hashlib, json, os, sys
import torch
import bandpo_lut
from bandpo_lut.cli.bench.command import cpu_kernel_line
from bandpo_lut.runtime import _extension
from bandpo_lut.tables import accuracy

later = sys.argv[1]
if later == "-":
    os.environ.pop("BANDPO_LUT_CPU_VARIANT", None)
else:
    os.environ["BANDPO_LUT_CPU_VARIANT"] = later      # after the import, before the first op
out = {"facts": _extension.facts()["cpu"].get("variant"), "build_info": bandpo_lut.build_info()["cpu_variant"],
       "bench": cpu_kernel_line()}
p64, _ = accuracy.sample_points(20000, 1e-3, 1.0, seed=7)
p = torch.from_numpy(p64).float()
try:
    h = hashlib.sha256()
    for divergence in ("kl", "tv"):
        for t in bandpo_lut.bounds(p, 0.05, divergence):
            h.update(t.numpy().tobytes())
    out["bits"] = h.hexdigest()
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def _read_at_import(tmp_path, at_import, later):
    env = fresh_env()
    env.pop("BANDPO_LUT_CPU_VARIANT", None)
    if at_import is not None:
        env["BANDPO_LUT_CPU_VARIANT"] = at_import
    proc = run_fresh(["-c", READ_AT_IMPORT, later], cwd=tmp_path, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # seven fresh processes, ~25 s
@pytest.mark.skipif(len(SUPPORTED) < 2, reason="this CPU runs one variant: no other to change to")
def test_the_variable_is_read_once_at_import_by_kernels_and_reports_alike(tmp_path):
    """Changed after `import bandpo_lut`, the variable changes neither the kernels (their bits are those of the
    variant read at import, told apart by the bits each variant gives when forced at import) nor what the facts,
    build_info (`bandpo-lut info`) and bench report; an invalid value at import stays an error, naming the
    variable and saying when it is read, however it is corrected later."""
    best, slowest = SUPPORTED[-1], SUPPORTED[0]
    forced = {v: _read_at_import(tmp_path, v, "-") for v in (best, slowest)}
    assert forced[best]["bits"] != forced[slowest]["bits"]    # the premise: the two variants are told apart
    for at_import, later in ((None, slowest), (slowest, best), (best, "avx1024")):
        got = _read_at_import(tmp_path, at_import, later)
        want = at_import or best
        assert got["facts"] == got["build_info"] == want, (at_import, later, got)
        assert f"variant {want} " in got["bench"], (at_import, later, got)
        assert got.get("bits") == forced[want]["bits"], (at_import, later, got)
    for later in ("auto", best):
        got = _read_at_import(tmp_path, "avx1024", later)
        assert got["facts"] is None and "'avx1024'" in got["build_info"], got
        assert "BANDPO_LUT_CPU_VARIANT='avx1024'" in got["error"] and "read once" in got["error"], got


EDGE_CHECK = r"""
import json
import numpy as np, torch
import bandpo_lut
from bandpo_lut.runtime import _extension
from bandpo_lut.reference import policy_loss as spec

assert _extension.facts()["cpu"]["variant"] == VARIANT
edges = [lo for _, lo, _ in spec.BUCKETS]
around = []
for e in edges[1:]:
    x = np.float32(np.log(np.float32(e)))
    around.append(x + np.arange(-150, 151, dtype=np.float32) * np.spacing(x))  # the 301 floats around log(edge)
olp = np.concatenate(around + [np.array([-np.inf, -0.0, 0.0, np.nan, -1e-30, -104.0], dtype=np.float32)])
olp = np.tile(olp, 3)                                           # rows longer than a block, a partial last block
t = torch.from_numpy(olp).reshape(1, -1)
_, m = bandpo_lut.policy_loss(t.clone(), t, torch.ones_like(t), None)
with np.errstate(invalid="ignore"):
    p = np.exp(olp.astype(np.float64)).astype(np.float32)      # e^olp correctly rounded to float32
    want = {}
    for (name, lo, hi), edge_hi in zip(spec.BUCKETS, edges[1:] + [None]):
        inside = p >= np.float32(lo)
        if edge_hi is not None:
            inside &= p < np.float32(edge_hi)
        want["n_tokens_" + name] = int(inside.sum())
    want["n_lowprob_pos"] = int((p < np.float32(spec.LOWPROB)).sum())
print(json.dumps({"got": {k: int(m[k].item()) for k in want}, "want": want}))
"""


@pytest.mark.parametrize("variant", SUPPORTED)
def test_each_variant_places_p_old_at_the_edges_as_its_correctly_rounded_exponential(tmp_path, variant):
    """Float32 log-probabilities on the 301 floats around each bucket edge's logarithm (the low-probability
    threshold is the same 0.2), NaN, -inf, ±0, -1e-30 and -104: each bucket's token count and the low-probability
    count are those of p = e^olp correctly rounded to float32 (float64's exponential rounded, numpy's) compared with
    the edges as float32. The float32 token pass decides from olp itself (no exponential per token: loss_cpu.cpp
    LogProbEdges); a threshold one float off moves a token across an edge here. (The GPU forms p with its expf,
    within 2 ulp: there a token within 2 ulp of an edge may fall either side.)"""
    env = fresh_env()
    env["BANDPO_LUT_CPU_VARIANT"] = variant
    proc = run_fresh(["-c", f"VARIANT = {variant!r}\n" + EDGE_CHECK], cwd=tmp_path, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"], out
