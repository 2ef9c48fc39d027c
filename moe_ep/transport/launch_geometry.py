"""Launch geometry of the routing and slab-layout kernels (``kernels/layout.cu``
and the peer launches that lay the slabs out themselves): threads per tile,
grids, dynamic shared memory, and the shape checks that go with them. Pure
Python, no CuPy: the CuPy backend (:mod:`~moe_ep.transport.cupy_backend`)
and the peer path (:mod:`~moe_ep.transport.peer`) both size their launches here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_ep.transport.kernel_launch import SHARED_INTS


def tile_threads(num_keys: int, extra_ints: int = 0) -> int:
  """Threads per tile block of the layout kernels: one warp-count row of
  ``num_keys`` ints per warp (plus ``extra_ints``) must fit in shared memory."""
  warps = (SHARED_INTS - extra_ints) // max(num_keys, 1)
  if warps < 1:
    raise ValueError(f"{num_keys} keys do not fit the layout kernels' shared memory")
  return 32 * min(32, warps)


class RouteSizes(NamedTuple):
  """The sizes of one dispatch's routing (the notation of :mod:`moe_ep.capacity`)."""

  num_tokens: int  # T
  ep_size: int  # R
  num_experts: int  # E
  top_k: int  # K


def route_count_shared_ints(threads: int, sizes: RouteSizes) -> int:
  return threads // 32 * sizes.ep_size + sizes.num_experts


def route_rank_shared_ints(threads: int, sizes: RouteSizes, counted: bool) -> int:
  """``route_rank``'s; ``counted=False``: it counts its one tile itself."""
  ep_size = sizes.ep_size
  own_counts = 0 if counted else ep_size + sizes.num_experts
  return (threads // 32 + 3) * ep_size + threads * (ep_size + 1 + 3 * sizes.top_k) + own_counts


# Up to this many member tiles, slab_rank counts them itself (no slab_count
# launch): each block counts the other tiles, one pass each; one launch fewer
# is faster at decode (docs/benchmarks.md, "Tuning").
SLAB_TILES_COUNTED_IN_RANK = 2

# Warps per token tile of the routing kernels beyond one tile: the fastest
# route_rank measured (docs/benchmarks.md, "Tuning").
ROUTE_WARPS = 4


def route_counted(num_tokens: int, threads: int) -> bool:
  """Whether ``route_count`` counts the token tiles first: more than one
  tile (one tile: ``route_rank_own_count`` counts it, one launch fewer at decode)."""
  return num_tokens > threads


def route_threads(sizes: RouteSizes) -> int:
  """Threads per token tile of ``route_count``/``route_rank``: up to 256
  tokens (decode) one tile of 8 warps, which leaves each thread the fewest
  serial loads (the faster route_rank: ``docs/benchmarks.md``, "Tuning"),
  else :data:`ROUTE_WARPS` warps; fewer where both kernels' shared memory
  would not fit."""
  most = 8 if sizes.num_tokens <= 32 * 8 else ROUTE_WARPS
  for warps in range(most, 0, -1):
    threads = 32 * warps
    counted = route_counted(sizes.num_tokens, threads)
    if max(route_count_shared_ints(threads, sizes),
           route_rank_shared_ints(threads, sizes, counted)) <= SHARED_INTS:
      return threads
  raise ValueError(f"ep_size={sizes.ep_size}, num_experts={sizes.num_experts} and "
                   f"top_k={sizes.top_k} do not fit the routing kernels' shared memory")


class SlabSizes(NamedTuple):
  """The sizes of one dispatch's slab layout (the notation of
  :mod:`moe_ep.capacity`)."""

  ep_size: int  # R ranks
  send_capacity: int  # S rows per destination send chunk
  top_k: int  # K routes per token
  local_experts: int  # L experts on each rank
  expert_capacity: int  # C rows per expert slab


def slab_layout_shapes(sizes: SlabSizes) -> list:
  """The slab layout's outputs: ``recv_pos [R, S, K]``, ``slab_row [L, C]``,
  ``slab_weights [L, C]`` float32, ``counts [L]``, ``demand [L]``."""
  slabs = (sizes.local_experts, sizes.expert_capacity)
  return [jax.ShapeDtypeStruct((sizes.ep_size, sizes.send_capacity, sizes.top_k), jnp.int32),
          jax.ShapeDtypeStruct(slabs, jnp.int32),
          jax.ShapeDtypeStruct(slabs, jnp.float32),
          jax.ShapeDtypeStruct((sizes.local_experts,), jnp.int32),
          jax.ShapeDtypeStruct((sizes.local_experts,), jnp.int32)]


@dataclasses.dataclass(frozen=True)
class SlabGeometry:
  """The receiver's slab-layout launches at one shape: ``tiles`` member
  tiles of ``threads``; ``slab_rank``'s grid of ``rank_blocks`` with
  ``shared_ints`` of dynamic shared memory; ``counted``: a ``slab_count``
  launch counts the tiles first (else ``slab_rank_own_count``'s blocks count
  them themselves)."""

  threads: int
  tiles: int
  rank_blocks: int
  shared_ints: int
  counted: bool


def slab_geometry(sizes: SlabSizes) -> SlabGeometry:
  """:class:`SlabGeometry` for ``R * S * K`` received members and ``[L, C]`` slabs."""
  local_experts, expert_capacity = sizes.local_experts, sizes.expert_capacity
  num_members = sizes.ep_size * sizes.send_capacity * sizes.top_k
  for name, size in (("R * S * K received members", num_members),
                     ("L * C slab rows", local_experts * expert_capacity)):
    if size >= 2**31:  # the kernels index them in int32, as the handle holds them
      raise ValueError(f"{name} = {size} must be < 2**31 (int32 positions)")
  threads = tile_threads(local_experts, extra_ints=2 * local_experts)
  tiles = -(-num_members // threads)
  rank_ints = (threads // 32 + 2) * local_experts
  # Few tiles (decode): slab_rank's blocks count them themselves, one launch fewer.
  counted = (tiles > SLAB_TILES_COUNTED_IN_RANK
             or rank_ints + tiles * local_experts > SHARED_INTS)
  return SlabGeometry(threads=threads, tiles=tiles,
                  rank_blocks=max(tiles, -(-local_experts * expert_capacity // threads)),
                  shared_ints=rank_ints + (0 if counted else tiles * local_experts),
                  counted=counted)
