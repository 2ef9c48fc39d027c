"""P2: dispatch and combine across GPUs: time and logical bandwidth (useful
bytes leaving a GPU / time, DeepEP's measure), next to a raw all_to_all of the
same buffer and jax.lax.ragged_all_to_all of the useful rows.

Runs over every device of the job: one process with several GPUs, or one
process per GPU under ``python -m moe_ep.launch --gpus-per-process 1``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.bench import common
from moe_ep.transport import (combine, dispatch, expert_capacity_for,
                              send_capacity_for)


def _shard(mesh, array):
  """A global array sharded over "ep" from a host array every process holds."""
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, NamedSharding(mesh, P("ep")),
                                      lambda index: array[index])


def _host_routing(rng, tokens: int, top_k: int, num_experts: int):
  idx = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)
  weights = rng.random((tokens, top_k)).astype(np.float32)
  return idx, weights / weights.sum(-1, keepdims=True)


def case(mesh, tokens: int, hidden: int, num_experts: int, top_k: int, capacity_factor,
         backend: str, iters: int) -> dict:
  ep_size = mesh.shape["ep"]
  capacity = expert_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  send_capacity = send_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  rng = np.random.default_rng(tokens + num_experts)
  x = _shard(mesh, rng.standard_normal((ep_size * tokens, hidden), np.float32).astype(jnp.bfloat16))
  idx, weights = (_shard(mesh, a) for a in _host_routing(rng, ep_size * tokens, top_k,
                                                         num_experts))
  smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
  kwargs = dict(num_experts=num_experts, expert_capacity=capacity, axis_name="ep",
                send_capacity=send_capacity, backend=backend)

  dispatch_fn = jax.jit(smap(lambda x, i, w: dispatch(x, i, w, **kwargs)))
  dispatched = dispatch_fn(x, idx, weights)
  dispatch_time = common.time_ms(lambda *a: dispatch_fn(*a).tokens, x, idx, weights, iters=iters)
  combine_fn = jax.jit(smap(lambda s, h: combine(s, h, num_tokens=tokens, axis_name="ep",
                                                 backend=backend)))
  combine_time = common.time_ms(combine_fn, dispatched.tokens, dispatched.handle, iters=iters)

  # Useful rows: wire rows a rank sends to the other ranks (padding excluded).
  send_slot = np.asarray(multihost_utils.process_allgather(dispatched.handle.send_slot,
                                                          tiled=True))
  send_slot = send_slot.reshape(ep_size, tokens, ep_size)
  off_device = [int((send_slot[r][:, [d for d in range(ep_size) if d != r]] >= 0).sum())
                for r in range(ep_size)]
  row_bytes = hidden * 2
  useful_bytes = max(off_device) * row_bytes
  wire_bytes = (ep_size - 1) * send_capacity * row_bytes

  buffer = _shard(mesh, np.ones((ep_size * ep_size, send_capacity, hidden), jnp.bfloat16))
  raw = jax.jit(smap(lambda b: jax.lax.all_to_all(b, "ep", 0, 0, tiled=True)))
  raw_time = common.time_ms(raw, buffer, iters=iters)
  ragged_time = _ragged_time(mesh, send_slot, send_capacity, hidden, iters)
  return {
      "tokens_per_rank": tokens, "num_experts": num_experts, "expert_capacity": capacity,
      "send_capacity": send_capacity, "useful_rows_off_device_per_rank": off_device,
      "dispatch": dispatch_time, "combine": combine_time, "raw_all_to_all": raw_time,
      "ragged_all_to_all": ragged_time,
      "dispatch_logical_gbs": useful_bytes / dispatch_time["median_ms"] / 1e6,
      "combine_logical_gbs": useful_bytes / combine_time["median_ms"] / 1e6,
      "raw_all_to_all_wire_gbs": wire_bytes / raw_time["median_ms"] / 1e6,
      "ragged_all_to_all_logical_gbs": (useful_bytes / ragged_time["median_ms"] / 1e6
                                        if "median_ms" in ragged_time else None),
  }


def _ragged_time(mesh, send_slot, send_capacity, hidden, iters):
  """ragged_all_to_all of exactly the useful rows (sizes precomputed)."""
  ep_size = mesh.shape["ep"]
  counts = np.stack([(send_slot[r] >= 0).sum(0) for r in range(ep_size)]).astype(np.int32)
  offsets = (np.arange(ep_size, dtype=np.int32) * send_capacity)[None].repeat(ep_size, 0)
  # Rank r's rows for d land in d's output block r.
  output_offsets = (np.arange(ep_size, dtype=np.int32)[:, None] * send_capacity).repeat(ep_size, 1)
  recv_sizes = counts.T.copy()
  operand = _shard(mesh, np.ones((ep_size * ep_size * send_capacity, hidden), jnp.bfloat16))

  def body(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
    output = jnp.zeros_like(operand)
    return jax.lax.ragged_all_to_all(operand, output, input_offsets[0], send_sizes[0],
                                     output_offsets[0], recv_sizes[0], axis_name="ep")
  try:
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = [operand] + [_shard(mesh, a) for a in (offsets, counts, output_offsets, recv_sizes)]
    return common.time_ms(fn, *args, iters=max(2, iters // 5), repeats=3)
  except Exception as error:  # not every jax/XLA build has it on every platform
    return {"error": repr(error)[:300]}


def run(token_counts=(4096, 8192), expert_counts=(64, 256), hidden=7168, top_k=8,
        capacity_factor=1.25, backend="auto", iters=10) -> dict:
  gpus = jax.devices()
  mesh = jax.sharding.Mesh(np.array(gpus), ("ep",))
  cases = [case(mesh, tokens, hidden, experts, top_k, capacity_factor, backend, iters)
           for tokens in token_counts for experts in expert_counts]
  return {"ep_size": len(gpus), "processes": jax.process_count(), "hidden": hidden,
          "top_k": top_k, "dtype": "bfloat16",
          "capacity_factor": capacity_factor, "transport": backend, "cases": cases}


def summary(result: dict) -> str:
  lines = [f"P2 EP={result['ep_size']} ({result['processes']} processes) H={result['hidden']} "
           f"K={result['top_k']}"]
  for c in result["cases"]:
    ragged = c["ragged_all_to_all_logical_gbs"]
    lines.append(
        f"  T={c['tokens_per_rank']} E={c['num_experts']}: dispatch "
        f"{c['dispatch']['median_ms']:.3f} ms ({c['dispatch_logical_gbs']:.0f} GB/s), combine "
        f"{c['combine']['median_ms']:.3f} ms ({c['combine_logical_gbs']:.0f} GB/s), raw a2a "
        f"{c['raw_all_to_all_wire_gbs']:.0f} GB/s, ragged a2a "
        f"{'n/a' if ragged is None else f'{ragged:.1f} GB/s'}")
  return "\n".join(lines)
