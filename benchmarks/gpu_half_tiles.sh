#!/usr/bin/env bash
# Half tiles (moe_ep.row_groups.GROUP_ALIGN = 64) and clusters of two CTAs
# (moe_ep.experts.hopper.CLUSTER_COLUMNS = 2) on the GPU, from the repository
# root on the device machine: what docs/grouped.md asks before either default
# flips. STEPS picks the steps (default all five; a device call of 600 s
# holds about two):
#   tests      the float64 GPU tests on half tiles (plain, fused, the layer)
#   clusters   the bank in clusters of two CTAs against single CTAs, bit for bit
#   clustercheck  memcheck on the workload in clusters of two (not by default)
#   memcheck   the sanitizer workload on half tiles, each buffer its own allocation
#   racecheck  the same, kernels only (cuBLAS's reference reports hazards of its own)
#   models     the banks on half against whole tiles, in clusters and not,
#              beside the dense chain
# Logs go to $OUT, JSON to $OUT/results.
source benchmarks/gpu_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SANITIZE=(compute-sanitizer --target-processes application-only --error-exitcode 7)
WORKLOAD=(python tests/experts/hopper_sanitizer_workload.py --align 64)
OPTIONS=()  # BANK_OPTIONS="_align64 ...": the models step's bank options (default all)
for option in ${BANK_OPTIONS:-}; do OPTIONS+=(--bank-option "$option"); done
for name in ${STEPS:-tests clusters memcheck racecheck models}; do
  case $name in
    tests) step tests 300 python -m pytest -q -m gpu tests/experts tests/test_layer_layouts.py \
             -k "align64 and (256-512 or 2880-1408 or hopper-bfloat16-mixed \
                 or hopper-bfloat16-half or 1408x2880 or layer_matches) and not clusters" ;;
    clusters) step clusters 150 python -m pytest -q -m gpu tests/experts -k clusters_of_two ;;
    clustercheck) step clustercheck 200 env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
                    "${SANITIZE[@]}" --tool memcheck "${WORKLOAD[@]}" --cluster 2 ;;
    memcheck) step memcheck 200 env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
                "${SANITIZE[@]}" --tool memcheck "${WORKLOAD[@]}" ;;
    racecheck) step racecheck 200 "${SANITIZE[@]}" --tool racecheck "${WORKLOAD[@]}" \
                 --no-reference ;;
    models) step models ${MODELS_SECONDS:-400} python -m moe_ep.bench models --model qwen3_30b_a3b \
              --model olmoe_1b_7b --model deepseek_v3 "${OPTIONS[@]}" --out "$OUT/results" ;;
    *) echo "unknown step $name (tests, clusters, clustercheck, memcheck, racecheck, models)"; exit 2 ;;
  esac
done
grep -h -E "(FAILED|passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|align64)" "$OUT"/*.log | head -40
