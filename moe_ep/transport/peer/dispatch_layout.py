"""Decode's whole dispatch in one launch (``peer_dispatch_layout``,
``kernels/peer_dispatch.cu``): the metadata exchange, the receiver's slab
layout and the rows. Off by default
(:func:`~moe_ep.transport.peer.dispatch_layout_enabled`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moe_ep.transport import launch_geometry
from moe_ep.transport import meta as meta_format
from moe_ep.transport.peer.callback import fused_call
from moe_ep.transport.peer.channel import ChannelLayout, check_axis, meta_channel_layout
from moe_ep.transport.peer.fused_layout import fused_meta_rows, layout_shared_fits
from moe_ep.transport.peer.kernels import THREADS, Kernel, kernel, multiprocessors
from moe_ep.transport.peer.rows import (ROW_WARPS, RowGrid, RowKernel, dispatch_kernel,
                                        fused_rows_problem)
from moe_ep.transport.peer.runtime import RUNTIME, timeout_s

# peer_dispatch_layout runs up to this many member tiles of 512 (decode),
# each counted by every receiver block; beyond, its receivers also place
# every own row, slower than the layout launches and peer_dispatch
# (docs/benchmarks.md, "Tuning").
DISPATCH_LAYOUT_MAX_TILES = 4


def dispatch_layout_tiles(ep_size: int, send_capacity: int, top_k: int) -> int:
  """peer_dispatch_layout's member tiles (of a row kernel's block)."""
  return -(-ep_size * send_capacity * top_k // THREADS)


def dispatch_layout_counted(tiles: int, receiver_blocks: int | None = None) -> bool:
  """Whether peer_dispatch_layout's receivers count the member tiles once
  each into scratch, a barrier before they rank (more tiles than
  :data:`DISPATCH_LAYOUT_MAX_TILES` or than receiver blocks), rather than
  each block counting every tile (slab_rank_own_count's way)."""
  return tiles > DISPATCH_LAYOUT_MAX_TILES or (receiver_blocks is not None
                                               and tiles > receiver_blocks)


def _shared_ints(tiles: int, local_experts: int, counted: bool) -> int:
  """The layout's shared memory with blocks of the row kernels."""
  return (ROW_WARPS + 2 + (0 if counted else tiles)) * local_experts


def dispatch_layout_fits(dtype, hidden: int, sizes: launch_geometry.SlabSizes,
                         wire_dtype: str | None = None) -> bool:
  """Whether :func:`dispatch_with_layout` runs at this shape: the fused
  dispatch kernel moves these rows (:func:`fused_rows_problem`; no FP8 wire
  yet), 2 <= R <= 4, metadata rows of whole 16-byte vectors, at most
  :data:`DISPATCH_LAYOUT_MAX_TILES` member tiles of 512 (decode) and the
  layout's shared memory fits."""
  ep_size, send_capacity, top_k, local_experts = sizes[:4]
  if wire_dtype is not None or fused_rows_problem(dtype, hidden, ep_size, top_k,
                                                  sums=False) is not None:
    return False
  width = meta_format.width(send_capacity, top_k, local_experts)
  tiles = dispatch_layout_tiles(ep_size, send_capacity, top_k)
  shared = _shared_ints(tiles, local_experts, dispatch_layout_counted(tiles))
  return (fused_meta_rows(ep_size, width) and tiles <= DISPATCH_LAYOUT_MAX_TILES
          and layout_shared_fits(shared)
          # its two channels must differ: a channel is keyed by its chunk bytes
          and meta_channel_layout(ep_size, width).chunk_bytes
          != send_capacity * hidden * np.dtype(dtype).itemsize)


def dispatch_layout_kernel(dtype, num_tokens: int, hidden: int, send_capacity: int, top_k: int,
                           local_experts: int, expert_capacity: int) -> RowKernel:
  """:func:`dispatch_with_layout`'s kernel (``peer_dispatch_layout``)."""
  row_kernel = dispatch_kernel(dtype, num_tokens, hidden, send_capacity, top_k,
                               local_experts * expert_capacity)
  width = meta_format.width(send_capacity, top_k, local_experts)
  # the member tiles depend on R too: dispatch_layout_launch appends them
  return dataclasses.replace(row_kernel, function="dispatch_layout",
                             sizes=(*row_kernel.sizes, local_experts, expert_capacity, width))


def dispatch_layout_launch(row_kernel: RowKernel, grid: RowGrid, layout: ChannelLayout,
                           meta_layout: ChannelLayout, ordinal: int, peers: int, meta_peers: int,
                           rank: int, tail: tuple) -> Kernel:
  """Rank ``rank``'s launch of ``row_kernel`` (:func:`dispatch_layout_kernel`)
  on GPU ``ordinal``, on its rows channel (``layout``, bases at ``peers``)
  and metadata channel (``meta_layout``, ``meta_peers``). Buffers: rows 0,
  send_token 1, send_slot 2, meta 3; slabs 4, recv_pos 5, slab_row 6,
  slab_weights 7, counts 8, demand 9, tile_counts scratch 10
  (:func:`dispatch_layout_tiles` ``* L`` ints). The metadata rows are pushed
  by up to a block per 32 KiB of each, from the sender blocks."""
  ep_size = layout.ep_size
  send_capacity, top_k, _, _, local_experts, _, width = row_kernel.sizes
  tiles = dispatch_layout_tiles(ep_size, send_capacity, top_k)
  counted = dispatch_layout_counted(tiles, grid.recv_blocks)
  if grid.send_blocks < ep_size - 1:
    raise ValueError(f"peer_dispatch_layout needs a sender block per other rank ({ep_size - 1});"
                     f" the grid has {grid.send_blocks} (configure(send_blocks=...))")
  meta_blocks = max(1, min(grid.send_blocks // (ep_size - 1), -(-4 * width // (32 << 10))))
  sized = dataclasses.replace(row_kernel, sizes=(*row_kernel.sizes, tiles))
  args = sized.args(grid, layout, peers, rank, tail) + (
      np.uint64(meta_peers), np.int64(meta_layout.slot_bytes), np.int64(meta_layout.data_offset),
      np.int32(meta_blocks), np.int32(counted))
  return Kernel(kernel(ordinal, row_kernel.function), grid.blocks, tuple(range(11)), args,
                shared_bytes=4 * _shared_ints(tiles, local_experts, counted))


def dispatch_layout_shapes(row_kernel: RowKernel, ep_size: int, slab_dtype,
                           slab_width: int) -> list:
  """``row_kernel``'s (:func:`dispatch_layout_kernel`) outputs at EP size
  ``ep_size``: slabs ``[L * C, slab_width]`` of ``slab_dtype``, the slab
  layout's maps (:func:`moe_ep.transport.launch_geometry.slab_layout_shapes`) and the
  layout's scratch (:func:`dispatch_layout_tiles` ``* L`` int32)."""
  send_capacity, top_k, slab_rows, _, local_experts, capacity, _ = row_kernel.sizes
  return [jax.ShapeDtypeStruct((slab_rows, slab_width), slab_dtype),
          *launch_geometry.slab_layout_shapes(launch_geometry.SlabSizes(
              ep_size, send_capacity, top_k, local_experts, capacity)),
          jax.ShapeDtypeStruct((dispatch_layout_tiles(ep_size, send_capacity, top_k)
                                * local_experts,), np.int32)]


def dispatch_with_layout(rows: jax.Array, meta: jax.Array, send_token: jax.Array,
                         send_slot: jax.Array, *, top_k: int, num_local_experts: int,
                         expert_capacity: int, axis_name: str,
                         mesh: jax.sharding.Mesh) -> tuple:
  """Dispatch from route's outputs to the slabs as one CUDA launch, the
  metadata exchange and the slab layout included (decode sizes; check
  :func:`dispatch_layout_fits` first; call it inside ``shard_map``, lowering
  for CUDA).

  One ``buffer_callback`` launching ``peer_dispatch_layout``: its sender
  blocks push the metadata rows (on the drop-in exchange's channel for
  ``meta``) and then every token row to the other ranks' slots at once; its
  receiver blocks wait for every source's metadata, lay the slabs out, meet
  at a barrier and then place the own rows and each arriving chunk. Bitwise
  the unfused path.

  Args:
    rows: ``[T, H]``; meta, send_token, send_slot: ``route``'s outputs
      (``[R, W]``, ``[R, S]``, ``[T, R]`` int32).
    top_k, num_local_experts, expert_capacity: ``K``, ``L``, ``C``.
    axis_name, mesh: the EP axis and the ``shard_map``'s mesh.

  Returns:
    ``(slabs [L * C, H], recv_pos [R, S, K], slab_row [L, C], slab_weights
    [L, C], counts [L], demand [L])``.
  """
  check_axis(mesh, axis_name)
  ep_size, send_capacity = send_token.shape
  num_tokens, hidden = rows.shape
  if not dispatch_layout_fits(rows.dtype, hidden, launch_geometry.SlabSizes(
      ep_size, send_capacity, top_k, num_local_experts, expert_capacity)):
    raise ValueError(f"no fused dispatch with layout at R={ep_size}, S={send_capacity}, "
                     f"K={top_k}, L={num_local_experts}, H={hidden} (dispatch_layout_fits)")
  width = meta_format.width(send_capacity, top_k, num_local_experts)
  if meta.shape != (ep_size, width):
    raise ValueError(f"meta shape {meta.shape} must be [R, 2 * S * K + L] = [{ep_size}, {width}]")
  row_kernel = dispatch_layout_kernel(rows.dtype, num_tokens, hidden, send_capacity, top_k,
                                      num_local_experts, expert_capacity)
  layout = row_kernel.layout(ep_size)
  meta_layout = meta_channel_layout(ep_size, width)
  channel = RUNTIME.gpu_channel(mesh, axis_name, layout)
  meta_channel = RUNTIME.gpu_channel(mesh, axis_name, meta_layout)
  site = RUNTIME.site(row_kernel.site, (ep_size, send_capacity, hidden), row_kernel.slot_dtype,
                      channel)
  timeout_ns = int(timeout_s() * 1e9)
  launches = {}
  for ordinal, state in (channel.on_device.items() if channel is not None else ()):
    launches[ordinal] = [dispatch_layout_launch(
        row_kernel, row_kernel.grid(ep_size, multiprocessors(ordinal)), layout, meta_layout,
        ordinal, state.peers.data.ptr, meta_channel.on_device[ordinal].peers.data.ptr,
        state.rank, RUNTIME.device_tail(ordinal, site, timeout_ns))]
  shapes = dispatch_layout_shapes(row_kernel, ep_size, rows.dtype, hidden)
  return fused_call("dispatch with layout", launches, (rows, send_token, send_slot, meta),
                    shapes, axis_name)[:6]
