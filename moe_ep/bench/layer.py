"""P4: the whole layer, forward+backward, on one device: MFU against the dense
matmul rate measured in the same run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_ep import ExpertParallelMoE, MoEConfig
from moe_ep.bench import common
from moe_ep.bench.experts import bank_flops


def run(hidden=4096, ffn=14336, num_experts=8, top_k=2, tokens=16384, seq=2048,
        capacity_factors=(1.0, 1.25), backend="auto", iters=5, matmul_size=8192) -> dict:
  peak = common.matmul_tflops(matmul_size)
  x = jax.random.normal(jax.random.key(1), (tokens // seq, seq, hidden), jnp.bfloat16)
  variants = {}
  for factor in capacity_factors:
    config = MoEConfig(hidden_size=hidden, ffn_size=ffn, num_experts=num_experts, top_k=top_k,
                       capacity_factor=factor, aux_loss_coeff=1e-2, dtype="bfloat16",
                       param_dtype="bfloat16", transport=backend)
    layer = ExpertParallelMoE(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
      y, aux = nnx.merge(graphdef, params, rest)(x)
      return jnp.mean(y.astype(jnp.float32) ** 2) + aux.aux_loss, aux

    # Gradients for the input too: inside a network the layer always owes
    # dx, and without it XLA drops the bank's largest backward GEMM.
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    timing = common.time_ms(step, params, x, iters=iters)
    (_, aux), _ = step(params, x)
    kept_rows = tokens * top_k * (1.0 - float(aux.dropped_fraction))
    flops = bank_flops(kept_rows, hidden, ffn) + 3 * 2 * tokens * hidden * num_experts
    tflops = flops / timing["median_ms"] / 1e9
    variants[f"cf{factor}"] = {
        "expert_capacity": config.expert_capacity or None, "dropped_fraction": float(aux.dropped_fraction),
        "useful_flops": flops, "tflops": tflops, "mfu": tflops / peak["tflops"], **timing}
    del layer, params, rest
  return {"shapes": dict(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k,
                         tokens=tokens, dtype="bfloat16", transport=backend),
          "dense_matmul": peak, "variants": variants}


def summary(result: dict) -> str:
  lines = [f"P4 layer fwd+bwd {result['shapes']}; dense {result['dense_matmul']['tflops']:.0f} TFLOP/s"]
  for name, v in result["variants"].items():
    lines.append(f"  {name}: {v['median_ms']:.2f} ms, {v['tflops']:.0f} TFLOP/s useful, "
                 f"MFU {100 * v['mfu']:.0f}%, dropped {100 * v['dropped_fraction']:.1f}%")
  return "\n".join(lines)
