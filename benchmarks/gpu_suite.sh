#!/usr/bin/env bash
# The README's two commands on the GPU machine, from the repository root: the
# whole test suite (GPU tests included), then the default main job. Logs to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
python -c "import jax, flax, cupy; print(jax.__version__, flax.__version__, cupy.__version__, jax.devices())"
start=$SECONDS
timeout "${SUITE_TIMEOUT:-540}" python -m pytest -q -v -rfEs --durations=30 > "$OUT/suite.log" 2>&1
echo "== suite rc=$? $((SECONDS - start))s: $(tail -n 1 "$OUT/suite.log")"
start=$SECONDS
timeout "${MAIN_TIMEOUT:-120}" python examples/pretrain.py > "$OUT/main.log" 2>&1
echo "== main rc=$? $((SECONDS - start))s: $(tail -n 1 "$OUT/main.log")"
grep -E "(FAILED|ERROR)" "$OUT/suite.log" | head -40
