"""`bandpo-lut bench`: speed and memory of the ops and the losses (`command`: the subcommand and the op/loss rows;
`fused_linear`: the fused-linear loss against the unfused one; `measure`: peak memory, read in a child process;
`child`: that child, run as `python -m bandpo_lut.cli.bench.child`)."""
