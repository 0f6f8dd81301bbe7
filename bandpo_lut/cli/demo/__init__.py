"""`bandpo-lut demo`: toy GRPO tasks comparing BandPO with the baselines (`command`: the subcommand; `tasks`: the
tasks and methods; `report`: their table and figure)."""
