"""One dag-paths experiment: every seed's warm-up and every (setting, reward, arm) run from it, seeds spread over
worker processes. Each seed's results depend on the seed alone (its own generators, one torch thread per
process), so the number of workers does not change them."""
from __future__ import annotations

import multiprocessing
import sys
import time
from dataclasses import dataclass

import torch

from bandpo_lut.cli.demo.dag.graph import make_graph
from bandpo_lut.cli.demo.dag.metrics import exact_metrics
from bandpo_lut.cli.demo.dag.model import all_answer_log_probs
from bandpo_lut.cli.demo.dag.train import DagConfig, new_model, run_arm, warm_up

REWARDS = ("path", "random")    # reward 1 iff a path; a fair coin per answer (the control)


@dataclass(frozen=True)
class Plan:
    cfg: DagConfig
    arms: tuple
    settings: tuple             # Setting objects
    rewards: tuple              # of REWARDS


def run_seed(plan: Plan, seed: int) -> dict:
    """{"warmup": metrics of the checkpoint, (setting, reward, arm): run_arm's output} for one seed."""
    graph = make_graph(seed, plan.cfg.graph)
    start = time.perf_counter()
    checkpoint = warm_up(seed, graph, plan.cfg)
    model = new_model(plan.cfg, seed)
    model.load_state_dict(checkpoint)
    with torch.no_grad():
        warm = exact_metrics(all_answer_log_probs(model, graph.prompts, graph.answers), graph.valid, graph.canonical)
    out = {"warmup": warm, "prompts": graph.prompts.shape[0], "valid": graph.valid.sum(1)}
    _say(f"seed {seed}: warm-up done in {time.perf_counter() - start:.1f} s ({graph.prompts.shape[0]} prompts, "
         f"pass@1 {float(warm['pass1']):.3f})")
    for setting in plan.settings:
        for reward in plan.rewards:
            for arm in plan.arms:
                start = time.perf_counter()
                out[(setting.name, reward, arm)] = run_arm(arm, setting, seed, checkpoint, graph, plan.cfg,
                                                           random_reward=reward == "random")
                _say(f"seed {seed}: {setting.name} / {reward} reward / {arm} done in "
                     f"{time.perf_counter() - start:.1f} s")
    return out


def _say(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _run_seed_star(job):
    return run_seed(*job)


def run(plan: Plan, seeds: list[int], jobs: int) -> dict:
    """seed -> run_seed's output, with `jobs` worker processes (1: in this process)."""
    if jobs <= 1 or len(seeds) == 1:
        return {seed: run_seed(plan, seed) for seed in seeds}
    ctx = multiprocessing.get_context("spawn")     # a fresh interpreter: no torch state forked mid-use
    with ctx.Pool(min(jobs, len(seeds)), initializer=torch.set_num_threads, initargs=(1,)) as pool:
        results = pool.map(_run_seed_star, [(plan, seed) for seed in seeds], chunksize=1)
    return dict(zip(seeds, results))
