#!/usr/bin/env bash
# The README's two commands on the GPU machine, from the repository root: the
# whole test suite (GPU tests included), then the default main job. Logs to $OUT.
source benchmarks/gpu_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step suite "${SUITE_TIMEOUT:-540}" python -m pytest -q -v -rfEs --durations=30
step main "${MAIN_TIMEOUT:-120}" python -m examples.pretrain
grep -E "(FAILED|ERROR)" "$OUT/suite.log" | head -40
