"""P2: dispatch and combine across GPUs: time and logical bandwidth (useful
bytes leaving a GPU / time, DeepEP's measure), next to a raw all_to_all of the
same buffer and jax.lax.ragged_all_to_all of the useful rows; and the row
exchange alone: the direct peer exchange (moe_ep.transport.peer) against
all_to_all, with fewer and more blocks per peer.

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
from moe_ep.transport import peer


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


def _same_bits(a, b) -> bool:
  """Shard by shard (works across processes): equal bit patterns."""
  return all(np.array_equal(np.asarray(x.data).view(np.uint16), np.asarray(y.data).view(np.uint16))
             for x, y in zip(a.addressable_shards, b.addressable_shards))


def exchange_case(mesh, rows: int, hidden: int, iters: int, block_counts=(None,),
                  repeat: int = 10) -> dict:
  """One row exchange of ``[R, rows, hidden]`` bf16 per rank: all_to_all and,
  where :func:`peer.supported`, the peer exchange (checked bitwise against
  it) with each ``blocks_per_peer`` in ``block_counts`` (None: all SMs).

  Device time per exchange: ``repeat`` exchanges chained in one jitted call
  (each one's output is the next one's input), so the host's per-call launch
  cost is paid once (XLA replays the chain from a CUDA graph). Bandwidth per
  GPU, both directions at once: off-device bytes sent / time, and DeepEP's
  measure, bytes received including the local chunk / time.
  """
  ep_size = mesh.shape["ep"]
  host = np.random.default_rng(rows).standard_normal((ep_size * ep_size * rows, hidden),
                                                     np.float32).astype(jnp.bfloat16)
  x = _shard(mesh, host)
  smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
  chunk_bytes = rows * hidden * 2

  def chained(exchange):
    def body(b):
      for _ in range(repeat):
        b = exchange(b)
      return b
    return jax.jit(smap(body))

  def timed(exchange):
    """Timing of the chain, and its result (from the last timed call)."""
    fn = chained(exchange)
    timing = common.time_ms(fn, x, iters=iters)
    ms = timing["median_ms"] / repeat
    return {"ms_per_exchange": ms, "off_device_gbs": (ep_size - 1) * chunk_bytes / ms / 1e6,
            "received_gbs": ep_size * chunk_bytes / ms / 1e6, "chain": timing}, fn(x)

  def all_to_all(b):
    return jax.lax.all_to_all(b, "ep", 0, 0, tiled=True)

  want = jax.jit(smap(all_to_all))(x)
  a2a_timing, want_chain = timed(all_to_all)
  result = {"shape_per_rank": [ep_size, rows, hidden], "dtype": "bfloat16", "repeat": repeat,
            "all_to_all": a2a_timing}
  reason = peer.unsupported_reason(mesh, "ep") if ep_size > 1 else "one rank"
  result["peer_unsupported_reason"] = reason
  if reason is not None:
    return result
  layout = peer.ChannelLayout(ep_size, chunk_bytes)
  multiprocessors = getattr(jax.local_devices()[0], "core_count", None)
  runs = []
  try:
    for blocks in block_counts:
      peer.configure(blocks_per_peer=blocks)

      def exchange(b):
        return peer.exchange(b, "ep", mesh, "exchange_rows")

      equal = _same_bits(jax.jit(smap(exchange))(x), want)
      timing, chain_out = timed(exchange)
      equal = equal and _same_bits(chain_out, want_chain)
      peer.raise_if_failed()
      per_peer = peer.blocks_per_peer(layout, multiprocessors) if multiprocessors else blocks
      runs.append({"blocks_per_peer": per_peer, "requested": blocks,
                   "send_blocks": None if per_peer is None else ep_size * per_peer,
                   "recv_blocks": None if per_peer is None else (ep_size - 1) * per_peer,
                   "bitwise_equal_to_all_to_all": equal,  # one call and the chain
                   **timing})
  finally:
    peer.configure()
  result.update(peer=runs, multiprocessors=multiprocessors,
                peer_buffer_bytes_per_process=peer.buffer_bytes())
  return result


def run_exchange(rows=(8192, 4096, 128), hidden=7168, iters=10,
                 block_counts=(None, 16, 32, 64)) -> dict:
  """The row exchange alone over every device of the job (see exchange_case)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
  return {"ep_size": mesh.shape["ep"], "processes": jax.process_count(),
          "exchange": [exchange_case(mesh, r, hidden, iters, block_counts) for r in rows]}


def run(token_counts=(4096, 8192), expert_counts=(64, 256), hidden=7168, top_k=8,
        capacity_factor=1.25, backend="auto", iters=10, block_counts=(None, 16, 32)) -> dict:
  gpus = jax.devices()
  mesh = jax.sharding.Mesh(np.array(gpus), ("ep",))
  cases = [case(mesh, tokens, hidden, experts, top_k, capacity_factor, backend, iters)
           for tokens in token_counts for experts in expert_counts]
  exchanges = [exchange_case(mesh, tokens, hidden, iters, block_counts)
               for tokens in token_counts]
  return {"ep_size": len(gpus), "processes": jax.process_count(), "hidden": hidden,
          "top_k": top_k, "dtype": "bfloat16",
          "capacity_factor": capacity_factor, "transport": backend, "cases": cases,
          "exchange": exchanges}


def exchange_summary(exchanges) -> list[str]:
  lines = []
  for e in exchanges:
    a2a = e["all_to_all"]
    line = (f"  exchange {e['shape_per_rank']} bf16: all_to_all {a2a['ms_per_exchange']:.3f} ms "
            f"({a2a['off_device_gbs']:.0f} GB/s)")
    for run in e.get("peer", []):
      mismatch = "" if run["bitwise_equal_to_all_to_all"] else ", MISMATCH"
      line += (f"; peer x{run['blocks_per_peer']} blocks {run['ms_per_exchange']:.3f} ms "
               f"({run['off_device_gbs']:.0f} GB/s{mismatch})")
    if e["peer_unsupported_reason"] is not None:
      line += f"; peer: n/a ({e['peer_unsupported_reason']})"
    lines.append(line)
  return lines


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
  lines += exchange_summary(result.get("exchange", []))
  return "\n".join(lines)
