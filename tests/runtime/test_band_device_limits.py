"""The cases that used to be CUDA-only limits, on every available device: many non-collapsible
dimensions, dense tables whose scalar-δ cells exceed 48 KB of shared memory, many rows and long rows, run-to-run
determinism; and, where a GPU is present, a side stream, a CUDA-graph capture (the scalar-δ cell cache) and more
than 2^31 elements (64-bit indexing). tools/gpu_check.py runs these with every other CUDA test (`pytest -m cuda`)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_error_lower, rel_error_upper

import bandpo_lut
from bandpo_lut.runtime import _ops  # noqa: F401  (loads the ops for the direct calls below)

_KEEP = []   # tables made here stay alive: the cell caches are keyed by the table's address


def dense_kl_table(factor, device):
    """The shipped KL table stretched along t (factor times the cells): a valid table of the same range."""
    prep = bandpo_lut.runtime.band.table_args("kl")
    coef, grid = prep.coefficients, list(prep.grid)
    nt = (coef.shape[1] - 3) * factor + 1
    dense = torch.nn.functional.interpolate(coef.unsqueeze(0), size=(nt + 2, coef.shape[2]), mode="bilinear",
                                            align_corners=True)[0].contiguous().to(device)
    grid[1] = grid[1] / factor
    _KEEP.append(dense)
    return dense, grid


def test_nine_non_collapsible_dims_equal_contiguous(device):
    g = torch.Generator().manual_seed(5)
    p = torch.rand([2, 1] * 5, generator=g).to(device)               # alternating broadcasts: nothing coalesces
    d = (torch.rand([1, 2] * 5, generator=g) * 0.2 + 0.01).to(device)
    r = (torch.rand([2] * 10, generator=g) * 2).to(device)
    shape = torch.broadcast_shapes(p.shape, d.shape)
    lo, up = bandpo_lut.bounds(p, d)
    lo2, up2 = bandpo_lut.bounds(p.expand(shape).contiguous(), d.expand(shape).contiguous())
    out = bandpo_lut.clip(r, p, d)
    out2 = bandpo_lut.clip(r, p.expand(shape).contiguous(), d.expand(shape).contiguous())
    # CPU: strided inputs are gathered into the contiguous loop; CUDA: one element function for both kernels
    assert torch.equal(lo, lo2) and torch.equal(up, up2) and torch.equal(out, out2)


@pytest.mark.parametrize("factor", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_tables(device, factor, dtype):
    # x4: 1,792 cells (57 KB of float / 115 KB of double cubics); x16: 7,168 cells (229 / 459 KB)
    table, grid = dense_kl_table(factor, device)
    g = torch.Generator().manual_seed(factor)
    x = torch.sigmoid(torch.empty(4000, dtype=torch.float64).uniform_(-15, 15, generator=g)).to(dtype).to(device)
    scalar = torch.ops.bandpo_lut.bounds(x, None, 0.05, table, grid, 0, False, math.inf)
    token = torch.ops.bandpo_lut.bounds(x, torch.full_like(x, 0.05), 0.05, table, grid, 0, False, math.inf)
    tol = 2e-6 if dtype == torch.float32 else 1e-12

    def close(got, want):   # (lower, upper) pairs, in the project's error measures
        assert rel_error_lower(got[0], want[0].double(), dtype).max() <= tol
        assert rel_error_upper(got[1], want[1]).max() <= tol

    close(scalar, token)    # the collapsed cells against the full 2-D spline
    if device != "cpu":
        close(scalar, torch.ops.bandpo_lut.bounds(x.cpu(), None, 0.05, table.cpu(), grid, 0, False, math.inf))
    # From log p, contiguous and strided: on CUDA four more kernels, each opted in to the cells' shared memory at its
    # launch (the planner checks the bytes against the dense kernel from p only). The reference: p = exp(log p) in
    # float64, read from p by the double kernels.
    log_x = torch.log(x)
    want = torch.ops.bandpo_lut.bounds(log_x.double().exp(), None, 0.05, table, grid, 0, False, math.inf)
    close(torch.ops.bandpo_lut.bounds(log_x, None, 0.05, table, grid, 0, True, math.inf), want)
    strided = torch.ops.bandpo_lut.bounds(log_x[::2], None, 0.05, table, grid, 0, True, math.inf)
    close(strided, (want[0][::2], want[1][::2]))
    lp = torch.log(x).reshape(40, 100)
    out = torch.ops.bandpo_lut.policy_loss_fwd(lp + 0.1 * torch.randn(lp.shape, generator=g, dtype=dtype).to(device),
                                               lp, torch.randn(lp.shape, generator=g, dtype=dtype).to(device), None,
                                               None, 0.05, table, grid, 0, 0, 0.0, 0.0, math.inf, 0.0, 0, 0)
    assert torch.isfinite(out[0]) and torch.isfinite(out[1]).all()


def test_a_table_at_a_reused_address_gets_its_own_cells(device):
    """The scalar-δ cell cubics are cached per table; a table freed and another allocated at its address must not
    get the first one's cells (as test_dense_tables' per-call `table.cpu()` copies landed at one address, and
    the CPU reference read the x4 table's cells, a quarter as many, for the x16 table: NaN and garbage bounds where
    the GPU was right). Here both tables are views of one buffer, so they share their address for certain."""
    small, grid_small = dense_kl_table(1, device)
    large, grid_large = dense_kl_table(4, device)
    buf = torch.empty(large.numel(), dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(11)
    x = torch.sigmoid(torch.empty(2000, dtype=torch.float64).uniform_(-15, 15, generator=g)).to(device)
    for table, grid in ((small, grid_small), (large, grid_large)):
        view = buf[:table.numel()].view(table.shape)
        view.copy_(table)
        scalar = torch.ops.bandpo_lut.bounds(x, None, 0.05, view, grid, 0, False, math.inf)
        token = torch.ops.bandpo_lut.bounds(x, torch.full_like(x, 0.05), 0.05, view, grid, 0, False, math.inf)
        # the full 2-D spline per element (no cells) is the reference
        assert rel_error_lower(scalar[0], token[0]).max() <= 1e-12
        assert rel_error_upper(scalar[1], token[1]).max() <= 1e-12


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.cuda
@cuda_only
def test_cuda_loss_matches_cpu_on_many_and_long_rows():
    g = torch.Generator().manual_seed(7)
    for B, T in ((65_536, 3), (3, 70_000), (5, 1)):
        olp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
        lp = olp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
        mask = torch.rand(B, T, generator=g) > 0.3
        for agg in ("token-mean", "seq-mean-token-mean"):
            res = []
            for dev in ("cpu", "cuda"):
                # A leaf of its own per device and agg: `lp.to("cpu")` is lp itself, whose requires_grad_() would
                # make the CUDA copy a non-leaf (no .grad) and accumulate the CPU gradient across the aggs.
                a = lp.detach().to(dev, copy=True).requires_grad_()
                loss, metrics = bandpo_lut.policy_loss(a, olp.to(dev), adv.to(dev), mask.to(dev), agg=agg)
                loss.backward()
                res.append((loss.cpu(), {k: v.cpu() for k, v in metrics.items()}, a.grad.cpu()))
            torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(res[1][2], res[0][2], rtol=1e-12, atol=1e-15)
            for k in res[0][1]:
                torch.testing.assert_close(res[1][1][k], res[0][1][k], rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.cuda
@cuda_only
def test_cuda_side_stream_and_graph_capture():
    g = torch.Generator().manual_seed(8)
    p = torch.rand(100_000, generator=g).cuda()
    r = (torch.rand(100_000, generator=g) * 2).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = bandpo_lut.clip(r, p, 0.0613)            # a δ never seen: its cells are made on the side stream
    b = bandpo_lut.clip(r, p, 0.0613)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.cpu(), bandpo_lut.clip(r.cpu(), p.cpu(), 0.0613), rtol=2e-6, atol=0)
    lp = torch.nn.functional.logsigmoid(torch.randn(4, 500, generator=g)).cuda()
    olp, adv = (lp + 0.05).clamp(max=0), torch.randn(4, 500, generator=g).cuda()
    static = lp.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        bandpo_lut.policy_loss(static, olp, adv)[0].backward()
    torch.cuda.current_stream().wait_stream(s)
    static.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                   # δ = 0.0771 is first seen inside the capture
        loss, metrics = bandpo_lut.policy_loss(static, olp, adv, delta=0.0771)
        loss.backward()
    with torch.no_grad():
        static.copy_(lp * 1.01)
    graph.replay()
    e = (lp * 1.01).clone().requires_grad_()
    e_loss, e_metrics = bandpo_lut.policy_loss(e, olp, adv, delta=0.0771)
    e_loss.backward()
    assert torch.equal(loss, e_loss) and torch.equal(static.grad, e.grad)
    assert all(torch.equal(metrics[k], e_metrics[k]) for k in metrics)


@pytest.mark.cuda
@cuda_only
def test_cuda_graph_capture_of_the_band_ops_in_a_fresh_process(fresh):
    """`clip` and `bounds` captured in a CUDA graph in a fresh process, after one warm-up call at another δ: the
    float32 KL band's cells in p's bits for the captured δ and its per-token patches are fitted inside the capture,
    into the capture's own memory; replayed on new inputs, the graph gives the eager call's bits, from p and log p."""
    code = """
import torch, bandpo_lut
g = torch.Generator().manual_seed(12)
n = 50_000
p = torch.rand(n, generator=g).cuda()
r = (torch.rand(n, generator=g) * 2).cuda()
d = (torch.rand(n, generator=g) * 0.2 + 0.01).cuda()
bandpo_lut.clip(r, p, 0.05)   # the table onto the device (an upload is not captured); no cells of these δ yet
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    outs = (bandpo_lut.clip(r, p, 0.0437), bandpo_lut.clip(r, p, d), *bandpo_lut.bounds(p, 0.0437),
            bandpo_lut.clip(r, log_p_old=torch.log(p), delta=0.0437), *bandpo_lut.bounds(p, d))
p.copy_(torch.rand(n, generator=g).cuda())
r.copy_(torch.rand(n, generator=g).cuda() * 2)
d.copy_(torch.rand(n, generator=g).cuda() * 0.2 + 0.01)
graph.replay()
torch.cuda.synchronize()
want = (bandpo_lut.clip(r, p, 0.0437), bandpo_lut.clip(r, p, d), *bandpo_lut.bounds(p, 0.0437),
        bandpo_lut.clip(r, log_p_old=torch.log(p), delta=0.0437), *bandpo_lut.bounds(p, d))
print([bool(torch.equal(a, b)) for a, b in zip(outs, want)])
print(bool(torch.allclose(want[0].cpu(), bandpo_lut.clip(r.cpu(), p.cpu(), 0.0437), rtol=2e-6, atol=0)))
"""
    out = fresh(["-c", code], check=True).stdout.splitlines()
    assert out == [str([True] * 7), "True"], out


def test_repeat_runs_are_bit_identical(device):
    """Reductions in a fixed order: the loss, its metrics and its gradient are the same bits run after run."""
    g = torch.Generator().manual_seed(9)
    B, T = 16, 8195   # several warp tiles per row, a partial last tile
    olp = torch.nn.functional.logsigmoid(torch.randn(B, T, generator=g) * 3).to(device)
    lp = olp + (torch.randn(B, T, generator=g) * 0.2).to(device)
    adv, mask = torch.randn(B, T, generator=g).to(device), (torch.rand(B, T, generator=g) > 0.1).to(device)
    runs = []
    for _ in range(3):
        a = lp.clone().requires_grad_()
        loss, metrics = bandpo_lut.policy_loss(a, olp, adv, mask, agg="seq-mean-token-mean", dual_clip=3.0)
        loss.backward()
        runs.append((loss, metrics, a.grad))
    for loss, metrics, grad in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][2])
        assert all(torch.equal(metrics[k], runs[0][1][k]) for k in metrics)


@pytest.mark.cuda
@pytest.mark.slow
@cuda_only
def test_cuda_more_than_2_to_the_31_elements():
    """64-bit indexing: a dense float16 input of 2^31 + 17 elements, and a broadcast one of as many (strided, split
    into 32-bit pieces), against the CPU op at sampled positions. Needs ~13 GB of GPU memory."""
    g = torch.Generator().manual_seed(10)
    n = 2 ** 31 + 17
    p = torch.rand(n, dtype=torch.float16, device="cuda")
    lo, up = bandpo_lut.bounds(p, 0.05)
    idx = torch.cat([torch.arange(64), torch.randint(0, n, (4096,), generator=g), torch.arange(n - 64, n)]).cuda()
    lo_c, up_c = bandpo_lut.bounds(p[idx].cpu(), 0.05)
    assert rel_error_upper(up[idx], up_c).max() <= 2 ** -10
    assert rel_error_lower(lo[idx], lo_c.double(), torch.float16).max() <= 2 ** -10
    del p, lo, up
    rows = torch.rand(2 ** 16 + 1, 1, device="cuda", dtype=torch.float16)
    cols = (torch.rand(1, 2 ** 15 + 3, device="cuda") * 0.2 + 0.01).half()
    lo, _ = bandpo_lut.bounds(rows, cols)
    for i in (0, 1, 2 ** 15, 2 ** 16):
        assert torch.equal(lo[i], bandpo_lut.bounds(rows[i:i + 1], cols)[0][0])
    del lo
    torch.cuda.empty_cache()
