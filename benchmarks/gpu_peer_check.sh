#!/usr/bin/env bash
# The peer path's safety and the layer on it, on the device machine (2 GPUs),
# from the repository root: P4 at the DeepSeek-like shape on both exchanges
# (bf16 and FP8 dispatch), then compute-sanitizer memcheck and racecheck over
# tests/transport/cupy_sanitizer_workload.py, one process per GPU. JSON goes to
# $OUT/check-results.tar.gz, logs to $OUT. TOOLS: the sanitizer tools to run;
# LAYER=0 skips P4 (the sanitizer runs alone, about a minute a tool).
source benchmarks/gpu_setup.sh
if [ "${LAYER:-1}" = 1 ]; then
  PROGRAM="
import pathlib
from moe_ep.bench import common, layer
result = layer.run(hidden=7168, ffn=2048, num_experts=64, top_k=8, tokens=8192, seq=2048,
                   capacity_factors=(1.25,))
print(layer.summary(result))
print(common.write_result('layer', result, pathlib.Path('$OUT/results')))
"
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" step layer "${LAYER_TIMEOUT:-240}" \
    python -c "$PROGRAM"
  grep -E "^P4|^  " "$OUT/layer.log"
fi
# compute-sanitizer 2025.3.1's front end segfaults at start-up in about a
# third of its runs when it follows the workload's child processes (its
# default, --target-processes all): on one H200 on 2026-12-01, memcheck over
# this workload crashed in 2 of 6 runs (rc 139 within 3-11 s, no output but
# its banner; under cuda-gdb, a worker thread of the compute-sanitizer binary
# itself). With --target-processes application-only: 0 of 9.
# A run that printed no summary is still tried again.
for tool in ${TOOLS:-memcheck racecheck}; do
  for attempt in 1 2 3 4 5; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false step "$tool" "${SANITIZER_TIMEOUT:-150}" \
      python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 \
      --timeout "${SANITIZER_TIMEOUT:-150}" -- \
      compute-sanitizer --tool "$tool" --target-processes application-only \
        --report-api-errors no --error-exitcode 7 \
      python tests/transport/cupy_sanitizer_workload.py
    echo "   (attempt $attempt) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|workload done' \
      "$OUT/$tool.log" | tr '\n' ' ')"
    grep -q -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" && break
  done
done
tar -czf "$OUT/check-results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
