"""``python -m bandpo_lut.integrations.openrlhf_launcher``: OpenRLHF's PPO trainer (``openrlhf.cli.train_ppo_ray``)
with BandPO's band (`bandpo_lut.integrations.openrlhf`) active in every Ray worker.

What an OpenRLHF user changes: the module run, plus any ``--band.*`` option (defaults: the paper's)::

    python -m bandpo_lut.integrations.openrlhf_launcher <the usual openrlhf.cli.train_ppo_ray arguments> \\
        --band.divergence kl --band.delta 0.05 --band.max_ratio 10 --band.dual_clip 10

The launcher removes the ``--band.*`` arguments and builds the band's LossSettings from them; a bad value, an
unknown ``--band...`` option, an OpenRLHF argument the band cannot train, or one the band's settings replace (a
``--actor.dual_clip`` other than ``--band.dual_clip``; with the band, an ``--actor.eps_clip*`` other than
OpenRLHF's default) ends as argparse's errors do (the usage, one error line naming the argument, exit 2), before
Ray starts. It then puts the band's options into
``$BANDPO_OPENRLHF``, adds `bandpo_lut.integrations.openrlhf.activate_from_env` as Ray's
``worker_process_setup_hook`` to OpenRLHF's own ``ray.init``, and runs ``openrlhf.cli.train_ppo_ray`` as
``__main__``. ``--help`` lists the ``--band.*`` options, then OpenRLHF's own help, which OpenRLHF prints itself
(in a child process: its module imports its GPU stack, Ray and vLLM, before it builds its parser).
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from typing import Optional

from bandpo_lut.runtime.settings import LossSettings

from ._common import PAPER, did_you_mean
from ._openrlhf_options import ENV, OPENRLHF_EPS, band_options_json, band_settings, check_clip_args, check_openrlhf_args

__all__ = ["PROG", "band_parser", "format_help", "main", "parse_band_args"]

PROG = "python -m bandpo_lut.integrations.openrlhf_launcher"
_OPENRLHF_MAIN = "openrlhf.cli.train_ppo_ray"
# Ray imports the loss's module in each worker and runs this (the launcher's own process never imports OpenRLHF)
_HOOK = "bandpo_lut.integrations.openrlhf.activate_from_env"


def _none_or_float(text: str):
    if text.lower() in ("none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or None, got {text!r}") from None


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


def parse_band_args(argv: list[str]) -> tuple[LossSettings, list[str]]:
    """(the band's LossSettings, the remaining arguments for OpenRLHF), the OpenRLHF arguments checked. A bad
    value, an unknown ``--band...`` option (an abbreviation included) or an OpenRLHF argument the band cannot
    train raises ValueError naming it."""
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
        raise ValueError(f"unrecognised argument {unknown[0]}{did_you_mean(unknown[0], known)}; the launcher's "
                         f"options are {', '.join(known)}, written in full")
    settings = band_settings(**vars(ns))
    q = argparse.ArgumentParser(add_help=False)
    q.add_argument("--actor.policy_loss_type", dest="policy_loss_type", default="ppo")
    q.add_argument("--algo.advantage.is_correction_level", dest="is_correction_level", default="off")
    q.add_argument("--actor.loss_agg_mode", dest="loss_agg_mode", default="token-mean")
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--actor.dual_clip", dest="dual_clip", type=float, default=None)
    c.add_argument("--actor.eps_clip", dest="eps_clip", type=float, default=OPENRLHF_EPS)
    c.add_argument("--actor.eps_clip_low_high", dest="eps_clip_low_high", type=float, nargs=2, default=None)
    orl, _ = q.parse_known_args(rest)
    clips, _ = c.parse_known_args(rest)
    if settings.clip == "band":
        check_openrlhf_args(**vars(orl))
    check_clip_args(settings, **vars(clips))
    return settings, rest


def openrlhf_help(timeout: float = 300.0) -> str:
    """OpenRLHF's own ``--help``, as OpenRLHF prints it (``python -m openrlhf.cli.train_ppo_ray --help`` in a
    child process), or, where it cannot run here, a line saying so and where to read it."""
    try:
        proc = subprocess.run([sys.executable, "-m", _OPENRLHF_MAIN, "--help"], capture_output=True, text=True,
                              timeout=timeout)
        ok, out = proc.returncode == 0, proc.stdout
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        ok, out, why = False, "", f"no answer within {timeout:g} s"
    if ok and "usage:" in out:
        return f"\nOpenRLHF's own arguments ({_OPENRLHF_MAIN}):\n\n" + out[out.index("usage:"):]
    return (f"\nOpenRLHF's own arguments: see `python -m {_OPENRLHF_MAIN} --help` where OpenRLHF's GPU stack is "
            f"installed (it could not run here: {why}).\n")


def format_help() -> str:
    """``--help``: the launcher's options, then OpenRLHF's."""
    return band_parser().format_help() + openrlhf_help()


def _ray_init_with_hook(init):
    @functools.wraps(init)
    def ray_init(*args, runtime_env=None, **kwargs):
        runtime_env = dict(runtime_env or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), ENV: os.environ[ENV]}
        runtime_env["worker_process_setup_hook"] = _HOOK
        return init(*args, runtime_env=runtime_env, **kwargs)

    return ray_init


def main(argv: Optional[list[str]] = None) -> None:
    """OpenRLHF's train_ppo_ray with the band (see the module docstring)."""
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

    os.environ[ENV] = band_options_json(settings)
    ray.init = _ray_init_with_hook(ray.init)
    sys.argv = [_OPENRLHF_MAIN, *rest]
    runpy.run_module(_OPENRLHF_MAIN, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
