"""`bandpo_lut.reference` as docs/api.md spells it, after `import bandpo_lut` alone, in a fresh process: the function
`reference.bounds` and the module `reference.policy_loss` (the loss's specification, with its function
`policy_loss`), imported on first use rather than with the package."""
from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.subprocess

CODE = r"""
import json, sys
import torch
import bandpo_lut

out = {"imported_with_the_package": "bandpo_lut.reference" in sys.modules}
spec = bandpo_lut.reference.policy_loss
lp = torch.log(torch.tensor([[0.3, 0.5, 0.9]]))
adv = torch.tensor([[1.0, -2.0, 0.5]])
loss, metrics = spec.policy_loss(lp, lp, adv)
lo, up = bandpo_lut.reference.bounds(torch.tensor([0.5], dtype=torch.float64), 0.05)
out.update(module=spec.__name__, loss=loss.item(), n_tokens=metrics["n_tokens"].item(), lo=lo.item(), up=up.item())
print(json.dumps(out))
"""


def kl_old_new(p: float, q: float) -> float:
    """KL(old || new) of the two-point distributions (the token, the rest), f(u) = u - 1 - log u of the registry."""
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_the_documented_spelling_works_after_import_bandpo_lut(fresh):
    out = json.loads(fresh(["-c", CODE], check=True).stdout.splitlines()[-1])
    assert out["imported_with_the_package"] is False
    assert out["module"] == "bandpo_lut.reference.policy_loss"
    # ratio 1 everywhere: inside every band, so the token-mean of -A
    assert out["loss"] == pytest.approx(-(1.0 - 2.0 + 0.5) / 3, rel=1e-6)
    assert out["n_tokens"] == 3
    # the KL band at p = 1/2: the ratios r whose new probability p*r is at KL distance delta from p
    for r in (out["lo"], out["up"]):
        assert kl_old_new(0.5, 0.5 * r) == pytest.approx(0.05, rel=1e-6)
    assert out["lo"] < 1 < out["up"]
