"""P1: the dispatch+combine round trip on one device against a MaxText-style
sort-based permute/unpermute, forward and forward+backward.

Every variant materialises the permuted rows (an optimization_barrier where
the experts would run), so XLA cannot fuse the round trip away. Bandwidth is
counted over the bytes any implementation must move: read the tokens, write
T*K rows, read them back, write the outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import common
from moe_ep.transport import combine, dispatch, expert_capacity_for


def random_routing(key, tokens: int, top_k: int, num_experts: int):
  """Distinct uniform top-k experts per token and softmax-like weights."""
  scores = jax.random.uniform(key, (tokens, num_experts))
  weights, idx = jax.lax.top_k(scores, top_k)
  return idx.astype(jnp.int32), weights / weights.sum(-1, keepdims=True)


def sort_permute_round_trip(x, idx, weights):
  """MaxText's permute / unpermute: argsort by expert, take, take back and
  a weighted sum over k."""
  tokens, top_k = idx.shape
  order = jnp.argsort(idx.reshape(-1))
  rows = jnp.take(x, order // top_k, axis=0)
  rows = jax.lax.optimization_barrier(rows)
  unsorted = jnp.take(rows, jnp.argsort(order), axis=0).reshape(tokens, top_k, -1)
  return jnp.einsum("tkh,tk->th", unsorted, weights.astype(x.dtype))


def transport_round_trip(x, idx, weights, *, num_experts, expert_capacity, backend,
                         wire_dtype=None, checkpoint_name=None):
  d = dispatch(x, idx, weights, num_experts=num_experts, expert_capacity=expert_capacity,
               transport=backend, wire_dtype=wire_dtype, checkpoint_name=checkpoint_name)
  slabs = jax.lax.optimization_barrier(d.tokens)
  return combine(slabs, d.handle, num_tokens=x.shape[0], transport=backend)


FP8 = "float8_e4m3fn"


def run(tokens=16384, hidden=4096, num_experts=64, top_k=8, capacity_factors=(1.0, 1.25),
        backends=("cupy", "xla"), iters=10, copy_bytes=2 << 30, fp8=True) -> dict:
  """Every backend at every capacity factor; with ``fp8``, the first backend
  at the first factor also with FP8 dispatch rows, the dequantize fused into
  the receive (``_fp8``) and with named FP8 slabs (``_fp8_named``, what the
  layer runs). One device has no wire, so FP8 only adds its quantize here:
  these rows measure that cost; its gain is P2's."""
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
  idx, weights = random_routing(keys[1], tokens, top_k, num_experts)
  cotangent = jax.random.normal(keys[2], (tokens, hidden), jnp.bfloat16)
  must_move = 2 * (tokens * hidden + tokens * top_k * hidden) * x.dtype.itemsize

  def timings(fn):
    forward = jax.jit(fn)
    loss = lambda x, w: jnp.vdot(fn(x, idx, w).astype(jnp.float32), cotangent.astype(jnp.float32))
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    fwd = common.time_ms(forward, x, idx, weights, iters=iters)
    fwd_bwd = common.time_ms(both, x, weights, iters=iters)
    return {"forward": fwd, "forward_backward": fwd_bwd,
            "forward_gbs": must_move / fwd["median_ms"] / 1e6}

  copy = common.copy_bandwidth_gbs(copy_bytes)
  variants = {"sort_permute_baseline": timings(sort_permute_round_trip)}
  for factor in capacity_factors:
    capacity = expert_capacity_for(tokens, top_k, num_experts, 1, factor)
    for backend in backends:
      fn = lambda x, i, w, c=capacity, b=backend: transport_round_trip(
          x, i, w, num_experts=num_experts, expert_capacity=c, backend=b)
      result = timings(fn)
      result["expert_capacity"] = capacity
      variants[f"{backend}_cf{factor}"] = result
  if fp8:
    backend, factor = backends[0], capacity_factors[0]
    capacity = expert_capacity_for(tokens, top_k, num_experts, 1, factor)
    for suffix, name in (("_fp8", None), ("_fp8_named", "moe.dispatch")):
      fn = lambda x, i, w, n=name: transport_round_trip(
          x, i, w, num_experts=num_experts, expert_capacity=capacity, backend=backend,
          wire_dtype=FP8, checkpoint_name=n)
      result = timings(fn)
      result["expert_capacity"] = capacity
      variants[f"{backend}_cf{factor}{suffix}"] = result
  baseline = variants["sort_permute_baseline"]
  for result in variants.values():
    result["forward_fraction_of_copy"] = result["forward_gbs"] / copy["gbs"]
    result["forward_backward_vs_baseline"] = (result["forward_backward"]["median_ms"]
                                              / baseline["forward_backward"]["median_ms"])
  return {
      "shapes": dict(tokens=tokens, hidden=hidden, num_experts=num_experts, top_k=top_k,
                     dtype="bfloat16", ep_size=1),
      "bytes_round_trip_must_move": must_move,
      "copy": copy,
      "note": ("transport variants combine unweighted (the layer weights rows in the expert "
               "epilogue); the baseline's unpermute includes its weighted sum, fused by XLA."),
      "variants": variants,
  }


def summary(result: dict) -> str:
  lines = [f"P1 transport round trip {result['shapes']}; copy {result['copy']['gbs']:.0f} GB/s"]
  for name, v in result["variants"].items():
    lines.append(f"  {name:28s} fwd {v['forward']['median_ms']:.3f} ms "
                 f"({100 * v['forward_fraction_of_copy']:.0f}% of copy)  fwd+bwd "
                 f"{v['forward_backward']['median_ms']:.3f} ms "
                 f"({v['forward_backward_vs_baseline']:.2f}x baseline)")
  return "\n".join(lines)

