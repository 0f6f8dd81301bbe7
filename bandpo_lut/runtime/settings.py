"""`LossSettings`: the loss options of `policy_loss`, `BandPolicyLoss` and `fused_linear_policy_loss` as one
frozen object, validated once, when it is built, without any tensor of the batch.

    settings = LossSettings(delta=0.05, divergence="kl", max_ratio=10.0, dual_clip=10.0)
    loss, metrics = bandpo_lut.policy_loss(log_prob, old_log_prob, advantages, mask, settings=settings)

This is the one validation path of the options (the entry points build the object from their keyword arguments
and carry it inward). A number δ is checked against the shipped table's range (its header only, no compiled
extension needed); a per-token δ tensor is the one tensor-valued option: its dtype is checked here, its shape
and device against the batch at call time (`loss_spec.check_tensors`).

`field_names` maps option names to the names the user wrote (a trainer integration's config fields, e.g.
``{"delta": "band_delta"}``): with it, every message names the user's field (``band_delta=2.0 is outside ...``);
without it, the option's own name (``delta=2.0 is outside ...``). Each option has one check, with one message and
one exception type, naming the option and the value given (``dual_clip must be None or a number > 1, got 0.5``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch

from bandpo_lut.tables import checks as _checks
from bandpo_lut.tables import divergences as _div

AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum")
CLIPS = ("band", "fixed", "dcpo")
MODES = ("clip", "mask")
DEFAULT_EPS = {"fixed": (0.2, 0.2), "dcpo": (0.16, 0.2)}

FIELDS = ("delta", "divergence", "max_ratio", "dual_clip", "agg", "clip", "mode", "eps_low", "eps_high")
# Where the loss keeps, in a settings object's __dict__, the ops' form of these options per device (its eager cache,
# bandpo_lut.runtime.loss._settings_op_args): device tensors, so never pickled or copied with the object.
OP_ARGS_CACHE = "_op_args_by_device"


def _constant_result(fn):
    fn._dynamo_marked_constant = True   # torch.compiler.assume_constant_result, without importing torch._dynamo
    return fn


@_constant_result
def delta_range(divergence: str) -> tuple[float, float, bool, str]:
    """(min, max, max_inclusive, source) of δ in the shipped table of `divergence`, from its header (file I/O:
    Dynamo calls this for real and takes the result as a constant)."""
    from bandpo_lut import tables
    table = tables.get(divergence)
    return table.delta_min, table.delta_max, table.delta_max_inclusive, table.source


@dataclasses.dataclass(frozen=True, eq=False)
class LossSettings:
    """The loss options (see `bandpo_lut.policy_loss` for their meaning), validated when built.

    delta: a number in the table's range, or a floating tensor broadcastable to (batch, T) (a per-token δ).
    eps_low/eps_high: None takes the clip's default (`eps()` gives the values the kernels use).
    field_names: the user's name for each option in error messages (integrations); not part of equality.
    Equality and hash: option by option, a tensor δ by identity (the same tensor object; its values may change in
    place, as a δ schedule's buffer does)."""
    delta: object = 0.05
    divergence: str = "kl"
    max_ratio: float | None = None
    dual_clip: float | None = None
    agg: str = "token-mean"
    clip: str = "band"
    mode: str = "clip"
    eps_low: float | None = None
    eps_high: float | None = None
    field_names: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        _validate(self)

    def _key(self) -> tuple:
        return tuple(_Identity(v) if isinstance(v, torch.Tensor) else v for v in (getattr(self, k) for k in FIELDS))

    def __eq__(self, other):
        if not isinstance(other, LossSettings):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop(OP_ARGS_CACHE, None)
        return state

    def options(self) -> dict:
        """The nine options as keyword arguments of policy_loss."""
        return {name: getattr(self, name) for name in FIELDS}

    def eps(self) -> tuple[float | None, float | None]:
        """(eps_low, eps_high) with the baseline clip's defaults filled in; (None, None) for clip="band"."""
        if self.clip == "band":
            return None, None
        low, high = DEFAULT_EPS[self.clip]
        return (float(low if self.eps_low is None else self.eps_low),
                float(high if self.eps_high is None else self.eps_high))


class _Identity:
    """A tensor compared and hashed by identity (its `==` is element-wise, and its truth value ambiguous)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Identity) and self.obj is other.obj

    def __hash__(self):
        return id(self.obj)


def _validate(s: LossSettings) -> None:
    """Every option, each by one check with one message and one exception type, naming the option as the user
    wrote it (`field_names`, else the library's name) and the value given."""
    names = s.field_names or {}

    def name(field: str) -> str:
        return names.get(field, field)

    for field, choices in (("agg", AGGS), ("clip", CLIPS), ("mode", MODES)):
        value = getattr(s, field)
        if not (isinstance(value, str) and value in choices):
            raise ValueError(f"{name(field)}={value!r} is not one of {choices}")
    if s.dual_clip is not None and not (_checks.is_number(s.dual_clip) and s.dual_clip > 1):
        raise ValueError(f"{name('dual_clip')} must be None or a number > 1, got {s.dual_clip!r}")
    if not _checks.max_ratio_ok(s.max_ratio):
        raise ValueError(f"{name('max_ratio')} must be a number >= 1 (the cap of the upper ratio bound) or None for "
                         f"no cap, got {s.max_ratio!r}")
    if s.clip != "band":
        _check_eps(s, name)
        return
    for field in ("eps_low", "eps_high"):
        if getattr(s, field) is not None:
            raise ValueError(f"{name(field)} applies to clip='fixed' or 'dcpo' only (clip='band' takes "
                             f"{name('delta')} and {name('divergence')}), got {getattr(s, field)!r}")
    compiled = _div.compiled_names()
    if not (isinstance(s.divergence, str) and s.divergence in _div.names()):
        raise ValueError(f"{name('divergence')}={s.divergence!r} is not a divergence; choose one of {compiled}")
    if s.divergence not in compiled:
        raise ValueError(f"{name('divergence')}={s.divergence!r} has no compiled kernel in this build (only the "
                         f"pure-PyTorch reference reads it); a training loss can use {compiled}")
    if isinstance(s.delta, torch.Tensor):
        # the dtype rule of bounds/clip; shape and device are checked against the batch at call time
        _checks.check_tensor(name("delta"), s.delta)
        return
    if not (_checks.is_number(s.delta) and 0 < s.delta < math.inf):
        raise ValueError(f"{name('delta')} must be a positive number (the trust-region radius δ) or a floating "
                         f"tensor, got {s.delta!r}")
    lo, hi, hi_inclusive, _ = delta_range(s.divergence)
    if not _checks.in_delta_range(s.delta, lo, hi, hi_inclusive):
        raise ValueError(f"{name('delta')}={s.delta!r} is outside the range of the shipped {s.divergence!r} table, "
                         f"{_checks.delta_interval(lo, hi, hi_inclusive)}")


def _check_eps(s: LossSettings, name) -> None:
    # fixed: a lower bound 1 - eps_low in [0, 1]; dcpo: eps must be > 0 (eps/p at p = 0 is 0/0).
    default_low, default_high = DEFAULT_EPS[s.clip]
    eps_low = default_low if s.eps_low is None else s.eps_low
    eps_high = default_high if s.eps_high is None else s.eps_high
    fixed = s.clip == "fixed"
    if not (_checks.is_number(eps_low) and ((0 <= eps_low <= 1) if fixed else (0 < eps_low < math.inf))):
        raise ValueError(f"{name('eps_low')} must be a number {'in [0, 1]' if fixed else '> 0'} for "
                         f"clip={s.clip!r}, got {eps_low!r}")
    if not (_checks.is_number(eps_high) and ((0 <= eps_high < math.inf) if fixed else (0 < eps_high < math.inf))):
        raise ValueError(f"{name('eps_high')} must be a finite number {'>= 0' if fixed else '> 0'} for "
                         f"clip={s.clip!r}, got {eps_high!r}")


class Default:
    """An option's default in an entry point's signature (shown as its value): an option left at it is told
    apart from the same value given, so that `settings=` plus any keyword option is refused."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


# The entry points' keyword defaults, read once here (Dynamo cannot trace dataclasses.fields inside a compiled frame).
DEFAULTS = {f.name: Default(f.default) for f in dataclasses.fields(LossSettings) if f.name in FIELDS}


def resolve(settings: LossSettings | None, options: dict, where: str) -> LossSettings:
    """The settings an entry point uses: `settings` as given (then no keyword option may be given), or a
    LossSettings built from the keyword options (those left out at their defaults, `DEFAULTS`)."""
    given = {k: v for k, v in options.items() if not isinstance(v, Default)}
    if settings is None:
        return build(given)
    if not isinstance(settings, LossSettings):
        raise TypeError(f"{where}: settings must be a bandpo_lut.LossSettings, got {type(settings).__name__}")
    if given:
        raise ValueError(f"{where}: give the options either as settings=LossSettings(...) or as keyword "
                         f"arguments, not both (also given: {', '.join(given)})")
    return settings


# Settings built from plain options, by (type, value) of each option and the field names: an eager training loop
# that calls policy_loss with the same keywords every step, or a trainer integration asking for its config's
# settings at every loss call, validates them once (building and validating cost ~30 us a call, a tenth of a small
# batch's eager step). Bounded (a δ schedule brings a new value every step): emptied when full.
_BUILT: dict = {}
_BUILT_MAX = 64


def build(options: Mapping[str, object], field_names: Mapping[str, str] | None = None) -> LossSettings:
    """`LossSettings(**options, field_names=field_names)`, built once per distinct value in eager code when every
    option is a plain number, string or None (the type is in the key: 1 == 1.0 == True, but a bool is no number to
    LossSettings). Under torch.compile the object is built as before (a symbolic δ must not become a dictionary
    key: that would guard on its value, one graph per δ); a tensor δ, or any other value, is never a key (equal
    tensors are not equal keys; an unhashable value meets LossSettings' own check)."""
    names = dict(field_names) if field_names else None
    if torch.compiler.is_compiling() or any(not isinstance(v, (str, int, float, type(None))) for v in options.values()):
        return LossSettings(**options, field_names=names)
    key = (tuple((k, type(v), v) for k, v in options.items()), tuple(names.items()) if names else None)
    built = _BUILT.get(key)
    if built is None:
        built = LossSettings(**options, field_names=names)   # raises for bad options: nothing is stored
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.clear()
        _BUILT[key] = built
    return built
