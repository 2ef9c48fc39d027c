#!/usr/bin/env bash
# The experts' bf16 weights saved (moe.remat.save + expert_weights) against
# recast in backward, end to end on the device machine, from the repository
# root: configs/h200.yaml at batch 12 and configs/h200_fine.yaml at batch 6,
# each with and without, alternating (benchmarks/gpu_pretrain.sh's JSON).
SAVE='moe.remat.save=[dispatch,expert_hidden,expert_output,expert_weights]'
RUNS="h200_b12 configs/h200.yaml train.batch_size=12
h200_b12_weights configs/h200.yaml train.batch_size=12 $SAVE
fine_b6 configs/h200_fine.yaml train.batch_size=6
fine_b6_weights configs/h200_fine.yaml train.batch_size=6 $SAVE" \
  RUN_TIMEOUT=${RUN_TIMEOUT:-150} bash benchmarks/gpu_pretrain.sh
