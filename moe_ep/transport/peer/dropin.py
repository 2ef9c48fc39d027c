"""The drop-in exchange: ``jax.lax.all_to_all(x, axis_name, 0, 0,
tiled=True)``, bitwise, as stores straight into the other GPUs' memory
(``kernels/peer_exchange.cu``); and the peer-write ceiling the benchmarks
measure against."""

from __future__ import annotations

import functools

import jax
import numpy as np

from moe_ep.transport.peer.callback import fused_call
from moe_ep.transport.peer.channel import ChannelLayout, check_axis
from moe_ep.transport.peer.kernels import THREADS, Kernel, kernel, multiprocessors
from moe_ep.transport.peer.runtime import RUNTIME, timeout_s


def blocks_per_peer(layout: ChannelLayout, multiprocessors: int) -> int:
  """Blocks each peer's chunk is split over: :func:`configure`'s value, else
  half the device's SMs shared among the R - 1 peers (faster than every SM:
  ``docs/benchmarks.md``, "Tuning"); never more
  than the chunk fills (4 vectors per thread)."""
  wanted = RUNTIME.settings.blocks_per_peer
  if wanted is None:
    wanted = max(1, multiprocessors // 2 // (layout.ep_size - 1))
  vectors = layout.chunk_bytes // layout.vector_bytes
  return int(max(1, min(wanted, -(-vectors // (THREADS * 4)))))


def exchange_launch(layout: ChannelLayout, ordinal: int, peers: int, rank: int,
                    tail: tuple) -> Kernel:
  """Rank ``rank``'s launch of the drop-in exchange on GPU ``ordinal``
  (``peers``: the device address of the ranks' channel bases; ``tail``:
  :meth:`Runtime.device_tail`): the send grid (a remote part per peer, as
  many blocks for the local chunk), then the receive grid. Buffers: x 0, out 1."""
  vector = layout.vector_bytes
  blocks = blocks_per_peer(layout, multiprocessors(ordinal))
  remote_blocks = (layout.ep_size - 1) * blocks
  args = (np.uint64(peers), np.int32(rank), np.int32(layout.ep_size),
          np.int64(layout.chunk_bytes // vector), np.int64(layout.slot_bytes),
          np.int64(layout.data_offset), np.int32(blocks), np.int32(blocks))
  return Kernel(kernel(ordinal, f"exchange_v{vector}"), 2 * remote_blocks + blocks, (0, 1),
                args + tail)


def _all_to_all(x, *, axis_name: str):
  return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def _peer(x, *, axis_name: str, mesh, what: str):
  ep_size = mesh.shape[axis_name]
  layout = ChannelLayout(ep_size, x.size // ep_size * x.dtype.itemsize)
  channel = RUNTIME.gpu_channel(mesh, axis_name, layout)
  site = RUNTIME.site(what, x.shape, x.dtype, channel)
  timeout_ns = int(timeout_s() * 1e9)
  launches = {ordinal: [exchange_launch(layout, ordinal, state.peers.data.ptr, state.rank,
                                        RUNTIME.device_tail(ordinal, site, timeout_ns))]
              for ordinal, state in (channel.on_device.items() if channel is not None else ())}
  return fused_call("exchange", launches, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype),
                    axis_name)


def exchange(x: jax.Array, axis_name: str, mesh: jax.sharding.Mesh,
             what: str = "exchange") -> jax.Array:
  """``jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)``, bitwise, by
  direct peer stores on CUDA (call it inside ``shard_map`` over ``mesh``);
  on every other platform it lowers to the ``all_to_all`` itself.

  Args:
    x: ``[R * k, ...]`` this rank's rows; chunk ``d`` (rows ``d*k .. d*k+k``)
      goes to rank ``d``. Any dtype.
    axis_name: the EP mesh axis (size ``R``).
    mesh: the mesh the enclosing ``shard_map`` runs over.
    what: names the exchange (a named scope, and timeout errors).

  Returns:
    ``[R * k, ...]``: chunk ``src`` is what rank ``src`` sent to this rank.
  """
  check_axis(mesh, axis_name)
  ep_size = mesh.shape[axis_name]
  try:
    traced_size = jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(f"exchange(axis_name={axis_name!r}) must be called inside jax.shard_map "
                     f"over that mesh axis") from None
  if traced_size != ep_size:
    raise ValueError(f"axis {axis_name!r} has size {traced_size} here but {ep_size} in mesh")
  if x.ndim < 1 or x.shape[0] % ep_size != 0:
    raise ValueError(f"x shape {x.shape} must be [R * k, ...] with R={ep_size} "
                     f"(the size of axis {axis_name!r}) dividing the leading dimension")
  with jax.named_scope(what):
    if ep_size == 1 or x.size == 0:
      return _all_to_all(x, axis_name=axis_name)
    return jax.lax.platform_dependent(
        x, cuda=functools.partial(_peer, axis_name=axis_name, mesh=mesh, what=what),
        default=functools.partial(_all_to_all, axis_name=axis_name))


def _ceiling(x, *, axis_name: str, mesh):
  ep_size = mesh.shape[axis_name]
  layout = ChannelLayout(ep_size, x.size // ep_size * x.dtype.itemsize)
  if layout.vector_bytes != 16:
    raise ValueError(f"write_ceiling needs chunks of whole 16-byte vectors; got "
                     f"{layout.chunk_bytes} bytes")
  channel = RUNTIME.gpu_channel(mesh, axis_name, layout)
  site = RUNTIME.site("write_ceiling", x.shape, x.dtype, channel)
  timeout_ns = int(timeout_s() * 1e9)
  launches = {}
  for ordinal, state in (channel.on_device.items() if channel is not None else ()):
    blocks = blocks_per_peer(layout, multiprocessors(ordinal))
    args = (np.uint64(state.peers.data.ptr), np.int32(state.rank), np.int32(ep_size),
            np.int64(layout.chunk_bytes // 16), np.int64(layout.slot_bytes),
            np.int64(layout.data_offset), np.int32(blocks))
    tail = RUNTIME.device_tail(ordinal, site, timeout_ns)
    launches[ordinal] = [  # buffers: x 0, a one-word output 1 (never written)
        Kernel(kernel(ordinal, "send_v16"), (ep_size - 1) * blocks, (0, 1),
               (*args, np.int32(0), *tail)),
        Kernel(kernel(ordinal, "drain_v16"), (ep_size - 1) * blocks, (1,), (*args, *tail)),
    ]
  return fused_call("write ceiling", launches, (x,), jax.ShapeDtypeStruct((1,), np.int32),
                    axis_name)


def write_ceiling(x: jax.Array, axis_name: str, mesh: jax.sharding.Mesh) -> jax.Array:
  """The peer-write ceiling, for benchmarks: chunk ``d`` of ``x [R * k,
  ...]`` stored straight into rank ``d``'s slot and signalled, as
  :func:`exchange` does, but nothing copied out (``peer_send`` +
  ``peer_drain``). Returns a ``[1]`` int32 placeholder; CUDA only."""
  check_axis(mesh, axis_name)
  with jax.named_scope("write_ceiling"):
    return _ceiling(x, axis_name=axis_name, mesh=mesh)
