"""GPU probe of the FP8 kernels against the bf16 ones on large groups: TFLOP/s
of each GEMM side by side (writes JSON to the folder given, default .)."""

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep.experts import hopper, hopper_fp8, hopper_wgrad
from moe_ep.row_groups import ROW_TILE

F8 = jnp.float8_e4m3fn
# (name, rows per group, groups, K, N)
SHAPES = [("mixtral_8x7b_w_in", 4096, 8, 4096, 28672), ("mixtral_8x7b_w_out", 4096, 8, 14336, 4096),
          ("qwen3_w_in", 1024, 128, 2048, 1536), ("qwen3_w_out", 1024, 128, 768, 2048),
          ("large_8k", 8192, 4, 7168, 4096)]


def timed(fn, *args, iters=20):
  fn(*args).block_until_ready()
  fn(*args).block_until_ready()
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


CONFIGS = {"rows4": hopper_fp8.FP8TileConfig(), "rows5": hopper_fp8.FP8TileConfig(max_concurrent_steps=5),
           "cols3": hopper_fp8.FP8TileConfig(split_rows=False, max_concurrent_steps=3)}


def main(out_dir="."):
  rng = np.random.default_rng(0)
  results = []
  for name, per_group, groups, k, n in SHAPES:
    m = per_group * groups
    tile_group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), per_group // ROW_TILE)
    kb, nb = -(-k // 128), -(-n // 128)
    a = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(groups, k, n)) / k ** 0.5, jnp.bfloat16)
    a8, b8t = a.astype(F8), jnp.swapaxes(b, 1, 2).astype(F8)
    sa, sb = jnp.ones((m, kb), jnp.float32), jnp.ones((groups, nb, kb), jnp.float32)
    flops = 2 * m * k * n
    bf16 = jax.jit(lambda a, b, t: hopper.grouped_matmul(a, b, t))
    t_bf16 = timed(bf16, a, b, tile_group)
    t_fp8s = {name: timed(jax.jit(lambda *x, c=c: hopper_fp8.grouped_matmul_fp8(*x, config=c)),
                          a8, sa, b8t, sb, tile_group) for name, c in CONFIGS.items()}
    fp8 = jax.jit(lambda *x: hopper_fp8.grouped_matmul_fp8(*x))
    # wgrad: out[g] [K, N] over the group's rows
    starts = jnp.arange(groups, dtype=jnp.int32) * per_group
    g = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    wgrad = jax.jit(lambda a, g, s, c: hopper_wgrad.grouped_matmul_wgrad(a, g, s, c, groups))
    t_wgrad = timed(wgrad, a, g, starts, jnp.full((groups,), per_group // 64, jnp.int32))
    a8t, g8t = a.T.astype(F8), g.T.astype(F8)
    t_wgrad8s = {name: timed(
        jax.jit(lambda *x, c=c: hopper_fp8.grouped_matmul_fp8_wgrad(*x, groups, config=c)),
        a8t, jnp.ones((k, m // 128), jnp.float32), g8t, jnp.ones((n, m // 128), jnp.float32),
        starts, jnp.full((groups,), per_group // 128, jnp.int32)) for name, c in CONFIGS.items()}
    # Agreement: the same quantized inputs, unit scales, fwd.
    ref = bf16(a8.astype(jnp.bfloat16), jnp.swapaxes(b8t, 1, 2).astype(jnp.bfloat16), tile_group)
    got = fp8(a8, sa, b8t, sb, tile_group)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32)))
                / jnp.max(jnp.abs(ref.astype(jnp.float32))))
    row = dict(name=name, m=m, k=k, n=n, groups=groups,
               bf16_tflops=flops / t_bf16 / 1e12,
               fp8_tflops={c: flops / t / 1e12 for c, t in t_fp8s.items()},
               wgrad_bf16_tflops=flops / t_wgrad / 1e12,
               wgrad_fp8_tflops={c: flops / t / 1e12 for c, t in t_wgrad8s.items()},
               fwd_rel_err_vs_bf16=err)
    print(json.dumps(row), flush=True)
    results.append(row)
  device = jax.devices()[0]
  pathlib.Path(out_dir, "fp8_probe.json").write_text(json.dumps(
      dict(device=device.device_kind, jax=jax.__version__, results=results), indent=1))


if __name__ == "__main__":
  main(*sys.argv[1:])
