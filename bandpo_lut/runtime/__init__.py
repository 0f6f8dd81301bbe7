"""What runs per training step: the compiled extension's loader (`_extension`) and its op registrations (`_ops`:
fake kernels, autograd), the band ops (`api`: `bounds`, `clip`), the fused policy loss (`loss`) and its
fused-linear form (`fused_linear`), the loss contract shared with the specification (`loss_spec`), and the
device-resident table cache (`table_cache`)."""
