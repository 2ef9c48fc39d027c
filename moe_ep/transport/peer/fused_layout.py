"""Dispatch's metadata exchange fused with the receiver's slab layout, one
launch at decode sizes (``kernels/peer_layout.cu``): sender blocks push the
metadata rows, the other blocks wait for every source's row and rank the
members reading them where they landed."""

from __future__ import annotations

import jax
import numpy as np

from moe_ep.transport import kernel_launch, launch_geometry
from moe_ep.transport import meta as meta_format
from moe_ep.transport.peer.callback import fused_call
from moe_ep.transport.peer.channel import ChannelLayout, check_axis, meta_channel_layout
from moe_ep.transport.peer.kernels import Kernel, kernel
from moe_ep.transport.peer.runtime import RUNTIME, timeout_s

LAYOUT_TABLE_BYTES = 8 * 32  # peer_slab_layout's static shared row pointers (ROW_MAX_LANES)
# Beyond 4 ranks the fused layout's blocks read every source's row from L2
# while R - 1 senders copy, slower than the two launches (docs/benchmarks.md).
FUSED_LAYOUT_MAX_RANKS = 4


def fused_meta_rows(ep_size: int, meta_width: int) -> bool:
  """Whether a launch can take route's metadata rows itself (the fused
  layout, the one-launch dispatch): 2 <= R <= 4, rows of whole 16-byte
  vectors."""
  return 2 <= ep_size <= FUSED_LAYOUT_MAX_RANKS and meta_width % 4 == 0


def layout_shared_fits(shared_ints: int) -> bool:
  """Whether the layout's dynamic shared memory fits beside such a launch's
  table of row pointers."""
  return 4 * shared_ints + LAYOUT_TABLE_BYTES <= 4 * kernel_launch.SHARED_INTS


def fused_layout_fits(sizes: launch_geometry.SlabSizes) -> bool:
  """Whether :func:`slab_layout` runs as one launch at this shape: 2 <= R <= 4,
  metadata rows of whole 16-byte vectors (``2 * S * K + L`` a multiple of
  4 words) and few received member tiles, where ``slab_rank_own_count``
  alone lays the slabs out (decode; :func:`moe_ep.transport.launch_geometry.slab_geometry`).
  Elsewhere the drop-in exchange and the backend's ``slab_layout`` run."""
  width = meta_format.width(sizes.send_capacity, sizes.top_k, sizes.local_experts)
  if not fused_meta_rows(sizes.ep_size, width):
    return False
  geometry = launch_geometry.slab_geometry(sizes)
  return not geometry.counted and layout_shared_fits(geometry.shared_ints)


def slab_layout_kernel(channel_layout: ChannelLayout, ordinal: int, peers: int, rank: int,
                       sizes: tuple[int, int, int, int], tail: tuple) -> Kernel:
  """Rank ``rank``'s launch of ``peer_slab_layout_v16`` on GPU ``ordinal``
  (``peers``: the device address of the ranks' channel bases; ``tail``:
  :meth:`Runtime.device_tail`; ``sizes``: ``(S, K, L, C)``). Buffers: meta
  0; recv_pos, slab_row, slab_weights, counts, demand 1-5."""
  slab_sizes = launch_geometry.SlabSizes(channel_layout.ep_size, *sizes)
  if not fused_layout_fits(slab_sizes):
    raise ValueError(f"no fused slab layout at R={channel_layout.ep_size}, (S, K, L, C)={sizes}: "
                     f"too many member tiles (fused_layout_fits)")
  geometry = launch_geometry.slab_geometry(slab_sizes)
  args = (np.uint64(peers), np.int32(rank), np.int32(channel_layout.ep_size),
          *(np.int32(v) for v in (*sizes, channel_layout.chunk_bytes // 4, geometry.tiles)),
          np.int64(channel_layout.slot_bytes), np.int64(channel_layout.data_offset), *tail)
  return Kernel(kernel(ordinal, "slab_layout_v16"),
                channel_layout.ep_size - 1 + geometry.rank_blocks, (0, 1, 2, 3, 4, 5), args,
                threads=geometry.threads,
                shared_bytes=4 * geometry.shared_ints)


def slab_layout(meta: jax.Array, *, top_k: int, num_local_experts: int, expert_capacity: int,
                axis_name: str, mesh: jax.sharding.Mesh) -> tuple:
  """Dispatch's metadata exchange and the receiver's slab layout as one CUDA
  launch (call it inside ``shard_map`` over ``mesh``, lowering for CUDA;
  check :func:`fused_layout_fits` first).

  One ``buffer_callback`` launching ``peer_slab_layout_v16`` on the drop-in
  exchange's channel for ``meta``: its first blocks store row ``d`` of
  ``meta`` into rank ``d``'s slot and raise its flag; the others wait for
  every source's row and rank the received members reading them where they
  landed. Bitwise the backend's ``slab_layout`` of the exchanged ``meta``.

  Args:
    meta: ``[R, W]`` int32, ``route``'s metadata (row ``d`` for rank ``d``).
    top_k, num_local_experts, expert_capacity: ``K``, ``L``, ``C``.
    axis_name, mesh: the EP axis and the ``shard_map``'s mesh.

  Returns:
    ``(recv_pos [R, S, K], slab_row [L, C], slab_weights [L, C], counts [L],
    demand [L])``.
  """
  check_axis(mesh, axis_name)
  ep_size = mesh.shape[axis_name]
  if meta.ndim != 2 or meta.shape[0] != ep_size or meta.dtype != np.int32:
    raise ValueError(f"meta must be int32 [R, W] with R={ep_size}; got {meta.dtype} "
                     f"{meta.shape}")
  width = meta.shape[1]
  send_capacity = meta_format.send_capacity(width, top_k, num_local_experts)
  slab_sizes = launch_geometry.SlabSizes(ep_size, send_capacity, top_k, num_local_experts,
                                     expert_capacity)
  if not fused_layout_fits(slab_sizes):
    raise ValueError(f"no fused slab layout at R={ep_size}, S={send_capacity}, K={top_k}, "
                     f"L={num_local_experts}: too many member tiles (fused_layout_fits)")
  channel_layout = meta_channel_layout(ep_size, width)
  channel = RUNTIME.gpu_channel(mesh, axis_name, channel_layout)
  site = RUNTIME.site("exchange_meta", meta.shape, meta.dtype, channel)
  timeout_ns = int(timeout_s() * 1e9)
  sizes = (send_capacity, top_k, num_local_experts, expert_capacity)
  launches = {ordinal: [slab_layout_kernel(channel_layout, ordinal, state.peers.data.ptr,
                                           state.rank, sizes,
                                           RUNTIME.device_tail(ordinal, site, timeout_ns))]
              for ordinal, state in (channel.on_device.items() if channel is not None else ())}
  shapes = launch_geometry.slab_layout_shapes(slab_sizes)
  return fused_call("slab layout", launches, (meta,), shapes, axis_name)
