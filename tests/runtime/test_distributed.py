"""Across data-parallel ranks: two processes (torch.distributed, gloo, 127.0.0.1) on one batch split unevenly, with
a fully masked row, equal one process on the whole batch, following docs/api.md's recipe for the global loss:
the head's gradient under DDP and under FSDP2 (`fully_shard`), each rank's input gradient, the all-reduced loss,
and `metrics_from_counts` of the all-reduced counts, for `policy_loss` (token-mean and seq-mean-token-mean) and
`fused_linear_policy_loss` (token-mean). The one-process side is the pure-PyTorch reference loss on an unfused
log-softmax. tests/support/distributed_checks.py runs the ranks (each wait bounded in time) and prints the checks."""
from __future__ import annotations

import json

import pytest
from helpers import REPO, fresh_env, run_fresh

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

CASES = [f"{how}/{path}/{agg}" for how in ("ddp", "fsdp2")
         for path, agg in (("policy_loss", "token-mean"), ("policy_loss", "seq-mean-token-mean"),
                           ("fused_linear", "token-mean"))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # the script bounds its ranks (distributed_checks.JOIN_TIMEOUT_S); this bounds the whole run
    proc = run_fresh([REPO / "tests" / "support" / "distributed_checks.py"], cwd=tmp_path_factory.mktemp("dist"),
                     env=fresh_env(), timeout=240, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process(results, case):
    ok, detail = results[case]
    assert ok, f"{case}: {detail}"
