#!/usr/bin/env bash
# What the MoE's backward recomputes, and what saving more of it buys, on the
# device machine, from the repository root: configs/h200_fine.yaml at batch 6
# profiled (examples/profile_step.py, $OUT/profile-<variant>/) as shipped and
# saving the experts' bf16 weights and the routing (moe.remat.save +
# expert_weights, router); then configs/h200.yaml at batch 12 trained with
# and without the weights saved (benchmarks/gpu_pretrain.sh's JSON; PRETRAIN=0:
# not).
source benchmarks/gpu_setup.sh
SAVE='moe.remat.save=[dispatch,expert_hidden,expert_output,expert_weights,router]'
for variant in shipped saved; do
  extra=(); [ "$variant" = saved ] && extra=("$SAVE")
  step "profile-fine-$variant" 150 python -m examples.profile_step configs/h200_fine.yaml \
    train.batch_size=6 "${extra[@]}" --steps 4 --out "$OUT/profile-fine-$variant"
  grep -E "^- step|remat recompute|^\| (expert GEMMs|router|other|remat)" \
    "$OUT"/profile-fine-$variant/*.md
done
[ "${PRETRAIN:-1}" = 1 ] || exit 0
RUNS="h200_b12 configs/h200.yaml train.batch_size=12
h200_b12_saved configs/h200.yaml train.batch_size=12 $SAVE" \
  RUN_TIMEOUT=${RUN_TIMEOUT:-130} bash benchmarks/gpu_pretrain.sh
