#!/usr/bin/env bash
# All GPU benchmarks, on the device machine from the repository root. JSON
# results go to $OUT/results and, packed, to $OUT/results.tar.gz (copy them
# to benchmarks/results/ here); logs to $OUT/bench.log.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG="$OUT/bench.log"
bench() {  # bench LABEL COMMAND...
  local label=$1 start=$SECONDS; shift
  echo "### $label: $*" >> "$LOG"
  timeout "${BENCH_TIMEOUT:-240}" "$@" >> "$LOG" 2>&1
  echo "== $label rc=$? $((SECONDS - start))s"
}
for name in ${BENCHMARKS:-transport overhead experts layer}; do
  bench "$name" python -m moe_ep.bench "$name" --out "$OUT/results"
done
if [ "$(python -c 'import jax; print(jax.device_count())')" -ge 2 ]; then
  bench ep_one_process python -m moe_ep.bench ep --out "$OUT/results"
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" bench ep_one_process_graphs \
    python -m moe_ep.bench ep --out "$OUT/results"
  XLA_PYTHON_CLIENT_PREALLOCATE=false bench ep_two_processes python -m moe_ep.launch \
    --num-processes 2 --gpus-per-process 1 --timeout 200 -- python -m moe_ep.bench ep --out "$OUT/results"
fi
grep -v -E "Warning|warn\(|^\s*$|Gloo" "$LOG" | grep -E "^(###|P[1-4]|  |host|\[p0\])" | tail -n 60
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
