"""The grouped receiver layout: each local expert's rows contiguous in one
``[M, H]`` buffer (the sibling of :mod:`~moe_ep.transport.receive_slabs`).

Instead of ``[L, C, H]`` slabs of a fixed capacity, each local expert's rows
sit contiguously in one ``[M, H]`` buffer: group ``l`` starts at row
``start[l]``, the exclusive running sum of the kept counts rounded up to
the layout's ``group_align`` (:mod:`moe_ep.row_groups`; the grouped GEMM's
row tile or half of it, so every tile of rows belongs to one expert), and
its padding rows up to the next multiple are zero. The buffer is static: ``M``
(:func:`moe_ep.row_groups.grouped_rows_for`) holds every routed row at one
rank (``T * K`` plus the alignment) and, across ranks, a rank-level bound;
rows past it are dropped and counted like capacity drops.

The layout is derived from the slab layout at the same per-expert capacity
(dropless: the bound ``R * T``), by int32 arithmetic only: a kept member at
slab position ``l * C + c`` moves to row ``start[l] + c``. The handle keeps
its two flat maps (``recv_pos`` member -> buffer row, ``slab_row`` now
``[M]``, buffer row -> received row), so every backend and exchange that
fills slabs through them fills the grouped buffer unchanged, and the flat
helpers of :mod:`~moe_ep.transport.receive_slabs` serve both layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_ep.row_groups import GROUP_ALIGN, group_of_rows, group_starts
from moe_ep.transport.handle import DROPPED_MEMBER, RoutingHandle

def from_slabs(recv_pos: jax.Array, slab_row: jax.Array, slab_weights: jax.Array,
               counts: jax.Array, num_rows: int, group_align: int = GROUP_ALIGN):
  """The grouped layout of a slab layout.

  Args:
    recv_pos: ``[R, S, K]`` slab positions ``l * C + c`` (-1 no route, -2 dropped).
    slab_row: ``[L, C]`` received row feeding each slab row, or -1.
    slab_weights: ``[L, C]`` float32.
    counts: ``[L]`` rows kept per expert.
    num_rows: ``M``, a multiple of ``ROW_TILE``.
    group_align: where the groups start (:data:`moe_ep.row_groups.GROUP_ALIGNS`).

  Returns:
    ``recv_pos [R, S, K]`` (rows of the buffer; -2 also where the buffer
    is full), ``row_source [M]`` and ``row_weights [M]`` (as ``slab_row`` and
    ``slab_weights``, per buffer row), ``counts [L]`` rows kept.
  """
  num_local_experts, capacity = slab_row.shape
  starts, rows = group_starts(counts, num_rows, group_align)
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
