"""A workload for ``compute-sanitizer`` on the FP8 expert bank's Hopper kernels.

Not a pytest module: run it on an H100/H200 under the sanitizer, with XLA
allocating each buffer on its own (so an access past one is out of bounds
for memcheck, not inside XLA's pool):

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \\
        --target-processes application-only --error-exitcode 7 \\
        python tests/experts/hopper_fp8_sanitizer_workload.py
    (the same with --tool racecheck)

It runs the FP8 bank (both GEMMs, forward, input and weight gradients, in
every tile configuration) on the edge cases of the layout: empty groups, a
group of one row, row tiles of no group at the buffer's end, sizes off the
128-element scale blocks (a partial last block, F = 2880's 64 columns) and
below one CTA's columns. Each result is checked against the pure-JAX bank of
the same quantized math, so a kernel that the sanitizer passes but that
computes the wrong rows still fails (exit code 1).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep.capacity import round_up
from moe_ep.experts import fp8 as fp8_experts
from moe_ep.experts import grouped, hopper_fp8
from moe_ep.row_groups import ROW_TILE

CASES = [  # group sizes, spare row tiles of no group, H, F
    ([300, 0, 1, 129], 1, 256, 512),
    ([0, 0, 517, 0], 1, 512, 256),
    ([300, 0, 129], 1, 2880, 1440),  # partial scale blocks in H and 2F
    ([200, 1], 1, 144, 96),  # below one CTA's columns
]
CONFIGS = {"split_rows": hopper_fp8.FP8TileConfig(),
           "split_columns": hopper_fp8.FP8TileConfig(split_rows=False, max_concurrent_steps=3),
           "chained": hopper_fp8.FP8TileConfig(chain_tiles=True),
           "overlapped": hopper_fp8.FP8TileConfig(overlap_promotion=True)}
START = time.monotonic()


def progress(done: str):
  """One line on stderr per case run, so a run cut short names its case."""
  print(f"{time.monotonic() - START:7.1f} s  {done}", file=sys.stderr, flush=True)


def bank_problem(rng, sizes, spare_tiles, hidden, ffn):
  """``(rows [M, H] bf16, counts, w_in [G, H, 2F], w_out [G, F, H], cotangent
  [M, H], in_group [M])``, rows outside the groups zero."""
  num_rows = sum(round_up(s, ROW_TILE) for s in sizes) + spare_tiles * ROW_TILE
  counts = jnp.asarray(sizes, jnp.int32)
  tiles = grouped.group_tiles(counts, num_rows, ROW_TILE)
  in_group = np.zeros(num_rows, bool)
  for start, size in zip(np.asarray(tiles.group_start), sizes):
    in_group[start:start + size] = True
  rows = rng.normal(size=(num_rows, hidden)) * in_group[:, None]
  w_in = rng.normal(size=(len(sizes), hidden, 2 * ffn)) / hidden ** 0.5
  w_out = rng.normal(size=(len(sizes), ffn, hidden)) / ffn ** 0.5
  cotangent = rng.normal(size=(num_rows, hidden)) * in_group[:, None]
  cast = lambda a: jnp.asarray(a, jnp.bfloat16)
  return cast(rows), counts, cast(w_in), cast(w_out), cast(cotangent), in_group


def passes(implementation, counts, config=hopper_fp8.FP8TileConfig()):
  def run(rows, w_in, w_out, cotangent):
    def mlp(rows, w_in, w_out):
      return fp8_experts.fp8_grouped_expert_mlp(
          rows, counts, w_in, w_out, fp8_experts.quantize_weights(w_in),
          fp8_experts.quantize_weights(w_out), "swiglu", implementation=implementation,
          tile_config=config)
    out, vjp = jax.vjp(mlp, rows, w_in, w_out)
    return (out, *vjp(cotangent))
  return jax.jit(run)


def main(check_reference: bool = True):
  if not grouped.hopper_available():
    raise SystemExit("needs a GPU of compute capability 9.0")
  rng = np.random.default_rng(0)
  failures = []
  for config_name, config in CONFIGS.items():
    for sizes, spare, hidden, ffn in CASES:
      rows, counts, w_in, w_out, cotangent, in_group = bank_problem(rng, sizes, spare, hidden,
                                                                    ffn)
      got = jax.block_until_ready(passes("hopper", counts, config)(rows, w_in, w_out,
                                                                   cotangent))
      progress(f"{config_name} {sizes} H={hidden} F={ffn}")
      if not check_reference:
        continue
      want = passes("xla", counts)(rows, w_in, w_out, cotangent)
      for name, g, w in zip(("out", "d_rows", "d_w_in", "d_w_out"), got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if name in ("out", "d_rows"):
          if np.any(g[~in_group]):
            failures.append(f"{config_name} {name} of {sizes}: rows of no group not zero")
          g, w = g[in_group], w[in_group]
        # The same codes and scales: the kernels differ from the float32
        # reference by FP8 wgmma's accumulation inside a block (about 2**-13)
        # and bf16 roundings of the hidden rows that requantize at e4m3's
        # 2**-4 steps: 2**-6 of the norm.
        error = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        if not error <= 2 ** -6:
          failures.append(f"{config_name} {name} of {sizes} H={hidden} F={ffn}: {error:.3g}")
  if failures:
    raise SystemExit("\n".join(failures))
  print(f"hopper FP8 sanitizer workload done: {len(CASES)} banks in {len(CONFIGS)} configs")


if __name__ == "__main__":
  main(check_reference="--no-reference" not in sys.argv[1:])
