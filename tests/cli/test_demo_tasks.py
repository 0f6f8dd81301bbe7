"""`bandpo-lut demo --task random-reward | rare-correct` (bandpo_lut.cli.demo.tasks) and the demo's argument
checks that must stop a run before it starts."""
from __future__ import annotations

import re

import pytest
import torch
from helpers import run_fresh

from bandpo_lut import policy_loss
from bandpo_lut.cli import main
from bandpo_lut.cli.demo.tasks import (
    METHODS,
    NO_CLIP,
    P_BUCKETS,
    TaskConfig,
    group_advantages,
    make_task,
    rollout,
    run_method,
    token_log_probs,
)

# smaller than --quick: a CLI run in a fresh process costs its imports and well under a second of training
TINY = ["--steps", "3", "--seeds", "2", "--contexts", "4", "--vocab", "200", "--good", "2", "--good-ranks", "5,50",
        "--group", "4", "--tokens", "4", "--minibatches", "2"]
SUMMARY = re.compile(r"^summary ([\w-]+): entropy ([\d.]+) -> ([\d.]+)", re.M)


def tiny_config(task: str, **changes) -> TaskConfig:
    cfg = dict(task=task, steps=3, contexts=4, vocab=200, good=2, good_ranks=(5, 50), tokens=4, group=4, epochs=2,
               minibatches=2, lr=0.05, init_scale=4.0, max_ratio=10.0)
    return TaskConfig(**{**cfg, **changes})


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("task", ["random-reward", "rare-correct"])
def test_task_runs_from_the_command_line(task, tmp_path):
    """Each task as a user starts it (a fresh process): every method's summary line, a figure."""
    out = tmp_path / f"{task}.png"
    proc = run_fresh(["-m", "bandpo_lut.cli", "demo", "--task", task, *TINY, "--out", out], cwd=tmp_path, check=True)
    found = {m: (float(a), float(b)) for m, a, b in SUMMARY.findall(proc.stdout)}
    assert set(found) == set(METHODS), proc.stdout[-2000:]
    assert len({a for a, _ in found.values()}) == 1          # the same seeds: the same initial entropy
    assert ("rare correct mass" in proc.stdout) == (task == "rare-correct")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


PROGRESS = re.compile(r"^  \[(\d+)/(\d+)\] ([\w-]+ seed \d+) done in [\d.]+ s", re.M)


@pytest.mark.parametrize("task", ["rewarded", "random-reward"])
def test_progress_per_method_and_seed_goes_to_stderr(task, capsys):
    """One progress line per finished (method, seed) on stderr, in order; stdout (the table) has none."""
    assert main(["demo", "--task", task, *TINY, "--methods", "ppo-clip,bandpo", "--out", "none"]) == 0
    captured = capsys.readouterr()
    found = PROGRESS.findall(captured.err)
    assert found == [(str(i + 1), "4", what) for i, what in
                     enumerate(["ppo-clip seed 0", "ppo-clip seed 1", "bandpo seed 0", "bandpo seed 1"])], captured.err
    assert not PROGRESS.search(captured.out)


@pytest.mark.slow
@pytest.mark.subprocess
def test_progress_arrives_while_the_run_goes_on(tmp_path):
    """As a user runs it (stderr a pipe): the first progress line is readable while the other runs still train."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "bandpo_lut.cli", "demo", "--task", "random-reward", *TINY,
                             "--steps", "150",
                             "--methods", "ppo-clip,bandpo,dcpo", "--out", "none"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if PROGRESS.match(line):
                assert proc.poll() is None, "the first progress line came only at the end"
                break
        else:
            raise AssertionError("no progress line")
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def test_no_clip_is_the_unclipped_surrogate():
    """The demo's no-clip reference, a policy_loss setting, against -mean(A * r) in plain torch: the same
    value and gradient at ratios far from 1 (up to e^5), and no token counted as clipped."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 8, generator=g, dtype=torch.float64) * 8
    lp = (old + (torch.rand(64, 8, generator=g, dtype=torch.float64) - 0.5) * 10).clamp(max=0).requires_grad_()
    adv = torch.randn(64, 8, generator=g, dtype=torch.float64)
    loss, metrics = policy_loss(lp, old, adv, **NO_CLIP)
    (grad,) = torch.autograd.grad(loss, lp)
    ref_lp = lp.detach().clone().requires_grad_()
    ref = -(adv * torch.exp(ref_lp - old)).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_lp.grad, rtol=1e-12, atol=1e-15)
    assert float(metrics["n_clipped"]) == 0 and float(metrics["n_tokens"]) == 64 * 8


def _first_update_gradients(task: str, seeds: range):
    """Per seed: the gradient of the no-clip loss w.r.t. the logits at the first update of a fresh batch (ratio 1),
    projected on two directions: the centred initial log-probabilities (the sign of -Cov(log pi, A) of arXiv
    2505.22617: > 0 moves mass to likely tokens) and each context's most likely token."""
    cfg = tiny_config(task, contexts=8, vocab=50, tokens=8, good_ranks=(5, 50))
    along_logp, top = [], []
    for seed in seeds:
        logits0, common, rare = make_task(seed, cfg)
        correct = None if common is None else common | rare
        theta = logits0.clone().requires_grad_()
        sampler, rewarder = torch.Generator().manual_seed(10_000 + seed), torch.Generator().manual_seed(20_000 + seed)
        tokens, old_lp, adv, _ = rollout(theta, correct, sampler, rewarder, cfg)
        lp = token_log_probs(theta, torch.arange(cfg.contexts).repeat_interleave(cfg.group), tokens)
        loss, _ = policy_loss(lp, old_lp, adv, **NO_CLIP)
        (grad,) = torch.autograd.grad(loss, theta)
        ascent = -grad.double()
        logp0 = torch.log_softmax(logits0.double(), dim=1)
        along_logp.append(float((ascent * (logp0 - logp0.mean(1, keepdim=True))).sum()))
        top.append(float(torch.gather(ascent, 1, logits0.argmax(1, keepdim=True)).sum()))
    return torch.tensor(along_logp), torch.tensor(top)


def _z(x: torch.Tensor) -> float:
    return float(x.mean() / (x.std() / len(x) ** 0.5))


@pytest.mark.slow
def test_random_reward_reference_has_zero_expected_gradient():
    """With coin-flip rewards, the unclipped policy gradient is zero in expectation: over 300 seeds its mean
    along log p_old and on the top tokens lies within 4 standard errors of 0. The same measure on
    rare-correct (50 seeds), whose reward depends on the tokens, is far from 0 (the check can fail)."""
    for stat in _first_update_gradients("random-reward", range(300)):
        assert abs(_z(stat)) < 4, _z(stat)
    along_logp, top = _first_update_gradients("rare-correct", range(50))   # z ~ 25 and 40 at 50 seeds
    assert _z(along_logp) > 6 and _z(top) > 6, (_z(along_logp), _z(top))


@pytest.mark.parametrize("method", ["ppo-clip", "dppo"])
def test_clip_counts_by_bucket_add_up_to_the_loss_counts(method):
    """The demo's own split of clipped tokens by p_old bucket (plain torch, from the method's bounds) sums to the
    loss's counts: policy_loss's, and for DPPO its masked tokens (verl's test; the bounds solved by bisection)."""
    cfg = tiny_config("random-reward", steps=6, contexts=8, vocab=100, tokens=8, epochs=4, lr=0.2)
    h = run_method(method, [0, 1], cfg)
    assert h["n_high"].shape == (2, 6, len(P_BUCKETS))
    assert float(h["n_high"].sum()) > 0 and float(h["n_low"].sum()) > 0   # the clip acted
    torch.testing.assert_close(h["n_high"].sum(-1).float(), h["n_clipped_upper"], rtol=0, atol=0)
    torch.testing.assert_close(h["n_low"].sum(-1).float(), h["n_clipped_lower"], rtol=0, atol=0)


def test_group_advantages_are_normalised_within_each_group():
    """(r - group mean) / (group's sample std + 1e-6), and 0 for a group whose rewards are all equal."""
    adv = group_advantages(torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64))
    std = (4 * 0.25 / 3) ** 0.5     # the sample standard deviation of 0, 1, 1, 0
    torch.testing.assert_close(adv[0], torch.tensor([-0.5, 0.5, 0.5, -0.5], dtype=torch.float64) / (std + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))


# ---- arguments that must stop the demo before any training ----

def _one_line_error(err: str, name: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert lines[-1].startswith("bandpo-lut demo: error:") and name in lines[-1], err


@pytest.mark.parametrize("argv,name", [
    (["--group", "1"], "--group"),            # std of one response is NaN: NaN advantages
    (["--tokens", "1e8"], "--tokens"),
])
def test_bad_sizes_are_argparse_errors(argv, name, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    _one_line_error(capsys.readouterr().err, name)


@pytest.mark.parametrize("task", ["rewarded", "random-reward"])
@pytest.mark.parametrize("argv,name", [
    (["--tokens", "100000000"], "--tokens"),
    (["--vocab", "100000000"], "--vocab"),
])
def test_sizes_past_the_limits_are_refused_before_the_run(task, argv, name, capsys, tmp_path):
    assert main(["demo", "--task", task, *argv, "--out", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""                # refused before the run started
    assert len(captured.err.splitlines()) == 1
    _one_line_error(captured.err, name)


@pytest.mark.parametrize("task", ["rewarded", "rare-correct"])
def test_an_unwritable_out_fails_before_the_run(task, capsys, tmp_path):
    """A figure path under a file (no folder can be made there, even as root): exit 2 at once, nothing run."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["demo", "--task", task, "--steps", "100000", "--out", str(blocker / "fig.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1
    _one_line_error(captured.err, "--out")


def test_no_clip_belongs_to_the_new_tasks_only(capsys):
    assert main(["demo", "--methods", "no-clip", *TINY]) == 2
    _one_line_error(capsys.readouterr().err, "--methods")


def test_sgd_needs_a_new_task_and_a_rate(capsys):
    assert main(["demo", "--optimizer", "sgd", "--lr", "50", *TINY]) == 2            # the default task: Adam only
    _one_line_error(capsys.readouterr().err, "--optimizer")
    assert main(["demo", "--task", "random-reward", "--optimizer", "sgd", *TINY]) == 2   # no --lr
    _one_line_error(capsys.readouterr().err, "--lr")
