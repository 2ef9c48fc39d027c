"""The routing handle and what dispatch returns: plain int32 data, no backend
code (notation: :mod:`moe_ep.capacity`)."""

from __future__ import annotations

from typing import NamedTuple

import jax

# RoutingHandle.recv_pos of a member that came to this rank and was dropped
# for capacity (-1: no route here).
DROPPED_MEMBER = -2


def _size(field: str, axis: int, doc: str) -> property:
  """A read-only size: axis ``axis`` of the handle's array ``field``."""
  return property(lambda handle: getattr(handle, field).shape[axis], doc=doc)


class RoutingHandle(NamedTuple):
  """The complete routing state of one dispatch: plain int32 arrays.

  Combine and both backward passes read only this; nothing is cached by
  pointer or held in Python. ``-1`` marks "no row" everywhere.

  Attributes:
    send_slot: ``[T, R]`` slot of token ``t`` in its chunk to rank ``d``
      (sender side; -1 if the token has no route to ``d`` or was dropped on
      the wire).
    send_token: ``[R, S]`` token index held by slot ``s`` of the chunk to
      rank ``d`` (the inverse of ``send_slot``).
    route_slot: ``[T, K]`` flat wire row ``d * S + slot`` that carries route
      ``(t, k)``, or -1 (invalid id, or dropped on the wire).
    recv_pos: ``[R, S, K]`` flat slab position ``l * C + c`` of member ``k``
      of the row received from rank ``src`` in slot ``s`` (receiver side):
      -1 where no route (no row in that slot, or route ``k`` of its token
      is not to this rank), -2 where the route came here and was dropped
      for capacity. So a slot held a row exactly where some member is not
      -1 (combine then sends back only those rows).
    slab_row: ``[L, C]`` flat received row ``src * S + s`` feeding slab row
      ``(l, c)``, or -1 on padding rows. In the grouped layout
      (:mod:`~moe_ep.transport.receive_grouped`) ``[M]``, per buffer row, and
      ``recv_pos`` holds buffer rows.
  """

  send_slot: jax.Array
  send_token: jax.Array
  route_slot: jax.Array
  recv_pos: jax.Array
  slab_row: jax.Array

  # The sizes, each read from the map that holds it.
  num_tokens = _size("send_slot", 0, "``T``: this rank's tokens.")
  ep_size = _size("send_slot", 1, "``R``: ranks on the EP axis.")
  send_capacity = _size("send_token", 1, "``S``: rows per destination send chunk.")
  top_k = _size("route_slot", 1, "``K``: routes per token.")
  num_local_experts = _size("slab_row", 0, "``L``: experts on this rank (slabs only).")
  expert_capacity = _size("slab_row", 1, "``C``: rows per expert slab (slabs only).")

  @property
  def grouped(self) -> bool:
    """Whether the rows sit in the grouped layout (``slab_row [M]``), else in slabs."""
    return self.slab_row.ndim == 1


class Dispatched(NamedTuple):
  """What ``dispatch`` returns (a pytree).

  Attributes:
    tokens: ``[L, C, H]`` slab ``l`` holds the rows routed to global expert
      ``r*L + l``, in the order (source rank, source token index, k); rows
      ``>= counts[l]`` are zero. Grouped: ``[M, H]``, the same rows of
      expert ``l`` contiguous from its group's start, other rows zero.
    weights: ``[L, C]`` (grouped ``[M]``) float32 routing weight of each
      row, 0 on padding.
    handle: the :class:`RoutingHandle`.
    counts: ``[L]`` int32 rows kept per local expert.
    demand: ``[L]`` int32 rows routed to each local expert before any drop,
      across all source ranks.
    fp8_tokens: None, or (a dispatch asked for them: ``fp8_rows``) the
      grouped rows as they crossed on the FP8 wire, ``(codes [M, H]
      float8_e4m3fn, scales [M, ceil(H / 128)] float32)``, zero on rows no
      member fills: ``tokens`` is their dequantization. Not differentiable
      (the gradient reaches the tokens through ``tokens``).
  """

  tokens: jax.Array
  weights: jax.Array
  handle: RoutingHandle
  counts: jax.Array
  demand: jax.Array
  fp8_tokens: tuple[jax.Array, jax.Array] | None = None
