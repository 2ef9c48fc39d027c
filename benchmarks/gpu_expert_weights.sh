#!/usr/bin/env bash
# What the MoE's backward recomputes, and what saving more of it buys, on the
# device machine, from the repository root: configs/h200_fine.yaml at batch 6
# profiled (examples/profile_step.py, $OUT/profile-<variant>/) as shipped and
# saving the experts' bf16 weights (moe.remat.save +
# expert_weights; PROFILE=0: not); then configs/h200.yaml at batch 12
# and configs/h200_fine.yaml at batch 6 trained with and without them saved
# (benchmarks/gpu_pretrain.sh's JSON; PRETRAIN=0: not).
source benchmarks/gpu_setup.sh
SAVE='moe.remat.save=[dispatch,expert_hidden,expert_output,expert_weights]'
for variant in $([ "${PROFILE:-1}" = 1 ] && echo shipped saved); do
  extra=(); [ "$variant" = saved ] && extra=("$SAVE")
  step "profile-fine-$variant" 150 python -m examples.profile_step configs/h200_fine.yaml \
    train.batch_size=6 "${extra[@]}" --steps 4 --out "$OUT/profile-fine-$variant"
  grep -E "^- step|remat recompute|^\| (expert GEMMs|router|other|remat)" \
    "$OUT"/profile-fine-$variant/*.md
done
[ "${PRETRAIN:-1}" = 1 ] || exit 0
RUNS="h200_b12 configs/h200.yaml train.batch_size=12
h200_b12_saved configs/h200.yaml train.batch_size=12 $SAVE
fine_b6 configs/h200_fine.yaml train.batch_size=6
fine_b6_saved configs/h200_fine.yaml train.batch_size=6 $SAVE" \
  RUN_TIMEOUT=${RUN_TIMEOUT:-130} bash benchmarks/gpu_pretrain.sh
