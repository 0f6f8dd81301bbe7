#!/usr/bin/env python
"""BandPO with TRL's GRPO trainer: a script to copy.

    python examples/trl_bandpo.py                      # tiny Qwen2 built here, CPU, ~30 s
    python examples/trl_bandpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/tldr \
        --learning_rate 1e-6 --max_steps 500 --per_device_train_batch_size 8

Every `BandGRPOConfig` field is a flag (``--band_delta 0.05 --band_max_ratio 10 --delta 10 ...``);
the defaults are the paper's settings (KL, δ = 0.05, upper bound capped at 10, dual clip 10).
Without ``--model`` the policy is a tiny random Qwen2 with a character tokenizer, both built here,
so the script runs offline; the reward (more "a", fewer "h") is a stand-in for yours.

What to read in the log: ``band/clip_frac`` (tokens the band clipped), ``band/clip_frac_upper_lowprob``
(the paper's clip-high rate of low-probability tokens), ``band/dual_clip_frac``. TRL's own
``clip_ratio/*`` compare the ratio after TRL's dual-clip cap with the bounds, so they miss tokens
above the cap; read ``band/*``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from datasets import Dataset, load_dataset

from bandpo_lut.integrations.trl import BandGRPOConfig, BandGRPOTrainer, argument_parser


@dataclass
class ScriptArguments:
    model: Optional[str] = field(default=None, metadata={
        "help": "A model id or folder; default: a tiny random Qwen2 built locally (offline)."})
    dataset: Optional[str] = field(default=None, metadata={
        "help": "A dataset with a 'prompt' column (datasets.load_dataset name); default: a few "
                "short prompts built here."})
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset."})


# Settings for the tiny local model (a random model needs a large learning rate to move in a few
# dozen steps); each applies only where the command line does not set it. 12 steps: at this rate the
# stand-in reward saturates (all 8 tokens "a", every advantage 0, nothing left to train) near step 14.
TINY_DEFAULTS = dict(learning_rate=0.05, max_steps=12, per_device_train_batch_size=8,
                     num_generations=4, max_completion_length=8, logging_steps=2, beta=0.0)
# For every run: several optimiser steps per generation batch, so that the ratio moves and the
# band acts (with TRL's default, num_iterations=1, the ratio is 1 and no clip ever acts).
RUN_DEFAULTS = dict(output_dir="bandpo-trl-example", num_iterations=2, report_to="none",
                    save_strategy="no")

CHARS = "abcdefgh "
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
PROMPTS = ["abc", "hgf", "a b", "dd", "ceg", "bah", "fed", "g a", "cab", "hh", "e f", "bad"]


def tiny_model_and_tokenizer():
    """A 2-layer Qwen2 over a 13-token character vocabulary, and its tokenizer (no download)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {**SPECIAL, **{c: i + len(SPECIAL) for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    return Qwen2ForCausalLM(config), tokenizer


def reward_fn(completions, **kwargs):
    """Stand-in reward: more "a", fewer "h" (rewards differ within a group, so advantages do too)."""
    return [float(str(c).count("a")) - 0.5 * str(c).count("h") for c in completions]


def _given(argv: list[str], name: str) -> bool:
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def main(argv: Optional[list[str]] = None) -> BandGRPOTrainer:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argument_parser(ScriptArguments, BandGRPOConfig)  # HfArgumentParser; --delta None works
    tiny = not _given(argv, "model")
    defaults = {**RUN_DEFAULTS, **(TINY_DEFAULTS if tiny else {})}
    import torch

    if not torch.cuda.is_available():  # TRL's default is bf16 on a GPU
        defaults.update(use_cpu=True, bf16=False)
    extra = [x for k, v in defaults.items() if not _given(argv, k) for x in (f"--{k}", str(v))]
    script, args = parser.parse_args_into_dataclasses(argv + extra)  # bad settings fail here

    if tiny:
        model, tokenizer = tiny_model_and_tokenizer()
    else:
        model, tokenizer = script.model, None  # TRL loads the model and its tokenizer
    if script.dataset is None:
        dataset = Dataset.from_dict({"prompt": PROMPTS})
    else:
        dataset = load_dataset(script.dataset, split=script.dataset_split)

    trainer = BandGRPOTrainer(model=model, reward_funcs=reward_fn, args=args,
                              train_dataset=dataset, processing_class=tokenizer)
    print(f"BandPO: {args.band_divergence}, delta {args.band_delta}, upper bound capped at "
          f"{args.band_max_ratio}, dual clip (TRL's delta) {args.delta}; "
          f"num_iterations {args.num_iterations}")
    trainer.train()

    logs = [h for h in trainer.state.log_history if "band/clip_frac" in h]
    # A window whose rewards were all equal (reward_std 0) had no advantage and trained nothing: its
    # fractions are 0 by construction, so the run's means leave it out and say how many there were.
    live = [h for h in logs if h.get("reward_std", 1.0) > 0]
    if live:
        mean = {k: sum(h[k] for h in live) / len(live) for k in
                ("band/clip_frac", "band/clip_frac_upper", "band/clip_frac_upper_lowprob",
                 "band/dual_clip_frac", "band/ppo_kl")}
        print(f"mean over the {len(live)} of {len(logs)} logging windows with a learning signal "
              f"(reward_std > 0): " + ", ".join(f"{k} {v:.4f}" for k, v in mean.items()))
    return trainer


if __name__ == "__main__":
    main()
