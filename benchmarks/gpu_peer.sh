#!/usr/bin/env bash
# The peer transport on the device machine (2 GPUs), from the repository
# root: its GPU tests, then P2 (`moe_ep.bench ep`) in one process with CUDA
# graphs for the callbacks. JSON goes to $OUT/ep-results.tar.gz, logs to $OUT.
#   PEER_TESTS=0 skips the tests; EP_ARGS is a Python dict of run() arguments;
#   PROCESSES=2 runs P2 as one process per GPU; TIMELINE=1 then also runs
#   `moe_ep.bench timeline` (one process, every GPU's kernels per call),
#   without and with the decode dispatch in one launch.
source benchmarks/gpu_setup.sh
if [ "${PEER_TESTS:-1}" = 1 ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false step peer_tests "${TEST_TIMEOUT:-240}" \
    python -m pytest -q -x -m gpu tests/transport/test_peer.py tests/test_exchange_paths.py \
    tests/transport/test_fp8_dispatch.py
fi
EP_ARGS=${EP_ARGS:-"{}"}
PROGRAM="
import pathlib
from moe_ep import distributed
from moe_ep.bench import common, ep
distributed.initialize_from_env()
result = ep.run(**$EP_ARGS)
import jax
if jax.process_index() == 0:
  print(ep.summary(result))
  print(common.write_result('ep', result, pathlib.Path('$OUT/results')))
"
if [ "${PROCESSES:-1}" = 1 ]; then  # one process for both GPUs: CUDA graphs need the flag
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" step ep "${BENCH_TIMEOUT:-400}" \
    python -c "$PROGRAM"
else  # one process per GPU, every GPU visible to each (the launcher's own limit ends it)
  XLA_PYTHON_CLIENT_PREALLOCATE=false step ep "$((${BENCH_TIMEOUT:-400} + 30))" \
    python -m moe_ep.launch --num-processes "$PROCESSES" --gpus-per-process 1 \
    --timeout "${BENCH_TIMEOUT:-400}" -- python -c "$PROGRAM"
fi
grep -v -E "Warning|warn\(|^\s*$|Gloo" "$OUT/ep.log" | tail -n 40
if [ "${TIMELINE:-0}" = 1 ]; then
  # twice: the decode dispatch as two launches (the default), then as one
  # (peer_dispatch_layout, $MOE_EP_PEER_DISPATCH_LAYOUT=1)
  for fused in 0 1; do  # timeline-<fused>.log
    MOE_EP_PEER_DISPATCH_LAYOUT=$fused XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" \
      step "timeline-$fused" "${TIMELINE_TIMEOUT:-150}" \
      python -m moe_ep.bench timeline --out "$OUT/results"
    tail -n 30 "$OUT/timeline-$fused.log"
  done
fi
grep -E "(FAILED|Error|error)" "$OUT/peer_tests.log" 2>/dev/null | head -20
tar -czf "$OUT/ep-results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
