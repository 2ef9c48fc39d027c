"""The receiver-side layout of dispatch's output: where each received
member's row lands, in one place.

The layout of *slabs*: local expert ``l``'s rows at ``[l, 0 ..
counts[l])`` of an ``[L, C, H]`` buffer (``C`` = ``expert_capacity``), in
(source rank, slot, k) order, the rest zero. The handle holds it as two flat
maps (:class:`~moe_ep.transport.handle.RoutingHandle`): ``recv_pos [R, S,
K]``, member -> output row ``l * C + c``, and ``slab_row [L, C]``, output
row -> received row ``src * S + s``. The row paths
(:mod:`~moe_ep.transport.row_paths`) move rows along those maps over flat
``[N, H]`` output rows and ask this module for everything that is
``[L, C]``: the layout computed from the received metadata, the flat maps,
the output's shape, which output rows a member fills. The grouped layout
(:mod:`~moe_ep.transport.receive_grouped`: each expert's rows contiguous in one
``[M, H]`` buffer) is derived from this one and keeps the same two flat
maps, ``slab_row`` then ``[M]``, so the flat helpers here serve it too.
"""

from __future__ import annotations

import jax

from moe_ep.transport.handle import RoutingHandle


def output_sources(handle: RoutingHandle) -> jax.Array:
  """``[N]`` int32: the received row ``src * S + s`` feeding each flat output
  row (``N = L * C``), or -1 (a zero row)."""
  return handle.slab_row.reshape(-1)


def output_shape(handle: RoutingHandle, width: int) -> tuple[int, ...]:
  """The shape of dispatch's output of rows ``width`` wide: ``[L, C, width]``."""
  return handle.slab_row.shape + (width,)


def filled(handle: RoutingHandle) -> jax.Array:
  """``[N]`` bool: the flat output rows some member fills (the others are
  padding)."""
  rows = output_sources(handle)
  return (rows >= 0) & (rows < handle.send_token.size)


def check_outputs(expert_outputs: jax.Array, handle: RoutingHandle) -> None:
  """ValueError unless ``expert_outputs`` is ``[L, C, H]`` in the layout of
  the dispatch that made ``handle`` (its rank checked already)."""
  if expert_outputs.shape[:2] != handle.slab_row.shape:
    raise ValueError(f"expert_outputs shape {expert_outputs.shape} must be [L, C, H] with "
                     f"[L, C] = {handle.slab_row.shape} from the handle")
