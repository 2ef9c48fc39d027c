"""P3: the expert bank's forward+backward TFLOP/s on its slab rows, against a
dense matmul of the same FLOPs measured in the same run."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_ep.bench import common
from moe_ep.experts import expert_mlp

SHAPES = ((4096, 14336, 8), (2048, 1408, 64), (7168, 2048, 32))  # (H, F, E)


def bank_flops(rows: int, hidden: int, ffn: int) -> int:
  """SwiGLU bank forward+backward: forward 2*rows*H*2F + 2*rows*F*H, backward twice that."""
  return 3 * (2 * rows * hidden * 2 * ffn + 2 * rows * ffn * hidden)


def run(shapes=SHAPES, total_rows: int = 65536, iters: int = 3, matmul_size: int = 8192) -> dict:
  peak = common.matmul_tflops(matmul_size)
  results = []
  for hidden, ffn, experts in shapes:
    capacity = total_rows // experts
    keys = jax.random.split(jax.random.key(hidden + ffn + experts), 4)
    tokens = jax.random.normal(keys[0], (experts, capacity, hidden), jnp.bfloat16)
    w_in = jax.random.normal(keys[1], (experts, hidden, 2 * ffn), jnp.bfloat16) * hidden ** -0.5
    w_out = jax.random.normal(keys[2], (experts, ffn, hidden), jnp.bfloat16) * ffn ** -0.5
    cotangent = jax.random.normal(keys[3], tokens.shape, jnp.bfloat16)

    def loss(tokens, w_in, w_out):
      out = expert_mlp(tokens, w_in, w_out, "swiglu")
      return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    timing = common.time_ms(step, tokens, w_in, w_out, iters=iters)
    flops = bank_flops(experts * capacity, hidden, ffn)
    results.append({"hidden": hidden, "ffn": ffn, "num_experts": experts,
                    "rows_per_expert": capacity, "flops": flops,
                    "tflops": flops / timing["median_ms"] / 1e9,
                    "fraction_of_dense": flops / timing["median_ms"] / 1e9 / peak["tflops"],
                    **timing})
  return {"dense_matmul": peak, "activation": "swiglu", "dtype": "bfloat16", "banks": results}


def summary(result: dict) -> str:
  lines = [f"P3 expert bank fwd+bwd; dense matmul {result['dense_matmul']['tflops']:.0f} TFLOP/s"]
  for bank in result["banks"]:
    lines.append(f"  H={bank['hidden']} F={bank['ffn']} E={bank['num_experts']}: "
                 f"{bank['tflops']:.0f} TFLOP/s ({100 * bank['fraction_of_dense']:.0f}% of dense)")
  return "\n".join(lines)
