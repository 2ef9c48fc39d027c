# Sourced by every benchmarks/gpu_*.sh, from the repository root on the device
# machine: its environment (NVLink multicast off), $OUT for logs and
# $OUT/results for JSON, the editable install (no build isolation: the device
# machine has no package index), the versions it runs, and
#   step NAME SECONDS COMMAND...
# which runs COMMAND with a time limit into $OUT/NAME.log and prints one line:
# its exit code, its seconds and the log's last line.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python - <<'PY'
import importlib.util, jax, flax
cupy = importlib.util.find_spec("cupy") and __import__("cupy").__version__
print("jax", jax.__version__, "flax", flax.__version__, "cupy", cupy, jax.devices())
PY
step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2 start=$SECONDS rc
  shift 2
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $((SECONDS - start))s: $(tail -n 1 "$OUT/$name.log")"
  return $rc
}
