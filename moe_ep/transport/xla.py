"""The pure-JAX backend: the transport's local passes as jnp code.

Runs on every platform and is the reference for the CuPy backend, which
implements the same functions (``route``, ``slab_layout``, ``expand_rows``,
``gather_sum_rows`` and the FP8 dispatch's ``quantize_pack_expand``,
``unpack_dequantize_expand``) with the same outputs: integers and FP8 bytes
exactly, floats summed in the same fixed order.
Row movement is done with gathers driven by the handle, never scatter-adds:
XLA's scatter with duplicates is slow on GPU and its summation order is not
fixed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_ep.transport import fp8
from moe_ep.transport import meta as meta_layout
from moe_ep.transport.handle import DROPPED_MEMBER


def route(topk_idx: jax.Array, topk_weights: jax.Array, *, num_experts: int, ep_size: int,
          send_capacity: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Sender side: which wire slot carries each (token, rank), and the metadata
  that travels with the rows.

  Args:
    topk_idx: ``[T, K]`` int32 global expert ids; ids outside
      ``[0, num_experts)`` are not routed.
    topk_weights: ``[T, K]`` float32 routing weights.

  Returns:
    ``send_slot [T, R]``, ``send_token [R, S]``, ``route_slot [T, K]`` (see
    :class:`~moe_ep.transport.handle.RoutingHandle`) and ``meta [R, W]``
    (see :mod:`moe_ep.transport.meta`).
  """
  send_slot, send_token, route_slot = _route_table(
      topk_idx, num_experts=num_experts, ep_size=ep_size, send_capacity=send_capacity)
  meta = _pack_meta(topk_idx, topk_weights, send_token, num_experts=num_experts)
  return send_slot, send_token, route_slot, meta


def _route_table(topk_idx, *, num_experts, ep_size, send_capacity):
  num_tokens, _ = topk_idx.shape
  local_experts = num_experts // ep_size
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  dest = jnp.where(valid, topk_idx // local_experts, ep_size)  # [T, K]
  member = (dest[:, :, None] == jnp.arange(ep_size)).any(axis=1)  # [T, R]
  running = jnp.cumsum(member.astype(jnp.int32), axis=0) - 1
  send_slot = jnp.where(member & (running < send_capacity), running, -1)

  token_ids = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None],
                               send_slot.shape)
  rank_ids = jnp.broadcast_to(jnp.arange(ep_size, dtype=jnp.int32)[None, :],
                              send_slot.shape)
  slot_or_oob = jnp.where(send_slot >= 0, send_slot, send_capacity)
  send_token = jnp.full((ep_size, send_capacity), -1, jnp.int32).at[
      rank_ids, slot_or_oob].set(token_ids, mode="drop", unique_indices=True)

  slot_of_route = jnp.take_along_axis(send_slot, jnp.minimum(dest, ep_size - 1), axis=1)
  route_slot = jnp.where(valid & (slot_of_route >= 0),
                         dest * send_capacity + slot_of_route, -1)
  return send_slot, send_token, route_slot.astype(jnp.int32)


def _pack_meta(topk_idx, topk_weights, send_token, *, num_experts):
  """``[R, W]`` int32: per slot the K local expert ids on that rank (or -1)
  and their float32 weights, then the routes this rank sends to each of the
  destination's experts."""
  ep_size, send_capacity = send_token.shape
  num_tokens, top_k = topk_idx.shape
  local_experts = num_experts // ep_size
  has_token = send_token >= 0
  token = jnp.where(has_token, send_token, 0)
  ids = topk_idx[token]  # [R, S, K]
  weights = topk_weights[token].astype(jnp.float32)
  valid = (ids >= 0) & (ids < num_experts)
  on_rank = (has_token[:, :, None] & valid
             & (ids // local_experts == jnp.arange(ep_size)[:, None, None]))
  local_ids = jnp.where(on_rank, ids % local_experts, -1).astype(jnp.int32)
  weights = jnp.where(on_rank, weights, 0.0)

  routed = jnp.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, num_experts)
  demand = jnp.zeros(num_experts + 1, jnp.int32).at[routed.reshape(-1)].add(1)
  demand = demand[:num_experts].reshape(ep_size, local_experts)
  return meta_layout.pack(local_ids, weights, demand)


def slab_layout(recv_meta: jax.Array, *, top_k: int, num_local_experts: int,
                expert_capacity: int):
  """Receiver-side layout: where each received member lands in the slabs.

  Members are ranked per local expert in the order (source rank, slot, k),
  which is (source rank, source token index, k) because slots grow with the
  token index. A member at rank ``c >= expert_capacity`` is dropped.

  Args:
    recv_meta: ``[R, meta_width]`` int32 metadata, indexed by source rank.

  Returns:
    ``recv_pos [R, S, K]`` (-2 where dropped, see
    :class:`~moe_ep.transport.handle.RoutingHandle`), ``slab_row [L, C]``,
    ``slab_weights [L, C]`` float32, ``counts [L]``, ``demand [L]`` (all
    int32 but the weights).
  """
  local_ids, weights, demand_sent = meta_layout.unpack(
      recv_meta, top_k=top_k, num_local_experts=num_local_experts)
  ep_size, send_capacity, _ = local_ids.shape
  num_members = ep_size * send_capacity * top_k
  capacity = expert_capacity
  keys = local_ids.reshape(num_members)
  keys = jnp.where((keys >= 0) & (keys < num_local_experts), keys, num_local_experts)

  order = jnp.argsort(keys, stable=True).astype(jnp.int32)
  sorted_keys = keys[order]
  starts = jnp.searchsorted(sorted_keys, jnp.arange(num_local_experts + 1), side="left",
                            method="scan_unrolled").astype(jnp.int32)  # unrolled: see group_of_rows
  routed = starts[1:] - starts[:-1]
  counts = jnp.minimum(routed, capacity)

  rank_in_expert = jnp.arange(num_members, dtype=jnp.int32) - starts[sorted_keys]
  kept = (sorted_keys < num_local_experts) & (rank_in_expert < capacity)
  routed_here = sorted_keys < num_local_experts
  pos_sorted = jnp.where(kept, sorted_keys * capacity + rank_in_expert,
                         jnp.where(routed_here, DROPPED_MEMBER, -1))
  recv_pos = jnp.zeros(num_members, jnp.int32).at[order].set(
      pos_sorted, unique_indices=True)

  member_at = starts[:num_local_experts, None] + jnp.arange(capacity, dtype=jnp.int32)
  in_slab = jnp.arange(capacity)[None, :] < counts[:, None]
  member = order[jnp.minimum(member_at, num_members - 1)]
  slab_row = jnp.where(in_slab, member // top_k, -1)
  slab_weights = jnp.where(in_slab, weights.reshape(num_members)[member], 0.0)
  demand = demand_sent.sum(axis=0, dtype=jnp.int32)
  return (recv_pos.reshape(ep_size, send_capacity, top_k), slab_row,
          slab_weights, counts, demand)


def expand_rows(table: jax.Array, targets: jax.Array, sources: jax.Array) -> jax.Array:
  """Copies each table row to every output row it feeds; other rows are zero.

  ``targets`` and ``sources`` describe the same map in both directions (both
  come from the routing handle): ``targets[m, j] == n`` exactly when
  ``sources[n] == m``. This backend gathers through ``sources``; a kernel may
  instead read each table row once and write it through ``targets``.

  Args:
    table: ``[M, H]``.
    targets: ``[M, J]`` int32 output row of copy ``j`` of row ``m``, or -1.
    sources: ``[N]`` int32 table row feeding output row ``n``, or -1 (zero row).

  Returns:
    ``[N, H]`` in ``table.dtype``.
  """
  del targets
  return gather_rows(table, sources)


def gather_rows(table: jax.Array, index: jax.Array) -> jax.Array:
  """``out[i] = table[index[i]]``, zero where ``index[i]`` is out of range.

  Args:
    table: ``[N, ...]``.
    index: int32 of any shape ``I``.

  Returns:
    ``I + table.shape[1:]``.
  """
  rows = table.shape[0]
  safe = jnp.where((index >= 0) & (index < rows), index, rows)
  return jnp.take(table, safe, axis=0, mode="fill", fill_value=0)


def gather_sum_rows(table: jax.Array, index: jax.Array) -> jax.Array:
  """``out[m] = sum_j table[index[m, j]]``, skipping out-of-range entries.

  The sum runs over ``j`` in order, in float32, and is cast to the table's
  dtype once at the end, so the result is fixed bit for bit.

  Args:
    table: ``[N, H]``.
    index: ``[M, J]`` int32.

  Returns:
    ``[M, H]`` in ``table.dtype``.
  """
  total = jnp.zeros((index.shape[0], table.shape[1]), jnp.float32)
  for j in range(index.shape[1]):
    total = total + gather_rows(table, index[:, j]).astype(jnp.float32)
  return total.astype(table.dtype)


# The FP8 dispatch's row passes (the format: moe_ep/transport/fp8.py).


def quantize_pack_expand(table: jax.Array, targets: jax.Array | None = None,
                         sources: jax.Array | None = None) -> jax.Array:
  """Each row quantized once to an FP8 wire row, copied to every output row it
  feeds (:func:`expand_rows` convention); without maps, wire row ``m`` is
  table row ``m``.

  Args:
    table: ``[M, H]`` float32, bfloat16 or float16.
    targets: ``[M, J]`` int32 or None; sources: ``[N]`` int32 or None.

  Returns:
    ``[N, W]`` uint8 (``[M, W]`` without maps), ``W = fp8.wire_bytes(H)``.
  """
  if targets is None and sources is None:
    return fp8.quantize_pack(table)
  return expand_rows(fp8.quantize_pack(table), targets, sources)


def unpack_dequantize_expand(wire: jax.Array, targets: jax.Array, sources: jax.Array, *,
                             hidden: int, dtype) -> jax.Array:
  """FP8 wire rows dequantized into their output rows; other rows are zero.

  Args:
    wire: ``[M, W]`` uint8 wire rows of ``hidden`` channels.
    targets: ``[M, J]`` int32; sources: ``[N]`` int32 (as :func:`expand_rows`).
    hidden: ``H``.
    dtype: output dtype (float32, bfloat16 or float16).

  Returns:
    ``[N, H]`` in ``dtype``: the dequantized wire rows expanded, computed
    as the expand then one dequantize (a zero wire row dequantizes to a
    zero row).
  """
  dtype = fp8.check_dtype(dtype)
  fp8.check_wire(wire, hidden)
  return fp8.dequantize_rows(*fp8.unpack_wire(expand_rows(wire, targets, sources), hidden),
                             dtype)


def dequantize_filled_rows(wire: jax.Array, filled: jax.Array, *, hidden: int,
                           dtype) -> jax.Array:
  """FP8 wire rows dequantized row for row, zero wherever ``filled`` is False
  whatever those rows' bytes hold (the named FP8 slabs, whose padding rows
  the peer dispatch leaves unwritten).

  Args:
    wire: ``[N, W]`` uint8 wire rows of ``hidden`` channels.
    filled: ``[N]`` bool.
    hidden: ``H``.
    dtype: output dtype (float32, bfloat16 or float16).

  Returns:
    ``[N, H]`` in ``dtype``.
  """
  return fp8.dequantize_wire_rows(wire, hidden, dtype, filled)
