"""The bounds oracle: `bounds(p_old, delta, divergence) -> (lower, upper)`, the pure-PyTorch float64 table reader
the compiled kernels are tested against. It lives in `bandpo_lut.tables.reader`, beside the tables it reads,
because table generation and verification use it too; this is its public name."""
from bandpo_lut.tables.reader import LOG_PROB_ROUNDING, bounds

__all__ = ["LOG_PROB_ROUNDING", "bounds"]
