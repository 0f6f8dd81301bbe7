"""`bandpo-lut demo`: toy GRPO tasks comparing BandPO with the baselines (`command`: the subcommand's arguments;
`registry`: every task behind one interface; `tasks`: the tabular tasks and their methods; `report`: their table and
figure)."""
