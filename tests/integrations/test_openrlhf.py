"""The OpenRLHF plug-in (bandpo_lut.integrations.openrlhf and its launcher, .openrlhf_launcher) against the real
openrlhf (pinned in requirements-openrlhf.txt, with the real deepspeed its loss module's utils import).

openrlhf 0.11.2 pins flash-attn (a CUDA build), ray 2.55 and transformers 5.15, so it is installed apart,
without dependencies, into a folder of its own (``.openrlhf-site`` at the repository root, or
``$BANDPO_OPENRLHF_SITE``)::

    pip install --no-deps --no-build-isolation --target .openrlhf-site -r requirements-openrlhf.txt

and the checks (tests/support/openrlhf_checks.py) run once, in a fresh interpreter with that folder on PYTHONPATH
(after the tested package and the venv, so that openrlhf's own top-level ``tests`` package shadows
nothing). A missing folder is an error, not a skip; BANDPO_SKIP_INTEGRATIONS=1 skips this module.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("BANDPO_SKIP_INTEGRATIONS") == "1":
    pytest.skip("BANDPO_SKIP_INTEGRATIONS=1", allow_module_level=True)

from helpers import apart_env, run_check_script, run_fresh  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.subprocess, pytest.mark.slow]


def site_env():
    return apart_env("BANDPO_OPENRLHF_SITE", ".openrlhf-site", "openrlhf", first=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_check_script("openrlhf_checks.py", site_env(), tmp_path_factory.mktemp("openrlhf"))


CHECKS = {
    "real_packages": "openrlhf.models.loss, .utils and deepspeed are the real installed modules",
    "token_mean_equals_policy_loss": "loss and gradient equal bandpo_lut.policy_loss (paper's settings)",
    "aggregations_equal_openrlhfs_aggregate_loss": "token-mean and seq-mean-token-mean, local and global "
                                                   "(dp_size, batch_num_tokens, global_batch_size): an "
                                                   "independent band loss through OpenRLHF's aggregate_loss",
    "fixed_is_openrlhfs_loss_bit_for_bit": "band.clip=fixed is OpenRLHF's PolicyLoss with --band.dual_clip as its "
                                           "dual clip, bit for bit",
    "band_metrics_in_openrlhfs_logging": "ppo_clip_ratio/ppo_kl as OpenRLHF's; band_* 0-dim metrics reach "
                                         "experience.info",
    "rounding_positive_old_log_prob": "an old log-prob of +6e-8 is p = 1 (finite loss and gradient)",
    "bad_options_refused_naming_the_argument": "impossible options and unsupported OpenRLHF modes refused, in "
                                                "one message naming the argument once (the launcher: before Ray)",
    "paper_defaults_and_launcher_args": "the paper's settings by default; --band.* removed from OpenRLHF's "
                                        "arguments; None turns the cap off; an --actor.dual_clip other than "
                                        "--band.dual_clip, and --actor.eps_clip* with the band, refused",
    "activate_rebinds_policyloss_and_ray_hook": "activate() makes PolicyLoss(...) build the band loss; the "
                                                "launcher's ray.init adds the worker hook and the band's options",
    "version_policy": "tested version silent; untested same-structure warns; changed convention refused",
}


@pytest.mark.parametrize("name", list(CHECKS), ids=list(CHECKS))
def test_openrlhf(results, name):
    ok, detail = results[name]
    assert ok, f"{CHECKS[name]}: {detail}"


def launcher(*args, cwd):
    """The launcher as a user runs it, with the documented arguments."""
    return run_fresh(["-m", "bandpo_lut.integrations.openrlhf_launcher", "--actor.model_name_or_path",
                      "Qwen/Qwen3-0.6B", *args], cwd=cwd, env=site_env())


PROG = "python -m bandpo_lut.integrations.openrlhf_launcher"


def assert_usage_error(proc, *needles):
    """argparse's way: exit 2, the usage, one error line naming the argument, no traceback, nothing of
    OpenRLHF's trainer (or Ray) imported."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "train_ppo_ray.py" not in err and "ray/" not in err, err[-2000:]
    assert f"usage: {PROG}" in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith(f"{PROG}: error: ")]
    assert len(errors) == 1, err[-2000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_launcher_refuses_a_bad_band_before_ray(tmp_path):
    """The documented command line with an impossible band: an argparse error naming the argument (exit 2,
    not a traceback), before anything of OpenRLHF (its trainer, Ray, deepspeed) is imported."""
    proc = run_fresh(["-X", "importtime", "-m", "bandpo_lut.integrations.openrlhf_launcher",
                      "--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--band.delta", "7"], cwd=tmp_path,
                     env=site_env())
    assert_usage_error(proc, "--band.delta", "7.0")
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert imported and not imported & {"openrlhf", "ray", "deepspeed"}, sorted(imported)


def test_launcher_refuses_an_abbreviated_band_option(tmp_path):
    """`--band.max` is not taken for --band.max_ratio (nor passed on to OpenRLHF, which would fail only after
    importing Ray and its trainer): refused, naming it and the full option."""
    assert_usage_error(launcher("--band.max", "3", cwd=tmp_path), "--band.max ", "did you mean --band.max_ratio")


def test_launcher_help_lists_the_band_options_and_where_openrlhfs_are(tmp_path):
    """--help lists every --band.* option with its default, then OpenRLHF's own help as OpenRLHF prints it;
    on a machine without OpenRLHF's GPU stack (vllm is not installed here) OpenRLHF's module cannot run, and
    the help says so, naming the command that prints it, still exit 0 (no traceback)."""
    proc = run_fresh(["-m", "bandpo_lut.integrations.openrlhf_launcher", "--help"], cwd=tmp_path, env=site_env())
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    out = proc.stdout
    assert f"usage: {PROG}" in out, out[:500]
    for option, default in (("--band.divergence", "kl"), ("--band.delta", "0.05"), ("--band.max_ratio", "10.0"),
                            ("--band.dual_clip", "10.0"), ("--band.clip", "band")):
        block = out[out.index(f"  {option} "):]
        block = block[:min(i for i in (block.find("\n  -"), block.find("\n\n")) if i > 0)]
        assert f"(default: {default})" in block, (option, block)
    orl = out[out.index("OpenRLHF's own arguments"):]
    assert "python -m openrlhf.cli.train_ppo_ray --help" in orl and "could not run here" in orl, orl
    assert "vllm" in orl, orl   # the reason: OpenRLHF's own import error, its last line
