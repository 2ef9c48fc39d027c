"""GPU probe: the Qwen3-30B-A3B bank's four row-tile GEMMs (forward of w_in
and w_out, input gradients through both) timed side by side as the
cooperative kernel (moe_ep.experts.hopper.grouped_matmul), the same chained
(CHAIN_TILES), the ping-pong prototype (benchmarks/pingpong.py: each compute
warpgroup its own [128, 128] tiles, its own three stages), and a dense
cuBLAS GEMM of the same rows; each kernel's output checked against the
cooperative one. Writes JSON to --out.

  python benchmarks/pingpong_probe.py [--loads zipf skewed] [--gemms NAME...] [--out DIR]
"""

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import pingpong  # noqa: E402

from benchmarks import common, experts  # noqa: E402
from moe_ep.experts import grouped, hopper  # noqa: E402
from moe_ep.row_groups import grouped_rows_for  # noqa: E402

TOKENS, TOP_K, HIDDEN, FFN, EXPERTS = 16384, 8, 2048, 768, 128


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--loads", nargs="+", default=["zipf", "skewed"])
  parser.add_argument("--gemms", nargs="+", default=None,
                      help="of fwd_w_in fwd_w_out dgrad_w_out dgrad_w_in (default all)")
  parser.add_argument("--stages", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/out/results"))
  args = parser.parse_args()
  routed = TOKENS * TOP_K
  num_rows = grouped_rows_for(TOKENS, TOP_K, EXPERTS, 1)
  result = {}
  for load in args.loads:
    sizes = experts.group_sizes(routed, EXPERTS, load)
    tiles = grouped.group_tiles(jnp.asarray(sizes, jnp.int32), num_rows)
    key = jax.random.split(jax.random.key(0), 4)
    gemms = {  # name: (rows' width K, weights [G, K, N] or [G, N, K] with transpose)
        "fwd_w_in": (HIDDEN, (EXPERTS, HIDDEN, 2 * FFN), False),
        "fwd_w_out": (FFN, (EXPERTS, FFN, HIDDEN), False),
        "dgrad_w_out": (HIDDEN, (EXPERTS, FFN, HIDDEN), True),
        "dgrad_w_in": (2 * FFN, (EXPERTS, HIDDEN, 2 * FFN), True),
    }
    for gemm, (width, wshape, transpose) in gemms.items():
      if args.gemms and gemm not in args.gemms:
        continue
      rows = experts.grouped_rows(sizes, num_rows, width, seed=3)
      w = jax.random.normal(key[1], wshape, jnp.bfloat16) * width ** -0.5
      n = wshape[1] if transpose else wshape[2]
      dense_w = jax.random.normal(key[2], (width, n), jnp.bfloat16)

      def coop(chain):
        return jax.jit(lambda a, b, t: hopper.grouped_matmul(
            a, b, t, transpose_rhs=transpose, config=hopper.TileConfig(chain_tiles=chain)))

      calls = {
          "dense": (jax.jit(lambda a, b: a[:routed] @ b), (rows, dense_w)),
          "cooperative": (coop(False), (rows, w, tiles.tile_group)),
          "chained": (coop(True), (rows, w, tiles.tile_group)),
          "pingpong": (jax.jit(lambda a, b, t: pingpong.pingpong_matmul(
              a, b, t, transpose_rhs=transpose, stages=args.stages)), (rows, w, tiles.tile_group)),
      }
      want = np.asarray(calls["cooperative"][0](*calls["cooperative"][1]).astype(jnp.float32))
      checks = {}
      for name in ("chained", "pingpong"):
        try:
          got = np.asarray(calls[name][0](*calls[name][1]).astype(jnp.float32))
          checks[name] = float(np.max(np.abs(got - want)))
        except Exception as error:  # noqa: BLE001
          checks[name] = repr(error)[:300]
      timings = common.time_interleaved(calls, iters=10, rounds=5)
      flops = 2 * routed * width * n
      for name, t in timings.items():
        if "median_ms" in t:
          t["tflops"] = flops / t["median_ms"] / 1e9
      result[f"{load}/{gemm}"] = {"timings": timings, "max_abs_diff_vs_cooperative": checks}
      line = "  ".join(f"{name} {t['median_ms']:.3f} ms {t['tflops']:.0f}" if "median_ms" in t
                       else f"{name} {t.get('error', '?')[:60]}" for name, t in timings.items())
      print(f"{load:7} {gemm:12} {line}  diff {checks}", flush=True)
  print(common.write_result("pingpong", {"shape": [TOKENS, TOP_K, HIDDEN, FFN, EXPERTS],
                                         "stages": args.stages, "gemms": result}, args.out))


if __name__ == "__main__":
  main()
