"""Dispatch's and combine's row paths as one peer launch each
(``kernels/peer_dispatch.cu``, ``kernels/peer_combine.cu``).

Sender blocks store each token row straight into the slot of every rank it
goes to, and combine each received row's member sum straight into the
source rank's slot, in chunks that each raise their own flag; receiver
blocks of the same grid meanwhile do this GPU's own rows (its tokens into
its slabs, its own member sums) and take each arriving chunk as soon as its
flag is up, so the NVLink transfer overlaps the local memory traffic. No
``[R, S, H]`` buffer in XLA on either side; results bitwise those of the
local row passes around an ``all_to_all`` (:func:`fused_rows_problem` says
which rows they take). These are CUDA operations: where the dispatch plan
takes them (:mod:`moe_ep.transport.plan`), the row paths run them on CUDA and
the ``all_to_all`` path elsewhere (:mod:`moe_ep.transport.row_paths`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moe_ep.transport import cupy_backend
from moe_ep.transport import fp8, kernel_launch
from moe_ep.transport.kernel_launch import DTYPE_SUFFIX
from moe_ep.capacity import round_up
from moe_ep.options import WIRE_DTYPES
from moe_ep.transport.peer.callback import fused_call
from moe_ep.transport.peer.channel import ChannelLayout, MAX_CHUNKS, check_axis
from moe_ep.transport.peer.kernels import THREADS, Kernel, kernel, multiprocessors
from moe_ep.transport.peer.runtime import RUNTIME, timeout_s

# The fused row kernels: one warp per unit of a row, blocks of THREADS.
ROW_WARPS = THREADS // 32
_COPY_STEP = 32 * 4  # vectors a warp moves per step (kernels/peer_rows.cuh ROW_COPY_UNROLL)
_SUM_STEP = 32 * 2  # vectors a warp sums per step (ROW_SUM_UNROLL)
MAX_FUSED_RANKS = 32  # one lane per rank's entry of a token
MAX_FUSED_TOP_K = 32  # one lane per member of a row
_FP8 = WIRE_DTYPES[0]  # the one wire dtype the fused dispatch quantizes to
_FP8_STEP_CHANNELS = 512  # channels per quantize step of a warp (kernels/fp8.cuh)
_CHUNKS_PER_SENDER = 8  # chunks each sender block signals, at most
_MIN_CHUNK_BYTES = 128 << 10  # smaller chunks only to give every sender block one
# The share of a fused exchange's blocks that store rows into the other GPUs
# (the senders also place their tokens' own rows; the sweep over sender
# counts for both directions and FP8: docs/benchmarks.md, "Tuning").
SEND_SHARE = {"dispatch": 0.5, "combine": 0.5}
# Up to this many bytes of combine output times R - 1 (decode and small
# prefill sizes), its receivers store each token's own member sum into the
# output first and wait for the other ranks' rows after (kernels/peer_combine.cu's
# own_first): the output is stored twice, and the own members' reads overlap
# the other ranks' sending; it pays only while the output is small, and less
# the more ranks share the members (docs/benchmarks.md, "Tuning").
_COMBINE_OWN_FIRST_BYTES = 8 << 20


def fused_rows_problem(dtype, hidden: int, ep_size: int, top_k: int, *,
                       sums: bool, wire_dtype: str | None = None) -> str | None:
  """Why the fused row kernels cannot move rows of ``hidden`` elements of
  ``dtype`` (the caller then runs the local row passes around the drop-in
  exchange), or None. ``sums``: combine's path, which adds rows.
  ``wire_dtype="float8_e4m3fn"``: dispatch quantizing the rows as it sends
  them (:func:`dispatch_rows`)."""
  dtype = np.dtype(dtype)
  if wire_dtype is not None:
    if wire_dtype != _FP8 or sums:
      return f"no fused kernel quantizes to {wire_dtype} on {'combine' if sums else 'dispatch'}"
    if dtype.name not in DTYPE_SUFFIX:
      return f"no fused FP8 dispatch of {dtype.name} rows (only {', '.join(DTYPE_SUFFIX)})"
    if hidden % 16:
      return f"FP8 rows quantized in the kernel need hidden % 16 == 0; hidden={hidden}"
    width = fp8.wire_bytes(hidden)
    zero_vectors = width // 16 - hidden // 16 - fp8_send_units(hidden)
    if not 0 <= zero_vectors <= 31:  # the kernel's last quantize step stores them, a lane each
      return (f"FP8 wire rows of {width} bytes for hidden={hidden}: the fused kernel writes "
              f"0 to 31 zero vectors after the codes and scales, not {zero_vectors}")
    return fused_rows_problem(np.uint8, width, ep_size, top_k, sums=False)
  row_bytes = hidden * dtype.itemsize
  if row_bytes % 16:
    return f"rows of {row_bytes} bytes are not a whole number of 16-byte vectors"
  if ep_size > MAX_FUSED_RANKS:
    return f"ep_size={ep_size} is above {MAX_FUSED_RANKS} (one lane per rank)"
  if top_k > MAX_FUSED_TOP_K:
    return f"top_k={top_k} is above {MAX_FUSED_TOP_K} (one lane per member)"
  if sums and dtype.name not in DTYPE_SUFFIX:
    return f"no fused sum kernel for {dtype.name} (only {', '.join(DTYPE_SUFFIX)})"
  return None


@dataclasses.dataclass(frozen=True)
class RowGrid:
  """Launch sizes of one fused row exchange on one device: one grid of
  blocks of 512 threads, one warp per unit of work (a row, or a segment of
  one), one block per SM.

  Attributes:
    send_blocks: the first blocks, which store rows into the other ranks'
      slots, one chunk at a time.
    recv_blocks: the rest, which do this GPU's own rows and then the
      arriving chunks.
    chunk_rows: slot rows per signalled chunk.
    num_chunks: chunks per destination (``ceil(S / chunk_rows)``).
    send_segment, recv_segment: 16-byte vectors per unit of a sender's and a
      receiver's warp (:func:`row_segment`); the FP8 dispatch's senders
      count quantize steps of 512 channels instead.
  """

  send_blocks: int
  recv_blocks: int
  chunk_rows: int
  num_chunks: int
  send_segment: int
  recv_segment: int

  @property
  def blocks(self) -> int:
    return self.send_blocks + self.recv_blocks


def row_grid(kind: str, ep_size: int, num_tokens: int, send_capacity: int, row_vecs: int,
             multiprocessors: int, send_units: int | None = None) -> RowGrid:
  """The grid of a fused ``kind`` (``"dispatch"`` or ``"combine"``) exchange:
  :func:`configure`'s ``row_blocks`` (default every SM, so that all blocks
  are resident at once and a receiver never waits on a block not yet
  running), of which ``send_blocks`` (default :data:`SEND_SHARE`) send.
  Chunks: at least one per sender block (decode: small chunks, each
  signalled as soon as one block has stored it), at most
  :data:`_CHUNKS_PER_SENDER` per sender block and none below 128 KiB beyond
  that (each flag costs its block a system fence), at most
  :data:`MAX_CHUNKS`, one row each at least. ``row_vecs``: 16-byte vectors
  per row; ``send_units``: a sender's units per row where they are not
  vectors (the FP8 dispatch's quantize steps; its ``send_segment`` then
  counts steps)."""
  if kind not in SEND_SHARE:
    raise ValueError(f"kind={kind!r} is not one of {tuple(SEND_SHARE)}")
  settings = RUNTIME.settings
  total = max(2, settings.row_blocks or multiprocessors)
  send = settings.send_blocks or round(SEND_SHARE[kind] * total)
  send = max(1, min(send, total - 1))
  others = ep_size - 1
  per_sender = -(-send // others)
  by_bytes = -(-send_capacity * row_vecs * 16 // _MIN_CHUNK_BYTES)
  chunks = max(per_sender, min(_CHUNKS_PER_SENDER * per_sender, by_bytes))
  chunks = max(1, min(MAX_CHUNKS, send_capacity, chunks))
  chunk_rows = -(-send_capacity // chunks)
  step = _COPY_STEP if kind == "dispatch" else _SUM_STEP
  receiver_rows = send_capacity if kind == "dispatch" else num_tokens
  return RowGrid(send_blocks=int(send), recv_blocks=int(total - send), chunk_rows=int(chunk_rows),
                 num_chunks=int(-(-send_capacity // chunk_rows)),
                 send_segment=(row_segment(chunk_rows, row_vecs, ROW_WARPS, step)
                               if send_units is None
                               else row_segment(chunk_rows, send_units, ROW_WARPS, 1)),
                 recv_segment=row_segment(receiver_rows, row_vecs, (total - send) * ROW_WARPS,
                                          step))


def fp8_send_units(hidden: int) -> int:
  """A sender's units per row in the FP8 dispatch (``row_grid``'s
  ``send_units``): quantize steps of 512 channels (kernels/fp8.cuh)."""
  return -(-hidden // _FP8_STEP_CHANNELS)


def row_segment(rows: int, row_vecs: int, warps: int, step: int) -> int:
  """16-byte vectors per unit of work of a row kernel: whole rows when there
  are rows enough to give each of ``warps`` warps two, else rows split into
  segments of whole ``step``s (a warp's step) so that few rows (decode)
  still spread over the grid."""
  if rows >= 2 * warps:
    return row_vecs
  pieces = min(-(-2 * warps // max(rows, 1)), -(-row_vecs // step))
  return min(row_vecs, round_up(-(-row_vecs // pieces), step))


def check_maps(mesh, axis_name: str, recv_pos, *, send_token=None, send_slot=None,
               slab_row=None) -> tuple[int, int, int]:
  """``(R, S, K)`` from the maps' shapes, checked against each other and the mesh."""
  check_axis(mesh, axis_name)
  ep_size = mesh.shape[axis_name]
  if recv_pos.ndim != 3 or recv_pos.shape[0] != ep_size:
    raise ValueError(f"recv_pos shape {recv_pos.shape} must be [R, S, K] with R={ep_size} "
                     f"(the size of axis {axis_name!r})")
  if send_slot is not None and (send_slot.ndim != 2 or send_slot.shape[1] != ep_size):
    raise ValueError(f"send_slot shape {send_slot.shape} must be [T, R] with R={ep_size}")
  if send_token is not None and send_token.shape != recv_pos.shape[:2]:
    raise ValueError(f"send_token shape {send_token.shape} must be [R, S] = "
                     f"{list(recv_pos.shape[:2])} (recv_pos' leading axes)")
  if slab_row is not None and slab_row.ndim != 1:
    raise ValueError(f"slab_row shape {slab_row.shape} must be [L * C]")
  for name, value in (("send_token", send_token), ("send_slot", send_slot),
                      ("recv_pos", recv_pos), ("slab_row", slab_row)):
    if value is not None and value.dtype != np.int32:
      raise ValueError(f"{name} must be int32; got {value.dtype}")
  return ep_size, recv_pos.shape[1], recv_pos.shape[2]


@dataclasses.dataclass(frozen=True)
class RowKernel:
  """One fused row kernel at one shape: which kernel, the rows its channel's
  slots hold and its size arguments. ``kind``: :func:`row_grid`'s; ``function``:
  the kernel's name after ``peer_``; ``site``: what a timeout names;
  ``sizes``: the int32 arguments after ``num_tokens`` and before the chunking;
  ``send_units``: as :func:`row_grid`'s."""

  kind: str
  function: str
  site: str
  slot_dtype: str
  slot_hidden: int
  num_tokens: int
  send_capacity: int
  sizes: tuple[int, ...]
  send_units: int | None = None

  @property
  def row_vecs(self) -> int:
    """16-byte vectors of one slot row."""
    return self.slot_hidden * np.dtype(self.slot_dtype).itemsize // 16

  def layout(self, ep_size: int) -> ChannelLayout:
    return ChannelLayout(ep_size, self.send_capacity * self.row_vecs * 16)

  def grid(self, ep_size: int, multiprocessors: int) -> RowGrid:
    return row_grid(self.kind, ep_size, self.num_tokens, self.send_capacity, self.row_vecs,
                    multiprocessors, self.send_units)

  def args(self, grid: RowGrid, layout: ChannelLayout, peers: int, rank: int,
           tail: tuple) -> tuple:
    """The kernel's arguments after its buffers' pointers: ``peers`` (the
    device address of the ranks' channel bases), ``rank``, the sizes, the
    chunking and the slots, then ``tail`` (:meth:`Runtime.device_tail`)."""
    return (np.uint64(peers), np.int32(rank), np.int32(layout.ep_size), np.int32(self.num_tokens),
            *(np.int32(v) for v in self.sizes), np.int32(grid.chunk_rows),
            np.int32(grid.num_chunks), np.int32(grid.send_blocks), np.int32(grid.send_segment),
            np.int32(grid.recv_segment), np.int64(layout.slot_bytes),
            np.int64(layout.data_offset), *tail)

  def job(self, ordinal: int, grid: RowGrid, layout: ChannelLayout, peers: int, rank: int,
          tail: tuple, buffers: tuple[int, ...]) -> Kernel:
    """Rank ``rank``'s launch of this kernel on GPU ``ordinal``, the
    callback's ``buffers`` (indices into its inputs then outputs) first;
    the rest as :meth:`args`."""
    return Kernel(kernel(ordinal, self.function), grid.blocks, buffers,
                  self.args(grid, layout, peers, rank, tail))


def dispatch_kernel(dtype, num_tokens: int, hidden: int, send_capacity: int, top_k: int,
                    num_slab_rows: int, wire_dtype: str | None = None) -> RowKernel:
  """:func:`dispatch_rows`' kernel for ``[T, H]`` rows of ``dtype`` (FP8:
  quantizing them into wire rows of ``W`` bytes)."""
  if wire_dtype is None:
    row_kernel = RowKernel("dispatch", "dispatch", "dispatch_rows", np.dtype(dtype).name, hidden,
                           num_tokens, send_capacity, ())
    return dataclasses.replace(row_kernel, sizes=(send_capacity, top_k, num_slab_rows,
                                                  row_kernel.row_vecs))
  row_kernel = RowKernel("dispatch", f"dispatch_fp8_{DTYPE_SUFFIX[np.dtype(dtype).name]}",
                         "dispatch_rows_fp8", "uint8", fp8.wire_bytes(hidden), num_tokens,
                         send_capacity, (), fp8_send_units(hidden))
  return dataclasses.replace(row_kernel, sizes=(send_capacity, top_k, num_slab_rows,
                                                row_kernel.row_vecs, hidden))


def combine_own_first(num_tokens: int, hidden: int, dtype, ep_size: int) -> bool:
  """Whether the peer combine's receivers sum each token's own members
  before waiting for the other ranks' rows: ``[T, H]`` output bytes times
  ``R - 1`` at most :data:`_COMBINE_OWN_FIRST_BYTES`."""
  output_bytes = num_tokens * hidden * np.dtype(dtype).itemsize
  return output_bytes * (ep_size - 1) <= _COMBINE_OWN_FIRST_BYTES


def combine_kernel(dtype, num_tokens: int, hidden: int, send_capacity: int, top_k: int,
                   num_slab_rows: int, *, ep_size: int, own_first: bool | None = None) -> RowKernel:
  """:func:`combine_rows`' kernel at EP size ``ep_size`` for slab rows of
  ``hidden`` elements of ``dtype``: ``peer_combine_own_first_*`` if
  ``own_first`` (None: where :func:`combine_own_first`), else in rank order."""
  if own_first is None:
    own_first = combine_own_first(num_tokens, hidden, dtype, ep_size)
  first = "own_first_" if own_first else ""
  return RowKernel("combine", f"combine_{first}{DTYPE_SUFFIX[np.dtype(dtype).name]}",
                   "combine_rows", np.dtype(dtype).name, hidden, num_tokens, send_capacity,
                   (send_capacity, top_k, num_slab_rows, hidden))


def _fused_launches(row_kernel: RowKernel, mesh, axis_name: str, ep_size: int,
                    buffers: tuple) -> dict:
  """Every local device's one launch of ``row_kernel`` on its channel, the
  callback's ``buffers`` (indices into its inputs then outputs) first."""
  layout = row_kernel.layout(ep_size)
  channel = RUNTIME.gpu_channel(mesh, axis_name, layout)
  site = RUNTIME.site(row_kernel.site, (ep_size, row_kernel.send_capacity,
                                        row_kernel.slot_hidden), row_kernel.slot_dtype, channel)
  timeout_ns = int(timeout_s() * 1e9)
  launches = {}
  for ordinal, state in (channel.on_device.items() if channel is not None else ()):
    launches[ordinal] = [row_kernel.job(
        ordinal, row_kernel.grid(ep_size, multiprocessors(ordinal)), layout,
        state.peers.data.ptr, state.rank, RUNTIME.device_tail(ordinal, site, timeout_ns),
        buffers)]
  return launches


def dispatch_rows(rows: jax.Array, send_token: jax.Array, send_slot: jax.Array,
                  recv_pos: jax.Array, slab_row: jax.Array, *, axis_name: str,
                  mesh: jax.sharding.Mesh, wire_dtype: str | None = None) -> jax.Array:
  """Dispatch's row path as one CUDA launch: ``rows [T, H]`` -> slabs
  ``[L * C, H]`` (call it inside ``shard_map`` over ``mesh``, lowering for
  CUDA; check :func:`fused_rows_problem` first).

  One ``buffer_callback`` launching ``peer_dispatch`` once: its sender blocks
  store each token row into the slot of every other rank it goes to, chunk
  by chunk, and with the first of them the token's own row into this rank's
  slabs (one read of the row); its receiver blocks meanwhile zero the padding
  rows and place the own rows of tokens that go to no other rank, then
  expand each chunk the other ranks send as soon as it has arrived.

  With ``wire_dtype="float8_e4m3fn"`` (``peer_dispatch_fp8_<dtype>``) the
  rows travel and land as FP8 wire rows (:mod:`~moe_ep.transport.fp8`), each
  quantized by the warp that sends it or places it in this rank's slabs: no
  quantize pass before the exchange. Its receivers leave the padding rows
  unwritten: the FP8 slabs' reader, the backend's ``dequantize_filled_rows``
  (:func:`moe_ep.transport.xla.dequantize_filled_rows`), zeroes them.

  Args:
    rows: ``[T, H]`` one row per token.
    send_token: ``[R, S]`` int32 token in slot s of the chunk to rank d, or -1.
    send_slot: ``[T, R]`` int32 slot of token t in its chunk to rank d, or -1
      (the inverse of ``send_token``): decides only which block places an
      own row; the slabs depend on the other maps alone.
    recv_pos: ``[R, S, K]`` int32 slab row of member k of the row received
      from rank src in slot s, or -1.
    slab_row: ``[L * C]`` int32 ``src * S + s`` feeding each slab row, or -1
      (a zero row).
    axis_name, mesh: the EP axis and the ``shard_map``'s mesh.
    wire_dtype: None, or ``"float8_e4m3fn"`` for FP8 slabs.

  Returns:
    ``[L * C, H]`` in ``rows.dtype``, bitwise the local row passes around an
    ``all_to_all`` (FP8: ``[L * C, W]`` uint8 wire rows, bitwise them on every
    row that ``slab_row`` fills; what the padding rows hold is undefined).
  """
  ep_size, send_capacity, top_k = check_maps(mesh, axis_name, recv_pos, send_token=send_token,
                                             send_slot=send_slot, slab_row=slab_row)
  if rows.ndim != 2:
    raise ValueError(f"rows shape {rows.shape} must be [T, H]")
  if send_slot.shape[0] != rows.shape[0]:  # the kernel reads send_slot[t] for every t < T
    raise ValueError(f"send_slot shape {send_slot.shape} must be [T, R] with T={rows.shape[0]} "
                     f"(rows' tokens)")
  if wire_dtype is not None and (problem := fused_rows_problem(
      rows.dtype, rows.shape[1], ep_size, top_k, sums=False, wire_dtype=wire_dtype)):
    raise ValueError(f"wire_dtype={wire_dtype!r}: {problem}")
  num_tokens, hidden = rows.shape
  num_slab_rows = slab_row.shape[0]
  if wire_dtype is not None:
    for device in np.asarray(mesh.devices).flat:  # this process's GPUs: e4m3 needs sm_89+
      if device.platform == "gpu" and device.process_index == jax.process_index():
        cupy_backend.check_compute_capability(kernel_launch.device_ordinal(device))
  row_kernel = dispatch_kernel(rows.dtype, num_tokens, hidden, send_capacity, top_k,
                               num_slab_rows, wire_dtype)
  launches = _fused_launches(  # buffers: rows, send_token, send_slot, recv_pos, slab_row; slabs
      row_kernel, mesh, axis_name, ep_size, (0, 1, 2, 3, 4, 5))
  return fused_call("dispatch rows" + (" fp8" if wire_dtype else ""), launches,
                    (rows, send_token, send_slot, recv_pos, slab_row),
                    jax.ShapeDtypeStruct((num_slab_rows, row_kernel.slot_hidden),
                                         row_kernel.slot_dtype), axis_name)


def combine_rows(slabs: jax.Array, recv_pos: jax.Array, send_slot: jax.Array, *,
                 axis_name: str, mesh: jax.sharding.Mesh) -> jax.Array:
  """Combine's row path as one CUDA launch: slabs ``[L * C, H]`` -> ``[T,
  H]`` (call it inside ``shard_map`` over ``mesh``, lowering for CUDA; check
  :func:`fused_rows_problem` first, ``sums=True``).

  One ``buffer_callback`` launching ``peer_combine_<dtype>`` once: its
  sender blocks store, per row each other rank sent here, the float32 sum of
  its members' slab rows (in member order, rounded once) into that rank's
  slot, chunk by chunk; its receiver blocks sum, per token, its returned rows
  over ranks in rank order in float32 (its own rank's member sum computed in
  place, rounded as if it had travelled), each as soon as its chunk has
  arrived, and round once: ``gather_sum_rows`` twice around an
  ``all_to_all``, bit for bit.

  Args:
    slabs: ``[L * C, H]`` float32, bfloat16 or float16.
    recv_pos, axis_name, mesh: as :func:`dispatch_rows`.
    send_slot: ``[T, R]`` int32 slot of token t's row in its chunk to rank d, or
      -1 (``RoutingHandle.send_slot``; read in the kernel, so no wire-row
      map is computed for it).

  Returns:
    ``[T, H]`` in ``slabs.dtype``.
  """
  ep_size, send_capacity, top_k = check_maps(mesh, axis_name, recv_pos, send_slot=send_slot)
  if slabs.ndim != 2:
    raise ValueError(f"slabs shape {slabs.shape} must be [L * C, H]")
  num_slab_rows, hidden = slabs.shape
  row_kernel = combine_kernel(slabs.dtype, send_slot.shape[0], hidden, send_capacity, top_k,
                              num_slab_rows, ep_size=ep_size)
  launches = _fused_launches(  # buffers: slabs 0, recv_pos 1, send_slot 2, y 3
      row_kernel, mesh, axis_name, ep_size, (0, 1, 2, 3))
  return fused_call("combine rows", launches, (slabs, recv_pos, send_slot),
                    jax.ShapeDtypeStruct((send_slot.shape[0], hidden), slabs.dtype), axis_name)
