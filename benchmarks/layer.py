"""P4: the whole layer, forward+backward with gradients for the input: MFU
against the dense matmul rate of one device measured in the same run, on one
device and with the experts spread over all devices of the process (EP=R,
``tokens`` per device), on each exchange path, with bf16 and FP8 dispatch;
on one device also dropless on the grouped expert layout, and the slab
layout beside the grouped one where ``expert_layout="auto"`` picks grouped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep import ExpertParallelMoE, MoEConfig
from benchmarks import common, hlo
from benchmarks.experts import bank_flops
from moe_ep.experts import bank_layout

FP8 = "float8_e4m3fn"


def step_call(mesh, *, hidden, ffn, num_experts, top_k, tokens, seq, factor, backend, exchange,
              dispatch_dtype, expert_layout="auto") -> tuple:
  """One layer config's fwd+bwd step on ``mesh`` (None: one device),
  ``tokens`` per device: ``(step, (params, x), config)``; ``step`` returns
  ``((loss, aux), grads)``."""
  devices = 1 if mesh is None else mesh.size
  config = MoEConfig(hidden_size=hidden, ffn_size=ffn, num_experts=num_experts, top_k=top_k,
                     capacity_factor=factor, aux_loss_coeff=1e-2, dtype="bfloat16",
                     param_dtype="bfloat16", transport=backend, exchange=exchange,
                     dispatch_dtype=dispatch_dtype, expert_layout=expert_layout)
  layer = ExpertParallelMoE(config, mesh=mesh, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  x = jax.random.normal(jax.random.key(1), (devices * tokens // seq, seq, hidden), jnp.bfloat16)
  if mesh is not None:
    x = jax.device_put(x, NamedSharding(mesh, P("ep")))

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y.astype(jnp.float32) ** 2) + aux.aux_loss, aux

  # Gradients for the input too: inside a network the layer always owes
  # dx, and without it XLA drops the bank's largest backward GEMM.
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return step, (params, x), config


def variant(mesh, *, hidden, ffn, num_experts, top_k, tokens, seq, factor, backend, exchange,
             dispatch_dtype, iters, peak_tflops, expert_layout="auto") -> dict:
  """One layer config timed on ``mesh`` (None: one device), ``tokens`` per device."""
  devices = 1 if mesh is None else mesh.size
  step, (params, x), config = step_call(
      mesh, hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k, tokens=tokens,
      seq=seq, factor=factor, backend=backend, exchange=exchange,
      dispatch_dtype=dispatch_dtype, expert_layout=expert_layout)
  timing = common.time_ms(step, params, x, iters=iters)
  (_, aux), _ = step(params, x)
  fp8_fusions = (hlo.fp8_consumers(step.lower(params, x).compile().as_text())
                 if dispatch_dtype else None)
  total_tokens = devices * tokens
  kept_rows = total_tokens * top_k * (1.0 - float(aux.dropped_fraction))
  flops = bank_flops(kept_rows, hidden, ffn) + 3 * 2 * total_tokens * hidden * num_experts
  tflops_per_device = flops / devices / timing["median_ms"] / 1e9
  return {"ep_size": devices, "exchange": exchange, "dispatch_dtype": dispatch_dtype,
          "expert_layout": bank_layout(expert_layout, jnp.bfloat16, hidden, ffn),
          "capacity_factor": factor, "expert_capacity": config.expert_capacity or None,
          "dropped_fraction": float(aux.dropped_fraction), "useful_flops": flops,
          "tflops_per_device": tflops_per_device, "mfu": tflops_per_device / peak_tflops,
          **({"fp8_fusions": fp8_fusions} if dispatch_dtype else {}), **timing}


def run(hidden=4096, ffn=14336, num_experts=8, top_k=2, tokens=16384, seq=2048,
        capacity_factors=(1.0, 1.25), backend="auto", iters=5, matmul_size=8192,
        fp8=True, multi_device=True) -> dict:
  """One device: every capacity factor, and FP8 dispatch at the first, on
  the layout ``"auto"`` picks; slabs at the first factor where that is
  grouped; dropless on the grouped layout. With more than one device (and
  ``multi_device``): EP over all of them at the first capacity factor, on
  each exchange path, bf16 and FP8 dispatch."""
  peak = common.matmul_tflops(matmul_size)
  shared = dict(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k, tokens=tokens,
                seq=seq, backend=backend, iters=iters, peak_tflops=peak["tflops"])
  dtypes = (None, FP8) if fp8 else (None,)
  variants = {}
  for factor in capacity_factors:
    for dtype in dtypes if factor == capacity_factors[0] else (None,):
      name = f"ep1_cf{factor}" + ("_fp8" if dtype else "")
      variants[name] = variant(None, factor=factor, exchange="auto", dispatch_dtype=dtype,
                                **shared)
  if bank_layout("auto", jnp.bfloat16, hidden, ffn) == "grouped":
    variants[f"ep1_cf{capacity_factors[0]}_slabs"] = variant(
        None, factor=capacity_factors[0], exchange="auto", dispatch_dtype=None,
        expert_layout="slabs", **shared)
  variants["ep1_dropless"] = variant(None, factor=None, exchange="auto", dispatch_dtype=None,
                                      expert_layout="grouped", **shared)
  devices = jax.devices()
  if multi_device and len(devices) > 1 and num_experts % len(devices) == 0:
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    exchanges = ("all_to_all", "peer") if backend != "xla" else ("all_to_all",)
    for exchange in exchanges:
      for dtype in dtypes:
        name = f"ep{len(devices)}_{exchange}" + ("_fp8" if dtype else "")
        try:
          variants[name] = variant(mesh, factor=capacity_factors[0], exchange=exchange,
                                    dispatch_dtype=dtype, **shared)
        except ValueError as error:  # the peer path where it cannot run
          variants[name] = {"skipped": str(error)}
  return {"shapes": dict(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k,
                         tokens_per_device=tokens, dtype="bfloat16", transport=backend),
          "dense_matmul": peak, "variants": variants}


def summary(result: dict) -> str:
  lines = [f"P4 layer fwd+bwd {result['shapes']}; dense {result['dense_matmul']['tflops']:.0f} "
           "TFLOP/s (one device)"]
  for name, v in result["variants"].items():
    if "skipped" in v:
      lines.append(f"  {name}: skipped ({v['skipped']})")
      continue
    lines.append(f"  {name} ({v['expert_layout']}): {v['median_ms']:.2f} ms, "
                 f"{v['tflops_per_device']:.0f} TFLOP/s useful per device, "
                 f"MFU {100 * v['mfu']:.0f}%, dropped {100 * v['dropped_fraction']:.1f}%")
    for f in v.get("fp8_fusions", []):
      lines.append(f"    reads FP8: {f['kind']}{' GEMM' if f['gemm'] else ''} -> {f['shape']} "
                   f"({f['op_name'][-60:]})")
  return "\n".join(lines)
