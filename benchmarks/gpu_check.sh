#!/usr/bin/env bash
# GPU correctness pass, run on the device machine from the repository root:
# the CuPy tests, the CuPy-parametrised transport and layer tests, memcheck
# over a kernel workload, the 2-GPU multi-process test. Logs go to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -c "import jax, flax, cupy; print(jax.__version__, flax.__version__, cupy.__version__, jax.devices())"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - start))s: $(tail -n 1 "$OUT/$name.log")"
}
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
