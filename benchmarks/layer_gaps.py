"""Where a layer step's wall time goes that no kernel fills: one shape's
fwd+bwd step (``benchmarks.layer.step_call``, dropless; or with
``--what`` its grouped bank on Zipf or Dirichlet loads, or the dense chain,
as ``python -m benchmarks models`` times them) timed back to back, then
``--calls`` calls traced back to back with no wait between them. From
device 0's kernels: the wall time per call, the busy time (the union of
the kernels' intervals), the widest gaps with the kernels on either side,
and each kernel's time per call.

    python benchmarks/layer_gaps.py --model qwen3_30b_a3b --out $OUT/results
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/layer_gaps.py ...
    python benchmarks/layer_gaps.py --model deepseek_v3 --what bank_zipf dense

A development driver (the figures go to docs/grouped.md), not a bench
subcommand: it answers one question, whether the layer's timed steps idle
between kernels.
"""

import argparse
import collections
import glob
import json
import os
import pathlib
import tempfile

import jax
import numpy as np

from benchmarks import common, experts, layer, models
from benchmarks.timeline import _gpu_kernels


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


def step_of(what: str, model: str, layout: str, factor):
  """``(fn, args)`` of ``what`` (``layer``, ``bank_zipf``, ``bank_skewed``,
  ``dense``) at ``model``'s shape."""
  tokens, top_k, hidden, ffn, experts_ = models.SHAPES[model][:5]
  if what == "layer":
    step, call_args, _ = layer.step_call(
        None, hidden=hidden, ffn=ffn, num_experts=experts_, top_k=top_k, tokens=tokens,
        seq=min(tokens, 2048), factor=factor, backend="auto", exchange="auto",
        dispatch_dtype=None, expert_layout=layout)
    return step, call_args
  if what == "dense":
    return models.dense_call(tokens * top_k, hidden, ffn)
  w_in, w_out = experts.weights(hidden, ffn, experts_, seed=1)
  return models.bank_call(tokens, top_k, experts_, what.removeprefix("bank_"), w_in, w_out)[0]


def profile(what: str, args) -> dict:
  step, call_args = step_of(what, args.model, args.layout, args.factor)
  timing = common.time_ms(step, *call_args, iters=10)
  folder = tempfile.mkdtemp(prefix="layer-gaps-")
  jax.block_until_ready(step(*call_args))
  with jax.profiler.trace(folder):
    outs = [step(*call_args) for _ in range(args.calls)]
    jax.block_until_ready(outs)
  del outs
  (path,) = glob.glob(folder + "/**/*.xplane.pb", recursive=True)
  events = _gpu_kernels(jax.profiler.ProfileData.from_file(path)).get(0)
  if not events:
    raise SystemExit("layer_gaps: the trace holds no GPU kernels; run it on a GPU")
  # From the first kernel's start to the last one's end: the host's first
  # dispatch is before it, so this is the device's wall time for the calls.
  span = max(start + duration for start, duration, _ in events) - events[0][0]
  idle = gaps(events)
  per_kernel = collections.Counter()
  for _, duration, name in events:
    per_kernel[name] += duration / 1e6 / args.calls
  return {
      "what": what, "timed_median_ms": timing["median_ms"], "timed": timing,
      "kernels_per_call": len(events) / args.calls,
      "traced_span_ms_per_call": span / 1e6 / args.calls,
      "busy_ms_per_call": (span - 1e3 * sum(g["us"] for g in idle)) / 1e6 / args.calls,
      "kernel_sum_ms_per_call": sum(d for _, d, _ in events) / 1e6 / args.calls,
      "kernel_ms_per_call": {name: round(ms, 4) for name, ms in per_kernel.most_common(args.top)},
      "widest_gaps": idle[:25],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="qwen3_30b_a3b", choices=sorted(models.SHAPES))
  parser.add_argument("--what", nargs="+", default=["layer"],
                      choices=["layer", "bank_zipf", "bank_skewed", "dense"])
  parser.add_argument("--layout", default="auto", help="expert_layout (auto, grouped, slabs)")
  parser.add_argument("--factor", type=float, default=None, help="capacity factor (None: dropless)")
  parser.add_argument("--calls", type=int, default=6)
  parser.add_argument("--top", type=int, default=16, help="kernels listed by time")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  args = parser.parse_args()
  tokens, top_k, hidden, ffn, experts_ = models.SHAPES[args.model][:5]
  result = {
      "model": args.model, "shape": dict(tokens=tokens, top_k=top_k, hidden=hidden, ffn=ffn,
                                         experts=experts_),
      "layout": args.layout, "capacity_factor": args.factor,
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "traced_calls": args.calls,
      "profiles": {what: profile(what, args) for what in args.what},
  }
  for what, found in result["profiles"].items():
    print(what, json.dumps({k: v for k, v in found.items() if k not in ("timed", "widest_gaps")},
                           indent=1))
  if args.out:
    print(common.write_result(f"layer-gaps-{args.model}", result, results_dir=args.out))


if __name__ == "__main__":
  main()
