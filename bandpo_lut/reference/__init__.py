"""Pure-PyTorch references: correct, not fast. The compiled ops are tested against these."""
