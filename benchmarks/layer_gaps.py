"""Where a layer step's wall time goes that no kernel fills: one shape's
fwd+bwd step (``moe_ep.bench.layer.step_call``, dropless) timed back to back,
then ``--calls`` calls traced back to back with no wait between them. From
device 0's kernels: the wall time per call, the busy time (the union of
the kernels' intervals) and the widest gaps with the kernels on either side.

    python benchmarks/layer_gaps.py --model qwen3_30b_a3b --out $OUT/results
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/layer_gaps.py ...

A development driver (the figures go to docs/grouped.md), not a bench
subcommand: it answers one question, whether the layer's timed steps idle
between kernels.
"""

import argparse
import glob
import json
import os
import pathlib
import tempfile

import jax
import numpy as np

from moe_ep.bench import common, layer, models
from moe_ep.bench.timeline import _gpu_kernels


def gaps(events) -> list[dict]:
  """Every idle gap between ``events`` (``(start, duration, name)``, sorted
  by start), widest first; the busy time is the span less their sum."""
  found, end, last = [], -np.inf, None
  for start, duration, name in events:
    if last is not None and start > end:
      found.append({"us": (start - end) / 1e3, "after": last, "before": name})
    if start + duration >= end:
      end, last = start + duration, name
  return sorted(found, key=lambda g: -g["us"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="qwen3_30b_a3b", choices=sorted(models.SHAPES))
  parser.add_argument("--layout", default="auto", help="expert_layout (auto, grouped, slabs)")
  parser.add_argument("--factor", type=float, default=None, help="capacity factor (None: dropless)")
  parser.add_argument("--calls", type=int, default=6)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  args = parser.parse_args()
  shape = models.SHAPES[args.model]
  tokens, top_k, hidden, ffn, experts = shape[:5]
  step, call_args, _ = layer.step_call(
      None, hidden=hidden, ffn=ffn, num_experts=experts, top_k=top_k, tokens=tokens,
      seq=min(tokens, 2048), factor=args.factor, backend="auto", exchange="auto",
      dispatch_dtype=None, expert_layout=args.layout)
  timing = common.time_ms(step, *call_args, iters=10)
  folder = tempfile.mkdtemp(prefix="layer-gaps-")
  jax.block_until_ready(step(*call_args))
  with jax.profiler.trace(folder):
    outs = [step(*call_args) for _ in range(args.calls)]
    jax.block_until_ready(outs)
  (path,) = glob.glob(folder + "/**/*.xplane.pb", recursive=True)
  events = _gpu_kernels(jax.profiler.ProfileData.from_file(path)).get(0)
  if not events:
    raise SystemExit("layer_gaps: the trace holds no GPU kernels; run it on a GPU")
  # From the first kernel's start to the last one's end: the host's first
  # dispatch is before it, so this is the device's wall time for the calls.
  span = max(start + duration for start, duration, _ in events) - events[0][0]
  idle = gaps(events)
  result = {
      "model": args.model, "shape": dict(tokens=tokens, top_k=top_k, hidden=hidden, ffn=ffn,
                                         experts=experts),
      "layout": args.layout, "capacity_factor": args.factor,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "timed_median_ms": timing["median_ms"], "timed": timing,
      "traced_calls": args.calls, "kernels_per_call": len(events) / args.calls,
      "traced_span_ms_per_call": span / 1e6 / args.calls,
      "busy_ms_per_call": (span - 1e3 * sum(g["us"] for g in idle)) / 1e6 / args.calls,
      "kernel_sum_ms_per_call": sum(d for _, d, _ in events) / 1e6 / args.calls,
      "widest_gaps": idle[:25],
  }
  print(json.dumps({k: v for k, v in result.items() if k != "timed"}, indent=1))
  if args.out:
    print(common.write_result(f"layer-gaps-{args.model}", result, results_dir=args.out))


if __name__ == "__main__":
  main()
