"""Row groups: the arithmetic of the grouped layout that both the transport
(which fills it) and the expert bank (whose GEMMs read it) need.

Each local expert's rows sit contiguously in one ``[M, H]`` buffer: group
``l`` starts at row ``start[l]``, the exclusive running sum of the kept counts
rounded up to the layout's ``group_align`` (:mod:`moe_ep.transport.receive_grouped`
describes how dispatch fills it). With ``group_align == ROW_TILE`` (the
default, :data:`GROUP_ALIGN`) every ``ROW_TILE``-row tile of the buffer
belongs to one group or to none; with half of it a group's last tile may be
half a tile, which the GEMMs run as such
(:func:`moe_ep.experts.grouped.group_tiles`), so a group pays at most
``group_align - 1`` rows of padding. Whoever decides the layout (the layer,
from ``MoEConfig.group_align``) passes the same ``group_align`` to the
buffer's size, to dispatch and to the bank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_ep.capacity import check_capacity_factor, check_experts, check_num_tokens, round_up

# Rows per tile of the grouped GEMM.
ROW_TILE = 128
# The alignments a layout's groups may start at: whole tiles, or half tiles.
GROUP_ALIGNS = (ROW_TILE, ROW_TILE // 2)
# The default alignment: whole tiles (half tiles measured no faster, docs/grouped.md).
GROUP_ALIGN = ROW_TILE


def check_group_align(group_align, name: str = "group_align") -> int:
  """``group_align`` if it is one of :data:`GROUP_ALIGNS`, else a ValueError
  naming ``name`` and the rule."""
  if isinstance(group_align, bool) or group_align not in GROUP_ALIGNS:
    raise ValueError(f"{name}={group_align!r}: groups start on whole row tiles ({ROW_TILE}) or "
                     f"half tiles ({ROW_TILE // 2})")
  return int(group_align)


def grouped_rows_for(num_tokens: int, top_k: int, num_experts: int, ep_size: int,
                     receive_factor: float | None = None,
                     group_align: int = GROUP_ALIGN) -> int:
  """Rows ``M`` of one rank's grouped buffer.

  Args:
    num_tokens, top_k, num_experts, ep_size: ``T``, ``K``, ``E``, ``R``.
    receive_factor: None: the worst case, ``R * T * min(K, L)`` rows (every
      token of every rank routed to this rank's experts). A float scales the
      balanced load of a rank, ``T * K`` rows, capped at the worst case (one
      rank: the worst case is ``T * K``, so every factor keeps every row).
    group_align: where the layout's groups start (:data:`GROUP_ALIGNS`).

  Returns:
    ``M``: the routed rows plus ``L * (group_align - 1)`` rows of group
    padding, a multiple of ``ROW_TILE``.
  """
  num_tokens = check_num_tokens(num_tokens, "grouped_rows_for")
  num_experts, top_k, ep_size = check_experts(num_experts, top_k, ep_size)
  check_capacity_factor(receive_factor, "receive_factor")
  group_align = check_group_align(group_align)
  local_experts = num_experts // ep_size
  rows = ep_size * num_tokens * min(top_k, local_experts)
  if receive_factor is not None:
    rows = min(rows, math.ceil(receive_factor * num_tokens * top_k))
  return round_up(rows + local_experts * (group_align - 1), ROW_TILE)


def group_starts(counts: jax.Array, num_rows: int,
                 align: int = GROUP_ALIGN) -> tuple[jax.Array, jax.Array]:
  """``(start [L], rows [L])``: each group's first row and its rows rounded
  up to ``align`` (:data:`GROUP_ALIGNS`), cut where the buffer of
  ``num_rows`` rows ends."""
  padded = round_up(counts.astype(jnp.int32), check_group_align(align, "align"))
  ends = jnp.minimum(jnp.cumsum(padded), num_rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends - starts


def group_of_rows(starts: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
  """``positions``' int32 group (the one whose ``[start, start + rows)`` holds
  each buffer row), -1 past the last group (:func:`group_starts` gives
  ``starts`` and ``rows``)."""
  # Unrolled: the default scan is a while loop, whose predicate XLA's GPU
  # runtime reads back on the host at every step.
  group = jnp.searchsorted(starts + rows, positions, side="right",
                           method="scan_unrolled").astype(jnp.int32)
  return jnp.where(group < starts.shape[0], group, -1)
