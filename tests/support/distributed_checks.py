"""Two processes against one: the global normalisation of the policy loss under DDP and FSDP2, run by
tests/runtime/test_distributed.py in a fresh interpreter. Prints one JSON object: check name -> [ok, detail].

One batch of 5 sequences is split unevenly, 3 rows to rank 0 and 2 to rank 1, one of rank 1's rows fully masked.
A linear head (V x H) on fixed hidden states is the model. Each rank follows docs/api.md's recipe ("Across
data-parallel ranks"): the rank's SUM of what the global loss averages, divided by the all-reduced global count,
times the world size (DDP and FSDP2 average gradients over the ranks). The gradients of the head and of each rank's
hidden states must equal those of the whole batch in one process, computed with the pure-PyTorch reference loss
(`bandpo_lut.reference.policy_loss`) and an unfused log-softmax; the metrics of the all-reduced counts must equal
the whole batch's.

Ranks start with torch.multiprocessing (spawn), talk over gloo through a TCP store on 127.0.0.1 at a free port,
and every wait is bounded: the collectives by the process group's timeout, the ranks by JOIN_TIMEOUT_S (then
they are terminated and the checks fail, naming what did not finish)."""
from __future__ import annotations

import json
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bandpo_lut

WORLD = 2
ROWS = (slice(0, 3), slice(3, 5))       # rank -> its rows: uneven on purpose
EMPTY_ROW = 3                           # fully masked, on rank 1
B, T, H, V = 5, 7, 8, 11
SETTINGS = dict(delta=0.05, max_ratio=3.0, dual_clip=2.0)
COLLECTIVE_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 90
# (wrapper, loss path, aggregation): the cases every rank runs, in this order
CASES = [(how, path, agg) for how in ("ddp", "fsdp2")
         for path, agg in (("policy_loss", "token-mean"), ("policy_loss", "seq-mean-token-mean"),
                           ("fused_linear", "token-mean"))]


def batch():
    """The whole batch, the same in every process: hidden states, the head, the sampled token ids, old
    log-probs near the head's own (so that some ratios leave the band on both sides), advantages, a 0/1 mask."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, T, H, generator=g)
    weight = 0.5 * torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 1.2 * torch.randn(B, T, generator=g)).clamp_max(0.0)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[EMPTY_ROW] = 0.0
    return hidden, weight, ids, old, adv, mask


class Head(torch.nn.Module):
    """The model: the LM head. Its forward computes the loss term, so that DDP's and FSDP2's hooks see it."""

    def __init__(self, weight):
        super().__init__()
        self.proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(weight)

    def forward(self, hidden, ids, old, adv, mask, path, agg):
        # The rank's sum of what the global loss averages: the token-sum for token-mean; for seq-mean-token-mean,
        # the rank's mean over its non-empty rows times their number (policy_loss gives 0 on a rank without any).
        rank_agg = "token-sum" if agg == "token-mean" else agg
        if path == "fused_linear":
            loss, metrics = bandpo_lut.fused_linear_policy_loss(hidden, self.proj.weight, ids, old, adv, mask,
                                                                agg=rank_agg, **SETTINGS)
        else:
            log_prob = torch.log_softmax(self.proj(hidden), -1).gather(-1, ids[..., None])[..., 0]
            loss, metrics = bandpo_lut.policy_loss(log_prob, old, adv, mask, agg=rank_agg, **SETTINGS)
        if agg == "seq-mean-token-mean":
            loss = loss * (mask.sum(-1) > 0).sum()
        return loss, metrics


def global_count(mask, agg):
    """What the global loss divides by, summed over the ranks: tokens (token-mean) or non-empty rows."""
    count = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum().to(mask.dtype)
    dist.all_reduce(count)
    return count


def wrap(model, how):
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return model


def full_grad(param):
    """(the whole gradient, whether it was sharded): FSDP2 leaves each rank a shard of it, as a DTensor."""
    grad = param.grad
    return (grad.full_tensor(), True) if hasattr(grad, "full_tensor") else (grad, False)


def rank_main(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        hidden, weight, ids, old, adv, mask = batch()
        rows = ROWS[rank]
        hidden, ids, old, adv, mask = hidden[rows], ids[rows], old[rows], adv[rows], mask[rows]
        results = {}
        for how, path, agg in CASES:
            try:
                results[f"{how}/{path}/{agg}"] = run_case(how, path, agg, weight, hidden, ids, old, adv, mask)
            except Exception as exc:  # the same on both ranks (an API refused): the other cases still run
                results[f"{how}/{path}/{agg}"] = f"rank {rank}: {type(exc).__name__}: {exc}"
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_case(how, path, agg, weight, hidden, ids, old, adv, mask):
    """One rank's side of one case: its loss share's backward through the wrapped head; what it all-reduced."""
    head = Head(weight)
    model = wrap(head, how)
    h = hidden.clone().requires_grad_(True)
    count = global_count(mask, agg)
    rank_sum, metrics = model(h, ids, old, adv, mask, path, agg)
    share = rank_sum / count             # this rank's share of the global loss: the shares sum to it
    (share * WORLD).backward()           # the wrappers average the gradients over WORLD ranks
    loss = share.detach().clone()
    dist.all_reduce(loss)
    counts = {k: metrics[k].detach().clone() for k in bandpo_lut.COUNTS}
    for v in counts.values():
        dist.all_reduce(v)
    weight_grad, sharded = full_grad(head.proj.weight)
    return dict(loss=loss, weight_grad=weight_grad.detach().clone(), sharded=sharded,
                hidden_grad=h.grad.detach().clone(), counts=counts)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out_dir) -> str:
    """Start the ranks, wait at most JOIN_TIMEOUT_S; '' when both finished, else what went wrong."""
    ctx = mp.start_processes(rank_main, args=(free_port(), out_dir), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return f"the ranks did not finish within {JOIN_TIMEOUT_S} s"
    except mp.ProcessRaisedException as exc:
        return f"a rank raised: {exc}"
    except mp.ProcessExitedException as exc:
        return f"a rank exited: {exc}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return ""


def expected():
    """One process, the whole batch, the pure-PyTorch reference loss on the unfused log-softmax."""
    from bandpo_lut.reference.policy_loss import policy_loss as reference_loss

    hidden, weight, ids, old, adv, mask = batch()
    out = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        w = weight.clone().requires_grad_(True)
        h = hidden.clone().requires_grad_(True)
        log_prob = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0]
        loss, metrics = reference_loss(log_prob, old, adv, mask, agg=agg, **SETTINGS)
        loss.backward()
        out[agg] = dict(loss=loss.detach(), weight_grad=w.grad, hidden_grad=h.grad, metrics=metrics)
    return out


def compare(ranks, want):
    """check name -> [ok, detail] for every case, from both ranks' results and the one-process reference."""
    checks = {}
    for how, path, agg in CASES:
        name = f"{how}/{path}/{agg}"
        ref = want[agg]
        try:
            for rank in range(WORLD):
                got = ranks[rank][name]
                if isinstance(got, str):
                    raise RuntimeError(got)
                if got["sharded"] != (how == "fsdp2"):
                    raise AssertionError(f"rank {rank}: the head's gradient is {'' if got['sharded'] else 'not '}"
                                         f"sharded under {how}")
                torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: the all-reduced loss: {m}")
                torch.testing.assert_close(got["weight_grad"], ref["weight_grad"], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: the head's gradient: {m}")
                # the input's gradient is WORLD x its share (only the parameters' gradients are averaged)
                torch.testing.assert_close(got["hidden_grad"] / WORLD, ref["hidden_grad"][ROWS[rank]],
                                           rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: its hidden states' gradient / {WORLD}: {m}")
                metrics = bandpo_lut.metrics_from_counts(got["counts"])
                for key in (*bandpo_lut.COUNTS, *bandpo_lut.FRACTIONS):
                    torch.testing.assert_close(metrics[key], ref["metrics"][key].to(metrics[key].dtype),
                                               rtol=1e-6, atol=1e-7,
                                               msg=lambda m, key=key: f"rank {rank}: metric {key}: {m}")
            m = ref["metrics"]
            checks[name] = [True, f"loss {float(ref['loss']):.6g}; of {int(m['n_tokens'])} tokens clipped: "
                                  f"{int(m['n_clipped_upper'])} upper, {int(m['n_clipped_lower'])} lower, "
                                  f"{int(m['n_dual_clipped'])} dual"]
        except Exception as exc:  # reported to the pytest side, which fails the named test
            checks[name] = [False, f"{type(exc).__name__}: {exc}"]
    return checks


def main():
    want = expected()
    with tempfile.TemporaryDirectory() as out_dir:
        failure = run_ranks(out_dir)
        if "EADDRINUSE" in failure:   # the free port was taken between free_port() and the store
            failure = run_ranks(out_dir)
        if failure:
            results = {f"{how}/{path}/{agg}": [False, failure] for how, path, agg in CASES}
        else:
            ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(WORLD)]
            results = compare(ranks, want)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
