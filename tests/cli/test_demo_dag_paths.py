"""`bandpo-lut demo --task dag-paths` (bandpo_lut.cli.demo.dag): the task generator against a brute-force walk, the
exact metrics against their definitions and against sampling, one GRPO update against the reference policy loss,
and a seed's numbers reproduced bit for bit."""
from __future__ import annotations

import itertools
import math
import re

import mpmath
import pytest
import torch
from helpers import run_fresh

from bandpo_lut.cli import main
from bandpo_lut.cli.demo.dag import experiment
from bandpo_lut.cli.demo.dag.graph import GraphConfig, make_graph
from bandpo_lut.cli.demo.dag.metrics import exact_metrics, sequence_kl
from bandpo_lut.cli.demo.dag.model import all_answer_log_probs
from bandpo_lut.cli.demo.dag.train import ARMS, DagConfig, Setting, grpo_step_loss, new_model, sample_answers
from bandpo_lut.cli.demo.tasks import group_advantages
from bandpo_lut.reference.policy_loss import policy_loss as reference_policy_loss


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the demo runs (its tensors are small: more threads only contend on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def same_bits(a, b) -> bool:
    """Equal bit for bit, NaN where the other has NaN."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def dfs_paths(adj: torch.Tensor, start: int, target: int) -> set:
    """Every path start -> target, as the tuple of its inner nodes, by depth-first search along the edges."""
    last = adj.shape[0]
    found, stack = set(), [(0, start, ())]
    while stack:
        layer, node, inner = stack.pop()
        if layer == last:
            if node == target:
                found.add(inner[:-1])
            continue
        for nxt in torch.nonzero(adj[layer, node]).flatten().tolist():
            stack.append((layer + 1, nxt, inner + (nxt,)))
    return found


@pytest.mark.parametrize("layers,width,edge_prob", [(3, 3, 0.5), (4, 4, 0.4), (5, 3, 0.6), (5, 6, 0.4)])
def test_generator_enumerates_exactly_the_paths(layers, width, edge_prob):
    """Every answer marked valid is a path, every path is marked, and the prompts are exactly the (start, target)
    pairs with at least two paths; the canonical answer is one of them; every node has an edge out and in."""
    for seed in range(4):
        try:
            g = make_graph(seed, GraphConfig(layers, width, edge_prob))
        except ValueError:
            continue                      # no pair with two paths: refused, as documented
        assert g.adj[:, :, :].any(2).all() and g.adj.any(1).all()
        prompts = {tuple(p) for p in g.prompts.tolist()}
        for s, t in itertools.product(range(width), repeat=2):
            paths = dfs_paths(g.adj, s, t)
            assert ((s, t) in prompts) == (len(paths) >= 2)
        for i, (s, t) in enumerate(g.prompts.tolist()):
            marked = {tuple(a) for a in g.answers[g.valid[i]].tolist()}
            assert marked == dfs_paths(g.adj, s, t), (seed, s, t)
            assert bool(g.valid[i, g.canonical[i]])


def _known_log_probs():
    """Two prompts over 6 answers with chosen probabilities (one answer of prompt 0 at probability 0)."""
    p = torch.tensor([[0.5, 0.2, 0.0, 0.1, 0.15, 0.05], [0.05, 0.05, 0.3, 0.3, 0.2, 0.1]], dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    return p.log(), p, valid, torch.tensor([0, 3])


def test_entropy_coverage_and_shares_against_their_definitions():
    """On known probabilities: the normalised entropy in mpmath; the coverage with N = 3 samples by summing the
    number of distinct valid answers over all 6^3 sample sequences; the >= 5% count and non-canonical mass by hand."""
    logp, p, valid, canonical = _known_log_probs()
    got = exact_metrics(logp, valid, canonical, samples=3)
    ent, cov, p5, nonc = [], [], [], []
    for i in range(2):
        v = [j for j in range(6) if valid[i, j]]
        mass = mpmath.fsum(mpmath.mpf(float(p[i, j])) for j in v)
        q = [mpmath.mpf(float(p[i, j])) / mass for j in v]
        ent.append(-mpmath.fsum(x * mpmath.log(x) for x in q if x > 0) / mpmath.log(len(v)))
        expected = mpmath.fsum(
            mpmath.fprod(mpmath.mpf(float(p[i, j])) for j in seq) * len(set(seq) & set(v))
            for seq in itertools.product(range(6), repeat=3))
        cov.append(expected / len(v))
        p5.append(sum(1 for x in q if x >= 0.05))
        nonc.append(mass - mpmath.mpf(float(p[i, canonical[i]])))
    assert abs(float(got["entropy"]) - float(mpmath.fsum(ent) / 2)) < 1e-12
    assert abs(float(got["coverage"]) - float(mpmath.fsum(cov) / 2)) < 1e-12
    assert float(got["paths5"]) == sum(p5) / 2
    assert abs(float(got["noncanonical"]) - float(mpmath.fsum(nonc) / 2)) < 1e-12
    assert abs(float(got["pass1"]) - (0.85 + 0.75) / 2) < 1e-12
    # KL of a distribution with itself is 0; against a different one, the sum by hand
    assert float(sequence_kl(logp[1:], logp[1:])) == 0.0
    other = torch.full((1, 6), 1 / 6, dtype=torch.float64).log()
    assert abs(float(sequence_kl(logp[1:], other)) - sum(x * math.log(6 * x) for x in p[1].tolist())) < 1e-12


def test_exact_metrics_against_sampling():
    """A model with random weights: its enumerated answer probabilities equal each answer's own token log-probs,
    and pass@1, non-canonical mass and coverage agree with sampling the model node by node (within 4 SE)."""
    cfg = DagConfig()
    g = make_graph(3, cfg.graph)
    model = new_model(cfg, 3)
    with torch.no_grad():
        logp = all_answer_log_probs(model, g.prompts, g.answers)
        one_by_one = model.token_log_probs(g.prompts.repeat_interleave(g.answers.shape[0], 0),
                                           g.answers.repeat(g.prompts.shape[0], 1)).sum(1).view_as(logp)
    torch.testing.assert_close(logp, one_by_one, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp.exp().sum(1), torch.ones(logp.shape[0]), rtol=0, atol=1e-5)
    exact = exact_metrics(logp, g.valid, g.canonical)
    R = 16
    P, n = g.prompts.shape[0], 64 * R            # R rounds of 64 samples per prompt
    sampler = torch.Generator().manual_seed(0)
    answers, _ = sample_answers(model, g.prompts.repeat_interleave(n, 0), g.answers.shape[1], sampler)
    idx = (answers * cfg.graph.width ** torch.arange(answers.shape[1] - 1, -1, -1)).sum(1).view(P, n)
    ok = torch.gather(g.valid, 1, idx).double()
    canon = (idx == g.canonical[:, None]).double()
    for name, per_prompt in (("pass1", ok.mean(1)), ("noncanonical", (ok - canon).mean(1))):
        se = float((ok if name == "pass1" else ok - canon).mean(0).std() / n ** 0.5) + 1e-9
        assert abs(float(per_prompt.mean()) - float(exact[name])) < 4 * se, name
    seen = torch.zeros(P, R, g.answers.shape[0], dtype=torch.bool).scatter_(2, idx.view(P, R, 64), True)
    covered = (seen & g.valid[:, None]).sum(2) / g.valid.sum(1, keepdim=True)      # (P, R): distinct valid / |V|
    per_round = covered.mean(0).double()
    assert abs(float(per_round.mean()) - float(exact["coverage"])) < 4 * float(per_round.std() / R ** 0.5)


@pytest.mark.parametrize("arm", list(ARMS))
def test_one_grpo_update_is_the_reference_policy_loss(arm):
    """The loss and parameter gradient of one GRPO update (sampled answers, group advantages, a moved policy so
    ratios leave 1) equal bandpo_lut.reference's policy loss on the same log-probabilities."""
    cfg = DagConfig()
    g = make_graph(1, cfg.graph)
    model = new_model(cfg, 1)
    sampler = torch.Generator().manual_seed(5)
    prompts = g.prompts.repeat_interleave(cfg.group, 0)
    answers, old_lp = sample_answers(model, prompts, g.answers.shape[1], sampler)
    reward = torch.randint(0, 2, (prompts.shape[0],), generator=sampler).float()
    adv = group_advantages(reward.view(-1, cfg.group)).reshape(-1, 1).expand_as(old_lp)
    with torch.no_grad():                          # move the policy: ratios spread around 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=sampler))
    loss, metrics, _ = grpo_step_loss(model, prompts, answers, old_lp, adv, ARMS[arm])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref, ref_metrics = reference_policy_loss(model.token_log_probs(prompts, answers), old_lp, adv, **ARMS[arm])
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-5, atol=1e-7)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-4, atol=1e-6)
    assert float(metrics["n_clipped"]) == float(ref_metrics["n_clipped"])
    if arm in ("ppo-clip", "clip-higher"):
        assert float(metrics["n_clipped"]) > 0        # the check covers a clip that acted


TINY_PLAN = experiment.Plan(cfg=DagConfig(steps=3, eval_every=2, warmup_steps=5), arms=("one-update", "ppo-clip"),
                            settings=(Setting("s", 2, 2, 1e-3),), rewards=("path", "random"))


def _flat(result: dict):
    for key, value in sorted(result.items(), key=lambda kv: str(kv[0])):
        if isinstance(value, dict):
            for k in sorted(value):
                yield (key, k), value[k]
        else:
            yield key, value


def test_a_seed_reproduces_bit_for_bit():
    """Two runs of one seed: every number equal, bit for bit; another seed differs."""
    torch.manual_seed(123)                  # the global stream must not matter
    a = experiment.run_seed(TINY_PLAN, 7)
    torch.rand(10)
    b = experiment.run_seed(TINY_PLAN, 7)
    for (ka, va), (kb, vb) in zip(_flat(a), _flat(b)):
        assert ka == kb and same_bits(va, vb), ka
    c = experiment.run_seed(TINY_PLAN, 8)
    assert not same_bits(a[("s", "path", "ppo-clip")]["entropy"], c[("s", "path", "ppo-clip")]["entropy"])


@pytest.mark.slow
@pytest.mark.subprocess
def test_workers_give_the_single_process_numbers():
    """Seeds spread over two spawned worker processes give the in-process numbers bit for bit."""
    one = experiment.run(TINY_PLAN, [0, 1], jobs=1)
    two = experiment.run(TINY_PLAN, [0, 1], jobs=2)
    for seed in (0, 1):
        for (ka, va), (kb, vb) in zip(_flat(one[seed]), _flat(two[seed])):
            assert ka == kb and same_bits(va, vb), (seed, ka)


def test_dag_paths_needs_the_reference_arm(capsys):
    assert main(["demo", "--task", "dag-paths", "--methods", "ppo-clip,bandpo", "--out", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bandpo-lut demo: error: --methods") and "one-update" in err[0]


@pytest.mark.parametrize("argv,name", [(["--lr", "0.1"], "--lr"), (["--good-ranks", "5,50"], "--good-ranks"),
                                       (["--contexts", "32"], None)])
def test_dag_paths_refuses_the_tabular_options(argv, name, capsys, tmp_path):
    """A tabular task's option given with --task dag-paths would be ignored: refused before any work, naming it
    (an option left at its default is not "given"; that run is then stopped by a bad --methods)."""
    code = main(["demo", "--task", "dag-paths", *argv, "--methods", "bandpo", "--out", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"bandpo-lut demo: error: {name or '--methods'}"), err


def test_the_refused_options_are_the_parsers_defaults():
    """TABULAR_ONLY's defaults are the parser's: an option left alone is never refused."""
    import argparse

    from bandpo_lut.cli.demo.command import add_arguments
    from bandpo_lut.cli.demo.dag.task import TABULAR_ONLY

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    assert {k: defaults[k] for k in TABULAR_ONLY} == TABULAR_ONLY


ENDPOINT = re.compile(r"^    ([\w-]+)\s+([+-][\d.]+) ± ([\d.]+)", re.M)


@pytest.mark.slow
@pytest.mark.subprocess
def test_dag_paths_runs_from_the_command_line(tmp_path):
    """As a user starts it (a fresh process, --quick shortened): the endpoints of every arm against the reference,
    progress per arm on stderr, a figure."""
    out = tmp_path / "dag.png"
    proc = run_fresh(["-m", "bandpo_lut.cli", "demo", "--task", "dag-paths", "--quick", "--steps", "2", "--out", out],
                     cwd=tmp_path, check=True)
    arms = [m for m, _, _ in ENDPOINT.findall(proc.stdout)]
    assert arms == [a for a in ARMS if a != "one-update"] * 2, proc.stdout[-3000:]
    assert len(re.findall(r"standard / path reward / [\w-]+ done in", proc.stderr)) == len(ARMS)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
