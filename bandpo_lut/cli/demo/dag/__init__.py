"""`bandpo-lut demo --task dag-paths`: a small GPT trained from scratch on paths through a random layered graph, then
GRPO under each clip (`graph`: the task and its exact answer sets; `model`: the GPT; `metrics`: the exact metrics;
`train`: warm-up and GRPO; `report`: table, endpoints and figure; `task`: the demo task behind the registry's
interface)."""
