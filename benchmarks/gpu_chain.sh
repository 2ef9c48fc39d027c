#!/usr/bin/env bash
# Chained tiles on the GPU, from the repository root on the device machine:
# what docs/grouped.md measured. Two switches, each on by default:
#   SETTING=moe_ep.experts.hopper.CHAIN_TILES BANK_OPTION=_tile_by_tile
#     each CTA's row tiles' pipelines as one chain (the default here);
#   SETTING=moe_ep.experts.hopper_wgrad.CHAIN_TILES BANK_OPTION=_wgrad_tile_by_tile
#     the weight gradient's ring.
# BANK_OPTION is the models bench's option that times the bank with SETTING
# off beside the defaults. STEPS picks the steps (default tests and models):
#   tests      the chained kernels against tile-by-tile ones bit for bit, and
#              every kernel's lowering with them
#   memcheck   the sanitizer workload chained, each buffer its own allocation
#   racecheck  the same, kernels only
#   models     the banks with BANK_OPTION against the defaults, beside the dense
#              chain, on MODELS (default the Qwen3 and OLMoE shapes)
#   pretrain   configs/h200.yaml at batch 12 and configs/h200_fine.yaml at
#              batch 6 with SETTING False, then True (two results of
#              benchmarks/gpu_pretrain.sh, one after the other)
# Logs go to $OUT, JSON to $OUT/results.
source benchmarks/gpu_setup.sh
SANITIZE=(compute-sanitizer --target-processes application-only --error-exitcode 7)
WORKLOAD=(python tests/experts/hopper_sanitizer_workload.py)
SETTING=${SETTING:-moe_ep.experts.hopper.CHAIN_TILES}
BANK_OPTION=${BANK_OPTION:-_tile_by_tile}
MODEL_ARGS=()
for model in ${MODELS:-qwen3_30b_a3b olmoe_1b_7b}; do MODEL_ARGS+=(--model "$model"); done
for name in ${STEPS:-tests models}; do
  case $name in
    tests) step tests 200 env XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -q -m gpu \
             -n 8 -p no:cacheprovider tests/experts -k "chain or lower" -rfE ;;
    memcheck) step memcheck 200 env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
                "${SANITIZE[@]}" --tool memcheck "${WORKLOAD[@]}" ;;
    racecheck) step racecheck 200 "${SANITIZE[@]}" --tool racecheck "${WORKLOAD[@]}" \
                 --no-reference ;;
    models) step models ${MODELS_SECONDS:-330} python -m moe_ep.bench models "${MODEL_ARGS[@]}" \
              --bank-option "$BANK_OPTION" --out "$OUT/results" ;;
    pretrain)
      for chained in False True; do
        RUNS="h200_b12_chain$chained configs/h200.yaml train.batch_size=12
fine_b6_chain$chained configs/h200_fine.yaml train.batch_size=6" STEPS=${PRETRAIN_STEPS:-20} \
        RUN_TIMEOUT=${RUN_TIMEOUT:-120} PRETRAIN_CMD="python benchmarks/run_with.py \
          $SETTING=$chained -m examples.pretrain" \
          bash benchmarks/gpu_pretrain.sh | tail -3
      done ;;
    *) echo "unknown step $name (tests, memcheck, racecheck, models, pretrain)"; exit 2 ;;
  esac
done
grep -h -E "(FAILED|passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|grouped_|dense:|layer_)" \
  "$OUT"/*.log | head -60
