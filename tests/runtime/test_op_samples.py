"""Every compiled op (bounds, clip, clip_backward, policy_loss_fwd, policy_loss_bwd, policy_loss_fwd_grad,
policy_loss_bwd_factor) on its sample inputs (tests/support/op_samples.py), on every device: the op's output against
an independent reference, and torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch) on the
same arguments.
This is the quick loop's check of a wrong bound, a wrong gradient and a broken registration."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_error_lower, rel_error_upper
from op_samples import DIFFERENTIABLE, band_samples, loss_samples, reference_loss

import bandpo_lut
import bandpo_lut.runtime.fused_linear  # noqa: F401  (registers bandpo_lut::fused_linear_chunks)
from bandpo_lut.reference.bounds import bounds as reference_bounds
from bandpo_lut.runtime.loss_spec import METRICS

ops = torch.ops.bandpo_lut
DTYPES = {"float32": (torch.float32, 1e-5), "float64": (torch.float64, 1e-10)}
BAND_OPS = ("bounds", "clip", "clip_backward")
LOSS_OPS = ("policy_loss_fwd", "policy_loss_bwd", "policy_loss_fwd_grad", "policy_loss_bwd_factor")
# declared in Python: per_token (bandpo_lut/runtime/_ops.py) and fused_linear_chunks (the fused-linear loss's chunk
# loop, bandpo_lut/runtime/fused_linear.py, registered when that module is imported: imported here, so the set is whole)
PY_OPS = ("per_token", "fused_linear_chunks")


def _band(device, dtype_name):
    return {s.id: s for s in band_samples(device, DTYPES[dtype_name][0])}


def _loss(device, dtype_name):
    return {s.id: s for s in loss_samples(device, DTYPES[dtype_name][0])}


BAND_IDS = [s.id for s in band_samples("cpu", torch.float64)]
LOSS_IDS = [s.id for s in loss_samples("cpu", torch.float64)]


def _reference_band(settings):
    """float64 reference bounds, with max_ratio applied to the upper one."""
    x = "p_old" if "p_old" in settings else "log_p_old"
    delta = settings["delta"]
    rlo, rup = reference_bounds(delta=delta.double().cpu() if isinstance(delta, torch.Tensor) else delta,
                                divergence=settings["divergence"], **{x: settings[x].double().cpu()})
    if settings["max_ratio"] is not None:
        rup = rup.clamp(max=settings["max_ratio"])
    return rlo, rup


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("sample_id", BAND_IDS)
def test_band_ops_match_the_reference(device, dtype_name, sample_id):
    sample = _band(device, dtype_name)[sample_id]
    dtype, rtol = DTYPES[dtype_name]
    rlo, rup = _reference_band(sample.settings)
    # bounds: the float64 reference reader of the same tables (float32 results: its value rounded, within 1e-6)
    lo, up = ops.bounds(*sample.calls["bounds"][0])
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert rel_error_upper(up, rup.to(dtype)).max() <= tol
    assert rel_error_lower(lo, rlo, dtype).max() <= tol
    # clip: torch.clamp between the reference bounds (NaN ratio: NaN)
    ratio = sample.settings["ratio"]
    args, _ = sample.calls["clip"]
    torch.testing.assert_close(ops.clip(*args).double().cpu(), torch.clamp(ratio.double().cpu(), rlo, rup),
                               rtol=10 * tol, atol=0, equal_nan=True)
    # clip_backward: the upstream gradient where lower <= ratio <= upper (ends included), 0 elsewhere and at NaN.
    # The sample's ratios are either an exact tie with a bound or further from both than the bounds' error.
    grad, r, clipped = sample.calls["clip_backward"][0]
    r64 = r.double().cpu()
    inside = (r64 >= rlo * (1 - 10 * tol)) & (r64 <= rup * (1 + 10 * tol))
    want = torch.where(inside, grad.double().cpu(), torch.zeros((), dtype=torch.float64))
    got = ops.clip_backward(grad, r, clipped).double().cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0, 0] != 0 and (got[:, 1] == 0).all()   # the tie (row 0) keeps its gradient, NaN gets none
    assert (got[..., 2:] == 0).any() and (got[..., 2:] != 0).any()   # ratios inside and outside the band


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("sample_id", LOSS_IDS)
def test_loss_ops_match_the_reference(device, dtype_name, sample_id):
    sample = _loss(device, dtype_name)[sample_id]
    _, rtol = DTYPES[dtype_name]
    loss, metrics, grad = reference_loss(sample.settings)
    f_loss, f_metrics, row_scale = ops.policy_loss_fwd(*sample.calls["policy_loss_fwd"][0])
    torch.testing.assert_close(f_loss, loss, rtol=rtol, atol=rtol * 1e-2)
    for k, v in zip(METRICS, f_metrics.unbind()):
        torch.testing.assert_close(v, metrics[k].to(v.dtype), rtol=rtol, atol=rtol * 1e-2, msg=k)
    args = sample.calls["policy_loss_bwd"][0]
    assert float(args[0]) == pytest.approx(0.7) and torch.equal(args[1], row_scale)
    torch.testing.assert_close(ops.policy_loss_bwd(*args), grad, rtol=rtol, atol=rtol * 1e-3)
    if device == "cpu":   # the forward that keeps the gradient factor: the forward's bits, and 0.7 · S_b · factor
        g_loss, g_metrics, g_row_scale, factor = ops.policy_loss_fwd_grad(*sample.calls["policy_loss_fwd_grad"][0])
        assert torch.equal(g_loss, f_loss) and torch.equal(g_metrics, f_metrics) and torch.equal(g_row_scale, row_scale)
        assert factor.dtype == (torch.float64 if dtype_name == "float64" else torch.float32)
        scaled = (factor.double() * 0.7 * row_scale.unsqueeze(1)).to(grad.dtype)
        torch.testing.assert_close(scaled, grad, rtol=rtol, atol=rtol * 1e-3)
        by_factor = ops.policy_loss_bwd_factor(*sample.calls["policy_loss_bwd_factor"][0])   # its backward
        assert by_factor.dtype == factor.dtype
        torch.testing.assert_close(by_factor.to(grad.dtype), grad, rtol=rtol, atol=rtol * 1e-3)


def _opcheck(op_name, args, kwargs):
    # opcheck compares eager and traced outputs without equal_nan: the NaN ratio (tested above) becomes 1 here
    args = [torch.nan_to_num(a, nan=1.0) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    if op_name in DIFFERENTIABLE:
        i = DIFFERENTIABLE[op_name]
        args[i] = args[i].detach().clone().requires_grad_()
    torch.library.opcheck(getattr(ops, op_name).default, tuple(args), kwargs)


# opcheck's checks (schema, fake kernel, autograd registration, AOT dispatch) do not depend on the dtype: float64
# in the quick loop, float32 with the slow tests.
OPCHECK_DTYPES = ["float64", pytest.param("float32", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype_name", OPCHECK_DTYPES)
@pytest.mark.parametrize("op_name", BAND_OPS)
def test_opcheck_band_ops(device, dtype_name, op_name):
    for sample in _band(device, dtype_name).values():
        _opcheck(op_name, *sample.calls[op_name])


@pytest.mark.parametrize("dtype_name", OPCHECK_DTYPES)
@pytest.mark.parametrize("op_name", LOSS_OPS)
def test_opcheck_loss_ops(device, dtype_name, op_name):
    if op_name in ("policy_loss_fwd_grad", "policy_loss_bwd_factor") and device != "cpu":
        pytest.skip(f"{op_name} is a CPU op (the GPU's backward recomputes)")
    for sample in _loss(device, dtype_name).values():
        _opcheck(op_name, *sample.calls[op_name])


def per_token_samples(device):
    """(x, batch, steps): a per-row column (GRPO's advantages), a full strided (batch, T) tensor and a scalar row."""
    g = torch.Generator().manual_seed(3)
    column = torch.randn(3, 1, generator=g).to(device)
    full = torch.randn(7, 3, generator=g).to(device).t()            # (3, 7), transposed: not contiguous
    row = torch.randn(7, generator=g).to(device)
    return [(column, 3, 7), (full, 3, 7), (row, 3, 7)]


def test_per_token_matches_the_reference_and_opcheck(device):
    for x, batch, steps in per_token_samples(device):
        # the reference: token t is x[t // steps, t % steps], by explicit indexing
        t = torch.arange(batch * steps, device=device)
        want = x.expand(batch, steps)[t // steps, t % steps]
        assert torch.equal(ops.per_token(x, batch, steps), want)
        torch.library.opcheck(ops.per_token.default, (x, batch, steps))


def test_samples_cover_every_op_and_setting():
    """Every op of the library has samples, and the samples cover what the docstrings promise."""
    declared = {name for name in dir(ops) if isinstance(getattr(ops, name), torch._ops.OpOverloadPacket)}
    covered = set(BAND_OPS) | set(LOSS_OPS) | set(PY_OPS)
    assert declared == covered, declared ^ covered
    band = band_samples("cpu", torch.float32)
    assert all(set(s.calls) == set(BAND_OPS) for s in band)
    assert {s.settings["divergence"] for s in band} == set(bandpo_lut_shipped())
    loss = loss_samples("cpu", torch.float32)
    assert all(set(s.calls) == set(LOSS_OPS) for s in loss)
    from bandpo_lut.reference.policy_loss import AGGS, CLIPS, MODES
    for key, values in (("clip", CLIPS), ("mode", MODES), ("agg", AGGS)):
        assert {s.settings[key] for s in loss} == set(values), key
    assert not math.isnan(float(band[0].settings["ratio"][0]))


def bandpo_lut_shipped():
    from bandpo_lut.tables import store as tables

    return tables.SHIPPED


def fused_linear_chunks_calls(device, monkeypatch):
    """The arguments `fused_linear_policy_loss` passes its chunk op, recorded from real calls (an entropy and
    gradients wanted, a bias, a temperature, chunks that do not divide the tokens), and the inputs they came from."""
    from bandpo_lut.runtime import fused_linear

    calls = []
    real = fused_linear.chunked_pass

    def record(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fused_linear, "chunked_pass", record)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 5, 8, generator=g).to(device).requires_grad_()
    weight = (torch.randn(11, 8, generator=g) / 2).to(device).requires_grad_()
    bias = torch.randn(11, generator=g).to(device).requires_grad_()
    ids = torch.randint(0, 11, (3, 5), generator=g).to(device)
    old = torch.log(torch.rand(3, 5, generator=g).clamp(min=0.05)).to(device)
    adv = torch.randn(3, 5, generator=g).to(device)
    loss, _, entropy = bandpo_lut.fused_linear_policy_loss(hidden, weight, ids, old, adv, bias=bias,
                                                           temperature=0.7, chunk_size=4, return_entropy=True)
    loss.backward()
    return calls, (hidden, weight, bias, ids, old, adv)


def test_fused_linear_chunks_matches_the_reference_and_opcheck(device, monkeypatch):
    calls, (hidden, weight, bias, ids, old, adv) = fused_linear_chunks_calls(device, monkeypatch)
    assert len(calls) == 1
    # detached: the op runs inside fused_linear_policy_loss's own autograd.Function, which is its derivative
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in calls[0])
    log_prob, entropy, grad_h, grad_w, grad_b = ops.fused_linear_chunks(*args)
    # the reference: the full logits, log_softmax, gather; entropy; the gradients by autograd of the unfused loss
    h = hidden.detach().reshape(15, 8).double().requires_grad_()
    w, b = weight.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    logp_all = torch.log_softmax((h @ w.t() + b) / 0.7, dim=-1)
    lp = logp_all.gather(-1, ids.reshape(15, 1)).squeeze(-1)
    want_entropy = -(logp_all.exp() * logp_all).sum(-1)
    torch.testing.assert_close(log_prob.double(), lp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=1e-5, atol=1e-6)
    ref_loss, _ = bandpo_lut.policy_loss(lp.reshape(3, 5), old.double(), adv.double())
    ref_loss.backward()
    torch.testing.assert_close(grad_h.double(), h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_w.double(), w.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_b.double(), b.grad, rtol=1e-4, atol=1e-6)
    torch.library.opcheck(ops.fused_linear_chunks.default, args)
