"""The grouped receiver layout: each local expert's rows contiguous in one
``[M, H]`` buffer (the sibling of :mod:`~moe_ep.transport.slabs`).

Instead of ``[L, C, H]`` slabs of a fixed capacity, each local expert's rows
sit contiguously in one ``[M, H]`` buffer: group ``l`` starts at row
``start[l]``, the exclusive running sum of the kept counts rounded up to
``ROW_TILE`` (the row tile of the grouped GEMM, so every tile of rows belongs
to one expert), and its padding rows up to the next multiple are zero. The
buffer is static: ``M`` (:func:`grouped_rows_for`) holds every routed row at
one rank (``T * K`` plus the alignment) and, across ranks, a rank-level
bound; rows past it are dropped and counted like capacity drops.

The layout is derived from the slab layout at the same per-expert capacity
(dropless: the bound ``R * T``), by int32 arithmetic only: a kept member at
slab position ``l * C + c`` moves to row ``start[l] + c``. The handle keeps
its two flat maps (``recv_pos`` member -> buffer row, ``slab_row`` now
``[M]``, buffer row -> received row), so every backend and exchange that
fills slabs through them fills the grouped buffer unchanged, and the flat
helpers of :mod:`~moe_ep.transport.slabs` serve both layouts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_ep.transport.layout import (DROPPED_MEMBER, RoutingHandle, check_capacity_factor,
                                    check_experts, check_num_tokens, round_up)

# Rows per tile of the grouped GEMM (moe_ep.experts.hopper.ROW_TILE): groups
# start at multiples of it.
ROW_TILE = 128


def grouped_rows_for(num_tokens: int, top_k: int, num_experts: int, ep_size: int,
                     receive_factor: float | None = None) -> int:
  """Rows ``M`` of one rank's grouped buffer.

  Args:
    num_tokens, top_k, num_experts, ep_size: ``T``, ``K``, ``E``, ``R``.
    receive_factor: None: the worst case, ``R * T * min(K, L)`` rows (every
      token of every rank routed to this rank's experts). A float scales the
      balanced load of a rank, ``T * K`` rows, capped at the worst case (one
      rank: the worst case is ``T * K``, so every factor keeps every row).

  Returns:
    ``M``: the routed rows plus ``L * (ROW_TILE - 1)`` rows of group padding,
    a multiple of ``ROW_TILE``.
  """
  num_tokens = check_num_tokens(num_tokens, "grouped_rows_for")
  num_experts, top_k, ep_size = check_experts(num_experts, top_k, ep_size)
  check_capacity_factor(receive_factor, "receive_factor")
  local_experts = num_experts // ep_size
  rows = ep_size * num_tokens * min(top_k, local_experts)
  if receive_factor is not None:
    rows = min(rows, math.ceil(receive_factor * num_tokens * top_k))
  return round_up(rows + local_experts * (ROW_TILE - 1), ROW_TILE)


def group_starts(counts: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """``(start [L], rows [L])``: each group's first row and its rows rounded
  up to ``ROW_TILE``, cut where the buffer of ``num_rows`` rows ends."""
  padded = round_up(counts.astype(jnp.int32), ROW_TILE)
  ends = jnp.minimum(jnp.cumsum(padded), num_rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends - starts


def group_of_rows(starts: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
  """``positions``' int32 group (the one whose ``[start, start + rows)`` holds
  each buffer row), -1 past the last group (:func:`group_starts` gives
  ``starts`` and ``rows``)."""
  group = jnp.searchsorted(starts + rows, positions, side="right").astype(jnp.int32)
  return jnp.where(group < starts.shape[0], group, -1)


def from_slabs(recv_pos: jax.Array, slab_row: jax.Array, slab_weights: jax.Array,
               counts: jax.Array, num_rows: int):
  """The grouped layout of a slab layout.

  Args:
    recv_pos: ``[R, S, K]`` slab positions ``l * C + c`` (-1 no route, -2 dropped).
    slab_row: ``[L, C]`` received row feeding each slab row, or -1.
    slab_weights: ``[L, C]`` float32.
    counts: ``[L]`` rows kept per expert.
    num_rows: ``M``, a multiple of ``ROW_TILE``.

  Returns:
    ``recv_pos [R, S, K]`` (rows of the buffer; -2 also where the buffer
    is full), ``row_source [M]`` and ``row_weights [M]`` (as ``slab_row`` and
    ``slab_weights``, per buffer row), ``counts [L]`` rows kept.
  """
  num_local_experts, capacity = slab_row.shape
  starts, rows = group_starts(counts, num_rows)
  kept = jnp.clip(num_rows - starts, 0, counts)
  expert = jnp.clip(recv_pos // capacity, 0, num_local_experts - 1)
  column = recv_pos % capacity
  fits = column < kept[expert]
  grouped_pos = jnp.where(recv_pos >= 0, jnp.where(fits, starts[expert] + column, DROPPED_MEMBER),
                          recv_pos)

  row = jnp.arange(num_rows, dtype=jnp.int32)
  row_group = group_of_rows(starts, rows, row)
  row_expert = jnp.maximum(row_group, 0)
  row_column = row - starts[row_expert]
  filled = (row_group >= 0) & (row_column < kept[row_expert])
  slab_index = row_expert * capacity + jnp.minimum(row_column, capacity - 1)
  row_source = jnp.where(filled, slab_row.reshape(-1)[slab_index], -1)
  row_weights = jnp.where(filled, slab_weights.reshape(-1)[slab_index], 0.0)
  return grouped_pos.astype(jnp.int32), row_source, row_weights, kept.astype(jnp.int32)


def check_outputs(expert_outputs: jax.Array, handle: RoutingHandle) -> None:
  """ValueError unless ``expert_outputs`` is ``[M, H]`` in the grouped layout
  of the dispatch that made ``handle``."""
  if expert_outputs.ndim != 2 or expert_outputs.shape[0] != handle.slab_row.shape[0]:
    raise ValueError(f"expert_outputs shape {expert_outputs.shape} must be [M, H] with "
                     f"M = {handle.slab_row.shape[0]} from the handle (the grouped layout)")
