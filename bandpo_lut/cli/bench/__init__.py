"""`bandpo-lut bench`: speed and memory of the ops, the loss and the fused-linear loss."""
