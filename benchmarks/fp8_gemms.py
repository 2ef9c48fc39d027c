"""The FP8 expert GEMMs on large groups, one Hopper GPU: each of the bank's
two kernels (the forward / input gradient and the weight gradient) in
TFLOP/s beside the bf16 kernel of the same product, in interleaved rounds,
for each tile configuration (DeepGEMM publishes 1214-1346 TFLOP/s for its
grouped FP8 GEMM on H800). The operands are the bf16 ones' e4m3 codes with
unit scales, so the forward's agreement with the bf16 kernel on them is a
check of the run, reported beside the times."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from moe_ep.experts import hopper, hopper_fp8, hopper_wgrad
from moe_ep.row_groups import ROW_TILE

F8 = jnp.float8_e4m3fn
# name: (rows per group, groups, K, N) of one product: the first GEMM's
# (N = 2F) and the second's (K = F) on public models' expert shapes.
SHAPES = {"mixtral_8x7b_w_in": (2048, 8, 4096, 28672),
          "mixtral_8x7b_w_out": (2048, 8, 14336, 4096),
          "qwen3_30b_a3b_w_in": (1024, 128, 2048, 1536)}
CONFIGS = {"default": hopper_fp8.FP8TileConfig(),
           "overlap": hopper_fp8.FP8TileConfig(overlap_promotion=True),
           "chain_overlap": hopper_fp8.FP8TileConfig(chain_tiles=True, overlap_promotion=True),
           "split_columns": hopper_fp8.FP8TileConfig(split_rows=False, max_concurrent_steps=3),
           "ring_wgrad": hopper_fp8.FP8TileConfig(chain_wgrad=True),
           "ring_wgrad_5": hopper_fp8.FP8TileConfig(chain_wgrad=True, max_concurrent_steps=5)}


def _operands(rng, per_group: int, groups: int, k: int, n: int) -> dict:
  rows = per_group * groups
  lhs = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(groups, k, n)) / k ** 0.5, jnp.bfloat16)
  out_grad = jnp.asarray(rng.normal(size=(rows, n)), jnp.bfloat16)
  return dict(lhs=lhs, rhs=rhs, out_grad=out_grad,
              tile_group=jnp.repeat(jnp.arange(groups, dtype=jnp.int32), per_group // ROW_TILE),
              starts=jnp.arange(groups, dtype=jnp.int32) * per_group)


def _shape_result(operands: dict, per_group: int, groups: int, k: int, n: int, configs: dict,
                  iters: int, rounds: int) -> dict:
  lhs, rhs, out_grad = operands["lhs"], operands["rhs"], operands["out_grad"]
  tile_group, starts, rows = operands["tile_group"], operands["starts"], lhs.shape[0]
  lhs8, rhs8_t = lhs.astype(F8), jnp.swapaxes(rhs, 1, 2).astype(F8)
  unit = lambda *shape: jnp.ones(shape, jnp.float32)
  lhs_scales, rhs_scales = unit(rows, -(-k // 128)), unit(groups, -(-n // 128), -(-k // 128))
  lhs8_t, grad8_t = lhs.T.astype(F8), out_grad.T.astype(F8)
  blocks = jnp.full((groups,), per_group // 128, jnp.int32)
  calls = {
      "forward_bf16": (jax.jit(hopper.grouped_matmul), (lhs, rhs, tile_group)),
      "wgrad_bf16": (jax.jit(lambda a, g, s, c: hopper_wgrad.grouped_matmul_wgrad(a, g, s, c,
                                                                                 groups)),
                     (lhs, out_grad, starts, jnp.full((groups,), per_group // 64, jnp.int32)))}
  for name, config in configs.items():
    calls[f"forward_fp8_{name}"] = (
        jax.jit(lambda *x, c=config: hopper_fp8.grouped_matmul_fp8(*x, config=c)),
        (lhs8, lhs_scales, rhs8_t, rhs_scales, tile_group))
    calls[f"wgrad_fp8_{name}"] = (
        jax.jit(lambda *x, c=config: hopper_fp8.grouped_matmul_fp8_wgrad(*x, groups, config=c)),
        (lhs8_t, unit(k, rows // 128), grad8_t, unit(n, rows // 128), starts, blocks))
  timings = common.time_interleaved(calls, iters=iters, rounds=rounds)
  flops = 2 * rows * k * n
  kernels = {name: {**timing, "tflops": flops / timing["median_ms"] / 1e9}
             if "median_ms" in timing else timing for name, timing in timings.items()}
  # The same codes through the bf16 kernel and the FP8 one: both sum exact
  # products in float32 (FP8 wgmma with fewer bits inside a 128-deep step).
  want = hopper.grouped_matmul(lhs8.astype(jnp.bfloat16), jnp.swapaxes(rhs8_t, 1, 2)
                               .astype(jnp.bfloat16), tile_group).astype(jnp.float32)
  got = hopper_fp8.grouped_matmul_fp8(lhs8, lhs_scales, rhs8_t, rhs_scales,
                                      tile_group).astype(jnp.float32)
  error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  return dict(rows_per_group=per_group, groups=groups, k=k, n=n, kernels=kernels,
              forward_max_error_vs_bf16=error)


def run(shapes: dict = SHAPES, configs: dict = CONFIGS, iters: int = 10, rounds: int = 3) -> dict:
  rng = np.random.default_rng(0)
  results = {}
  for name, (per_group, groups, k, n) in shapes.items():
    operands = _operands(rng, per_group, groups, k, n)
    results[name] = _shape_result(operands, per_group, groups, k, n, configs, iters, rounds)
  return dict(shapes=results, configs={name: repr(c) for name, c in configs.items()})


def summary(result: dict) -> str:
  lines = ["FP8 expert GEMMs, TFLOP/s (bf16 kernel beside each FP8 config):"]
  for name, shape in result["shapes"].items():
    figures = ", ".join(
        f"{kernel} {timing['tflops']:.0f}" if "tflops" in timing else f"{kernel} {timing['error']}"
        for kernel, timing in shape["kernels"].items())
    lines.append(f"  {name} (G={shape['groups']}, {shape['rows_per_group']} rows, K={shape['k']}, "
                 f"N={shape['n']}; forward vs bf16 {shape['forward_max_error_vs_bf16']:.1e}): "
                 f"{figures}")
  return "\n".join(lines)
