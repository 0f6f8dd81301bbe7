"""BandPO for OpenRLHF: the actor's ``PolicyLoss`` with the band in place of its fixed clip, and `activate`,
which makes OpenRLHF build it. The command line that activates it in every Ray worker is
`bandpo_lut.integrations.openrlhf_launcher`::

    python -m bandpo_lut.integrations.openrlhf_launcher <the usual openrlhf.cli.train_ppo_ray arguments> \\
        --band.divergence kl --band.delta 0.05 --band.max_ratio 10 --band.dual_clip 10

How it fits OpenRLHF (tested: `TESTED_OPENRLHF`):

- **No registry**: OpenRLHF's PPO actor (``openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer``) builds
  ``PolicyLoss(...)`` directly, inside a Ray actor. `activate` rebinds ``PolicyLoss`` in
  ``openrlhf.models.loss``, ``openrlhf.models`` and the PPO actor module to `BandPolicyLoss` (with the band's
  LossSettings) and makes the actor's training step log the band metrics; the launcher has Ray run it in
  every worker process (`activate_from_env`, with the options in ``$BANDPO_OPENRLHF``).
- **Options** (`bandpo_lut.integrations._openrlhf_options`, shared with the launcher, which imports no
  OpenRLHF): `band_settings` builds the band's `bandpo_lut.LossSettings` from the launcher's ``--band.*``
  (defaults: the paper's), each bad value refused naming its ``--band.*`` argument; `check_openrlhf_args`
  refuses the OpenRLHF arguments the band cannot train.
- **Loss**: `BandPolicyLoss` subclasses OpenRLHF's ``PolicyLoss`` and keeps its call convention
  (``forward(...) -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``) and its aggregation:
  ``--actor.loss_agg_mode token-mean`` (masked sum / the window's global token count x dp_size) or
  ``seq-mean-token-mean`` (sum of per-sequence token means / the global sample count x dp_size).
- **Supported**: ``--actor.policy_loss_type ppo``. Refused: ``gspo`` (one sequence-level ratio,
  which a per-token band does not bound) and ``--algo.advantage.is_correction_level`` other than
  ``off`` (the vLLM-mismatch correction is not carried over yet); never silently trained otherwise.
- **band.clip=fixed** runs OpenRLHF's own ``PolicyLoss.forward`` with ``--actor.eps_clip_low_high`` and
  ``--band.dual_clip`` as its dual clip (a baseline that differs from the band run in the clip alone): the
  stock loss, bit for bit, plus the band metrics of that clip. ``--band.dual_clip`` is the dual clip on both
  routes; the launcher refuses an ``--actor.dual_clip`` that differs from it and, with the band, an
  ``--actor.eps_clip*`` other than OpenRLHF's default (they would not act); `BandPolicyLoss` built without the
  launcher names such values in a warning, once.
- **Metrics**: ``ppo_clip_ratio`` is the band's clip fraction, ``ppo_kl`` is OpenRLHF's; every
  fraction of `bandpo_lut.policy_loss` is added to ``experience.info`` as ``band_<name>`` (0-dim, so
  OpenRLHF weights it by tokens across micro-batches and ranks and logs it as ``train/band_<name>``).
- **Old log-probabilities** pass to bandpo_lut unchanged (one in (0, 2^-9] is p = 1 there).
- **Install**: OpenRLHF as it documents (GPU, flash-attn); the tests use requirements-openrlhf.txt
  (openrlhf without its GPU dependencies, plus deepspeed).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
import types
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

import bandpo_lut
from bandpo_lut.runtime import loss_spec
from bandpo_lut.runtime.settings import LossSettings

from ._common import check_framework, check_route, warn_unused_trainer_clips
from ._openrlhf_options import ENV, NAMES, OPENRLHF_EPS, band_from_json, band_settings, check_openrlhf_args

__all__ = ["TESTED_OPENRLHF", "BandPolicyLoss", "activate", "activate_from_env", "band_settings",
           "check_openrlhf_args"]

TESTED_OPENRLHF = ("0.11.2",)
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


def _warn_replaced_clips(loss) -> None:
    """The OpenRLHF clip arguments a BandPolicyLoss was built with that the band's settings replace (the launcher
    refuses them; `activate` alone cannot tell them from defaults but by their values), each named once."""
    messages = []
    if loss.dual_clip is not None and loss.dual_clip != loss.band.dual_clip:
        messages.append(f"--actor.dual_clip={loss.dual_clip} has no effect with BandPO: "
                        f"--band.dual_clip={loss.band.dual_clip} takes its place")
    if loss.band.clip == "band" and (loss.clip_eps_low, loss.clip_eps_high) != (OPENRLHF_EPS, OPENRLHF_EPS):
        messages.append(f"--actor.eps_clip_low_high=[{loss.clip_eps_low}, {loss.clip_eps_high}] has no effect with "
                        f"--band.clip band: the clip is the band of --band.delta={loss.band.delta}")
    warn_unused_trainer_clips(messages)


class BandPolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` with BandPO's band; same constructor (plus ``band``, a LossSettings from
    `band_settings`; default: the one `activate` was given, else the paper's) and same ``forward``
    convention. Every LossSettings a call uses is built here, once."""

    activated: Optional[LossSettings] = None  # set by `activate` for the actor's construction

    def __init__(self, *args, band: Optional[LossSettings] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.band = band or type(self).activated or band_settings()
        check_route(self.band.clip, NAMES["clip"])
        _warn_replaced_clips(self)
        # --band.dual_clip is the dual clip on both routes (the launcher refuses an --actor.dual_clip that differs)
        self.dual_clip = self.band.dual_clip
        if self.band.clip == "band":
            check_openrlhf_args(self.policy_loss_type, self.is_correction_level)
            # OpenRLHF's aggregations, from the band's sums or means (`forward`)
            aggs = ("token-mean", "token-sum") if self.token_level_loss else ("seq-mean-token-mean",)
            self._settings = {agg: dataclasses.replace(self.band, agg=agg) for agg in aggs}
        elif self.policy_loss_type == "ppo":  # the metrics of OpenRLHF's own clip (gspo's is per sequence)
            self._settings = {"token-mean": LossSettings(
                clip="fixed", eps_low=self.clip_eps_low, eps_high=self.clip_eps_high, dual_clip=self.dual_clip,
                field_names={"eps_low": "--actor.eps_clip_low_high", "eps_high": "--actor.eps_clip_low_high",
                             "dual_clip": NAMES["dual_clip"]})}
        self.last_band_metrics: dict = {}

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                dp_size=1, batch_num_tokens=None, global_batch_size=None):
        mask = torch.ones_like(log_probs) if action_mask is None else action_mask
        if self.band.clip == "fixed":
            out = super().forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs,
                                  dp_size, batch_num_tokens, global_batch_size)
            if self.policy_loss_type == "ppo":
                _, metrics = bandpo_lut.policy_loss(log_probs.detach(), old_log_probs, advantages, mask,
                                                    settings=self._settings["token-mean"])
                self.last_band_metrics = _fractions(metrics)
            return out
        if self.token_level_loss:
            agg = "token-mean" if batch_num_tokens is None else "token-sum"
        else:
            agg = "seq-mean-token-mean"
        loss, metrics = bandpo_lut.policy_loss(log_probs, old_log_probs, advantages, mask,
                                               settings=self._settings[agg])
        if agg == "token-sum":
            loss = loss / batch_num_tokens * dp_size
        elif agg == "seq-mean-token-mean" and global_batch_size is not None:
            # ours averages the per-sequence means over the non-empty sequences; OpenRLHF divides their
            # sum by the global sample count
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


def activate(settings: Optional[LossSettings] = None, *, patch_actor: bool = True) -> type:
    """Make OpenRLHF build `BandPolicyLoss` (with ``settings``, from `band_settings`; default the paper's)
    wherever it builds ``PolicyLoss``, in this process. Returns the class. ``patch_actor``: also import the PPO
    actor module (needs OpenRLHF's full GPU stack) to rebind its name and log the band metrics."""
    cls = type("BandPolicyLoss", (BandPolicyLoss,), {"activated": settings or band_settings()})
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
    """Ray's ``worker_process_setup_hook``: `activate` with the band options in ``$BANDPO_OPENRLHF``."""
    raw = os.environ.get(ENV)
    if raw:
        activate(band_from_json(raw))
