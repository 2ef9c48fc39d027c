#!/usr/bin/env bash
# GPU correctness pass, run on the device machine from the repository root:
# the CuPy tests, the CuPy-parametrised transport and layer tests, memcheck
# over a kernel workload, the 2-GPU multi-process test. Logs go to $OUT.
source benchmarks/gpu_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[ "${SKIP_TESTS:-0}" = 1 ] || step cupy_tests 200 python -m pytest -q -x -m gpu tests/transport/test_cupy.py
[ "${SKIP_TESTS:-0}" = 1 ] || step cupy_param 300 python -m pytest -q -k cupy tests/transport tests/test_layer.py
for attempt in 1 2 3; do  # its front end can segfault at start-up (gpu_peer_check.sh)
  step memcheck 150 compute-sanitizer --tool memcheck --target-processes application-only \
    --report-api-errors no --error-exitcode 7 \
    python tests/transport/cupy_sanitizer_workload.py
  grep -q "ERROR SUMMARY" "$OUT/memcheck.log" && break
done
step multiprocess_gpu 150 python -m pytest -q -m gpu tests/multiprocess
grep -h -E "(FAILED|Error|error|ERROR SUMMARY)" "$OUT"/*.log | head -40
