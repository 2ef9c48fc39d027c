#!/usr/bin/env bash
# All GPU benchmarks, on the device machine from the repository root. JSON
# results go to $OUT/results and, packed, to $OUT/results.tar.gz (keep the
# ones the docs cite in benchmarks/results/<benchmark>/, then run
# python benchmarks/index.py); a log per benchmark to $OUT/bench-<name>.log.
source benchmarks/gpu_setup.sh
T=${BENCH_TIMEOUT:-240}
for name in ${BENCHMARKS:-transport overhead experts layer}; do
  step "bench-$name" "$T" python -m moe_ep.bench "$name" --out "$OUT/results"
done
if [ "$(python -c 'import jax; print(jax.device_count())')" -ge 2 ]; then
  step bench-ep_one_process "$T" python -m moe_ep.bench ep --out "$OUT/results"
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" step bench-ep_one_process_graphs "$T" \
    python -m moe_ep.bench ep --out "$OUT/results"
  XLA_PYTHON_CLIENT_PREALLOCATE=false step bench-ep_two_processes "$T" python -m moe_ep.launch \
    --num-processes 2 --gpus-per-process 1 --timeout 200 -- python -m moe_ep.bench ep --out "$OUT/results"
fi
cat "$OUT"/bench-*.log | grep -v -E "Warning|warn\(|^\s*$|Gloo" | grep -E "^(P[1-4]|  |host|\[p0\])" | tail -n 60
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
