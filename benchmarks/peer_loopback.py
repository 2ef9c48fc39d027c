"""Every rank of an EP group running its peer kernel (a fused row kernel,
the drop-in exchange, or the metadata exchange fused with the slab layout)
on ONE GPU, in turn: each rank's channel is a buffer in that GPU's memory,
so the kernels' indexing, chunking, flags and own-row placement run as at
EP=R without R GPUs. For tests (one rank's
output against the pure-JAX path, at any R), compute-sanitizer (one
process, one GPU) and timing a kernel's local memory traffic; it is not a
transport and moves nothing between GPUs. The in-turn runners cannot
show kernels running at once; :func:`run_concurrently` runs every rank's
kernels at once on their own streams of the one GPU, over several steps
(the flags, acknowledgements and step parity as on R GPUs, but no NVLink
and no second GPU's memory).

How rank ``r``'s output comes about: fresh channels at step 0, every rank
but ``r`` with its own flags raised beforehand (its receivers find every
chunk "arrived" at once and read whatever its slots hold; their outputs are
thrown away); those ranks run first, each storing its rows into ``r``'s
slots and raising ``r``'s flags of step 1; then ``r`` runs and finds every
chunk it waits for, as on R GPUs. Its wait is bounded like any peer wait: a
kernel that waited in vain raises :class:`RuntimeError` naming the peer.

Needs CuPy and a CUDA GPU (the FP8 kernel: compute capability 8.9+).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_ep.transport import launch_geometry
from moe_ep.transport.peer.channel import ChannelLayout, meta_channel_layout
from moe_ep.transport.peer.dispatch_layout import dispatch_layout_launch, dispatch_layout_shapes
from moe_ep.transport.peer.dropin import exchange_launch
from moe_ep.transport.peer.failures import WAIT_KINDS
from moe_ep.transport.peer.fused_layout import slab_layout_kernel
from moe_ep.transport.peer.kernels import multiprocessors
from moe_ep.transport.peer.rows import RowGrid, RowKernel

_RAISED = 0x3F  # every byte of a raised flag: a step no exchange reaches


@dataclasses.dataclass
class Launch:
  """A rank's kernel ready to run again on its inputs, every flag raised
  (nothing waits) and the other ranks' rows of the full exchange in its
  slots: each run gives the same output. For timing. ``out``: its output
  buffer; ``held``: the device buffers the launch reads."""

  run: object
  out: object
  grid: RowGrid
  held: tuple


def _unwritten(cupy, shape: tuple, dtype):
  """An output buffer full of 0xAB bytes, as XLA's are not zeroed: a row the
  kernel fails to write shows."""
  out = cupy.empty(shape, dtype)
  out.view(cupy.uint8).fill(0xAB)
  return out


def _ranks_first(rank: int, ep_size: int) -> list[int]:
  return [q for q in range(ep_size) if q != rank] + [rank]


def _channels(layout: ChannelLayout, rank: int) -> tuple:
  """Fresh channels of every rank, every rank's but ``rank``'s flags raised;
  ``(channels, peers)``, ``peers`` their bases as a device array."""
  import cupy
  channels = [cupy.zeros(layout.total_bytes, cupy.uint8) for _ in range(layout.ep_size)]
  for q, channel in enumerate(channels):
    if q != rank:
      channel[:layout.step_offset] = _RAISED  # its flags and acks
  return channels, cupy.asarray(np.array([c.data.ptr for c in channels], np.uint64))


def _failure_word(timeout_s: float) -> tuple:
  """``(failed, record, tail)``: a failure word and record, and the
  arguments every peer kernel ends with (site 0)."""
  import cupy
  failed = cupy.zeros(1, cupy.uint32)
  record = cupy.zeros(4, cupy.uint64)  # one PeerFailure (32 bytes)
  return failed, record, (np.uint64(failed.data.ptr), np.uint64(record.data.ptr),
                          np.uint64(int(timeout_s * 1e9)), np.int32(0))


def _checked(failed, record, what: str) -> None:
  if int(failed[0]) != 0:
    kind, peer_rank, _, rank = (int(v) for v in record.view(np.uint32)[:4])
    raise RuntimeError(f"loopback {what}: rank {rank} waited in vain for rank {peer_rank} "
                       f"(wait kind {kind}: {WAIT_KINDS.get(kind, '?')})")


def _in_turn(layout: ChannelLayout, rank: int, absent: tuple, timeout_s: float,
             what: str, launch) -> tuple:
  """``launch(q, peers, tail)`` (rank ``q``'s kernel launched; returns its
  output buffer) for every rank but ``rank``, then ``rank``, skipping
  ``absent``; waits for them. Returns ``rank``'s output buffer and the
  device buffers the launches use ``(channels, peers, failed, record)``."""
  import cupy
  channels, peers = _channels(layout, rank)
  failed, record, tail = _failure_word(timeout_s)
  out = None
  for q in _ranks_first(rank, layout.ep_size):
    if q not in absent:
      out = launch(q, peers.data.ptr, tail)
  cupy.cuda.Device().synchronize()
  _checked(failed.get(), record.get(), what)
  return out, (channels, peers, failed, record)


def run_rank(kernel: RowKernel, inputs: list[tuple], out_shape: tuple, out_dtype, *,
             rank: int, absent: tuple = (), ordinal: int = 0, timeout_s: float = 10.0,
             keep: bool = False):
  """Rank ``rank``'s output of ``kernel`` (:func:`peer.dispatch_kernel`,
  :func:`peer.combine_kernel`), every rank's kernel run on GPU ``ordinal``.

  Args:
    kernel: the fused row kernel at its shape.
    inputs: per rank ``q`` its kernel's input buffers in the kernel's order
      (host or device arrays; e.g. dispatch: rows, send_token, send_slot,
      recv_pos, slab_row).
    out_shape, out_dtype: each rank's output buffer.
    rank: the rank whose output is returned.
    absent: ranks whose kernel never runs (a peer that never arrives).
    timeout_s: the bound of every wait.
    keep: also return a :class:`Launch` of ``rank``'s kernel on the same
      inputs with every flag raised.

  Returns:
    ``rank``'s output as a NumPy array (and the :class:`Launch` with ``keep``).
  """
  import cupy
  ep_size = len(inputs)
  layout = kernel.layout(ep_size)
  with cupy.cuda.Device(ordinal):
    grid = kernel.grid(ep_size, multiprocessors(ordinal))
    launched = {}

    def launch(q, peers, tail):
      job, buffers, (out,) = row_job(kernel, grid, layout, peers, q, tail,
                                     tuple(cupy.asarray(a) for a in inputs[q]), out_shape,
                                     out_dtype, ordinal)
      job.launch(buffers)
      launched[q] = (job, buffers)
      return out

    out, held = _in_turn(layout, rank, absent, timeout_s, kernel.function, launch)
    result = out.get()
    if not keep:
      return result
    # Every later launch finds its flags raised, and the rows of step 1 in
    # the slots of either parity: it repeats the full exchange's work.
    _replayable(held[0][rank], layout)
    job, buffers = launched[rank]
    return result, Launch(run=lambda: job.launch(buffers), out=out, grid=grid,
                          held=(*held, buffers))


def exchange_rank(chunks: list, *, rank: int, absent: tuple = (), ordinal: int = 0,
                  timeout_s: float = 10.0):
  """Rank ``rank``'s output of the drop-in exchange (``peer_exchange``,
  :func:`peer.exchange`'s kernel): ``chunks[q]`` is rank ``q``'s input
  ``[R, k...]`` (host or device; every rank's the same shape and dtype);
  returns ``[R, k...]`` whose row ``src`` is ``chunks[src][rank]``, as
  ``all_to_all``. ``absent``, ``timeout_s``: as :func:`run_rank`."""
  import cupy
  ep_size = len(chunks)
  with cupy.cuda.Device(ordinal):
    inputs = [cupy.ascontiguousarray(cupy.asarray(c)) for c in chunks]
    layout = ChannelLayout(ep_size, inputs[0].nbytes // ep_size)

    def launch(q, peers, tail):
      out = cupy.zeros_like(inputs[q])
      exchange_launch(layout, ordinal, peers, q, tail).launch((inputs[q], out))
      return out

    out, _ = _in_turn(layout, rank, absent, timeout_s, "exchange", launch)
    return out.get()


def slab_layout_rank(metas: list, sizes: tuple, *, rank: int, absent: tuple = (),
                     ordinal: int = 0, timeout_s: float = 10.0) -> tuple:
  """Rank ``rank``'s outputs of the metadata exchange fused with the slab
  layout (``peer_slab_layout_v16``, :func:`peer.slab_layout`'s kernel):
  ``metas[q]`` is rank ``q``'s route metadata ``[R, W]`` int32, ``sizes``
  ``(S, K, L, C)``. Returns NumPy ``(recv_pos [R * S * K], slab_row [L * C],
  slab_weights [L * C], counts [L], demand [L])``. ``absent``,
  ``timeout_s``: as :func:`run_rank`."""
  import cupy
  ep_size = len(metas)
  shapes = launch_geometry.slab_layout_shapes(launch_geometry.SlabSizes(ep_size, *sizes))
  with cupy.cuda.Device(ordinal):
    inputs = [cupy.ascontiguousarray(cupy.asarray(m, dtype=np.int32)) for m in metas]
    layout = meta_channel_layout(ep_size, inputs[0].shape[1])

    def launch(q, peers, tail):
      outs = [_unwritten(cupy, shape.shape, shape.dtype) for shape in shapes]
      slab_layout_kernel(layout, ordinal, peers, q, sizes, tail).launch((inputs[q], *outs))
      return outs

    outs, _ = _in_turn(layout, rank, absent, timeout_s, "slab layout", launch)
    return tuple(out.get().reshape(-1) for out in outs)


def _replayable(channel, layout: ChannelLayout) -> None:
  """Every flag and acknowledgement raised, and the slots of step 1's parity
  copied into the other's: a later launch finds everything arrived."""
  channel[:layout.step_offset] = _RAISED
  parity_bytes = (layout.ep_size - 1) * layout.slot_bytes
  first = layout.data_offset
  channel[first:first + parity_bytes] = channel[first + parity_bytes:first + 2 * parity_bytes]


def dispatch_layout_rank(kernel: RowKernel, inputs: list[tuple], *, rank: int,
                         absent: tuple = (), ordinal: int = 0, timeout_s: float = 10.0,
                         keep: bool = False):
  """Rank ``rank``'s outputs of ``peer_dispatch_layout``
  (:func:`peer.dispatch_layout_kernel`), every rank's launch run on GPU
  ``ordinal`` on two channels each (rows and metadata): ``inputs[q]`` is
  rank ``q``'s ``(rows, send_token, send_slot, meta)``. Returns NumPy
  ``(slabs [L * C, row bytes] uint8, recv_pos, slab_row, slab_weights,
  counts, demand)`` (the maps flat), and with ``keep`` a :class:`Launch`
  repeating ``rank``'s launch with every flag of both channels raised.
  ``absent``, ``timeout_s``: as :func:`run_rank`."""
  import cupy
  ep_size = len(inputs)
  width = kernel.sizes[-1]
  layout = kernel.layout(ep_size)
  meta_layout = meta_channel_layout(ep_size, width)
  shapes = dispatch_layout_shapes(kernel, ep_size, np.uint8, kernel.row_vecs * 16)
  with cupy.cuda.Device(ordinal):
    grid = kernel.grid(ep_size, multiprocessors(ordinal))
    meta_channels, meta_peers = _channels(meta_layout, rank)
    launched = {}

    def launch(q, peers, tail):
      outs = [_unwritten(cupy, shape.shape, shape.dtype) for shape in shapes]
      job = dispatch_layout_launch(kernel, grid, layout, meta_layout, ordinal, peers,
                                        meta_peers.data.ptr, q, tail)
      buffers = (*(cupy.asarray(a) for a in inputs[q]), *outs)
      job.launch(buffers)
      launched[q] = (job, buffers)
      return outs

    outs, held = _in_turn(layout, rank, absent, timeout_s, kernel.function, launch)
    result = tuple(out.get().reshape(out.shape[0], -1) if i == 0 else out.get().reshape(-1)
                   for i, out in enumerate(outs[:6]))
    if not keep:
      return result
    _replayable(held[0][rank], layout)
    _replayable(meta_channels[rank], meta_layout)
    job, buffers = launched[rank]
    return result, Launch(run=lambda: job.launch(buffers), out=outs[0], grid=grid,
                          held=(*held, meta_channels, meta_peers, buffers))


def row_job(kernel: RowKernel, grid: RowGrid, layout: ChannelLayout, peers: int,
            rank: int, tail: tuple, inputs: tuple, out_shape: tuple, out_dtype,
            ordinal: int = 0) -> tuple:
  """Rank ``rank``'s launch of a fused row kernel for :func:`run_concurrently`:
  ``(Kernel, buffers, [out])``, ``inputs`` device arrays in the
  kernel's order, ``out`` a fresh :func:`_unwritten` buffer."""
  import cupy
  out = _unwritten(cupy, out_shape, out_dtype)
  buffers = (*inputs, out)
  job = kernel.job(ordinal, grid, layout, peers, rank, tail, tuple(range(len(buffers))))
  return job, buffers, [out]


def run_concurrently(layouts: list, launches, steps: int, *, ordinal: int = 0,
                     timeout_s: float = 10.0) -> list:
  """Every rank's launches of ``steps`` steps, ranks at once, each on its own
  stream of GPU ``ordinal``, on fresh channels (one per layout in
  ``layouts``, all at step 0): the kernels wait for each other's flags and
  acknowledgements, and alternate slot parity, as on R GPUs.

  Args:
    layouts: the channels' :class:`ChannelLayout`, every one of R ranks.
    launches: ``(step, q, peers, tail) -> [(Kernel, buffers,
      outputs)]``, rank ``q``'s launches of that step in order; ``peers``:
      per layout, the device pointer of the R channel bases; ``tail``: the
      arguments every peer kernel ends with (rank ``q``'s failure word). It
      must not copy from the host (a pageable copy may wait for the device,
      where a kernel waits for a rank not yet launched): upload inputs first.
      Each kernel's grid must leave the other ranks room to run (at most
      the SMs / R blocks of one block per SM), else a wait times out.
    steps: how many times each rank's launches run, without a host sync
      between.
    timeout_s: the bound of every wait; one that ran out raises
      :class:`RuntimeError` naming the rank and its peer.

  Returns:
    ``outputs[step][q]``: rank ``q``'s outputs of that step, NumPy arrays in
    launch order.
  """
  import cupy
  ep_size = layouts[0].ep_size
  with cupy.cuda.Device(ordinal):
    bases, words, streams, held = _concurrent_setup(layouts, ep_size, timeout_s)
    jobs = []
    for step in range(steps):
      jobs.append([])
      for q in range(ep_size):
        with streams[q]:
          rank_jobs = launches(step, q, [b.data.ptr for b in bases], words[q][2])
          for kernel, buffers, _ in rank_jobs:
            kernel.launch(buffers)
        jobs[-1].append(rank_jobs)
    for stream in streams:
      stream.synchronize()
    _check_ranks(words)
    del held
    return [[[out.get() for _, _, outs in rank_jobs for out in outs] for rank_jobs in step_jobs]
            for step_jobs in jobs]


def _concurrent_setup(layouts: list, ep_size: int, timeout_s: float) -> tuple:
  """Fresh channels (step 0) of every layout, each rank's failure word and
  stream: ``(bases, words, streams, held)``, ``bases`` per layout the
  device array of the R channel bases, ``held`` the channels."""
  import cupy
  channels = [[cupy.zeros(layout.total_bytes, cupy.uint8) for _ in range(ep_size)]
              for layout in layouts]
  bases = [cupy.asarray(np.array([c.data.ptr for c in chans], np.uint64)) for chans in channels]
  words = [_failure_word(timeout_s) for _ in range(ep_size)]
  streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(ep_size)]
  return bases, words, streams, channels


def _check_ranks(words: list) -> None:
  for q, (failed, record, _) in enumerate(words):
    _checked(failed.get(), record.get(), f"concurrent run, rank {q}")


def time_concurrently(layouts: list, launches, *, steps: int = 20, replays: int = 20,
                      ordinal: int = 0, timeout_s: float = 10.0) -> dict:
  """Time per step of every rank's launches run at once, as
  :func:`run_concurrently` (``launches(0, q, peers, tail)``, built once and
  repeated): ``steps`` steps captured in one CUDA graph, each rank a branch
  of it on its own stream, replayed ``replays`` times on channels that keep
  stepping (no flag raised: every wait is real). The ranks share one GPU's
  SMs and memory, so a step is what the kernels and their handshakes cost
  with live peers, not what two GPUs take (no NVLink). Returns ``{"us":
  median per step, "min_us": fastest replay's}``."""
  import cupy
  ep_size = layouts[0].ep_size
  with cupy.cuda.Device(ordinal):
    bases, words, streams, held = _concurrent_setup(layouts, ep_size, timeout_s)
    jobs = [launches(0, q, [b.data.ptr for b in bases], words[q][2]) for q in range(ep_size)]
    cupy.cuda.Device().synchronize()
    main = streams[0]
    main.begin_capture()
    fork = cupy.cuda.Event()
    fork.record(main)
    for stream in streams[1:]:
      stream.wait_event(fork)
    for _ in range(steps):
      for q in range(ep_size):
        with streams[q]:
          for kernel, buffers, _ in jobs[q]:
            kernel.launch(buffers)
    for stream in streams[1:]:
      join = cupy.cuda.Event()
      join.record(stream)
      main.wait_event(join)
    graph = main.end_capture()
    graph.launch(main)
    main.synchronize()
    _check_ranks(words)
    times = []
    for _ in range(replays):
      start, end = cupy.cuda.Event(), cupy.cuda.Event()
      start.record(main)
      graph.launch(main)
      end.record(main)
      end.synchronize()
      times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / steps)
    _check_ranks(words)
    del held, jobs
    return {"us": float(np.median(times)), "min_us": float(np.min(times))}
