"""Pure-PyTorch references, correct rather than fast (the compiled ops are tested against them): the float64
table reader `bandpo_lut.reference.bounds(...)` and the executable specification of the policy loss, the module
`bandpo_lut.reference.policy_loss` (its docstring; the function `bandpo_lut.reference.policy_loss.policy_loss`)."""
from . import policy_loss  # noqa: F401  (imported here so that the documented spelling is an attribute of this package)
from .bounds import bounds  # noqa: F401  (the function; `from bandpo_lut.reference.bounds import ...` still works)
