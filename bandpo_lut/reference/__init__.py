"""Pure-PyTorch references, correct rather than fast (the compiled ops are tested against them): the float64
table reader `bandpo_lut.reference.bounds(...)` and the executable specification of the policy loss (`.policy_loss`)."""
from .bounds import bounds  # noqa: F401  (the function; `from bandpo_lut.reference.bounds import ...` still works)
