#!/usr/bin/env bash
# BandPO with verl's PPO trainer (GRPO advantages), the paper's settings: KL trust region,
# delta 0.05, upper ratio bound capped at 10, dual clip 10. verl 0.9.1, one node.
#
#   bash examples/verl_bandpo.sh                                   # the defaults below
#   MODEL=Qwen/Qwen2.5-7B-Instruct N_GPUS=8 bash examples/verl_bandpo.sh trainer.total_epochs=5
#
# Data: verl's GSM8K parquet files (examples/data_preprocess/gsm8k.py in verl's repository writes
# them to ~/data/gsm8k). Extra arguments are passed to verl as Hydra overrides.
#
# BandPO is the six actor_rollout_ref.actor.policy_loss lines (the last four spell out the
# defaults); the rest is an ordinary verl GRPO command line. The band acts only when the ratio
# moves: keep several optimiser steps per rollout batch (ppo_mini_batch_size below
# train_batch_size, as here: 4 steps; or ppo_epochs > 1). With one step per batch the ratio is 1
# and no clip acts.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
N_GPUS=${N_GPUS:-8}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=512 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.policy_loss.loss_mode=bandpo \
    actor_rollout_ref.actor.policy_loss._target_=bandpo_lut.integrations.verl.BandPolicyLossConfig \
    +actor_rollout_ref.actor.policy_loss.band_divergence=kl \
    +actor_rollout_ref.actor.policy_loss.band_delta=0.05 \
    +actor_rollout_ref.actor.policy_loss.band_max_ratio=10 \
    +actor_rollout_ref.actor.policy_loss.band_dual_clip=10 \
    trainer.logger='["console"]' \
    trainer.project_name=bandpo \
    trainer.experiment_name=grpo-bandpo-kl-0.05 \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=15 \
    "$@"
