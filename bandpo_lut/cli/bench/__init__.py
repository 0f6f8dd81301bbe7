"""`bandpo-lut bench`: speed and memory of the ops and the losses (`command`: the subcommand and the op/loss rows;
`fused_linear`: the fused-linear loss against the unfused one)."""
