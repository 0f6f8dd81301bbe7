"""What the trainer plug-ins' check scripts share (skyrl_checks.py, openrlhf_checks.py, beside this file). Each script
runs in a fresh interpreter with its trainer's folder on PYTHONPATH (this folder is the script's, so it is
importable), registers named checks with `check`, and prints `RESULTS` as one JSON object: name -> [ok, detail]."""
from __future__ import annotations

import warnings
from importlib import metadata

import torch
from helpers import clamp_ties_included

from bandpo_lut.reference.bounds import bounds as reference_bounds

RESULTS: dict = {}


def check(name):
    """Run the decorated function now; record [True, its return value] or [False, the error] under `name`."""
    def run(fn):
        try:
            RESULTS[name] = [True, fn()]
        except Exception as exc:  # reported to the pytest side, which fails the named test
            RESULTS[name] = [False, f"{type(exc).__name__}: {exc}"]
        return fn
    return run


def batch(seed, *, b=5, t=9, spread=0.7):
    """(new, old, adv, mask) log-probs, advantages and a float mask whose first sequence is empty; one generator,
    so that `g` can go on to draw what a trainer needs besides (returned last)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64).clamp_min(1e-5)).float()
    new = (old + spread * torch.randn(b, t, generator=g)).clamp_max(0.0)
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    mask[0] = 0.0  # an empty sequence
    return new, old, adv, mask, g


def independent_per_token(new, old, adv, *, delta=0.05, max_ratio=10.0, dual_clip=10.0, weight=None):
    """BandPO's per-token loss from its definition, on the pure-PyTorch reference bounds: (the leaf, the loss)."""
    lp = new.clone().requires_grad_(True)
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    lo, up = reference_bounds(log_p_old=old, delta=delta, divergence="kl")
    up = up.clamp(max=max_ratio)
    loss = torch.maximum(-adv * ratio, -adv * clamp_ties_included(ratio, lo, up))
    loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return lp, loss if weight is None else loss * weight


def close(a, b, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def version_policy(dist: str, plugin: str, check_version, owner, attr: str, changed, *needles) -> str:
    """The plug-ins' version policy, checked the same way for each: an untested `dist` version of the same
    structure imports with a warning naming it; one whose `owner.attr` (what the plug-in relies on) became
    `changed` is refused by `check_version()` with an ImportError containing every needle."""
    real, original = metadata.version, getattr(owner, attr)
    try:
        metadata.version = lambda name: "9.9.9" if name == dist else real(name)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            check_version()
        prefix = f"bandpo_lut.integrations.{plugin}: {dist} 9.9.9 is not one of the tested"
        assert any(str(w.message).startswith(prefix) for w in record), record
        setattr(owner, attr, changed)
        try:
            check_version()
        except ImportError as exc:
            assert all(n in str(exc) for n in needles), str(exc)
        else:
            raise AssertionError("a changed convention was accepted")
    finally:
        setattr(owner, attr, original)
        metadata.version = real
    return "ok"
