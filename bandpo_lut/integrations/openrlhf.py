"""BandPO for OpenRLHF: the actor's ``PolicyLoss`` with the band in place of its fixed clip.

What an OpenRLHF user changes: the launcher module, plus any ``--band.*`` setting (defaults: the
paper's settings)::

    python -m bandpo_lut.integrations.openrlhf <the usual openrlhf.cli.train_ppo_ray arguments> \\
        --band.divergence kl --band.delta 0.05 --band.max_ratio 10 --band.dual_clip 10

How it fits OpenRLHF (tested: `TESTED_OPENRLHF`):

- **No registry**: OpenRLHF's PPO actor (``openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer``) builds
  ``PolicyLoss(...)`` directly, inside a Ray actor. The launcher removes the ``--band.*`` arguments,
  checks them and the OpenRLHF arguments the band depends on (a bad one is refused before Ray starts,
  naming it), puts the settings into the environment variable ``BANDPO_OPENRLHF`` and adds
  `activate_from_env` as Ray's ``worker_process_setup_hook`` to OpenRLHF's own ``ray.init``, then
  runs ``openrlhf.cli.train_ppo_ray`` as ``__main__``. Each worker process thus calls `activate`,
  which rebinds ``PolicyLoss`` in ``openrlhf.models.loss``, ``openrlhf.models`` and the PPO actor
  module to `BandPolicyLoss`, and makes the actor's training step log the band metrics.
- **Loss**: `BandPolicyLoss` subclasses OpenRLHF's ``PolicyLoss`` and keeps its call convention
  (``forward(...) -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``) and its aggregation:
  ``--actor.loss_agg_mode token-mean`` (masked sum / the window's global token count x dp_size) or
  ``seq-mean-token-mean`` (sum of per-sequence token means / the global sample count x dp_size).
- **Supported**: ``--actor.policy_loss_type ppo``. Refused: ``gspo`` (one sequence-level ratio,
  which a per-token band does not bound) and ``--algo.advantage.is_correction_level`` other than
  ``off`` (the vLLM-mismatch correction is not carried over yet); never silently trained otherwise.
- **band.clip=fixed** runs OpenRLHF's own ``PolicyLoss.forward`` (``--actor.eps_clip_low_high``,
  ``--actor.dual_clip``): the stock loss, bit for bit, plus the band metrics of that clip. With the
  band, ``--actor.dual_clip`` has no effect (``--band.dual_clip`` takes its place; a warning says so).
- **Metrics**: ``ppo_clip_ratio`` is the band's clip fraction, ``ppo_kl`` is OpenRLHF's; every
  fraction of `bandpo_lut.policy_loss` is added to ``experience.info`` as ``band_<name>`` (0-dim, so
  OpenRLHF weights it by tokens across micro-batches and ranks and logs it as ``train/band_<name>``).
- **Old log-probabilities** pass to bandpo_lut unchanged (one in (0, 2^-9] is p = 1 there).
- **Install**: OpenRLHF as it documents (GPU, flash-attn); the tests use requirements-openrlhf.txt
  (openrlhf without its GPU dependencies, plus deepspeed).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
import types
import warnings
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

import bandpo_lut
from bandpo_lut.runtime import loss_spec

from ._common import PAPER, check_band, check_framework, is_number

__all__ = ["TESTED_OPENRLHF", "BandSettings", "BandPolicyLoss", "activate", "activate_from_env",
           "check_openrlhf_args", "main"]

TESTED_OPENRLHF = ("0.11.2",)
ENV = "BANDPO_OPENRLHF"
_MODULE = "bandpo_lut.integrations.openrlhf"  # not __name__: that is "__main__" under `python -m`
_CLIPS = ("band", "fixed")
_FORWARD_PARAMS = ("self", "log_probs", "old_log_probs", "advantages", "action_mask",
                   "rollout_log_probs", "dp_size", "batch_num_tokens", "global_batch_size")
_INIT_PARAMS = ("clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type",
                "is_correction_level")


def _load_loss_module():
    """The real ``openrlhf.models.loss``. ``openrlhf/models/__init__.py`` imports the actor model,
    which needs flash-attn (a CUDA build); where flash-attn is absent (a CPU machine), the loss module
    and its ``.utils`` are loaded from the installed package's own directory without that
    ``__init__``, and the half-made parent package is removed again afterwards."""
    try:
        from openrlhf.models import loss
        return loss
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("flash_attn"):
            raise
    import openrlhf

    parent = types.ModuleType("openrlhf.models")
    parent.__path__ = [str(Path(openrlhf.__file__).parent / "models")]
    parent.__package__ = "openrlhf.models"
    sys.modules["openrlhf.models"] = parent
    try:
        return importlib.import_module("openrlhf.models.loss")
    finally:
        del sys.modules["openrlhf.models"]


try:
    _orl_loss = _load_loss_module()
except ImportError as exc:  # pragma: no cover - exercised only without openrlhf/deepspeed
    raise ImportError(
        f"bandpo_lut.integrations.openrlhf needs openrlhf {TESTED_OPENRLHF[-1]} and deepspeed (its "
        f"models.utils imports it), installed as requirements-openrlhf.txt says ({exc})") from exc

PolicyLoss = _orl_loss.PolicyLoss


def _check_openrlhf() -> None:
    try:
        version = metadata.version("openrlhf")
    except metadata.PackageNotFoundError:
        version = "unknown"
    problems = []
    for name in ("PolicyLoss", "aggregate_loss", "masked_mean"):
        if not hasattr(_orl_loss, name):
            problems.append(f"openrlhf.models.loss.{name} is missing")
    if hasattr(_orl_loss, "PolicyLoss"):
        params = tuple(inspect.signature(PolicyLoss.forward).parameters)
        if params != _FORWARD_PARAMS:
            problems.append(f"PolicyLoss.forward takes {params}, this integration implements "
                            f"{_FORWARD_PARAMS}")
        init = inspect.signature(PolicyLoss.__init__).parameters
        missing = [p for p in _INIT_PARAMS if p not in init]
        if missing:
            problems.append(f"PolicyLoss.__init__ lacks {missing}")
    check_framework("openrlhf", version, TESTED_OPENRLHF, problems, module="openrlhf",
                    install=f"pip install --no-deps 'openrlhf=={TESTED_OPENRLHF[-1]}' (see "
                            f"requirements-openrlhf.txt for deepspeed and why --no-deps)")


_check_openrlhf()


@dataclass(frozen=True)
class BandSettings:
    """The band of `BandPolicyLoss` (the launcher's ``--band.*``); defaults: the paper's settings.
    Checked when built: an impossible value is refused, naming its ``--band.*`` argument."""

    divergence: str = PAPER["divergence"]
    delta: float = PAPER["delta"]
    max_ratio: Optional[float] = PAPER["max_ratio"]
    dual_clip: Optional[float] = PAPER["dual_clip"]
    clip: str = "band"

    def __post_init__(self):
        check_band(self.divergence, self.delta, self.max_ratio,
                   field={k: f"--band.{k}" for k in ("divergence", "delta", "max_ratio")})
        d = self.dual_clip
        if d is not None and not (is_number(d) and d > 1 and not math.isnan(d)):
            raise ValueError(f"--band.dual_clip must be None (off) or a number > 1 (paper: "
                             f"{PAPER['dual_clip']:g}), got {d!r}")
        if self.clip not in _CLIPS:
            raise ValueError(f"--band.clip must be one of {_CLIPS}, got {self.clip!r}")


def check_openrlhf_args(policy_loss_type="ppo", is_correction_level="off", loss_agg_mode="token-mean"):
    """Refuse the OpenRLHF settings the band does not train, naming OpenRLHF's argument."""
    if policy_loss_type != "ppo":
        raise ValueError(f"--actor.policy_loss_type={policy_loss_type!r} is not supported with BandPO: "
                         f"use 'ppo' (gspo uses one sequence-level ratio, which the per-token band "
                         f"does not bound)")
    if is_correction_level != "off":
        raise ValueError(f"--algo.advantage.is_correction_level={is_correction_level!r} is not supported "
                         f"with BandPO (the train/rollout IS correction is not carried over): use 'off'")
    if loss_agg_mode not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"--actor.loss_agg_mode must be 'token-mean' or 'seq-mean-token-mean', got "
                         f"{loss_agg_mode!r}")


_warned_dual = False


class BandPolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` with BandPO's band; same constructor (plus ``band``, default: the
    settings `activate` was given, else the paper's) and same ``forward`` convention."""

    band_settings: Optional[BandSettings] = None  # set by `activate` for the actor's construction

    def __init__(self, *args, band: Optional[BandSettings] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.band = band or type(self).band_settings or BandSettings()
        if self.band.clip == "band":
            check_openrlhf_args(self.policy_loss_type, self.is_correction_level)
            global _warned_dual
            if self.dual_clip is not None and not _warned_dual:
                _warned_dual = True
                warnings.warn(f"--actor.dual_clip={self.dual_clip} has no effect with BandPO: "
                              f"--band.dual_clip={self.band.dual_clip} takes its place", UserWarning,
                              stacklevel=2)
        self.last_band_metrics: dict = {}

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                dp_size=1, batch_num_tokens=None, global_batch_size=None):
        mask = torch.ones_like(log_probs) if action_mask is None else action_mask
        b = self.band
        if b.clip == "fixed":
            out = super().forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs,
                                  dp_size, batch_num_tokens, global_batch_size)
            if self.policy_loss_type == "ppo":  # gspo's clip is per sequence: no per-token metrics
                _, metrics = bandpo_lut.policy_loss(
                    log_probs.detach(), old_log_probs, advantages, mask, clip="fixed",
                    eps_low=self.clip_eps_low, eps_high=self.clip_eps_high, dual_clip=self.dual_clip)
                self.last_band_metrics = _fractions(metrics)
            return out
        kwargs = dict(delta=b.delta, divergence=b.divergence, max_ratio=b.max_ratio, dual_clip=b.dual_clip)
        if self.token_level_loss:
            if batch_num_tokens is None:
                loss, metrics = bandpo_lut.policy_loss(log_probs, old_log_probs, advantages, mask,
                                                       agg="token-mean", **kwargs)
            else:
                loss, metrics = bandpo_lut.policy_loss(log_probs, old_log_probs, advantages, mask,
                                                       agg="token-sum", **kwargs)
                loss = loss / batch_num_tokens * dp_size
        else:
            # ours averages the per-sequence means over the non-empty sequences; OpenRLHF divides their
            # sum by the global sample count
            loss, metrics = bandpo_lut.policy_loss(log_probs, old_log_probs, advantages, mask,
                                                   agg="seq-mean-token-mean", **kwargs)
            if global_batch_size is not None:
                n_seq = (mask.sum(dim=-1) > 0).to(loss.dtype).sum()
                loss = loss * n_seq / global_batch_size * dp_size
        self.last_band_metrics = _fractions(metrics)
        ppo_kl = _orl_loss.masked_mean(-(log_probs - old_log_probs).detach(), mask, dim=None)
        return loss, metrics["clip_frac"], ppo_kl, None, None


def _fractions(metrics: dict) -> dict:
    return {(k if k.startswith("band_") else f"band_{k}"): v.detach() for k, v in metrics.items()
            if k in loss_spec.FRACTIONS}


def _log_band_metrics(training_step):
    """ActorPPOTrainer.training_step, which also puts the loss's band metrics into experience.info
    (OpenRLHF copies that dict into its logged metrics after the loss call)."""
    if getattr(training_step, "_bandpo", False):
        return training_step

    @functools.wraps(training_step)
    def step(self, experience, *args, **kwargs):
        loss_fn = self.actor_loss_fn
        if isinstance(loss_fn, BandPolicyLoss):
            forward = loss_fn.forward

            def forward_and_log(*a, **k):
                out = forward(*a, **k)
                experience.info.update(loss_fn.last_band_metrics)
                return out

            loss_fn.forward = forward_and_log
            try:
                return training_step(self, experience, *args, **kwargs)
            finally:
                del loss_fn.forward
        return training_step(self, experience, *args, **kwargs)

    step._bandpo = True
    return step


def activate(settings: Optional[BandSettings] = None, *, patch_actor: bool = True) -> type:
    """Make OpenRLHF build `BandPolicyLoss` (with ``settings``, default the paper's) wherever it
    builds ``PolicyLoss``, in this process. Returns the class. ``patch_actor``: also import the PPO
    actor module (needs OpenRLHF's full GPU stack) to rebind its name and log the band metrics."""
    cls = type("BandPolicyLoss", (BandPolicyLoss,), {"band_settings": settings or BandSettings()})
    _orl_loss.PolicyLoss = cls
    models = sys.modules.get("openrlhf.models")
    if models is not None and hasattr(models, "PolicyLoss"):
        models.PolicyLoss = cls
    if patch_actor:
        from openrlhf.trainer.ray import ppo_actor

        ppo_actor.PolicyLoss = cls
        ppo_actor.ActorPPOTrainer.training_step = _log_band_metrics(
            ppo_actor.ActorPPOTrainer.training_step)
    return cls


def activate_from_env() -> None:
    """Ray's ``worker_process_setup_hook``: `activate` with the settings in ``$BANDPO_OPENRLHF``."""
    raw = os.environ.get(ENV)
    if raw:
        activate(BandSettings(**json.loads(raw)))


def _none_or_float(text: str):
    if text.lower() in ("none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or None, got {text!r}") from None


PROG = "python -m bandpo_lut.integrations.openrlhf"
_OPENRLHF_MAIN = "openrlhf.cli.train_ppo_ray"


def band_parser() -> argparse.ArgumentParser:
    """The launcher's own options (``--band.*``). No abbreviations: ``--band.max`` must not quietly mean
    ``--band.max_ratio``. ``exit_on_error=False``: `parse_band_args` reports a bad value as ValueError."""
    p = argparse.ArgumentParser(
        prog=PROG, add_help=False, allow_abbrev=False, exit_on_error=False,
        usage=f"{PROG} [--band.* options] <{_OPENRLHF_MAIN} arguments>",
        description=f"OpenRLHF's PPO trainer ({_OPENRLHF_MAIN}) with BandPO's band in place of its fixed "
                    "ratio clip. The --band.* options are this launcher's (defaults: the paper's settings), "
                    f"written in full; every other argument goes to {_OPENRLHF_MAIN} unchanged.")
    g = p.add_argument_group("BandPO")
    g.add_argument("--band.divergence", dest="divergence", default=PAPER["divergence"], metavar="NAME",
                   help="f-divergence of the trust region: kl, tv, chi2 or hellinger (default: %(default)s)")
    g.add_argument("--band.delta", dest="delta", type=float, default=PAPER["delta"], metavar="DELTA",
                   help="trust-region radius, within the shipped table's range (default: %(default)s)")
    g.add_argument("--band.max_ratio", dest="max_ratio", type=_none_or_float, default=PAPER["max_ratio"],
                   metavar="R", help="cap on the upper ratio bound, >= 1, or None for no cap (default: "
                                     "%(default)s)")
    g.add_argument("--band.dual_clip", dest="dual_clip", type=_none_or_float, default=PAPER["dual_clip"],
                   metavar="C", help="dual-clip constant > 1 for tokens with A < 0, or None for off; takes the "
                                     "place of --actor.dual_clip (default: %(default)s)")
    g.add_argument("--band.clip", dest="clip", default="band", metavar="KIND",
                   help="band (BandPO), or fixed: OpenRLHF's own clip, with the band metrics logged "
                        "(default: %(default)s)")
    return p


def parse_band_args(argv: list[str]) -> tuple[BandSettings, list[str]]:
    """(settings, the remaining arguments for OpenRLHF), the OpenRLHF arguments checked. A bad value, an
    unknown ``--band...`` option (an abbreviation included) or an OpenRLHF argument the band cannot train
    raises ValueError naming it."""
    p = band_parser()
    try:
        ns, rest = p.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    known = [opt for action in p._actions for opt in action.option_strings]
    # what allow_abbrev=False left over: a --band... token that is none of ours would otherwise reach
    # OpenRLHF's parser, which fails only after Ray and the trainer are imported
    unknown = [t.split("=", 1)[0] for t in rest if t.startswith("--band")]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.5)
        raise ValueError(f"unrecognised argument {unknown[0]}" + (f" (did you mean {close[0]}?)" if close else "")
                         + f"; the launcher's options are {', '.join(known)}, written in full")
    settings = BandSettings(**vars(ns))
    q = argparse.ArgumentParser(add_help=False)
    q.add_argument("--actor.policy_loss_type", dest="policy_loss_type", default="ppo")
    q.add_argument("--algo.advantage.is_correction_level", dest="is_correction_level", default="off")
    q.add_argument("--actor.loss_agg_mode", dest="loss_agg_mode", default="token-mean")
    orl, _ = q.parse_known_args(rest)
    if settings.clip == "band":
        check_openrlhf_args(**vars(orl))
    return settings, rest


def openrlhf_parser() -> Optional[argparse.ArgumentParser]:
    """OpenRLHF's own argument parser, or None where it cannot be had. train_ppo_ray builds it in its
    main block, after module imports that need OpenRLHF's GPU stack (vllm, ray); the statements before
    its ``parser.parse_args()`` need only the standard library, so they are run by themselves, from the
    installed file, and ``--help`` works wherever OpenRLHF is installed."""
    try:
        spec = importlib.util.find_spec(_OPENRLHF_MAIN)
        tree = ast.parse(Path(spec.origin).read_text())
        block = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
        # the file's standard-library imports (argparse, datetime for a default), then the parser's statements
        body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and all(
            (getattr(n, "module", None) or a.name).split(".")[0] in sys.stdlib_module_names for a in n.names)]
        for stmt in block.body:
            if "parse_args" in ast.unparse(stmt):
                break
            body.append(stmt)
        namespace: dict = {}
        exec(compile(ast.Module(body=body, type_ignores=[]), spec.origin, "exec"), namespace)
        parser = namespace["parser"]
        return parser if isinstance(parser, argparse.ArgumentParser) else None
    except Exception:  # any change in OpenRLHF's file: the help says where to look instead
        return None


def format_help() -> str:
    """``--help``: the launcher's options, then OpenRLHF's."""
    text = band_parser().format_help()
    orl = openrlhf_parser()
    if orl is None:
        return text + (f"\nOpenRLHF's own arguments: see `python -m {_OPENRLHF_MAIN} --help` (they could not "
                       "be read from the installed openrlhf here).\n")
    orl.usage = argparse.SUPPRESS  # its usage line lists every option again (hundreds of lines)
    return text + f"\nOpenRLHF's own arguments ({_OPENRLHF_MAIN}):\n\n" + orl.format_help()


def _ray_init_with_hook(init):
    @functools.wraps(init)
    def ray_init(*args, runtime_env=None, **kwargs):
        runtime_env = dict(runtime_env or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), ENV: os.environ[ENV]}
        runtime_env["worker_process_setup_hook"] = f"{_MODULE}.activate_from_env"
        return init(*args, runtime_env=runtime_env, **kwargs)

    return ray_init


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m bandpo_lut.integrations.openrlhf ARGS``: OpenRLHF's train_ppo_ray with the band. A bad
    ``--band.*`` value, an unknown ``--band...`` option or an OpenRLHF setting the band cannot train ends
    as argparse's errors do (the usage, one error line, exit 2), before Ray starts."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(format_help())
        raise SystemExit(0)
    try:
        settings, rest = parse_band_args(argv)
    except ValueError as exc:
        band_parser().error(str(exc))
    import ray

    os.environ[ENV] = json.dumps(asdict(settings))
    ray.init = _ray_init_with_hook(ray.init)
    sys.argv = [_OPENRLHF_MAIN, *rest]
    runpy.run_module(_OPENRLHF_MAIN, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # the importable module's `main` (its classes are the ones the Ray workers' hook activates)
    from bandpo_lut.integrations.openrlhf import main as _main

    _main()
