"""The peer exchanges' state in this process, held in one object
(:data:`RUNTIME`, as DeepEP's ``Buffer`` holds its): the settings, the
channels allocated on each device and how each device addresses its peers',
the traced exchange sites, and the host-mapped failure records.

Channels are allocated at trace time, one ``cudaMalloc`` per device and
chunk size, and kept until :func:`release` (:func:`buffer_bytes`);
devices of one process reach each other's by raw pointers with peer access
enabled, devices of other processes through CUDA IPC handles published once
per buffer in the ``jax.distributed`` key-value store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import threading

import jax
import numpy as np

from moe_ep.transport import kernel_launch
from moe_ep.transport.peer.channel import ALIGN, ChannelLayout, ep_groups, on_gpus
from moe_ep.transport.peer.failures import Failure, PeerTimeoutError, Site, failure_message
from moe_ep.transport.peer.kernels import compile_kernels
from moe_ep.transport.peer.settings import Settings

log = logging.getLogger(__name__)

# How long trace time waits for the other processes' buffer addresses.
ADDRESS_TIMEOUT_S = 300.0
MAX_LOCAL_DEVICES = 64  # slots of the host-mapped failure records
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostAllocPortable | cudaHostAllocMapped


@dataclasses.dataclass
class OnDevice:
  """A channel's state on one local device."""

  ordinal: int
  rank: int
  group: tuple  # the group's jax devices, by rank
  memory: object  # cupy.cuda.Memory of layout.total_bytes
  peers: object  # cupy uint64 [R]: each rank's channel base as mapped here


@dataclasses.dataclass
class Channel:
  key: str
  layout: ChannelLayout
  on_device: dict[int, OnDevice]


@dataclasses.dataclass
class Runtime:
  """Everything this process's peer exchanges hold.

  Attributes:
    settings: :func:`configure`'s.
    channels: by key (mesh, axis and chunk bytes).
    sites: the traced exchanges, by the index their kernels record.
    failed_words: per device ordinal, one device u32 "a wait failed here".
    records: ``Failure[MAX_LOCAL_DEVICES]`` over host-mapped memory, or None
      before the first channel; ``records_device_ptr`` its device address.
    opened: IPC mappings, ``(ordinal, channel, global id) -> pointer``.
    support: :func:`~moe_ep.transport.peer.reachability.unsupported_reason`'s
      answers by mesh and axis.
    generation: how many times :meth:`release` has run; a peer callback
      traced in an earlier generation refuses to run (:meth:`check_traced`).
  """

  settings: Settings = dataclasses.field(default_factory=Settings)
  lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
  channels: dict[str, Channel] = dataclasses.field(default_factory=dict)
  sites: list[Site] = dataclasses.field(default_factory=list)
  failed_words: dict[int, object] = dataclasses.field(default_factory=dict)
  records: object = None
  records_device_ptr: int = 0
  opened: dict[tuple[int, str, int], int] = dataclasses.field(default_factory=dict)
  support: dict[tuple, str | None] = dataclasses.field(default_factory=dict)
  generation: int = 0

  # --- exchange sites and the arguments every kernel ends with ---

  def site(self, what: str, shape, dtype, channel: Channel | None) -> int:
    """The index of the traced exchange ``what`` (registered once)."""
    site = Site(what, tuple(shape), str(dtype), channel.key if channel is not None else "")
    with self.lock:
      if site in self.sites:
        return self.sites.index(site)
      self.sites.append(site)
      return len(self.sites) - 1

  def device_tail(self, ordinal: int, site: int, timeout_ns: int) -> tuple:
    """The failure word, record, timeout and site arguments every kernel ends with."""
    return (np.uint64(self.failed_words[ordinal].ptr),
            np.uint64(self.records_device_ptr + ctypes.sizeof(Failure) * ordinal),
            np.uint64(timeout_ns), np.int32(site))

  # --- device memory: channels, failure records ---

  def gpu_channel(self, mesh, axis_name: str, layout: ChannelLayout) -> Channel | None:
    """The channel on a GPU mesh (allocated at trace time); None elsewhere
    (lowering for CUDA on another platform: the callback fails only if run)."""
    if not on_gpus(mesh):
      return None
    kernel_launch.require_cupy()
    return self.channel(mesh, axis_name, layout)

  def channel(self, mesh, axis_name: str, layout: ChannelLayout) -> Channel:
    """The channel of this mesh axis and chunk size, allocated and connected
    on every local device of the mesh the first time (trace time)."""
    import cupy
    key = _channel_key(mesh, axis_name, layout)
    with self.lock:
      if key in self.channels:
        return self.channels[key]
      self._ensure_records()
      me = jax.process_index()
      local_groups = [g for g in ep_groups(mesh, axis_name)
                      if any(d.process_index == me for d in g)]
      memories = {}
      for group in local_groups:
        for device in group:
          if device.process_index != me:
            continue
          ordinal = kernel_launch.device_ordinal(device)
          if ordinal >= MAX_LOCAL_DEVICES:
            raise RuntimeError(f"peer exchange supports CUDA ordinals < {MAX_LOCAL_DEVICES}; "
                               f"got cuda:{ordinal}")
          with cupy.cuda.Device(ordinal):
            memory = cupy.cuda.Memory(layout.total_bytes)  # its own cudaMalloc: IPC-exportable
            _zero(memory.ptr, layout.control_bytes)
          memories[device.id] = memory
          self._failed_word(ordinal)
          compile_kernels(ordinal)
      client = kv_client() if jax.process_count() > 1 else None
      crosses = any(d.process_index != me for g in local_groups for d in g)
      if crosses:
        if client is None:
          raise RuntimeError("peer exchange across processes needs jax.distributed.initialize()")
        for gid, memory in memories.items():
          client.key_value_set_bytes(f"moe_ep/peer/{key}/{gid}",
                                     cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
      on_device = {}
      for group in local_groups:
        for rank, device in enumerate(group):
          if device.process_index != me:
            continue
          ordinal = kernel_launch.device_ordinal(device)
          bases = [self._base_as_seen_from(ordinal, key, member, memories, client)
                   for member in group]
          with cupy.cuda.Device(ordinal):
            peers = cupy.asarray(np.asarray(bases, np.uint64))
          on_device[ordinal] = OnDevice(ordinal, rank, group, memories[device.id], peers)
      channel = Channel(key, layout, on_device)
      self.channels[key] = channel
      log.info("peer exchange: %d x %.1f MiB on %s (2 parities x %d slots of %d B) -> "
               "%.1f MiB held outside XLA in all", len(memories), layout.total_bytes / 2**20,
               ",".join(f"cuda:{o}" for o in sorted(on_device)), layout.ep_size - 1,
               layout.slot_bytes, self.buffer_bytes() / 2**20)
      return channel

  def _base_as_seen_from(self, ordinal: int, key: str, member, memories: dict, client) -> int:
    """Group member ``member``'s channel base as device ``ordinal`` addresses
    it: the raw pointer in this process (with peer access), else its IPC
    mapping (opened once per local device and buffer)."""
    import cupy
    if member.id in memories:
      member_ordinal = kernel_launch.device_ordinal(member)
      if member_ordinal != ordinal:
        _enable_peer_access(ordinal, member_ordinal)
      return memories[member.id].ptr
    opened = (ordinal, key, member.id)
    if opened not in self.opened:
      handle = kv_get(client, f"moe_ep/peer/{key}/{member.id}",
                      f"device {member.id}'s receive buffer (process {member.process_index})")
      with cupy.cuda.Device(ordinal):
        try:
          self.opened[opened] = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        except cupy.cuda.runtime.CUDARuntimeError as error:
          raise RuntimeError(f"cuda:{ordinal} could not map device {member.id}'s receive "
                             f"buffer (process {member.process_index}) by CUDA IPC: "
                             f"{error}") from error
    return self.opened[opened]

  def _ensure_records(self) -> None:
    if self.records is not None:
      return
    import cupy
    size = ctypes.sizeof(Failure) * MAX_LOCAL_DEVICES
    host_ptr = cupy.cuda.runtime.hostAlloc(size, _HOST_ALLOC_PORTABLE_MAPPED)
    ctypes.memset(host_ptr, 0, size)
    self.records_device_ptr = cupy.cuda.runtime.pointerGetAttributes(host_ptr).devicePointer
    self.records = (Failure * MAX_LOCAL_DEVICES).from_address(host_ptr)

  def _failed_word(self, ordinal: int):
    import cupy
    if ordinal not in self.failed_words:
      with cupy.cuda.Device(ordinal):
        memory = cupy.cuda.Memory(ALIGN)
        _zero(memory.ptr, ALIGN)
      self.failed_words[ordinal] = memory
    return self.failed_words[ordinal]

  def buffer_bytes(self) -> int:
    """Device memory this process holds outside XLA for peer exchanges."""
    with self.lock:
      channels = sum(c.layout.total_bytes * len(c.on_device) for c in self.channels.values())
      return channels + ALIGN * len(self.failed_words)

  # --- failures ---

  def failed_on(self, ordinals) -> bool:
    """Whether a wait on one of these devices has failed (host memory only)."""
    return self.records is not None and any(self.records[o].kind for o in ordinals)

  def raise_if_failed(self) -> None:
    """Raises :class:`PeerTimeoutError` if a peer wait of this process timed
    out. Reads host memory only: no device synchronisation."""
    if self.records is None:
      return
    for ordinal in range(MAX_LOCAL_DEVICES):
      record = self.records[ordinal]
      if record.kind == 0:
        continue
      site = self.sites[record.site] if record.site < len(self.sites) else None
      channel = self.channels.get(site.channel) if site is not None else None
      message, fields = failure_message(record, ordinal, channel, site)
      raise PeerTimeoutError(message, **fields)

  def reset(self) -> None:
    """Clears every failure record and rearms every channel (flags, acks,
    step counters) of this process. Call it on every process, with no
    exchange in flight anywhere (it synchronises the local devices first)."""
    import cupy
    with self.lock:
      ordinals = {o for c in self.channels.values() for o in c.on_device} | set(self.failed_words)
      for ordinal in ordinals:
        with cupy.cuda.Device(ordinal):
          cupy.cuda.runtime.deviceSynchronize()
      for channel in self.channels.values():
        for state in channel.on_device.values():
          with cupy.cuda.Device(state.ordinal):
            _zero(state.memory.ptr, channel.layout.control_bytes)
      for ordinal, memory in self.failed_words.items():
        with cupy.cuda.Device(ordinal):
          _zero(memory.ptr, ALIGN)
      if self.records is not None:
        ctypes.memset(ctypes.addressof(self.records), 0, ctypes.sizeof(self.records))

  def release(self) -> int:
    """Frees every channel, IPC mapping, failure word and the failure
    records of this process, and returns the bytes of device memory freed
    (:meth:`buffer_bytes` before). The settings stay; the next traced
    exchange allocates afresh. Call it on every process, with no exchange in
    flight anywhere (it synchronises the local devices first); programs
    traced before it must not run again (their callbacks refuse to,
    :meth:`check_traced`): retrace them (``jax.clear_caches()``)."""
    with self.lock:
      freed = self.buffer_bytes()
      held = self.channels or self.failed_words or self.opened or self.records is not None
      if held:
        import cupy
        ordinals = ({o for c in self.channels.values() for o in c.on_device}
                    | set(self.failed_words) | {o for o, _, _ in self.opened})
        for ordinal in sorted(ordinals):
          with cupy.cuda.Device(ordinal):
            cupy.cuda.runtime.deviceSynchronize()
        for (ordinal, _, _), pointer in self.opened.items():
          with cupy.cuda.Device(ordinal):
            cupy.cuda.runtime.ipcCloseMemHandle(pointer)
        if self.records is not None:
          cupy.cuda.runtime.freeHost(ctypes.addressof(self.records))
      # Dropping the last references frees the channels' and the failure
      # words' device memory (cupy.cuda.Memory frees itself).
      self.channels.clear()
      self.failed_words.clear()
      self.opened.clear()
      self.sites.clear()
      self.records, self.records_device_ptr = None, 0
      self.generation += 1
      return freed

  def check_traced(self, generation: int, what: str) -> None:
    """RuntimeError naming ``what`` unless it was traced in this
    :attr:`generation` (after the latest :meth:`release`)."""
    if generation != self.generation:
      raise RuntimeError(
          f"peer {what} was traced before moe_ep.transport.peer.release() freed its "
          "channels; trace it again (jax.clear_caches() drops the compiled programs)")


RUNTIME = Runtime()


def configure(*, timeout_s: float | None = None, blocks_per_peer: int | None = None,
              row_blocks: int | None = None, send_blocks: int | None = None,
              dispatch_layout: bool | None = None) -> None:
  """Sets, for exchanges traced from now on (a compiled program keeps its
  values; ``None`` restores the default):

  * ``timeout_s``: the wait bound;
  * ``blocks_per_peer``: the blocks each peer's chunk is split over in the
    drop-in :func:`~moe_ep.transport.peer.exchange`;
  * ``row_blocks``: the blocks (one per SM) of a fused row exchange
    (:func:`~moe_ep.transport.peer.dispatch_rows`,
    :func:`~moe_ep.transport.peer.combine_rows`), by default every SM;
  * ``send_blocks``: how many of those store rows into the other GPUs (the
    rest do this GPU's own rows and the arriving ones), by default
    ``SEND_SHARE`` of them;
  * ``dispatch_layout``: whether dispatch at decode sizes runs as one launch
    with its metadata exchange and slab layout
    (:func:`~moe_ep.transport.peer.dispatch_with_layout`) where it fits; by
    default ``$MOE_EP_PEER_DISPATCH_LAYOUT`` = ``1``, else off
    (:func:`dispatch_layout_enabled` says why).
  """
  RUNTIME.settings = Settings(timeout_s=timeout_s, blocks_per_peer=blocks_per_peer,
                              row_blocks=row_blocks, send_blocks=send_blocks,
                              dispatch_layout=dispatch_layout)


def timeout_s() -> float:
  """The wait bound new exchanges get: :func:`configure`'s, else
  ``$MOE_EP_PEER_TIMEOUT_S``, else 30 s."""
  return RUNTIME.settings.wait_bound_s()


def dispatch_layout_enabled() -> bool:
  """Whether dispatch takes :func:`~moe_ep.transport.peer.dispatch_with_layout`
  where it fits: :func:`configure`'s ``dispatch_layout``, else
  ``$MOE_EP_PEER_DISPATCH_LAYOUT`` = ``1``. Off by default: in the loopback
  the one launch took as long as the fused layout and peer_dispatch one after
  the other (``docs/benchmarks.md``, "Tuning"); what it should gain, the rows
  leaving before the layout is done, only two GPUs can show."""
  return RUNTIME.settings.dispatch_layout_on()


def buffer_bytes() -> int:
  """Device memory this process holds outside XLA for peer exchanges."""
  return RUNTIME.buffer_bytes()


def raise_if_failed() -> None:
  """Raises :class:`PeerTimeoutError` if a peer wait of this process timed
  out. Reads host memory only: no device synchronisation."""
  RUNTIME.raise_if_failed()


def reset() -> None:
  """Clears every failure record and rearms every channel (flags, acks,
  step counters) of this process. Call it on every process, with no exchange
  in flight anywhere (it synchronises the local devices first)."""
  RUNTIME.reset()


def release() -> int:
  """Frees the device memory this process holds for peer exchanges (the
  channels, their IPC mappings, the failure records) and returns its bytes.
  Call it on every process, with no exchange in flight anywhere; programs
  traced before it must be traced again (``jax.clear_caches()``), and the
  next traced exchange allocates its channels afresh."""
  return RUNTIME.release()


def kv_client():
  from jax._src import distributed
  return distributed.global_state.client


def kv_get(client, key: str, what: str) -> bytes:
  try:
    return client.blocking_key_value_get_bytes(key, int(ADDRESS_TIMEOUT_S * 1000))
  except Exception as error:  # jaxlib raises its own status errors
    raise RuntimeError(f"peer exchange: waited {ADDRESS_TIMEOUT_S:.0f} s for {what} (key {key!r}) "
                       f"in the jax.distributed key-value store; every process must trace the "
                       f"same exchanges: {error}") from error


def _channel_key(mesh, axis_name: str, layout: ChannelLayout) -> str:
  ident = repr((tuple(d.id for d in np.asarray(mesh.devices).flat), mesh.axis_names,
                axis_name, layout.chunk_bytes))
  return hashlib.sha1(ident.encode()).hexdigest()[:16]


def _zero(pointer: int, size: int) -> None:
  """Zeroes device memory of the current device and waits for it."""
  import cupy
  cupy.cuda.runtime.memset(pointer, 0, size)
  cupy.cuda.runtime.deviceSynchronize()


def _enable_peer_access(ordinal: int, peer_ordinal: int) -> None:
  import cupy
  with cupy.cuda.Device(ordinal):
    try:
      cupy.cuda.runtime.deviceEnablePeerAccess(peer_ordinal)
    except cupy.cuda.runtime.CUDARuntimeError as error:
      if error.status != _PEER_ACCESS_ALREADY_ENABLED:
        raise RuntimeError(f"enabling peer access cuda:{ordinal} -> cuda:{peer_ordinal} "
                           f"failed: {error}") from error
