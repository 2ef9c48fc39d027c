"""Which grouped GEMM in clusters of two CTAs stops (a GPU driver): each
case in its own process with a time limit, so one that never finishes names
itself and the others still run.

    python benchmarks/cluster_probe.py            # every case, 60 s each
    python benchmarks/cluster_probe.py --first 3 --limit 45
    python benchmarks/cluster_probe.py forward 256 512 --one   # one case, in this process

A case is a pass (forward, input gradient, weight gradient) of
``moe_ep.experts.hopper`` at contraction K and columns N on the sanitizer
workload's first layout (groups of 300, 0, 1, 129, 128 and 64 rows, two
spare row tiles), with ``hopper.CLUSTER_COLUMNS = 2``.
"""

import subprocess
import sys
import time

SIZES, SPARE = [300, 0, 1, 129, 128, 64], 2
CASES = [(p, k, n) for k, n in ((256, 512), (1024, 512), (256, 2048))
         for p in ("forward", "input_gradient", "weight_gradient")]


def one(pass_name: str, contraction: int, columns: int) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from moe_ep.capacity import round_up
  from moe_ep.experts import grouped, hopper, hopper_wgrad
  from moe_ep.experts.grouped import ROW_TILE
  hopper.CLUSTER_COLUMNS = 2
  rng = np.random.default_rng(0)
  num_rows = round_up(sum(round_up(s, ROW_TILE) for s in SIZES), ROW_TILE) + SPARE * ROW_TILE
  tiles = grouped.group_tiles(jnp.asarray(SIZES, jnp.int32), num_rows)
  bf16 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  if pass_name == "forward":
    out = hopper.grouped_matmul(bf16(num_rows, contraction), bf16(len(SIZES), contraction, columns),
                                tiles.tile_group)
  elif pass_name == "input_gradient":
    out = hopper.grouped_matmul(bf16(num_rows, columns), bf16(len(SIZES), contraction, columns),
                                tiles.tile_group, transpose_rhs=True)
  else:
    steps = tiles.group_blocks  # as moe_ep.experts.grouped._wgrad
    out = hopper_wgrad.grouped_matmul_wgrad(bf16(num_rows, contraction), bf16(num_rows, columns),
                                            tiles.group_start, steps, len(SIZES))
  jax.block_until_ready(out)


def main():
  if "--one" in sys.argv:
    name, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    one(name, k, n)
    return
  first = int(sys.argv[sys.argv.index("--first") + 1]) if "--first" in sys.argv else len(CASES)
  limit = float(sys.argv[sys.argv.index("--limit") + 1]) if "--limit" in sys.argv else 60
  for name, k, n in CASES[:first]:
    start = time.monotonic()
    try:
      run = subprocess.run([sys.executable, __file__, name, str(k), str(n), "--one"],
                           capture_output=True, text=True, timeout=limit)
      outcome = "ok" if run.returncode == 0 else f"rc={run.returncode}: {run.stderr[-300:]}"
    except subprocess.TimeoutExpired:
      outcome = f"did not finish in {limit:.0f} s"
    print(f"{name} K={k} N={n}: {outcome} ({time.monotonic() - start:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
