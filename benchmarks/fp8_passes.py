"""The FP8 bank's passes outside its GEMMs on public models' shapes, one
device: each pass of :mod:`moe_ep.experts.fp8_passes` as its one kernel
(``kernels/fp8_bank.cu``, where CuPy and a CUDA GPU are here) beside the same
values as XLA passes, in interleaved rounds: the activation with both of its
quantizations, its gradient likewise, and the weights' quantization (float32
master weights, as the layer holds them). Each time also as GB/s of the
bytes the pass must move at least (its inputs read once, its outputs
written once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import common, models
from moe_ep.activations import small_activation
from moe_ep.experts import fp8_passes
from moe_ep.row_groups import ROW_TILE
from moe_ep.transport import kernel_launch

# The models benchmark's shapes whose passes differ most: few wide experts,
# many narrow ones.
SHAPES = {name: models.SHAPES[name] for name in ("mixtral_8x7b", "qwen3_30b_a3b")}


def _kernels_here() -> bool:
  return jax.default_backend() == "gpu" and kernel_launch.cupy_available()


def _shape_calls(tokens: int, top_k: int, hidden: int, ffn: int, experts: int) -> tuple:
  """``({name: (fn, args)}, {name: bytes moved at least})`` of one shape."""
  rows = -(-tokens * top_k // ROW_TILE) * ROW_TILE
  keys = jax.random.split(jax.random.key(0), 4)
  hidden_rows = jax.random.normal(keys[0], (rows, 2 * ffn), jnp.bfloat16)
  act_grad = jax.random.normal(keys[1], (rows, ffn), jnp.bfloat16)
  weights = (jax.random.uniform(keys[2], (rows,), jnp.float32)
             if small_activation(hidden, ffn) else None)
  w_in = jax.random.normal(keys[3], (experts, hidden, 2 * ffn), jnp.float32)
  scale_bytes = 4 / 128 * 2  # both ways' float32 scales per element, about
  passes = {
      "activation": (lambda f: jax.jit(lambda h, w: f(h, "swiglu", w)), (hidden_rows, weights),
                     rows * ffn * (4 + 2 + scale_bytes)),
      "activation_grad": (lambda f: jax.jit(lambda h, g, w: f(h, g, "swiglu", w)),
                          (hidden_rows, act_grad, weights),
                          rows * ffn * (4 + 2 + 2 * (2 + scale_bytes))),
      "weights": (lambda f: jax.jit(f), (w_in,), w_in.size * (4 + 2) + w_in.size / 128 ** 2 * 4),
  }
  implementations = {
      "activation": (fp8_passes.activate_quantized_cuda, fp8_passes.activate_quantized_xla),
      "activation_grad": (fp8_passes.activation_grad_quantized_cuda,
                          fp8_passes.activation_grad_quantized_xla),
      "weights": (fp8_passes.quantize_weights_cuda, fp8_passes.quantize_weights_xla)}
  calls, moved = {}, {}
  for name, (wrap, args, nbytes) in passes.items():
    kernel, xla = implementations[name]
    if _kernels_here():
      calls[f"{name}_kernel"] = (wrap(kernel), args)
    calls[f"{name}_xla"] = (wrap(xla), args)
    moved[name] = nbytes
  return calls, moved


def run(shapes: dict = SHAPES, iters: int = 5, rounds: int = 4) -> dict:
  results = {}
  for name, (tokens, top_k, hidden, ffn, experts) in shapes.items():
    calls, moved = _shape_calls(tokens, top_k, hidden, ffn, experts)
    timings = common.time_interleaved(calls, iters=iters, rounds=rounds)
    for method, timing in timings.items():
      if "median_ms" in timing:
        timing["gbps"] = moved[method.rsplit("_", 1)[0]] / timing["median_ms"] / 1e6
    results[name] = {"tokens": tokens, "top_k": top_k, "hidden": hidden, "ffn": ffn,
                     "num_experts": experts, "activation": "swiglu", "passes": timings}
  return {"kernels": _kernels_here(), "shapes": results}


def summary(result: dict) -> str:
  lines = ["FP8 bank passes, ms (GB/s of the bytes each must move)"
           + ("" if result["kernels"] else "; no CuPy GPU here: XLA passes only")]
  for name, shape in result["shapes"].items():
    figures = ", ".join(f"{method} {t['median_ms']:.3f} ({t['gbps']:.0f})" if "median_ms" in t
                        else f"{method} {t.get('error', '?')[:40]}"
                        for method, t in shape["passes"].items())
    lines.append(f"  {name} (H={shape['hidden']}, F={shape['ffn']}): {figures}")
  return "\n".join(lines)
