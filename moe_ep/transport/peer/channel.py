"""A channel's byte layout and the EP groups it serves: pure logic, no device.

A channel is one allocation per device and chunk size in bytes, written by
the device's peers (``kernels/peer.cuh`` places the same regions).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moe_ep.capacity import round_up

ALIGN = 256
VECTOR_BYTES = (16, 8, 4, 2, 1)
MAX_CHUNKS = 1024  # signalled chunks per destination of one fused exchange (PEER_MAX_CHUNKS)


@dataclasses.dataclass(frozen=True)
class ChannelLayout:
  """Byte layout of one channel's allocation on one device (as ``kernels/peer.cuh``).

  ``flags u64[2][R][M]`` at 0 (``M`` = :data:`MAX_CHUNKS`: one flag per
  signalled chunk), ``acks u64[2][R]`` at ``16RM``, ``step u64`` after them,
  ``counters u32[2R + 2]`` after that, then ``2 * (R - 1)`` receive slots of
  ``slot_bytes`` from ``data_offset``.
  """

  ep_size: int
  chunk_bytes: int

  def __post_init__(self):
    if self.ep_size < 2:
      raise ValueError(f"ChannelLayout.ep_size={self.ep_size} must be >= 2")
    if self.chunk_bytes < 1:
      raise ValueError(f"ChannelLayout.chunk_bytes={self.chunk_bytes} must be >= 1")

  @property
  def flags_bytes(self) -> int:
    return 16 * MAX_CHUNKS * self.ep_size

  @property
  def acks_offset(self) -> int:
    return self.flags_bytes

  @property
  def step_offset(self) -> int:
    return self.acks_offset + 16 * self.ep_size

  @property
  def counters_offset(self) -> int:
    return self.step_offset + 8

  @property
  def control_bytes(self) -> int:
    return self.counters_offset + 4 * (2 * self.ep_size + 2)

  @property
  def data_offset(self) -> int:
    return round_up(self.control_bytes, ALIGN)

  @property
  def slot_bytes(self) -> int:
    return round_up(self.chunk_bytes, ALIGN)

  @property
  def total_bytes(self) -> int:
    return self.data_offset + 2 * (self.ep_size - 1) * self.slot_bytes

  @property
  def vector_bytes(self) -> int:
    """The widest copy unit dividing the chunk (16 bytes for any row of a
    multiple of 16 bytes)."""
    return next(v for v in VECTOR_BYTES if self.chunk_bytes % v == 0)

  @staticmethod
  def slot_of(src: int, dst: int) -> int:
    """The receive slot that source ``src`` fills on destination ``dst``."""
    if src == dst:
      raise ValueError(f"rank {src} has no receive slot for itself")
    return src if src < dst else src - 1


def meta_channel_layout(ep_size: int, width: int) -> ChannelLayout:
  """The channel dispatch's ``[R, W]`` int32 metadata travels on: the
  drop-in exchange's for an array of that shape (channels are keyed by their
  chunk bytes), so the fused layout kernels and the exchange share one."""
  return ChannelLayout(ep_size, width * 4)


def ep_groups(mesh: jax.sharding.Mesh, axis_name: str) -> list[tuple]:
  """The EP groups of ``mesh``: for each combination of the other axes'
  coordinates, the devices along ``axis_name`` in axis order (rank = index)."""
  check_axis(mesh, axis_name)
  axis = mesh.axis_names.index(axis_name)
  rows = np.moveaxis(np.asarray(mesh.devices), axis, -1).reshape(-1, mesh.shape[axis_name])
  return [tuple(row) for row in rows]


def check_axis(mesh, axis_name) -> None:
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name={axis_name!r} must be one mesh axis name (a str)")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")


def on_gpus(mesh) -> bool:
  """Whether every device of ``mesh`` is a GPU."""
  return all(d.platform == "gpu" for d in np.asarray(mesh.devices).flat)
