"""Direct peer exchange: ``all_to_all`` over the EP axis as stores straight
into the other GPUs' memory (``kernels/peer.cu``).

:func:`exchange` is a drop-in for ``jax.lax.all_to_all(x, axis_name, 0, 0,
tiled=True)`` inside ``shard_map``, bitwise: chunk ``d`` of ``x [R * k, ...]``
goes to rank ``d``; the result's chunk ``src`` is what rank ``src`` sent here.
On CUDA it is one ``buffer_callback`` (command-buffer compatible) launching
two kernels on XLA's stream; on every other platform it lowers to the
``all_to_all`` itself. Use it where :func:`supported` says so: every pair of
GPUs of each EP group reaches the other by peer access, on one host.

How it works, per EP group (the devices along ``axis_name`` with equal other
mesh coordinates, ranked in axis order):

* **Receive buffers outside XLA.** At trace time each device gets one
  ``cudaMalloc`` per chunk size in bytes (a "channel", shared by every
  exchange of that size whatever its dtype): two parities of ``R - 1``
  receive slots plus flags, acknowledgements and a step counter
  (:class:`ChannelLayout`). Every later exchange of that size reuses it;
  :func:`buffer_bytes` is the total, and each allocation is logged.
* **Addresses.** Devices of one process use raw pointers with peer access
  enabled; devices of other processes are reached through CUDA IPC handles
  published once per buffer in the ``jax.distributed`` key-value store.
* **Signalling on the device.** One launch of ``peer_exchange``: its send
  blocks push ``x[d]`` into rank ``d``'s slot of parity ``s & 1`` (``s`` =
  the device's step counter + 1), after ``d`` has acknowledged reading that
  slot at step ``s - 2``, and raise ``d``'s flag to ``s``; its receive blocks
  wait for each source's flag, copy its chunk out and acknowledge it; the
  launch's last block advances the counter. Every launch
  has the same arguments, so XLA can replay it from a CUDA graph; the
  counters agree because every rank runs the same sequence of exchanges.
* **No hangs.** Every wait ends after :func:`timeout_s` (default 30 s,
  ``$MOE_EP_PEER_TIMEOUT_S``); the kernel then records which peer and step it
  waited for in host-mapped memory and later waits on that device return at
  once. :func:`raise_if_failed` (also run by every callback that executes on
  the host) raises :class:`PeerTimeoutError` naming them; :func:`reset`
  rearms after all ranks are idle.

:func:`dispatch_rows` and :func:`combine_rows` are the row paths of dispatch
and combine on the same channels and protocol, fused, one launch each: sender
blocks store each token row straight into the slot of every rank it goes to,
and combine each received row's member sum straight into the source rank's
slot, in chunks that each raise their own flag; receiver blocks of the same
grid meanwhile do this GPU's own rows (its tokens into its slabs, its own
member sums) and take each arriving chunk as soon as its flag is up, so the
NVLink transfer overlaps the local memory traffic. No ``[R, S, H]`` buffer in
XLA on either side; results bitwise those of the ``all_to_all`` path
(:func:`fused_rows_problem` says which rows they take).

:func:`slab_layout` is dispatch's metadata exchange fused with the
receiver's slab layout, one launch at decode sizes (:func:`fused_layout_fits`):
sender blocks push the metadata rows, the other blocks wait for every
source's row and rank the members reading them where they landed.

Exchanges on one channel must run in program order on each device. XLA's
command buffers keep thunk order by default; ``--xla_gpu_command_buffer_
scheduling_mode=CONCURRENT`` could run two of them at once, so
:func:`supported` returns False under it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import socket
import threading

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from moe_ep import distributed
from moe_ep.transport import cupy as cupy_backend
from moe_ep.transport import meta as meta_format

__all__ = [
    "ChannelLayout",
    "PeerTimeoutError",
    "ProcessFacts",
    "blocks_per_peer",
    "RowGrid",
    "buffer_bytes",
    "combine_rows",
    "configure",
    "dispatch_layout_enabled",
    "dispatch_layout_fits",
    "dispatch_layout_kernel",
    "dispatch_layout_launch",
    "dispatch_layout_tiles",
    "dispatch_rows",
    "dispatch_with_layout",
    "ep_groups",
    "exchange",
    "fp8_send_units",
    "fused_layout_fits",
    "fused_rows_problem",
    "meta_channel_layout",
    "raise_if_failed",
    "reachability_problem",
    "reset",
    "row_grid",
    "row_segment",
    "slab_layout",
    "slab_layout_kernel",
    "supported",
    "timeout_s",
    "unsupported_reason",
    "write_ceiling",
]

log = logging.getLogger(__name__)

TIMEOUT_ENV = "MOE_EP_PEER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
_MAX_TIMEOUT_S = 24 * 3600.0
# How long trace time waits for the other processes' buffer addresses.
ADDRESS_TIMEOUT_S = 300.0
_THREADS = 512
_MAX_LOCAL_DEVICES = 64  # slots of the host-mapped failure records
_ALIGN = 256
_VECTOR_BYTES = (16, 8, 4, 2, 1)
_KERNEL_FILE = "peer.cu"
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostAllocPortable | cudaHostAllocMapped
_CONCURRENT_FLAG = "xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
_WAIT_KINDS = {1: "acknowledge reading step", 2: "deliver its chunk of step",
               3: "finish (every receiver block of its own launch) the slab maps of step"}
# The fused row kernels (kernels/peer.cu, peer_<name>): one warp per row.
_ROW_THREADS = 512
_ROW_WARPS = _ROW_THREADS // 32
_COPY_STEP = 32 * 4  # vectors a warp moves per step (kernels/peer.cu ROW_COPY_UNROLL)
_SUM_STEP = 32 * 2  # vectors a warp sums per step (ROW_SUM_UNROLL)
MAX_FUSED_RANKS = 32  # one lane per rank's entry of a token
MAX_FUSED_TOP_K = 32  # one lane per member of a row
_SUM_SUFFIX = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_ROW_KERNELS = ("dispatch", "dispatch_layout", "send_v16", "drain_v16",
                *(f"combine_{suffix}" for suffix in _SUM_SUFFIX.values()),
                *(f"combine_own_first_{suffix}" for suffix in _SUM_SUFFIX.values()),
                *(f"dispatch_fp8_{suffix}" for suffix in _SUM_SUFFIX.values()))
_LAYOUT_TABLE_BYTES = 8 * 32  # peer_slab_layout's static shared row pointers (ROW_MAX_LANES)
# The fused metadata exchange and layout pays up to 4 ranks: rank 0's launch
# against peer_exchange + slab_rank_own_count in the loopback (one H200,
# graph replay, 2026-12-01): R=2 T=128 E=256 9.5 vs 11.1 us, R=2 T=64 E=64
# 7.5 vs 9.1, R=4 T=32 E=256 7.5 vs 8.3, but R=8 T=16 E=256 8.7 vs 8.1 (its
# layout blocks read every source's row from L2, R - 1 senders copy).
_FUSED_LAYOUT_MAX_RANKS = 4
# peer_dispatch_layout runs up to this many member tiles of 512 (decode),
# each counted by every receiver block (slab_rank_own_count's way). Beyond,
# its receivers can count each tile once into scratch and rank after a
# barrier (tested), but they also place every own row, which the senders of
# peer_dispatch place as they send: at P2's shape (T=8192, E=64, R=2) the
# loopback took 526.5 us against 455-457 for the layout launches and
# peer_dispatch (dispatch-layout-chain-loopback-1xH200-20261201.json).
_DISPATCH_LAYOUT_MAX_TILES = 4
_FP8 = "float8_e4m3fn"  # the one wire dtype the fused dispatch quantizes to
_FP8_STEP_CHANNELS = 512  # channels per quantize step of a warp (kernels/fp8.cuh)
MAX_CHUNKS = 1024  # signalled chunks per destination of one fused exchange (PEER_MAX_CHUNKS)
_CHUNKS_PER_SENDER = 8  # chunks each sender block signals, at most
_MIN_CHUNK_BYTES = 128 << 10  # smaller chunks only to give every sender block one
# The share of a fused exchange's blocks that store rows into the other GPUs
# (2 H200s, T=8192, H=7168, 132 SMs: combine with 33 / 66 senders 631 / 542
# us, benchmarks/results/ep-20261130-200223.json; since the senders also
# place their tokens' own rows, dispatch rows with 44 / 56 / 66 / 80 senders
# 493 / 454 / 454 / 495 us, FP8 316 / 305 / 293 / 312 us:
# ep-20261130-233350.json).
SEND_SHARE = {"dispatch": 0.5, "combine": 0.5}


class PeerTimeoutError(RuntimeError):
  """A peer exchange waited past the timeout for another rank.

  Attributes: ``device`` (this process's device), ``rank`` (its EP rank),
  ``peer_rank``, ``peer_device``, ``step``, ``what`` (the exchange's name).
  """

  def __init__(self, message: str, *, device: str, rank: int, peer_rank: int, peer_device: str,
               step: int, what: str):
    super().__init__(message)
    self.device, self.rank, self.peer_rank = device, rank, peer_rank
    self.peer_device, self.step, self.what = peer_device, step, what


# --- settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Settings:
  timeout_s: float | None = None  # None: $MOE_EP_PEER_TIMEOUT_S, else DEFAULT_TIMEOUT_S
  blocks_per_peer: int | None = None  # None: half the device's SMs / (R - 1)
  row_blocks: int | None = None  # None: every SM
  send_blocks: int | None = None  # None: SEND_SHARE of row_blocks
  dispatch_layout: bool | None = None  # None: $MOE_EP_PEER_DISPATCH_LAYOUT == "1"


_settings = _Settings()


def configure(*, timeout_s: float | None = None, blocks_per_peer: int | None = None,
              row_blocks: int | None = None, send_blocks: int | None = None,
              dispatch_layout: bool | None = None) -> None:
  """Sets, for exchanges traced from now on (a compiled program keeps its
  values; ``None`` restores the default):

  * ``timeout_s``: the wait bound;
  * ``blocks_per_peer``: the blocks each peer's chunk is split over in the
    drop-in :func:`exchange`;
  * ``row_blocks``: the blocks (one per SM) of a fused row exchange
    (:func:`dispatch_rows`, :func:`combine_rows`), by default every SM;
  * ``send_blocks``: how many of those store rows into the other GPUs (the
    rest do this GPU's own rows and the arriving ones), by default
    :data:`SEND_SHARE` of them;
  * ``dispatch_layout``: whether dispatch at decode sizes runs as one launch
    with its metadata exchange and slab layout (:func:`dispatch_with_layout`)
    where :func:`dispatch_layout_fits`; by default ``$MOE_EP_PEER_DISPATCH_LAYOUT``
    = ``1``, else off (:func:`dispatch_layout_enabled` says why).
  """
  global _settings
  if timeout_s is not None:
    _check_timeout("timeout_s", timeout_s)
  for name, value, least in (("blocks_per_peer", blocks_per_peer, 1),
                             ("row_blocks", row_blocks, 2), ("send_blocks", send_blocks, 1)):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < least):
      raise ValueError(f"{name}={value!r} must be an integer >= {least} or None")
  if dispatch_layout is not None and not isinstance(dispatch_layout, bool):
    raise ValueError(f"dispatch_layout={dispatch_layout!r} must be True, False or None")
  if row_blocks is not None and send_blocks is not None and send_blocks >= row_blocks:
    raise ValueError(f"send_blocks={send_blocks} must be below row_blocks={row_blocks} (at "
                     f"least one block receives)")
  _settings = _Settings(timeout_s=timeout_s, blocks_per_peer=blocks_per_peer,
                        row_blocks=row_blocks, send_blocks=send_blocks,
                        dispatch_layout=dispatch_layout)


DISPATCH_LAYOUT_ENV = "MOE_EP_PEER_DISPATCH_LAYOUT"


def dispatch_layout_enabled() -> bool:
  """Whether dispatch takes :func:`dispatch_with_layout` where it fits:
  :func:`configure`'s ``dispatch_layout``, else ``$MOE_EP_PEER_DISPATCH_LAYOUT``
  = ``1``. Off by default: on one H200 (the loopback, rank 0, every flag
  raised) the one launch took as long as the fused layout and peer_dispatch
  one after the other (26.5 against 26.2 us at T=128, E=256, R=2; 15.6
  against 16.5 us at T=32, R=4); what it should gain, the rows leaving
  before the layout is done, only two GPUs can show."""
  if _settings.dispatch_layout is not None:
    return _settings.dispatch_layout
  return os.environ.get(DISPATCH_LAYOUT_ENV, "").strip() == "1"


def _check_timeout(name: str, value) -> float:
  try:
    seconds = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name}={value!r} must be a number of seconds") from None
  if not 0 < seconds <= _MAX_TIMEOUT_S:
    raise ValueError(f"{name}={value!r} must be in (0, {_MAX_TIMEOUT_S:.0f}] seconds")
  return seconds


def timeout_s() -> float:
  """The wait bound new exchanges get: :func:`configure`'s, else
  ``$MOE_EP_PEER_TIMEOUT_S``, else 30 s."""
  if _settings.timeout_s is not None:
    return float(_settings.timeout_s)
  env = os.environ.get(TIMEOUT_ENV)
  if env is None or env.strip() == "":
    return DEFAULT_TIMEOUT_S
  return _check_timeout(TIMEOUT_ENV, env)


# --- pure layout logic -----------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ChannelLayout:
  """Byte layout of one channel's allocation on one device (as ``kernels/peer.cu``).

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
    return _round_up(self.control_bytes, _ALIGN)

  @property
  def slot_bytes(self) -> int:
    return _round_up(self.chunk_bytes, _ALIGN)

  @property
  def total_bytes(self) -> int:
    return self.data_offset + 2 * (self.ep_size - 1) * self.slot_bytes

  @property
  def vector_bytes(self) -> int:
    """The widest copy unit dividing the chunk (16 bytes for any row of a
    multiple of 16 bytes)."""
    return next(v for v in _VECTOR_BYTES if self.chunk_bytes % v == 0)

  @staticmethod
  def slot_of(src: int, dst: int) -> int:
    """The receive slot that source ``src`` fills on destination ``dst``."""
    if src == dst:
      raise ValueError(f"rank {src} has no receive slot for itself")
    return src if src < dst else src - 1


def meta_channel_layout(ep_size: int, width: int) -> ChannelLayout:
  """The channel dispatch's ``[R, W]`` int32 metadata travels on: the
  drop-in :func:`exchange`'s for an array of that shape (channels are keyed
  by their chunk bytes), so the fused layout kernels and the exchange share
  one."""
  return ChannelLayout(ep_size, width * 4)


def ep_groups(mesh: jax.sharding.Mesh, axis_name: str) -> list[tuple]:
  """The EP groups of ``mesh``: for each combination of the other axes'
  coordinates, the devices along ``axis_name`` in axis order (rank = index)."""
  _check_axis(mesh, axis_name)
  axis = mesh.axis_names.index(axis_name)
  rows = np.moveaxis(np.asarray(mesh.devices), axis, -1).reshape(-1, mesh.shape[axis_name])
  return [tuple(row) for row in rows]


def _check_axis(mesh, axis_name) -> None:
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name={axis_name!r} must be one mesh axis name (a str)")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")


# --- can the group use it? ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessFacts:
  """What one process knows about its GPUs: its host, the PCI bus id of each
  of its JAX devices (by global id), every GPU it can see, and which ordered
  pairs of those have peer access (PCI bus ids)."""

  host: str
  device_pci: dict[int, str]
  visible_pci: tuple[str, ...]
  peer_pairs: frozenset[tuple[str, str]]

  def to_json(self) -> str:
    return json.dumps({"host": self.host,
                       "device_pci": {str(k): v for k, v in self.device_pci.items()},
                       "visible_pci": list(self.visible_pci),
                       "peer_pairs": sorted(map(list, self.peer_pairs))})

  @classmethod
  def from_json(cls, text: str) -> "ProcessFacts":
    data = json.loads(text)
    return cls(host=data["host"], device_pci={int(k): v for k, v in data["device_pci"].items()},
               visible_pci=tuple(data["visible_pci"]),
               peer_pairs=frozenset(tuple(pair) for pair in data["peer_pairs"]))


def reachability_problem(groups: list[tuple[int, ...]], facts: list[ProcessFacts],
                         process_of: dict[int, int]) -> str | None:
  """Why some pair of one EP group cannot use the peer path, or None.

  A pair qualifies when both devices are on one host and some process of
  that host sees both GPUs and has peer access between them both ways.

  Args:
    groups: the EP groups as global device ids.
    facts: :class:`ProcessFacts` of every process, by process index.
    process_of: global device id -> process index.
  """
  for group in groups:
    for i, a in enumerate(group):
      for b in group[i + 1:]:
        fa, fb = facts[process_of[a]], facts[process_of[b]]
        if fa.host != fb.host:
          return f"devices {a} and {b} of one EP group are on different hosts"
        pa, pb = fa.device_pci[a], fb.device_pci[b]
        witnesses = [f for f in facts if f.host == fa.host and {pa, pb} <= set(f.visible_pci)]
        if not witnesses:
          return (f"no process sees both GPUs {pa} and {pb} (devices {a} and {b}) to check "
                  f"peer access; keep every GPU visible to every process")
        if not all((pa, pb) in f.peer_pairs and (pb, pa) in f.peer_pairs for f in witnesses):
          return f"GPUs {pa} and {pb} (devices {a} and {b}) have no peer access"
  return None


def _host_id() -> str:
  """Hostname plus boot id: two containers of one name on two machines differ."""
  return f"{socket.gethostname()}/{distributed.boot_id()}"


@functools.cache
def _local_facts() -> ProcessFacts:
  import cupy
  runtime = cupy.cuda.runtime
  visible = runtime.getDeviceCount()
  pci = [runtime.deviceGetPCIBusId(o) for o in range(visible)]
  pairs = frozenset((pci[a], pci[b]) for a in range(visible) for b in range(visible)
                    if a != b and runtime.deviceCanAccessPeer(a, b))
  device_pci = {d.id: pci[_ordinal(d)] for d in jax.local_devices(backend="gpu")}
  return ProcessFacts(host=_host_id(), device_pci=device_pci, visible_pci=tuple(pci),
                      peer_pairs=pairs)


def _kv_client():
  from jax._src import distributed
  return distributed.global_state.client


def _all_facts() -> list[ProcessFacts]:
  """Every process's facts, read from the key-value store (published once)."""
  local = _local_facts()
  if jax.process_count() == 1:
    return [local]
  return [ProcessFacts.from_json(text) for text in _gather_facts(local.to_json())]


@functools.cache
def _gather_facts(local_json: str) -> tuple[str, ...]:
  client = _kv_client()
  if client is None:
    raise RuntimeError("peer exchange across processes needs jax.distributed.initialize()")
  client.key_value_set_bytes(f"moe_ep/peer/facts/{jax.process_index()}", local_json.encode())
  return tuple(_kv_get(client, f"moe_ep/peer/facts/{p}", f"process {p}'s GPU facts").decode()
               for p in range(jax.process_count()))


def _kv_get(client, key: str, what: str) -> bytes:
  try:
    return client.blocking_key_value_get_bytes(key, int(ADDRESS_TIMEOUT_S * 1000))
  except Exception as error:  # jaxlib raises its own status errors
    raise RuntimeError(f"peer exchange: waited {ADDRESS_TIMEOUT_S:.0f} s for {what} (key {key!r}) "
                       f"in the jax.distributed key-value store; every process must trace the "
                       f"same exchanges: {error}") from error


_support_cache: dict[tuple, str | None] = {}


def unsupported_reason(mesh: jax.sharding.Mesh, axis_name: str) -> str | None:
  """None where :func:`exchange` can take the peer path, else why not."""
  _check_axis(mesh, axis_name)
  devices = list(np.asarray(mesh.devices).flat)
  if any(d.platform != "gpu" for d in devices):
    return "the mesh has non-GPU devices"
  if not cupy_backend.cupy_available():
    return "CuPy is not installed"
  if _CONCURRENT_FLAG in os.environ.get("XLA_FLAGS", "").replace("--", ""):
    return (f"XLA_FLAGS has --{_CONCURRENT_FLAG}, which may run two exchanges of one channel "
            f"at once")
  key = (tuple(d.id for d in devices), mesh.axis_names, axis_name)
  if key not in _support_cache:
    groups = [tuple(d.id for d in group) for group in ep_groups(mesh, axis_name)]
    process_of = {d.id: d.process_index for d in devices}
    _support_cache[key] = reachability_problem(groups, _all_facts(), process_of)
  return _support_cache[key]


def supported(mesh: jax.sharding.Mesh, axis_name: str) -> bool:
  """Whether every pair of GPUs in each EP group of ``mesh`` along
  ``axis_name`` has peer access on one host (and CuPy is installed). False on
  CPU, across hosts, or where a process cannot see a pair to check it. Every
  process computes the same answer from the same published facts."""
  return unsupported_reason(mesh, axis_name) is None


# --- device memory: channels, failure records ---------------------------------------------


class _Failure(ctypes.Structure):
  """One device's timeout record, as ``PeerFailure`` in ``kernels/peer.cu``."""

  _fields_ = [("kind", ctypes.c_uint32), ("peer", ctypes.c_uint32), ("site", ctypes.c_uint32),
              ("rank", ctypes.c_uint32), ("step", ctypes.c_uint64),
              ("waited_ns", ctypes.c_uint64)]


@dataclasses.dataclass
class _OnDevice:
  """A channel's state on one local device."""

  ordinal: int
  rank: int
  group: tuple  # the group's jax devices, by rank
  memory: object  # cupy.cuda.Memory of layout.total_bytes
  peers: object  # cupy uint64 [R]: each rank's channel base as mapped here


@dataclasses.dataclass
class _Channel:
  key: str
  layout: ChannelLayout
  on_device: dict[int, _OnDevice]


@dataclasses.dataclass(frozen=True)
class _Site:
  """One traced exchange: what timeouts name."""

  what: str
  shape: tuple
  dtype: str
  channel: str


_lock = threading.RLock()
_channels: dict[str, _Channel] = {}
_sites: list[_Site] = []
_failed_words: dict[int, object] = {}  # ordinal -> cupy.cuda.Memory, one u32 "failed"
_records = None  # ctypes array of _Failure over host-mapped memory
_records_device_ptr = 0
_modules: dict[int, object] = {}
_streams: dict[tuple[int, int], object] = {}
_opened: dict[tuple[int, str, int], int] = {}  # (ordinal, channel, global id) -> IPC pointer


def _ordinal(device) -> int:
  hardware_id = getattr(device, "local_hardware_id", None)
  return device.id if hardware_id is None else hardware_id


def _ensure_records() -> None:
  global _records, _records_device_ptr
  if _records is not None:
    return
  import cupy
  size = ctypes.sizeof(_Failure) * _MAX_LOCAL_DEVICES
  host_ptr = cupy.cuda.runtime.hostAlloc(size, _HOST_ALLOC_PORTABLE_MAPPED)
  ctypes.memset(host_ptr, 0, size)
  _records_device_ptr = cupy.cuda.runtime.pointerGetAttributes(host_ptr).devicePointer
  _records = (_Failure * _MAX_LOCAL_DEVICES).from_address(host_ptr)


def _zero(pointer: int, size: int) -> None:
  """Zeroes device memory of the current device and waits for it."""
  import cupy
  cupy.cuda.runtime.memset(pointer, 0, size)
  cupy.cuda.runtime.deviceSynchronize()


def _failed_word(ordinal: int):
  import cupy
  if ordinal not in _failed_words:
    with cupy.cuda.Device(ordinal):
      memory = cupy.cuda.Memory(_ALIGN)
      _zero(memory.ptr, _ALIGN)
    _failed_words[ordinal] = memory
  return _failed_words[ordinal]


def _kernels(ordinal: int) -> dict:
  if ordinal not in _modules:
    import cupy
    with cupy.cuda.Device(ordinal):
      module = cupy_backend.compile_module(_KERNEL_FILE)
      functions = {f"exchange_v{v}": module.get_function(f"peer_exchange_v{v}")
                   for v in _VECTOR_BYTES}
      functions.update({name: module.get_function(f"peer_{name}") for name in _ROW_KERNELS})
      functions["slab_layout_v16"] = module.get_function("peer_slab_layout_v16")
      _modules[ordinal] = functions
  return _modules[ordinal]


def _enable_peer_access(ordinal: int, peer_ordinal: int) -> None:
  import cupy
  with cupy.cuda.Device(ordinal):
    try:
      cupy.cuda.runtime.deviceEnablePeerAccess(peer_ordinal)
    except cupy.cuda.runtime.CUDARuntimeError as error:
      if error.status != _PEER_ACCESS_ALREADY_ENABLED:
        raise RuntimeError(f"enabling peer access cuda:{ordinal} -> cuda:{peer_ordinal} "
                           f"failed: {error}") from error


def _channel_key(mesh, axis_name: str, layout: ChannelLayout) -> str:
  ident = repr((tuple(d.id for d in np.asarray(mesh.devices).flat), mesh.axis_names,
                axis_name, layout.chunk_bytes))
  return hashlib.sha1(ident.encode()).hexdigest()[:16]


def _channel(mesh, axis_name: str, layout: ChannelLayout) -> _Channel:
  """The channel of this mesh axis and chunk size, allocated and connected
  on every local device of the mesh the first time (trace time)."""
  import cupy
  key = _channel_key(mesh, axis_name, layout)
  with _lock:
    if key in _channels:
      return _channels[key]
    _ensure_records()
    me = jax.process_index()
    local_groups = [g for g in ep_groups(mesh, axis_name)
                    if any(d.process_index == me for d in g)]
    memories = {}
    for group in local_groups:
      for device in group:
        if device.process_index != me:
          continue
        ordinal = _ordinal(device)
        if ordinal >= _MAX_LOCAL_DEVICES:
          raise RuntimeError(f"peer exchange supports CUDA ordinals < {_MAX_LOCAL_DEVICES}; "
                             f"got cuda:{ordinal}")
        with cupy.cuda.Device(ordinal):
          memory = cupy.cuda.Memory(layout.total_bytes)  # its own cudaMalloc: IPC-exportable
          _zero(memory.ptr, layout.control_bytes)
        memories[device.id] = memory
        _failed_word(ordinal)
        _kernels(ordinal)
    client = _kv_client() if jax.process_count() > 1 else None
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
        ordinal = _ordinal(device)
        bases = [_base_as_seen_from(ordinal, key, member, memories, client) for member in group]
        with cupy.cuda.Device(ordinal):
          peers = cupy.asarray(np.asarray(bases, np.uint64))
        on_device[ordinal] = _OnDevice(ordinal, rank, group, memories[device.id], peers)
    channel = _Channel(key, layout, on_device)
    _channels[key] = channel
    log.info("peer exchange: %d x %.1f MiB on %s (2 parities x %d slots of %d B) -> "
             "%.1f MiB held outside XLA in all", len(memories), layout.total_bytes / 2**20,
             ",".join(f"cuda:{o}" for o in sorted(on_device)), layout.ep_size - 1,
             layout.slot_bytes, buffer_bytes() / 2**20)
    return channel


def _base_as_seen_from(ordinal: int, key: str, member, memories: dict, client) -> int:
  """Group member ``member``'s channel base as device ``ordinal`` addresses
  it: the raw pointer in this process (with peer access), else its IPC
  mapping (opened once per local device and buffer)."""
  import cupy
  if member.id in memories:
    member_ordinal = _ordinal(member)
    if member_ordinal != ordinal:
      _enable_peer_access(ordinal, member_ordinal)
    return memories[member.id].ptr
  opened = (ordinal, key, member.id)
  if opened not in _opened:
    handle = _kv_get(client, f"moe_ep/peer/{key}/{member.id}",
                     f"device {member.id}'s receive buffer (process {member.process_index})")
    with cupy.cuda.Device(ordinal):
      try:
        _opened[opened] = cupy.cuda.runtime.ipcOpenMemHandle(handle)
      except cupy.cuda.runtime.CUDARuntimeError as error:
        raise RuntimeError(f"cuda:{ordinal} could not map device {member.id}'s receive buffer "
                           f"(process {member.process_index}) by CUDA IPC: {error}") from error
  return _opened[opened]


def buffer_bytes() -> int:
  """Device memory this process holds outside XLA for peer exchanges."""
  with _lock:
    channels = sum(c.layout.total_bytes * len(c.on_device) for c in _channels.values())
    return channels + _ALIGN * len(_failed_words)


# --- failures ------------------------------------------------------------------------------


def _failure_message(record: _Failure, ordinal: int, channel: _Channel | None,
                     site: _Site | None) -> tuple[str, dict]:
  """The error text for one device's record (pure: no device access)."""
  state = channel.on_device.get(ordinal) if channel is not None else None
  rank = int(record.rank)
  peer_rank = int(record.peer)
  peer_device = (str(state.group[peer_rank]) if state is not None
                 and 0 <= peer_rank < len(state.group) else f"EP rank {peer_rank}")
  what = site.what if site is not None else f"site {record.site}"
  shape = f" {site.dtype}{list(site.shape)}" if site is not None else ""
  waited = _WAIT_KINDS.get(int(record.kind), f"wait kind {record.kind}")
  message = (f"peer exchange {what!r}{shape}: cuda:{ordinal} (EP rank {rank}) waited "
             f"{record.waited_ns / 1e9:.2f} s for rank {peer_rank} ({peer_device}) to {waited} "
             f"{record.step}, past the {TIMEOUT_ENV} bound. Every rank must run the same "
             f"sequence of exchanges; later exchanges on this device returned without waiting "
             f"(their results are invalid) until peer.reset().")
  return message, dict(device=f"cuda:{ordinal}", rank=rank, peer_rank=peer_rank,
                       peer_device=peer_device, step=int(record.step), what=what)


def raise_if_failed() -> None:
  """Raises :class:`PeerTimeoutError` if a peer wait of this process timed
  out. Reads host memory only: no device synchronisation."""
  if _records is None:
    return
  for ordinal in range(_MAX_LOCAL_DEVICES):
    record = _records[ordinal]
    if record.kind == 0:
      continue
    site = _sites[record.site] if record.site < len(_sites) else None
    channel = _channels.get(site.channel) if site is not None else None
    message, fields = _failure_message(record, ordinal, channel, site)
    raise PeerTimeoutError(message, **fields)


def reset() -> None:
  """Clears every failure record and rearms every channel (flags, acks,
  step counters) of this process. Call it on every process, with no exchange
  in flight anywhere (it synchronises the local devices first)."""
  import cupy
  with _lock:
    ordinals = {o for c in _channels.values() for o in c.on_device} | set(_failed_words)
    for ordinal in ordinals:
      with cupy.cuda.Device(ordinal):
        cupy.cuda.runtime.deviceSynchronize()
    for channel in _channels.values():
      for state in channel.on_device.values():
        with cupy.cuda.Device(state.ordinal):
          _zero(state.memory.ptr, channel.layout.control_bytes)
    for ordinal, memory in _failed_words.items():
      with cupy.cuda.Device(ordinal):
        _zero(memory.ptr, _ALIGN)
    if _records is not None:
      ctypes.memset(ctypes.addressof(_records), 0, ctypes.sizeof(_records))


# --- the exchange ------------------------------------------------------------------------------


def _site(what: str, shape, dtype, channel_key: str) -> int:
  site = _Site(what, tuple(shape), str(dtype), channel_key)
  with _lock:
    if site in _sites:
      return _sites.index(site)
    _sites.append(site)
    return len(_sites) - 1


def blocks_per_peer(layout: ChannelLayout, multiprocessors: int) -> int:
  """Blocks each peer's chunk is split over: :func:`configure`'s value, else
  half the device's SMs shared among the R - 1 peers (on 2 H200s, 64 blocks
  moved 282 GB/s against 267 with 132: benchmarks/results/ep-exchange-*);
  never more than the chunk fills (4 vectors per thread)."""
  wanted = _settings.blocks_per_peer
  if wanted is None:
    wanted = max(1, multiprocessors // 2 // (layout.ep_size - 1))
  vectors = layout.chunk_bytes // layout.vector_bytes
  return int(max(1, min(wanted, -(-vectors // (_THREADS * 4)))))


@functools.cache
def _multiprocessors(ordinal: int) -> int:
  import cupy
  return cupy.cuda.Device(ordinal).attributes["MultiProcessorCount"]


def _stream(ordinal: int, handle: int):
  import cupy
  key = (ordinal, handle)
  if key not in _streams:
    _streams[key] = cupy_backend._external_stream(cupy, handle, ordinal)
  return _streams[key]


@dataclasses.dataclass(frozen=True)
class _Launch:
  """One device's launch of one exchange site, fixed at trace time."""

  function: object  # peer_exchange_v<vector bytes>
  blocks: int
  args: tuple  # the kernel's arguments after x and out


def exchange_launch(layout: ChannelLayout, ordinal: int, peers: int, rank: int,
                    tail: tuple) -> _Launch:
  """Rank ``rank``'s launch of the drop-in exchange on GPU ``ordinal``
  (``peers``: the device address of the ranks' channel bases; ``tail``:
  :func:`_device_tail`): the send grid (a remote part per peer, as many
  blocks for the local chunk), then the receive grid."""
  vector = layout.vector_bytes
  blocks = blocks_per_peer(layout, _multiprocessors(ordinal))
  remote_blocks = (layout.ep_size - 1) * blocks
  args = (np.uint64(peers), np.int32(rank), np.int32(layout.ep_size),
          np.int64(layout.chunk_bytes // vector), np.int64(layout.slot_bytes),
          np.int64(layout.data_offset), np.int32(blocks), np.int32(blocks))
  return _Launch(_kernels(ordinal)[f"exchange_v{vector}"], 2 * remote_blocks + blocks,
                 args + tail)


def _launches(channel: _Channel, site: int, timeout_ns: int) -> dict[int, _Launch]:
  return {ordinal: exchange_launch(channel.layout, ordinal, state.peers.data.ptr, state.rank,
                                   _device_tail(ordinal, site, timeout_ns))
          for ordinal, state in channel.on_device.items()}


def _launcher(channel: _Channel | None, site: int, timeout_ns: int):
  """The buffer_callback body: checks for an earlier timeout, then launches
  peer_exchange with the arguments fixed at trace time."""
  launches = _launches(channel, site, timeout_ns) if channel is not None else {}

  def callback(ctx, outs, x):
    import cupy
    if _records is not None and any(_records[o].kind for o in launches):
      raise_if_failed()
    (out,) = outs
    ordinal = cupy_backend._device_ordinal(x)
    launch = launches.get(ordinal)
    if launch is None:
      raise RuntimeError(f"peer exchange ran on cuda:{ordinal}, which it was not set up for "
                         f"at trace time (was it traced for another mesh or platform?)")
    x_ptr, out_ptr = cupy_backend._pointer(x), cupy_backend._pointer(out)
    with cupy.cuda.Device(ordinal), _stream(ordinal, ctx.stream):
      launch.function((launch.blocks,), (_THREADS,), (x_ptr, out_ptr, *launch.args))

  return callback


def _varying_over(out, x, axis_name: str):
  """buffer_callback drops shard_map's varying-axes type: restore x's, plus
  the EP axis (as all_to_all's result has)."""
  axes = cupy_backend._varying_axes(x) | {axis_name}
  return jax.lax.pcast(out, tuple(sorted(axes, key=str)), to="varying")


def _all_to_all(x, *, axis_name: str):
  return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def _peer(x, *, axis_name: str, mesh, what: str):
  ep_size = mesh.shape[axis_name]
  layout = ChannelLayout(ep_size, x.size // ep_size * x.dtype.itemsize)
  channel = None
  gpus = all(d.platform == "gpu" for d in np.asarray(mesh.devices).flat)
  if gpus:
    cupy_backend.require_cupy()
    channel = _channel(mesh, axis_name, layout)
  site = _site(what, x.shape, x.dtype, channel.key if channel is not None else "")
  timeout_ns = int(timeout_s() * 1e9)
  with jax.named_scope("moe_peer_exchange"):
    (out,) = buffer_callback(_launcher(channel, site, timeout_ns),
                             [jax.ShapeDtypeStruct(x.shape, x.dtype)],
                             command_buffer_compatible=True)(x)
  return _varying_over(out, x, axis_name)


def exchange(x: jax.Array, axis_name: str, mesh: jax.sharding.Mesh,
             what: str = "exchange") -> jax.Array:
  """``jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)``, bitwise, by
  direct peer stores on CUDA (call it inside ``shard_map`` over ``mesh``).

  Args:
    x: ``[R * k, ...]`` this rank's rows; chunk ``d`` (rows ``d*k .. d*k+k``)
      goes to rank ``d``. Any dtype.
    axis_name: the EP mesh axis (size ``R``).
    mesh: the mesh the enclosing ``shard_map`` runs over.
    what: names the exchange (a named scope, and timeout errors).

  Returns:
    ``[R * k, ...]``: chunk ``src`` is what rank ``src`` sent to this rank.
  """
  _check_axis(mesh, axis_name)
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


# --- dispatch's metadata exchange fused with the receiver's slab layout -------------------------


def _fused_meta_rows(ep_size: int, meta_width: int) -> bool:
  """Whether a launch can take route's metadata rows itself (the fused
  layout, the one-launch dispatch): 2 <= R <= 4, rows of whole 16-byte
  vectors."""
  return 2 <= ep_size <= _FUSED_LAYOUT_MAX_RANKS and meta_width % 4 == 0


def _layout_shared_fits(shared_ints: int) -> bool:
  """Whether the layout's dynamic shared memory fits beside such a launch's
  table of row pointers."""
  return 4 * shared_ints + _LAYOUT_TABLE_BYTES <= 4 * cupy_backend._SHARED_INTS


def fused_layout_fits(ep_size: int, send_capacity: int, top_k: int, local_experts: int,
                      expert_capacity: int) -> bool:
  """Whether :func:`slab_layout` runs as one launch at this shape: 2 <= R <= 4,
  metadata rows of whole 16-byte vectors (``2 * S * K + L`` a multiple of
  4 words) and few received member tiles, where ``slab_rank_own_count``
  alone lays the slabs out (decode; :func:`moe_ep.transport.cupy.slab_plan`).
  Elsewhere the drop-in :func:`exchange` and the backend's ``slab_layout``
  run."""
  if not _fused_meta_rows(ep_size, meta_format.width(send_capacity, top_k, local_experts)):
    return False
  plan = cupy_backend.slab_plan(ep_size, send_capacity, top_k, local_experts, expert_capacity)
  return not plan.counted and _layout_shared_fits(plan.shared_ints)


def slab_layout_kernel(layout: ChannelLayout, ordinal: int, peers: int, rank: int,
                       sizes: tuple[int, int, int, int], tail: tuple) -> _Kernel:
  """Rank ``rank``'s launch of ``peer_slab_layout_v16`` on GPU ``ordinal``
  (``peers``, ``tail``: as :func:`exchange_launch`; ``sizes``: ``(S, K, L,
  C)``). Buffers: meta 0; recv_pos, slab_row, slab_weights, counts, demand
  1-5."""
  send_capacity, top_k, local_experts, capacity = sizes
  if not fused_layout_fits(layout.ep_size, *sizes):
    raise ValueError(f"no fused slab layout at R={layout.ep_size}, (S, K, L, C)={sizes}: "
                     f"too many member tiles (fused_layout_fits)")
  plan = cupy_backend.slab_plan(layout.ep_size, send_capacity, top_k, local_experts, capacity)
  args = (np.uint64(peers), np.int32(rank), np.int32(layout.ep_size),
          *(np.int32(v) for v in (*sizes, layout.chunk_bytes // 4, plan.tiles)),
          np.int64(layout.slot_bytes), np.int64(layout.data_offset), *tail)
  return _Kernel(_kernels(ordinal)["slab_layout_v16"],
                 layout.ep_size - 1 + plan.rank_blocks, (0, 1, 2, 3, 4, 5), args,
                 threads=plan.threads, shared_bytes=4 * plan.shared_ints)


def _fused_slab_layout(meta, *, top_k: int, local_experts: int, expert_capacity: int,
                       axis_name: str, mesh):
  ep_size, width = meta.shape
  send_capacity = meta_format.send_capacity(width, top_k, local_experts)
  layout = meta_channel_layout(ep_size, width)
  channel = _gpu_channel(mesh, axis_name, layout)
  site = _site("exchange_meta", meta.shape, meta.dtype, channel.key if channel is not None else "")
  timeout_ns = int(timeout_s() * 1e9)
  sizes = (send_capacity, top_k, local_experts, expert_capacity)
  launches = {ordinal: [slab_layout_kernel(layout, ordinal, state.peers.data.ptr, state.rank,
                                           sizes, _device_tail(ordinal, site, timeout_ns))]
              for ordinal, state in (channel.on_device.items() if channel is not None else ())}
  shapes = cupy_backend.slab_layout_shapes(ep_size, send_capacity, top_k, local_experts,
                                           expert_capacity)
  return _fused_call("slab layout", launches, (meta,), shapes, axis_name)


def slab_layout(meta: jax.Array, *, top_k: int, num_local_experts: int, expert_capacity: int,
                axis_name: str, mesh: jax.sharding.Mesh, all_to_all_path) -> tuple:
  """Dispatch's metadata exchange and the receiver's slab layout in one
  launch (call it inside ``shard_map`` over ``mesh``; check
  :func:`fused_layout_fits` first).

  On CUDA one ``buffer_callback`` launching ``peer_slab_layout_v16`` on the
  drop-in exchange's channel for ``meta``: its first blocks store row ``d``
  of ``meta`` into rank ``d``'s slot and raise its flag; the others wait for
  every source's row and rank the received members reading them where they
  landed. Elsewhere ``all_to_all_path(meta)``. Bitwise the backend's
  ``slab_layout`` of ``exchange(meta)``.

  Args:
    meta: ``[R, W]`` int32, ``route``'s metadata (row ``d`` for rank ``d``).
    top_k, num_local_experts, expert_capacity: ``K``, ``L``, ``C``.
    axis_name, mesh: the EP axis and the ``shard_map``'s mesh.
    all_to_all_path: ``meta -> (recv_pos, slab_row, slab_weights, counts,
      demand)`` through XLA's ``all_to_all`` (every platform but CUDA).

  Returns:
    ``(recv_pos [R, S, K], slab_row [L, C], slab_weights [L, C], counts [L],
    demand [L])``.
  """
  _check_axis(mesh, axis_name)
  ep_size = mesh.shape[axis_name]
  if meta.ndim != 2 or meta.shape[0] != ep_size or meta.dtype != np.int32:
    raise ValueError(f"meta must be int32 [R, W] with R={ep_size}; got {meta.dtype} "
                     f"{meta.shape}")
  send_capacity = meta_format.send_capacity(meta.shape[1], top_k, num_local_experts)
  if not fused_layout_fits(ep_size, send_capacity, top_k, num_local_experts, expert_capacity):
    raise ValueError(f"no fused slab layout at R={ep_size}, S={send_capacity}, K={top_k}, "
                     f"L={num_local_experts}: too many member tiles (fused_layout_fits)")
  with jax.named_scope("exchange_meta"):
    return jax.lax.platform_dependent(
        meta, cuda=functools.partial(_fused_slab_layout, top_k=top_k,
                                     local_experts=num_local_experts,
                                     expert_capacity=expert_capacity, axis_name=axis_name,
                                     mesh=mesh),
        default=all_to_all_path)


# --- the fused row paths of dispatch and combine ------------------------------------------------


def fused_rows_problem(dtype, hidden: int, ep_size: int, top_k: int, *,
                       sums: bool, wire_dtype: str | None = None) -> str | None:
  """Why the fused row kernels cannot move rows of ``hidden`` elements of
  ``dtype`` (the caller then runs the local row passes around the drop-in
  :func:`exchange`), or None. ``sums``: combine's path, which adds rows.
  ``wire_dtype="float8_e4m3fn"``: dispatch quantizing the rows as it sends
  them (:func:`dispatch_rows`)."""
  dtype = np.dtype(dtype)
  if wire_dtype is not None:
    if wire_dtype != _FP8 or sums:
      return f"no fused kernel quantizes to {wire_dtype} on {'combine' if sums else 'dispatch'}"
    if dtype.name not in _SUM_SUFFIX:
      return f"no fused FP8 dispatch of {dtype.name} rows (only {', '.join(_SUM_SUFFIX)})"
    if hidden % 16:
      return f"FP8 rows quantized in the kernel need hidden % 16 == 0; hidden={hidden}"
    from moe_ep.transport import fp8  # imports this module's package
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
  if sums and dtype.name not in _SUM_SUFFIX:
    return f"no fused sum kernel for {dtype.name} (only {', '.join(_SUM_SUFFIX)})"
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
  total = max(2, _settings.row_blocks or multiprocessors)
  send = _settings.send_blocks or round(SEND_SHARE[kind] * total)
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
                 send_segment=(row_segment(chunk_rows, row_vecs, _ROW_WARPS, step)
                               if send_units is None
                               else row_segment(chunk_rows, send_units, _ROW_WARPS, 1)),
                 recv_segment=row_segment(receiver_rows, row_vecs, (total - send) * _ROW_WARPS,
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
  return min(row_vecs, _round_up(-(-row_vecs // pieces), step))


@dataclasses.dataclass(frozen=True)
class _Kernel:
  """One launch of a fused callback: the pointers of the callback's buffers
  ``buffers`` (indices into its inputs then outputs) lead the arguments;
  ``threads`` per block, ``shared_bytes`` of dynamic shared memory."""

  function: object
  blocks: int
  buffers: tuple[int, ...]
  args: tuple
  threads: int = _ROW_THREADS
  shared_bytes: int = 0

  def launch(self, buffers) -> None:
    """Launches on CuPy's current device and stream; ``buffers``: the
    callback's inputs then outputs (pointers or CuPy arrays)."""
    self.function((self.blocks,), (self.threads,),
                  (*(buffers[i] for i in self.buffers), *self.args),
                  shared_mem=self.shared_bytes)


def _device_tail(ordinal: int, site: int, timeout_ns: int) -> tuple:
  """The failure word, record, timeout and site arguments every kernel ends with."""
  return (np.uint64(_failed_words[ordinal].ptr),
          np.uint64(_records_device_ptr + ctypes.sizeof(_Failure) * ordinal),
          np.uint64(timeout_ns), np.int32(site))


def _gpu_channel(mesh, axis_name: str, layout: ChannelLayout) -> _Channel | None:
  """The channel on a GPU mesh (allocated at trace time); None elsewhere
  (lowering for CUDA on another platform: the callback fails only if run)."""
  if not all(d.platform == "gpu" for d in np.asarray(mesh.devices).flat):
    return None
  cupy_backend.require_cupy()
  return _channel(mesh, axis_name, layout)


def _fused_call(name: str, launches: dict[int, list[_Kernel]], inputs, out_shape, axis_name):
  """One command-buffer buffer_callback running ``launches[ordinal]`` on
  XLA's stream, under the scope ``moe_peer_exchange`` (which the HLO counts
  read as the exchange it replaces). ``out_shape``: one ShapeDtypeStruct, or
  a list of them (then a tuple of outputs)."""

  def callback(ctx, outs, *buffers):
    import cupy
    if _records is not None and any(_records[o].kind for o in launches):
      raise_if_failed()
    ordinal = cupy_backend._device_ordinal(buffers[0])
    kernels = launches.get(ordinal)
    if kernels is None:
      raise RuntimeError(f"peer {name} ran on cuda:{ordinal}, which it was not set up for at "
                         f"trace time (was it traced for another mesh or platform?)")
    pointers = [cupy_backend._pointer(b) for b in (*buffers, *outs)]
    with cupy.cuda.Device(ordinal), _stream(ordinal, ctx.stream):
      for kernel in kernels:
        kernel.launch(pointers)

  shapes = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
  with jax.named_scope("moe_peer_exchange"):
    outs = buffer_callback(callback, list(shapes), command_buffer_compatible=True)(*inputs)
  axes = tuple(sorted(frozenset({axis_name}).union(
      *(cupy_backend._varying_axes(x) for x in inputs)), key=str))
  outs = [jax.lax.pcast(out, axes, to="varying") for out in outs]
  return tuple(outs) if isinstance(out_shape, (list, tuple)) else outs[0]


def _check_maps(mesh, axis_name: str, recv_pos, *, send_token=None, send_slot=None,
                slab_row=None) -> tuple[int, int, int]:
  """``(R, S, K)`` from the maps' shapes, checked against each other and the mesh."""
  _check_axis(mesh, axis_name)
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
  the kernel's key in the compiled module; ``site``: what a timeout names;
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
    chunking and the slots, then ``tail`` (:func:`_device_tail`)."""
    return (np.uint64(peers), np.int32(rank), np.int32(layout.ep_size), np.int32(self.num_tokens),
            *(np.int32(v) for v in self.sizes), np.int32(grid.chunk_rows),
            np.int32(grid.num_chunks), np.int32(grid.send_blocks), np.int32(grid.send_segment),
            np.int32(grid.recv_segment), np.int64(layout.slot_bytes),
            np.int64(layout.data_offset), *tail)

  def job(self, ordinal: int, grid: RowGrid, layout: ChannelLayout, peers: int, rank: int,
          tail: tuple, buffers: tuple[int, ...]) -> _Kernel:
    """Rank ``rank``'s launch of this kernel on GPU ``ordinal``, the
    callback's ``buffers`` (indices into its inputs then outputs) first;
    the rest as :meth:`args`."""
    return _Kernel(_kernels(ordinal)[self.function], grid.blocks, buffers,
                   self.args(grid, layout, peers, rank, tail))


def dispatch_kernel(dtype, num_tokens: int, hidden: int, send_capacity: int, top_k: int,
                    num_slab_rows: int, wire_dtype: str | None = None) -> RowKernel:
  """:func:`dispatch_rows`' kernel for ``[T, H]`` rows of ``dtype`` (FP8:
  quantizing them into wire rows of ``W`` bytes)."""
  if wire_dtype is None:
    kernel = RowKernel("dispatch", "dispatch", "dispatch_rows", np.dtype(dtype).name, hidden,
                       num_tokens, send_capacity, ())
    return dataclasses.replace(kernel, sizes=(send_capacity, top_k, num_slab_rows,
                                              kernel.row_vecs))
  from moe_ep.transport import fp8  # imports this module's package
  kernel = RowKernel("dispatch", f"dispatch_fp8_{_SUM_SUFFIX[np.dtype(dtype).name]}",
                     "dispatch_rows_fp8", "uint8", fp8.wire_bytes(hidden), num_tokens,
                     send_capacity, (), fp8_send_units(hidden))
  return dataclasses.replace(kernel, sizes=(send_capacity, top_k, num_slab_rows,
                                            kernel.row_vecs, hidden))


# Up to this many bytes of combine output times R - 1 (decode and small
# prefill sizes), its receivers store each token's own member sum into the
# output first and wait for the other ranks' rows after (kernels/peer.cu's
# own_first): the output is stored twice, and the own members' reads overlap
# the other ranks' sending. With every rank at once on one H200 (H=7168 bf16,
# E=256) own-first was 4% faster at EP=2 for 7.3 MB of output and 5% slower
# for 14.7 MB; at EP=4, where a rank holds a quarter of the members, it was
# no faster even at 3.7 MB (combine-own-first-sweep-1xH200-20261201.json).
_COMBINE_OWN_FIRST_BYTES = 8 << 20


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
  return RowKernel("combine", f"combine_{first}{_SUM_SUFFIX[np.dtype(dtype).name]}",
                   "combine_rows", np.dtype(dtype).name, hidden, num_tokens, send_capacity,
                   (send_capacity, top_k, num_slab_rows, hidden))


def _fused_launches(kernel: RowKernel, mesh, axis_name: str, ep_size: int,
                    buffers: tuple) -> dict:
  """Every local device's one launch of ``kernel`` on its channel, the
  callback's ``buffers`` (indices into its inputs then outputs) first."""
  layout = kernel.layout(ep_size)
  channel = _gpu_channel(mesh, axis_name, layout)
  site = _site(kernel.site, (ep_size, kernel.send_capacity, kernel.slot_hidden),
               kernel.slot_dtype, channel.key if channel is not None else "")
  timeout_ns = int(timeout_s() * 1e9)
  launches = {}
  for ordinal, state in (channel.on_device.items() if channel is not None else ()):
    launches[ordinal] = [kernel.job(ordinal, kernel.grid(ep_size, _multiprocessors(ordinal)),
                                    layout, state.peers.data.ptr, state.rank,
                                    _device_tail(ordinal, site, timeout_ns), buffers)]
  return launches


def dispatch_layout_tiles(ep_size: int, send_capacity: int, top_k: int) -> int:
  """peer_dispatch_layout's member tiles (of a row kernel's block)."""
  return -(-ep_size * send_capacity * top_k // _ROW_THREADS)


def _dispatch_layout_counted(tiles: int, receiver_blocks: int | None = None) -> bool:
  """Whether peer_dispatch_layout's receivers count the member tiles once
  each into scratch, a barrier before they rank (more tiles than
  :data:`_DISPATCH_LAYOUT_MAX_TILES` or than receiver blocks), rather than
  each block counting every tile (slab_rank_own_count's way)."""
  return tiles > _DISPATCH_LAYOUT_MAX_TILES or (receiver_blocks is not None
                                                and tiles > receiver_blocks)


def _dispatch_layout_shared_ints(tiles: int, local_experts: int, counted: bool) -> int:
  """The layout's shared memory with blocks of the row kernels."""
  return (_ROW_WARPS + 2 + (0 if counted else tiles)) * local_experts


def dispatch_layout_fits(dtype, hidden: int, ep_size: int, send_capacity: int, top_k: int,
                         local_experts: int, expert_capacity: int,
                         wire_dtype: str | None = None) -> bool:
  """Whether :func:`dispatch_with_layout` runs at this shape: the fused
  dispatch kernel moves these rows (:func:`fused_rows_problem`; no FP8 wire
  yet), 2 <= R <= 4, metadata rows of whole 16-byte vectors, at most
  :data:`_DISPATCH_LAYOUT_MAX_TILES` member tiles of 512 (decode) and the
  layout's shared memory fits."""
  if wire_dtype is not None or fused_rows_problem(dtype, hidden, ep_size, top_k,
                                                  sums=False) is not None:
    return False
  width = meta_format.width(send_capacity, top_k, local_experts)
  tiles = dispatch_layout_tiles(ep_size, send_capacity, top_k)
  shared = _dispatch_layout_shared_ints(tiles, local_experts, _dispatch_layout_counted(tiles))
  return (_fused_meta_rows(ep_size, width) and tiles <= _DISPATCH_LAYOUT_MAX_TILES
          and _layout_shared_fits(shared)
          # its two channels must differ: a channel is keyed by its chunk bytes
          and meta_channel_layout(ep_size, width).chunk_bytes
          != send_capacity * hidden * np.dtype(dtype).itemsize)


def dispatch_layout_kernel(dtype, num_tokens: int, hidden: int, send_capacity: int, top_k: int,
                           local_experts: int, expert_capacity: int) -> RowKernel:
  """:func:`dispatch_with_layout`'s kernel (``peer_dispatch_layout``)."""
  kernel = dispatch_kernel(dtype, num_tokens, hidden, send_capacity, top_k,
                           local_experts * expert_capacity)
  width = meta_format.width(send_capacity, top_k, local_experts)
  # the member tiles depend on R too: dispatch_layout_launch appends them
  return dataclasses.replace(kernel, function="dispatch_layout",
                             sizes=(*kernel.sizes, local_experts, expert_capacity, width))


def dispatch_layout_launch(kernel: RowKernel, grid: RowGrid, layout: ChannelLayout,
                           meta_layout: ChannelLayout, ordinal: int, peers: int, meta_peers: int,
                           rank: int, tail: tuple) -> _Kernel:
  """Rank ``rank``'s launch of ``kernel`` (:func:`dispatch_layout_kernel`) on
  GPU ``ordinal``, on its rows channel (``layout``, bases at ``peers``) and
  metadata channel (``meta_layout``, ``meta_peers``). Buffers: rows 0, send_token 1,
  send_slot 2, meta 3; slabs 4, recv_pos 5, slab_row 6, slab_weights 7,
  counts 8, demand 9, tile_counts scratch 10 (:func:`dispatch_layout_tiles`
  ``* L`` ints). The metadata rows are pushed by up to a block per 32 KiB
  of each, from the sender blocks."""
  ep_size = layout.ep_size
  send_capacity, top_k, _, _, local_experts, _, width = kernel.sizes
  tiles = dispatch_layout_tiles(ep_size, send_capacity, top_k)
  counted = _dispatch_layout_counted(tiles, grid.recv_blocks)
  if grid.send_blocks < ep_size - 1:
    raise ValueError(f"peer_dispatch_layout needs a sender block per other rank ({ep_size - 1});"
                     f" the grid has {grid.send_blocks} (configure(send_blocks=...))")
  meta_blocks = max(1, min(grid.send_blocks // (ep_size - 1), -(-4 * width // (32 << 10))))
  sized = dataclasses.replace(kernel, sizes=(*kernel.sizes, tiles))
  args = sized.args(grid, layout, peers, rank, tail) + (
      np.uint64(meta_peers), np.int64(meta_layout.slot_bytes), np.int64(meta_layout.data_offset),
      np.int32(meta_blocks), np.int32(counted))
  return _Kernel(_kernels(ordinal)[kernel.function], grid.blocks, tuple(range(11)), args,
                 threads=_ROW_THREADS,
                 shared_bytes=4 * _dispatch_layout_shared_ints(tiles, local_experts, counted))


def dispatch_layout_shapes(kernel: RowKernel, ep_size: int, slab_dtype,
                           slab_width: int) -> list:
  """``kernel``'s (:func:`dispatch_layout_kernel`) outputs at EP size
  ``ep_size``: slabs ``[L * C, slab_width]`` of ``slab_dtype``, the slab
  layout's maps (:func:`moe_ep.transport.cupy.slab_layout_shapes`) and the
  layout's scratch (:func:`dispatch_layout_tiles` ``* L`` int32)."""
  send_capacity, top_k, slab_rows, _, local_experts, capacity, _ = kernel.sizes
  return [jax.ShapeDtypeStruct((slab_rows, slab_width), slab_dtype),
          *cupy_backend.slab_layout_shapes(ep_size, send_capacity, top_k, local_experts,
                                           capacity),
          jax.ShapeDtypeStruct((dispatch_layout_tiles(ep_size, send_capacity, top_k)
                                * local_experts,), np.int32)]


def _fused_dispatch_layout(rows, send_token, send_slot, meta, *, top_k: int, local_experts: int,
                           expert_capacity: int, axis_name: str, mesh):
  num_tokens, hidden = rows.shape
  ep_size, send_capacity = send_token.shape
  kernel = dispatch_layout_kernel(rows.dtype, num_tokens, hidden, send_capacity, top_k,
                                  local_experts, expert_capacity)
  layout = kernel.layout(ep_size)
  meta_layout = meta_channel_layout(ep_size, meta.shape[1])
  channel = _gpu_channel(mesh, axis_name, layout)
  meta_channel = _gpu_channel(mesh, axis_name, meta_layout)
  site = _site(kernel.site, (ep_size, send_capacity, hidden), kernel.slot_dtype,
               channel.key if channel is not None else "")
  timeout_ns = int(timeout_s() * 1e9)
  launches = {}
  for ordinal, state in (channel.on_device.items() if channel is not None else ()):
    launches[ordinal] = [dispatch_layout_launch(
        kernel, kernel.grid(ep_size, _multiprocessors(ordinal)), layout, meta_layout, ordinal,
        state.peers.data.ptr,
        meta_channel.on_device[ordinal].peers.data.ptr, state.rank,
        _device_tail(ordinal, site, timeout_ns))]
  shapes = dispatch_layout_shapes(kernel, ep_size, rows.dtype, hidden)
  return _fused_call("dispatch with layout", launches, (rows, send_token, send_slot, meta),
                     shapes, axis_name)[:6]


def dispatch_with_layout(rows: jax.Array, meta: jax.Array, send_token: jax.Array,
                         send_slot: jax.Array, *, top_k: int, num_local_experts: int,
                         expert_capacity: int, axis_name: str, mesh: jax.sharding.Mesh,
                         all_to_all_path) -> tuple:
  """Dispatch from route's outputs to the slabs in one launch, the metadata
  exchange and the slab layout included (decode sizes; check
  :func:`dispatch_layout_fits` first; call it inside ``shard_map``).

  On CUDA one ``buffer_callback`` launching ``peer_dispatch_layout``: its
  sender blocks push the metadata rows (on the drop-in exchange's channel
  for ``meta``) and then every token row to the other ranks' slots at once;
  its receiver blocks wait for every source's metadata, lay the slabs out,
  meet at a barrier and then place the own rows and each arriving chunk.
  Elsewhere ``all_to_all_path(rows, meta)``. Bitwise the unfused path.

  Args:
    rows: ``[T, H]``; meta, send_token, send_slot: ``route``'s outputs
      (``[R, W]``, ``[R, S]``, ``[T, R]`` int32).
    top_k, num_local_experts, expert_capacity: ``K``, ``L``, ``C``.
    axis_name, mesh: the EP axis and the ``shard_map``'s mesh.
    all_to_all_path: ``(rows, meta) ->`` the same six arrays through XLA's
      ``all_to_all`` (every platform but CUDA).

  Returns:
    ``(slabs [L * C, H], recv_pos [R, S, K], slab_row [L, C], slab_weights
    [L, C], counts [L], demand [L])``.
  """
  _check_axis(mesh, axis_name)
  ep_size, send_capacity = send_token.shape
  if not dispatch_layout_fits(rows.dtype, rows.shape[-1], ep_size, send_capacity, top_k,
                              num_local_experts, expert_capacity):
    raise ValueError(f"no fused dispatch with layout at R={ep_size}, S={send_capacity}, "
                     f"K={top_k}, L={num_local_experts}, H={rows.shape[-1]} "
                     f"(dispatch_layout_fits)")
  width = meta_format.width(send_capacity, top_k, num_local_experts)
  if meta.shape != (ep_size, width):
    raise ValueError(f"meta shape {meta.shape} must be [R, 2 * S * K + L] = [{ep_size}, {width}]")
  with jax.named_scope("exchange_rows"):
    return jax.lax.platform_dependent(
        rows, send_token, send_slot, meta,
        cuda=functools.partial(_fused_dispatch_layout, top_k=top_k,
                               local_experts=num_local_experts,
                               expert_capacity=expert_capacity, axis_name=axis_name, mesh=mesh),
        default=lambda rows, send_token, send_slot, meta: all_to_all_path(rows, meta))


def _fused_dispatch(rows, send_token, send_slot, recv_pos, slab_row, *, axis_name: str, mesh,
                    wire_dtype: str | None = None):
  num_tokens, hidden = rows.shape
  ep_size, send_capacity, top_k = recv_pos.shape
  num_slab_rows = slab_row.shape[0]
  if wire_dtype is not None:
    from moe_ep.transport import fp8  # imports this module's package
    for device in np.asarray(mesh.devices).flat:  # this process's GPUs: e4m3 needs sm_89+
      if device.platform == "gpu" and device.process_index == jax.process_index():
        fp8.check_compute_capability(_ordinal(device))
  kernel = dispatch_kernel(rows.dtype, num_tokens, hidden, send_capacity, top_k, num_slab_rows,
                           wire_dtype)
  launches = _fused_launches(  # buffers: rows, send_token, send_slot, recv_pos, slab_row; slabs
      kernel, mesh, axis_name, ep_size, (0, 1, 2, 3, 4, 5))
  return _fused_call("dispatch rows" + (" fp8" if wire_dtype else ""), launches,
                     (rows, send_token, send_slot, recv_pos, slab_row),
                     jax.ShapeDtypeStruct((num_slab_rows, kernel.slot_hidden),
                                          kernel.slot_dtype), axis_name)


def _fused_combine(slabs, recv_pos, send_slot, *, axis_name: str, mesh):
  num_slab_rows, hidden = slabs.shape
  ep_size, send_capacity, top_k = recv_pos.shape
  kernel = combine_kernel(slabs.dtype, send_slot.shape[0], hidden, send_capacity, top_k,
                          num_slab_rows, ep_size=ep_size)
  launches = _fused_launches(  # buffers: slabs 0, recv_pos 1, send_slot 2, y 3
      kernel, mesh, axis_name, ep_size, (0, 1, 2, 3))
  return _fused_call("combine rows", launches, (slabs, recv_pos, send_slot),
                     jax.ShapeDtypeStruct((send_slot.shape[0], hidden), slabs.dtype), axis_name)


def dispatch_rows(rows: jax.Array, send_token: jax.Array, send_slot: jax.Array,
                  recv_pos: jax.Array, slab_row: jax.Array, *, axis_name: str,
                  mesh: jax.sharding.Mesh,
                  all_to_all_path, wire_dtype: str | None = None) -> jax.Array:
  """Dispatch's row path, fused: ``rows [T, H]`` -> slabs ``[L * C, H]``
  (call it inside ``shard_map`` over ``mesh``).

  On CUDA one ``buffer_callback`` launching ``peer_dispatch`` once: its
  sender blocks store each token row into the slot of every other rank it
  goes to, chunk by chunk, and with the first of them the token's own row
  into this rank's slabs (one read of the row); its receiver blocks
  meanwhile zero the padding rows and place the own rows of tokens that go
  to no other rank, then expand each chunk the other ranks send as soon as
  it has arrived. Elsewhere
  ``all_to_all_path(rows)``. Check :func:`fused_rows_problem` first.

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
    all_to_all_path: ``rows -> [L * C, H]``, the same map through XLA's
      ``all_to_all`` (every platform but CUDA); FP8: ``-> [L * C, W]``.
    wire_dtype: None, or ``"float8_e4m3fn"`` for FP8 slabs.

  Returns:
    ``[L * C, H]`` in ``rows.dtype``, bitwise ``all_to_all_path(rows)``
    (FP8: ``[L * C, W]`` uint8 wire rows, bitwise it on every row that
    ``slab_row`` fills; what the padding rows hold is undefined).
  """
  _check_maps(mesh, axis_name, recv_pos, send_token=send_token, send_slot=send_slot,
              slab_row=slab_row)
  if rows.ndim != 2:
    raise ValueError(f"rows shape {rows.shape} must be [T, H]")
  if send_slot.shape[0] != rows.shape[0]:  # the kernel reads send_slot[t] for every t < T
    raise ValueError(f"send_slot shape {send_slot.shape} must be [T, R] with T={rows.shape[0]} "
                     f"(rows' tokens)")
  if wire_dtype is not None and (problem := fused_rows_problem(
      rows.dtype, rows.shape[1], mesh.shape[axis_name], recv_pos.shape[2], sums=False,
      wire_dtype=wire_dtype)):
    raise ValueError(f"wire_dtype={wire_dtype!r}: {problem}")
  with jax.named_scope("exchange_rows"):
    return jax.lax.platform_dependent(
        rows, send_token, send_slot, recv_pos, slab_row,
        cuda=functools.partial(_fused_dispatch, axis_name=axis_name, mesh=mesh,
                               wire_dtype=wire_dtype),
        default=lambda rows, *maps: all_to_all_path(rows))


def combine_rows(slabs: jax.Array, recv_pos: jax.Array, send_slot: jax.Array, *,
                 axis_name: str, mesh: jax.sharding.Mesh, all_to_all_path) -> jax.Array:
  """Combine's row path, fused: slabs ``[L * C, H]`` -> ``[T, H]`` (call it
  inside ``shard_map`` over ``mesh``).

  On CUDA one ``buffer_callback`` launching ``peer_combine_<dtype>`` once:
  its sender blocks store, per row each other rank sent here, the float32 sum
  of its members' slab rows (in member order, rounded once) into that rank's
  slot, chunk by chunk; its receiver blocks sum, per token, its returned rows
  over ranks in rank order in float32 (its own rank's member sum computed in
  place, rounded as if it had travelled), each as soon as its chunk has
  arrived, and round once: ``gather_sum_rows`` twice around an
  ``all_to_all``, bit for bit. Elsewhere ``all_to_all_path(slabs)``. Check
  :func:`fused_rows_problem` first (``sums=True``).

  Args:
    slabs: ``[L * C, H]`` float32, bfloat16 or float16.
    recv_pos, axis_name, mesh: as :func:`dispatch_rows`.
    send_slot: ``[T, R]`` int32 slot of token t's row in its chunk to rank d, or
      -1 (``RoutingHandle.send_slot``; read in the kernel, so no wire-row
      map is computed for it).
    all_to_all_path: ``slabs -> [T, H]`` through XLA's ``all_to_all``.

  Returns:
    ``[T, H]`` in ``slabs.dtype``.
  """
  _check_maps(mesh, axis_name, recv_pos, send_slot=send_slot)
  if slabs.ndim != 2:
    raise ValueError(f"slabs shape {slabs.shape} must be [L * C, H]")
  with jax.named_scope("exchange_rows"):
    return jax.lax.platform_dependent(
        slabs, recv_pos, send_slot,
        cuda=functools.partial(_fused_combine, axis_name=axis_name, mesh=mesh),
        default=lambda slabs, *maps: all_to_all_path(slabs))


def _ceiling(x, *, axis_name: str, mesh):
  ep_size = mesh.shape[axis_name]
  layout = ChannelLayout(ep_size, x.size // ep_size * x.dtype.itemsize)
  if layout.vector_bytes != 16:
    raise ValueError(f"write_ceiling needs chunks of whole 16-byte vectors; got "
                     f"{layout.chunk_bytes} bytes")
  channel = _gpu_channel(mesh, axis_name, layout)
  site = _site("write_ceiling", x.shape, x.dtype, channel.key if channel is not None else "")
  timeout_ns = int(timeout_s() * 1e9)
  launches = {}
  for ordinal, state in (channel.on_device.items() if channel is not None else ()):
    kernels = _kernels(ordinal)
    blocks = blocks_per_peer(layout, _multiprocessors(ordinal))
    args = (np.uint64(state.peers.data.ptr), np.int32(state.rank), np.int32(ep_size),
            np.int64(layout.chunk_bytes // 16), np.int64(layout.slot_bytes),
            np.int64(layout.data_offset), np.int32(blocks))
    tail = _device_tail(ordinal, site, timeout_ns)
    launches[ordinal] = [  # buffers: x 0, a one-word output 1 (never written)
        _Kernel(kernels["send_v16"], (ep_size - 1) * blocks, (0, 1), (*args, np.int32(0), *tail)),
        _Kernel(kernels["drain_v16"], (ep_size - 1) * blocks, (1,), (*args, *tail)),
    ]
  return _fused_call("write ceiling", launches, (x,), jax.ShapeDtypeStruct((1,), np.int32),
                     axis_name)


def write_ceiling(x: jax.Array, axis_name: str, mesh: jax.sharding.Mesh) -> jax.Array:
  """The peer-write ceiling, for benchmarks: chunk ``d`` of ``x [R * k,
  ...]`` stored straight into rank ``d``'s slot and signalled, as
  :func:`exchange` does, but nothing copied out (``peer_send`` +
  ``peer_drain``). Returns a ``[1]`` int32 placeholder; CUDA only."""
  _check_axis(mesh, axis_name)
  with jax.named_scope("write_ceiling"):
    return _ceiling(x, axis_name=axis_name, mesh=mesh)
