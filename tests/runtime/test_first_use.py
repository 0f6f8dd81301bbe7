"""The first use of the package in a fresh process may be torch.compile (default, fullgraph, dynamic, with
backward), torch.export, a FakeTensorMode, a δ schedule under fullgraph, or a compiled frame reading two tables
(two divergences, or a baseline clip next to the band); each must work, and eager use
afterwards in the same process must be unaffected. One subprocess per scenario
(tests/support/first_use_scenarios.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import fresh_env, run_fresh

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "first_use_scenarios.py"
SCENARIOS = ["compile_default", "compile_fullgraph", "compile_dynamic_loss", "compile_dynamic_clip", "export",
             "fake_mode", "delta_schedule", "readme_loss_dynamic", "two_divergences_one_frame",
             "fixed_clip_next_to_band"]


def test_every_scenario_is_listed():
    text = SCRIPT.read_text()
    assert sorted(SCENARIOS) == sorted(line.split("def scenario_")[1].split("(")[0]
                                       for line in text.splitlines() if line.startswith("def scenario_"))


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    # Inductor's compiled kernels may be shared between the processes (it saves minutes on 2 cores); what is
    # tested, the package's state at its first use, starts fresh in every process regardless.
    return tmp_path_factory.mktemp("inductor")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_first_use_in_a_fresh_process(scenario, tmp_path, inductor_cache):
    # run from a neutral folder, so that the installed package (with its compiled extension) is imported
    env = fresh_env(TORCHINDUCTOR_CACHE_DIR=inductor_cache, PYTHONHASHSEED=0)
    proc = run_fresh([SCRIPT, scenario], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0 and f"ok {scenario}" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
