"""What the fused policy loss (`bandpo_lut.runtime.loss`) and its specification (`bandpo_lut.reference.policy_loss`)
share: the option names and their compiled ids, the metric names, counts -> fractions, argument validation.

Both import this module; production code never imports `bandpo_lut.reference`. The C++ side
(`csrc/loss_element.h`) writes the same facts once more, as enums and constants; the "loss" entry of the
compiled library's facts (`bandpo_lut.runtime._extension.facts()`, csrc/facts.h) reports them and
`tests/runtime/test_contract.py` fails when the two differ.
"""
from __future__ import annotations

import math

import torch

from bandpo_lut.runtime.settings import AGGS, CLIPS, DEFAULT_EPS, MODES, LossSettings  # noqa: F401 (re-exported: the option names)
from bandpo_lut.tables.checks import check_max_ratio as _check_max_ratio
from bandpo_lut.tables.checks import check_tensor as check_floating_tensor
from bandpo_lut.tables.checks import is_host_scalar as _is_host_scalar
from bandpo_lut.tables.checks import is_number as _is_number

# The compiled ids of the string options: their position in the tuples above (C++: AggKind, ClipKind, LossMode).
AGG_ID = {name: i for i, name in enumerate(AGGS)}
CLIP_ID = {name: i for i, name in enumerate(CLIPS)}
MODE_ID = {name: i for i, name in enumerate(MODES)}

LOG_RATIO_CLAMP = 20.0  # |log_prob - old_log_prob| is clamped to this before exp, as trainers do
LOWPROB = 0.2  # "low-probability token": p_old < LOWPROB

# (suffix, lower edge, upper edge); the last bucket includes p = 1.
BUCKETS = (("p00_20", 0.0, 0.2), ("p20_40", 0.2, 0.4), ("p40_60", 0.4, 0.6),
           ("p60_80", 0.6, 0.8), ("p80_100", 0.8, 1.0))

COUNTS = (
    "n_tokens", "n_clipped", "n_clipped_upper", "n_clipped_lower", "n_dual_clipped",
    "n_lowprob_pos", "n_clipped_upper_lowprob", "ppo_kl_sum", "band_width_sum", "n_band_finite",
) + tuple(f"n_tokens_{s}" for s, _, _ in BUCKETS) + tuple(f"n_clipped_{s}" for s, _, _ in BUCKETS)

# fraction name -> (numerator count, denominator count)
FRACTIONS = {
    "ppo_kl": ("ppo_kl_sum", "n_tokens"),
    "clip_frac": ("n_clipped", "n_tokens"),
    "clip_frac_upper": ("n_clipped_upper", "n_tokens"),
    "clip_frac_lower": ("n_clipped_lower", "n_tokens"),
    "dual_clip_frac": ("n_dual_clipped", "n_tokens"),
    "clip_frac_upper_lowprob": ("n_clipped_upper_lowprob", "n_lowprob_pos"),
    "band_width_mean": ("band_width_sum", "n_band_finite"),
    **{f"clip_frac_{s}": (f"n_clipped_{s}", f"n_tokens_{s}") for s, _, _ in BUCKETS},
}

# The metric vector of the compiled forward: the counts, then the fractions (each formed in the kernel as
# count / count in the compute dtype, 0 where the denominator is 0). Its length sizes the fake kernel.
METRICS = COUNTS + tuple(FRACTIONS)
FRACTION_INDICES = tuple((COUNTS.index(num), COUNTS.index(den)) for num, den in FRACTIONS.values())


def baseline_bounds(p_old: torch.Tensor, clip: str, eps_low: float, eps_high: float):
    """[lo, up] of a baseline clip at p_old, before any max_ratio cap (the compiled loss writes the same
    formulas in `csrc/loss_element.h`; the tests compare the two).

    "fixed": PPO's [1 - eps_low, 1 + eps_high]. "dcpo": DCPO's lo = 1/2 + 1/2·sqrt(max(1 - 4·eps_low/p, 0)),
    up = 1/2 + 1/2·sqrt(1 + 4·eps_high/p), so at p = 0: lo = 1/2, up = +inf."""
    if clip == "fixed":
        return torch.full_like(p_old, 1.0 - eps_low), torch.full_like(p_old, 1.0 + eps_high)
    if clip == "dcpo":
        lo = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * eps_low / p_old, min=0.0))
        return lo, 0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / p_old)
    raise ValueError(f"clip: expected a baseline clip ('fixed' or 'dcpo'), got {clip!r}")


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0, with no NaN in either direction of autograd."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))


def metrics_from_counts(counts: dict) -> dict:
    """The fractions of FRACTIONS from (possibly summed over micro-batches/ranks) counts, in a handful of
    vectorised ops whatever the number of metrics.

    Returns a new dict with the counts themselves and the fractions (0-dim tensors)."""
    missing = [name for name in COUNTS if name not in counts]
    if missing:
        raise KeyError(f"metrics_from_counts: counts lacks {', '.join(missing)} (it needs every name of "
                       f"bandpo_lut.COUNTS, as the metrics of policy_loss hold them)")
    out = {name: counts[name] for name in COUNTS}
    num = torch.stack([torch.as_tensor(counts[n]) for n, _ in FRACTIONS.values()])
    den = torch.stack([torch.as_tensor(counts[d]) for _, d in FRACTIONS.values()])
    out.update(zip(FRACTIONS, safe_div(num, den).unbind()))
    return out


# ---------------------------------------------------------------------------------------------
# argument checks


def _check_tensor(name: str, x, like: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"policy_loss: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"policy_loss: {name} must be a dense (strided) tensor, got layout {x.layout}")
    if name != "mask" and not x.dtype.is_floating_point:
        raise TypeError(f"policy_loss: {name} must have a floating dtype, got {x.dtype}")
    if like is None:
        if x.dim() != 2:
            raise ValueError(f"policy_loss: {name} must have shape (batch, T), got {tuple(x.shape)}")
        return
    if x.shape != like.shape:
        raise ValueError(f"policy_loss: {name} has shape {tuple(x.shape)} but log_prob has shape "
                         f"{tuple(like.shape)}; they must be equal")
    if x.device != like.device:
        raise ValueError(f"policy_loss: {name} is on {x.device} but log_prob is on {like.device}")


def _check_delta_tensor(delta: torch.Tensor, log_prob: torch.Tensor) -> None:
    """A per-token δ: the same dtype rule as `bounds`/`clip` (one check, `checks.check_tensor`), on
    log_prob's device (or a 0-dim CPU δ, read on the host: `checks.is_host_scalar`), broadcastable to log_prob's
    shape (batch, T)."""
    try:
        check_floating_tensor("delta", delta)
    except TypeError as err:
        raise TypeError(f"policy_loss: {err}") from None
    if delta.device != log_prob.device and not _is_host_scalar(delta):
        raise ValueError(f"policy_loss: delta is on {delta.device} but log_prob is on {log_prob.device}; give it "
                         "on log_prob's device, or a 0-dim CPU tensor")
    shape = tuple(log_prob.shape)
    # d == 1 or d == s, not `d in (1, s)`: under torch.compile(dynamic=True) a size of log_prob is symbolic, and
    # Dynamo takes `int in (1, SymInt)` as False even where the two are equal
    pairs = zip(reversed(tuple(delta.shape)), reversed(shape))
    ok = delta.dim() <= len(shape) and all(d == 1 or d == s for d, s in pairs)
    if not ok:
        raise ValueError(f"policy_loss: delta has shape {tuple(delta.shape)}, which does not broadcast to "
                         f"log_prob's shape {shape}; give a number or a tensor broadcastable to (batch, T)")


def check_max_ratio(max_ratio) -> None:
    _check_max_ratio(max_ratio, "policy_loss: max_ratio")


def baseline_eps(clip: str, eps_low, eps_high) -> tuple[float, float]:
    """A baseline clip's (eps_low, eps_high), defaults filled in, validated."""
    default_low, default_high = DEFAULT_EPS[clip]
    eps_low = default_low if eps_low is None else eps_low
    eps_high = default_high if eps_high is None else eps_high
    # fixed: a lower bound 1 - eps_low in [0, 1]; dcpo: eps must be > 0 (eps/p at p = 0 is 0/0).
    low_ok = (0 <= eps_low <= 1) if clip == "fixed" else (0 < eps_low < math.inf)
    high_ok = (0 <= eps_high < math.inf) if clip == "fixed" else (0 < eps_high < math.inf)
    if not (_is_number(eps_low) and low_ok):
        rng = "in [0, 1]" if clip == "fixed" else "> 0"
        raise ValueError(f"policy_loss: eps_low must be a number {rng} for clip={clip!r}, "
                         f"got {eps_low!r}")
    if not (_is_number(eps_high) and high_ok):
        rng = ">= 0" if clip == "fixed" else "> 0"
        raise ValueError(f"policy_loss: eps_high must be a finite number {rng} for clip={clip!r}, "
                         f"got {eps_high!r}")
    return float(eps_low), float(eps_high)


def check_args(log_prob, old_log_prob, advantages, mask, delta, divergence, max_ratio,
               dual_clip, agg, clip, mode, eps_low, eps_high):
    """Validate `policy_loss`'s arguments (both implementations) through the one validation path, LossSettings;
    returns (eps_low, eps_high) with the clip's defaults filled in (None, None for clip="band")."""
    settings = LossSettings(delta=delta, divergence=divergence, max_ratio=max_ratio, dual_clip=dual_clip, agg=agg,
                            clip=clip, mode=mode, eps_low=eps_low, eps_high=eps_high)
    check_tensors(log_prob, old_log_prob, advantages, mask, settings)
    return settings.eps()


def check_tensors(log_prob, old_log_prob, advantages, mask, settings: LossSettings) -> None:
    """The per-call checks (the batch's tensors, and a per-token δ's shape and device against them); the
    options were validated when `settings` was built. Python checks only: no host synchronisation."""
    _check_tensor("log_prob", log_prob, None)
    _check_tensor("old_log_prob", old_log_prob, log_prob)
    _check_tensor("advantages", advantages, log_prob)
    if mask is not None:
        _check_tensor("mask", mask, log_prob)
        if mask.dtype.is_complex:
            raise TypeError(f"policy_loss: mask must be bool, integer or floating (0/1 values), "
                            f"got {mask.dtype}")
    if settings.clip == "band" and isinstance(settings.delta, torch.Tensor):
        _check_delta_tensor(settings.delta, log_prob)


def compute_dtype(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor) -> torch.dtype:
    """The arithmetic dtype: the promotion of the three inputs' dtypes, at least float32."""
    dtype = log_prob.dtype
    if dtype in _AT_LEAST_FLOAT32 and old_log_prob.dtype == dtype and advantages.dtype == dtype:
        return dtype      # the usual call: no promotion to ask torch for (each asks its dispatcher)
    dtype = torch.promote_types(torch.promote_types(dtype, old_log_prob.dtype), advantages.dtype)
    return torch.promote_types(dtype, torch.float32)


_AT_LEAST_FLOAT32 = (torch.float32, torch.float64)
