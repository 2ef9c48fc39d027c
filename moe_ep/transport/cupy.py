"""The CuPy backend: ``kernels/*.cu`` launched on XLA's own stream.

Each function has the signature and outputs of its twin in
:mod:`moe_ep.transport.xla` (the FP8 pair delegates to
:mod:`moe_ep.transport.fp8`, which launches ``kernels/fp8.cu``); each lowers to one
``jax.experimental.buffer_callback`` (FFI buffers, no host round trip) whose
Python callback only launches kernels: raw pointers from
``__cuda_array_interface__``, XLA's stream wrapped by
``cupy.cuda.ExternalStream``, scratch space declared as an extra output so
nothing is allocated and nothing synchronises. Launch shapes depend on static
shapes only, so every callback is ``command_buffer_compatible`` and XLA can
replay it from a CUDA graph.

Kernels compile with NVRTC once per device, at trace time (never inside a
step). CuPy is imported lazily here and by the modules built on this one's
launch helpers, :mod:`~moe_ep.transport.peer` and :mod:`~moe_ep.transport.fp8`
(the benchmarks also use it, to time a raw device memcpy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from moe_ep.transport import kernel_source
from moe_ep.transport import meta as meta_layout
from moe_ep.transport import xla

_INSTALL_HINT = ("backend='cupy' needs CuPy: pip install 'moe_ep[cuda13]' (CUDA 13) "
                 "or 'moe_ep[cuda12]' (CUDA 12)")

KERNELS = {
    "rows.cu": ("expand_rows_v16", "expand_rows_v8", "expand_rows_v4", "expand_rows_v2",
                "gather_sum_rows_f32", "gather_sum_rows_bf16", "gather_sum_rows_f16"),
    "layout.cu": ("route_count", "route_rank", "route_rank_own_count", "slab_count", "slab_rank",
                  "slab_rank_own_count"),
}
_SUM_KERNELS = {jnp.dtype(jnp.float32): "gather_sum_rows_f32",
                jnp.dtype(jnp.bfloat16): "gather_sum_rows_bf16",
                jnp.dtype(jnp.float16): "gather_sum_rows_f16"}
_MAX_THREADS = 256
_SHARED_INTS = 12288  # 48 KiB of dynamic shared memory, the default limit

_compiled: dict[int, dict[str, object]] = {}  # device ordinal -> kernel name -> RawKernel
_compile_lock = threading.Lock()


def cupy_available() -> bool:
  return importlib.util.find_spec("cupy") is not None


def require_cupy() -> None:
  if not cupy_available():
    raise ImportError(_INSTALL_HINT)


# --- compilation ---------------------------------------------------------------


def compile_module(kernel_file: str):
  """``kernels/<kernel_file>`` compiled by NVRTC for the current CUDA device:
  a ``cupy.RawModule``. Where NVRTC fails, RuntimeError naming the file, with
  the compiler's log. (This backend's, the peer exchange's and the FP8
  kernels all compile through it.)"""
  import cupy
  module = cupy.RawModule(code=kernel_source.source(kernel_file),
                          options=kernel_source.COMPILE_OPTIONS)
  try:
    module.compile()
  except cupy.cuda.compiler.CompileException as error:
    raise RuntimeError(f"compiling kernels/{kernel_file} failed:\n{error}") from error
  return module


def compile_kernels(device_ordinal: int) -> dict[str, object]:
  """Compiles every kernel file for one CUDA device (cached)."""
  with _compile_lock:
    if device_ordinal in _compiled:
      return _compiled[device_ordinal]
    import cupy
    functions = {}
    with cupy.cuda.Device(device_ordinal):
      for kernel_file, names in KERNELS.items():
        module = compile_module(kernel_file)
        for name in names:
          functions[name] = module.get_function(name)
    _compiled[device_ordinal] = functions
    return functions


def _gpu_ordinals() -> list[int]:
  try:
    devices = jax.local_devices(backend="gpu")
  except RuntimeError:
    return []
  ordinals = []
  for device in devices:
    hardware_id = getattr(device, "local_hardware_id", None)
    ordinals.append(device.id if hardware_id is None else hardware_id)
  return ordinals


def _compile_at_trace_time() -> None:
  """Compiles for every local GPU now, so no step ever waits for NVRTC.
  Without CuPy or GPUs (e.g. lowering for CUDA on a CPU machine) it does
  nothing; the callbacks then fail only if they actually run."""
  if not cupy_available():
    return
  for ordinal in _gpu_ordinals():
    compile_kernels(ordinal)


# --- launching -----------------------------------------------------------------


def _pointer(buffer) -> np.uint64:
  return np.uint64(buffer.__cuda_array_interface__["data"][0])


def _device_ordinal(buffer) -> int:
  device_type, ordinal = buffer.__dlpack_device__()
  if device_type != 2:  # kDLCUDA
    raise RuntimeError("backend='cupy' ran on a non-CUDA buffer; use backend='auto' or 'xla' "
                       "off CUDA devices")
  return ordinal


class _StreamHandle:
  """A raw ``cudaStream_t`` in the CUDA stream protocol."""

  def __init__(self, handle: int):
    self.handle = handle

  def __cuda_stream__(self):
    return (0, self.handle)


def _external_stream(cupy, handle: int, ordinal: int):
  """XLA's stream as a CuPy stream (``Stream.from_external`` where CuPy has
  it, the older ``ExternalStream`` otherwise)."""
  if hasattr(cupy.cuda.Stream, "from_external"):
    with cupy.cuda.Device(ordinal):
      return cupy.cuda.Stream.from_external(_StreamHandle(handle))
  return cupy.cuda.ExternalStream(handle, ordinal)


_streams: dict[tuple[int, int], object] = {}  # (device ordinal, cudaStream_t) -> CuPy stream


@contextlib.contextmanager
def _on_xla_stream(ctx, buffer):
  """Makes the buffer's device and XLA's stream current; yields
  ``launch(name, grid, block, *args, shared_ints=0)``."""
  import cupy
  ordinal = _device_ordinal(buffer)
  functions = _compiled.get(ordinal) or compile_kernels(ordinal)
  key = (ordinal, ctx.stream)
  stream = _streams.get(key)
  if stream is None:
    stream = _streams.setdefault(key, _external_stream(cupy, ctx.stream, ordinal))

  def launch(name, grid, block, *args, shared_ints=0):
    functions[name]((int(grid),), (int(block),), args, shared_mem=4 * shared_ints)

  with cupy.cuda.Device(ordinal), stream:
    yield launch


def _i32(*values):
  return tuple(np.int32(v) for v in values)


def _varying_axes(x) -> frozenset:
  """The shard_map axes ``x`` varies over (``aval.mat.varying`` in newer
  JAX, ``aval.vma`` in older)."""
  aval = jax.typeof(x)
  manual_axis_type = getattr(aval, "mat", None)
  if manual_axis_type is not None:
    return frozenset(manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def _varying_like(outputs, *inputs):
  """buffer_callback drops shard_map's varying-axes type; restore the union
  of the inputs' so both platform branches agree."""
  axes = frozenset().union(*(_varying_axes(x) for x in inputs))
  if not axes:
    return outputs
  axes = tuple(sorted(axes, key=str))
  return [jax.lax.pcast(out, axes, to="varying") for out in outputs]


def _call(scope: str, callback, result_shapes, *inputs):
  _compile_at_trace_time()
  with jax.named_scope(scope):
    outputs = buffer_callback(callback, result_shapes, command_buffer_compatible=True)(*inputs)
  return _varying_like(list(outputs), *inputs)


def _threads_for(row_work: int) -> int:
  return int(min(_MAX_THREADS, max(32, -(-row_work // 32) * 32)))


def _tile_threads(num_keys: int, extra_ints: int = 0) -> int:
  """Threads per tile block of the layout kernels: one warp-count row of
  ``num_keys`` ints per warp (plus ``extra_ints``) must fit in shared memory."""
  warps = (_SHARED_INTS - extra_ints) // max(num_keys, 1)
  if warps < 1:
    raise ValueError(f"{num_keys} keys do not fit the layout kernels' shared memory")
  return 32 * min(32, warps)


def _route_count_shared_ints(threads: int, ep_size: int, num_experts: int) -> int:
  return threads // 32 * ep_size + num_experts


def _route_rank_shared_ints(threads: int, ep_size: int, top_k: int, num_experts: int,
                            counted: bool) -> int:
  """``route_rank``'s; ``counted=False``: it counts its one tile itself."""
  own_counts = 0 if counted else ep_size + num_experts
  return (threads // 32 + 3) * ep_size + threads * (ep_size + 1 + 3 * top_k) + own_counts


# Up to this many member tiles, slab_rank counts them itself (no slab_count
# launch): each block counts the other tiles, one pass each. At decode (T=128,
# E=256, K=8) on an H200, 2 tiles (EP=2): slab kernels 7.4 -> 7.0 us and the
# routing 17.5 -> 15.8 us; 1 tile (EP=1): 16.6 -> 12.5 us.
_SLAB_TILES_COUNTED_IN_RANK = 2

# Warps per token tile of the routing kernels beyond one tile: of 1, 2, 4
# and 8, 4 was the fastest route_rank (or within 0.2 us of it) at every T
# from 512 to 8192 on an H200 (2026-12-01; up to 2.7 us faster than 1 warp).
_ROUTE_WARPS = 4


def _route_counted(num_tokens: int, threads: int) -> bool:
  """Whether ``route_count`` counts the token tiles first: more than one
  tile (one tile: ``route_rank_own_count`` counts it, one launch fewer at decode)."""
  return num_tokens > threads


def _route_threads(num_tokens: int, ep_size: int, num_experts: int, top_k: int) -> int:
  """Threads per token tile of ``route_count``/``route_rank``: up to 256
  tokens (decode) one tile of 8 warps, which leaves each thread the fewest
  serial loads (route_rank 7.2 instead of 8.7-10.0 us at T=128 on an H200),
  else :data:`_ROUTE_WARPS` warps; fewer where both kernels' shared memory
  would not fit."""
  most = 8 if num_tokens <= 32 * 8 else _ROUTE_WARPS
  for warps in range(most, 0, -1):
    threads = 32 * warps
    counted = _route_counted(num_tokens, threads)
    if max(_route_count_shared_ints(threads, ep_size, num_experts),
           _route_rank_shared_ints(threads, ep_size, top_k, num_experts,
                                   counted)) <= _SHARED_INTS:
      return threads
  raise ValueError(f"ep_size={ep_size}, num_experts={num_experts} and top_k={top_k} do not "
                   "fit the routing kernels' shared memory")


# --- the four backend functions ---------------------------------------------------


def route(topk_idx, topk_weights, *, num_experts: int, ep_size: int, send_capacity: int):
  """Kernels ``route_count``, ``route_rank`` (one tile: ``route_rank_own_count``
  alone); see :func:`moe_ep.transport.xla.route`."""
  num_tokens, top_k = topk_idx.shape
  local_experts = num_experts // ep_size
  width = meta_layout.width(send_capacity, top_k, local_experts)
  demand_offset = meta_layout.demand_offset(send_capacity, top_k)
  threads = _route_threads(num_tokens, ep_size, num_experts, top_k)
  tiles = -(-num_tokens // threads)
  rank_blocks = max(tiles, -(-ep_size * send_capacity // threads))
  workspace = (tiles * ep_size, tiles * num_experts)
  shapes = [jax.ShapeDtypeStruct((num_tokens, ep_size), jnp.int32),
            jax.ShapeDtypeStruct((ep_size, send_capacity), jnp.int32),
            jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
            jax.ShapeDtypeStruct((ep_size, width), jnp.int32),
            jax.ShapeDtypeStruct((sum(workspace),), jnp.int32)]

  counted = _route_counted(num_tokens, threads)

  def callback(ctx, outs, idx, weights):
    send_slot, send_token, route_slot, meta, scratch = (_pointer(b) for b in outs)
    dest_counts, expert_counts = scratch, scratch + np.uint64(4 * workspace[0])
    sizes = _i32(num_tokens, top_k, num_experts, local_experts, ep_size)
    with _on_xla_stream(ctx, idx) as launch:
      if counted:
        launch("route_count", tiles, threads, _pointer(idx), *sizes, dest_counts,
               expert_counts, shared_ints=_route_count_shared_ints(threads, ep_size, num_experts))
      launch("route_rank" if counted else "route_rank_own_count", rank_blocks, threads,
             _pointer(idx), _pointer(weights), *sizes, *_i32(send_capacity, tiles), dest_counts,
             expert_counts, send_slot, send_token, route_slot, meta, *_i32(width, demand_offset),
             shared_ints=_route_rank_shared_ints(threads, ep_size, top_k, num_experts, counted))

  outputs = _call("moe_cupy_route", callback, shapes, topk_idx.astype(jnp.int32),
                  topk_weights.astype(jnp.float32))
  return tuple(outputs[:4])


def slab_layout_shapes(ep_size: int, send_capacity: int, top_k: int, local_experts: int,
                       expert_capacity: int) -> list:
  """The slab layout's outputs: ``recv_pos [R, S, K]``, ``slab_row [L, C]``,
  ``slab_weights [L, C]`` float32, ``counts [L]``, ``demand [L]``."""
  return [jax.ShapeDtypeStruct((ep_size, send_capacity, top_k), jnp.int32),
          jax.ShapeDtypeStruct((local_experts, expert_capacity), jnp.int32),
          jax.ShapeDtypeStruct((local_experts, expert_capacity), jnp.float32),
          jax.ShapeDtypeStruct((local_experts,), jnp.int32),
          jax.ShapeDtypeStruct((local_experts,), jnp.int32)]


@dataclasses.dataclass(frozen=True)
class SlabPlan:
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


def slab_plan(ep_size: int, send_capacity: int, top_k: int, local_experts: int,
              expert_capacity: int) -> SlabPlan:
  """:class:`SlabPlan` for ``R * S * K`` received members and ``[L, C]`` slabs."""
  num_members = ep_size * send_capacity * top_k
  for name, size in (("R * S * K received members", num_members),
                     ("L * C slab rows", local_experts * expert_capacity)):
    if size >= 2**31:  # the kernels index them in int32, as the handle holds them
      raise ValueError(f"{name} = {size} must be < 2**31 (int32 positions)")
  threads = _tile_threads(local_experts, extra_ints=2 * local_experts)
  tiles = -(-num_members // threads)
  rank_ints = (threads // 32 + 2) * local_experts
  # Few tiles (decode): slab_rank's blocks count them themselves, one launch fewer.
  counted = (tiles > _SLAB_TILES_COUNTED_IN_RANK
             or rank_ints + tiles * local_experts > _SHARED_INTS)
  return SlabPlan(threads=threads, tiles=tiles,
                  rank_blocks=max(tiles, -(-local_experts * expert_capacity // threads)),
                  shared_ints=rank_ints + (0 if counted else tiles * local_experts),
                  counted=counted)


def slab_layout(recv_meta, *, top_k: int, num_local_experts: int, expert_capacity: int):
  """Kernels ``slab_count``, ``slab_rank`` (few tiles: ``slab_rank_own_count``
  alone); see :func:`moe_ep.transport.xla.slab_layout`."""
  ep_size, width = recv_meta.shape
  local_experts, capacity = num_local_experts, expert_capacity
  send_capacity = meta_layout.send_capacity(width, top_k, local_experts)
  plan = slab_plan(ep_size, send_capacity, top_k, local_experts, capacity)
  threads, tiles = plan.threads, plan.tiles
  shapes = [*slab_layout_shapes(ep_size, send_capacity, top_k, local_experts, capacity),
            jax.ShapeDtypeStruct((tiles * local_experts,), jnp.int32)]

  def callback(ctx, outs, meta):
    recv_pos, slab_row, slab_weights, counts, demand, tile_counts = (
        _pointer(b) for b in outs)
    with _on_xla_stream(ctx, meta) as launch:
      if plan.counted:
        launch("slab_count", tiles, threads, _pointer(meta),
               *_i32(ep_size, send_capacity, top_k, local_experts, width), tile_counts,
               shared_ints=threads // 32 * local_experts)
      launch("slab_rank" if plan.counted else "slab_rank_own_count", plan.rank_blocks, threads,
             _pointer(meta), *_i32(ep_size, send_capacity, top_k, local_experts, capacity, width,
                                   meta_layout.demand_offset(send_capacity, top_k), tiles),
             tile_counts, recv_pos, slab_row, slab_weights, counts, demand,
             shared_ints=plan.shared_ints)

  return tuple(_call("moe_cupy_slab_layout", callback, shapes, recv_meta)[:5])


_VECTOR_BYTES = (16, 8, 4, 2)


def expand_rows(table, targets, sources):
  """Kernel ``expand_rows_v{16,8,4,2}``: each table row read once and written
  to all its targets; see :func:`moe_ep.transport.xla.expand_rows`."""
  num_table_rows, hidden = table.shape
  row_bytes = hidden * table.dtype.itemsize
  vector = next((v for v in _VECTOR_BYTES if row_bytes % v == 0), None)
  if vector is None:  # odd widths of 1-byte types: no kernel variant
    return xla.expand_rows(table, targets, sources)
  num_out_rows = sources.shape[0]
  fanout = targets.shape[1]
  row_vecs = row_bytes // vector
  threads = _threads_for(-(-row_vecs // 4))
  zero_blocks = -(-num_out_rows // 8)

  def callback(ctx, outs, rows, target_index, source_index):
    (out,) = outs
    with _on_xla_stream(ctx, rows) as launch:
      launch(f"expand_rows_v{vector}", num_table_rows + zero_blocks, threads, _pointer(rows),
             _pointer(target_index), _pointer(source_index), _pointer(out),
             *_i32(num_table_rows, fanout, num_out_rows, row_vecs))

  shape = jax.ShapeDtypeStruct((num_out_rows, hidden), table.dtype)
  return _call("moe_cupy_expand_rows", callback, [shape], table,
               targets.astype(jnp.int32), sources.astype(jnp.int32))[0]


def gather_sum_rows(table, index):
  """Kernel ``gather_sum_rows_{f32,bf16,f16}``: fixed-order float32 sums;
  see :func:`moe_ep.transport.xla.gather_sum_rows`."""
  kernel = _SUM_KERNELS.get(jnp.dtype(table.dtype))
  if kernel is None:
    return xla.gather_sum_rows(table, index)
  num_table_rows, hidden = table.shape
  num_out_rows, fanin = index.shape
  per_vector = 16 // table.dtype.itemsize
  threads = _threads_for(hidden // per_vector if hidden % per_vector == 0 else hidden)

  def callback(ctx, outs, rows, row_index):
    (out,) = outs
    with _on_xla_stream(ctx, rows) as launch:
      launch(kernel, num_out_rows, threads, _pointer(rows), _pointer(row_index), _pointer(out),
             *_i32(num_table_rows, fanin, num_out_rows, hidden))

  shape = jax.ShapeDtypeStruct((num_out_rows, hidden), table.dtype)
  return _call("moe_cupy_gather_sum_rows", callback, [shape], table,
               index.astype(jnp.int32))[0]


# --- the FP8 dispatch's fused row passes (kernels/fp8.cu) --------------------------
# Launched by moe_ep.transport.fp8 (its own kernel file and compile cache; it
# imports this module, hence the imports inside).


def _fp8_kernels(fn, *args, **kwargs):
  """Runs an ``fp8.cuda_*`` function; the compute-capability error (the e4m3
  conversions need sm_89+) also says which setting asked for the kernels."""
  try:
    return fn(*args, **kwargs)
  except RuntimeError as error:
    if "compute capability" not in str(error):
      raise
    raise RuntimeError(
        f"{error}. FP8 dispatch (MoEConfig.dispatch_dtype / dispatch(wire_dtype=)) with "
        "transport 'cupy' or 'auto' runs these kernels; on this GPU use transport='xla' "
        "(the pure-JAX FP8 path) or no FP8 dispatch") from error


def quantize_pack_expand(table, targets=None, sources=None):
  """Kernel ``quantize_pack_{f32,bf16,f16}``; see
  :func:`moe_ep.transport.xla.quantize_pack_expand`."""
  from moe_ep.transport import fp8
  return _fp8_kernels(fp8.cuda_quantize_pack, table, targets, sources)


def unpack_dequantize_expand(wire, targets, sources, *, hidden: int, dtype):
  """Kernel ``unpack_dequantize_expand_{f32,bf16,f16}``; see
  :func:`moe_ep.transport.xla.unpack_dequantize_expand`."""
  from moe_ep.transport import fp8
  return _fp8_kernels(fp8.cuda_unpack_dequantize_expand, wire, targets, sources,
                      hidden=hidden, dtype=dtype)


def dequantize_filled_rows(wire, filled, *, hidden: int, dtype):
  """Kernel ``unpack_dequantize_expand_{f32,bf16,f16}`` with every filled row
  its own target and source (the others zero); see
  :func:`moe_ep.transport.xla.dequantize_filled_rows`; an unfilled row's
  codes are not read. On one H200, [81920, 7424] wire rows to bf16 with 80%
  filled: 452 us (``dequantize-skip-1xH200-20261201.json``; 496-500 us when
  it read every row, against 742-763 us for XLA's fusion of the same values,
  ``dequantize-filled-1xH200-20261201.json``)."""
  from moe_ep.transport import fp8
  fp8._check_filled(filled, wire)
  rows = jnp.where(filled, jnp.arange(wire.shape[0], dtype=jnp.int32), -1)
  return _fp8_kernels(fp8.cuda_unpack_dequantize_expand, wire, rows[:, None], rows,
                      hidden=hidden, dtype=dtype)
