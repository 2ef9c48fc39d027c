"""The CuPy backend: ``kernels/rows.cu``, ``layout.cu`` and ``fp8.cu`` launched
on XLA's own stream.

Each function has the signature and outputs of its twin in
:mod:`moe_ep.transport.xla` and lowers to one ``buffer_callback`` that only
launches kernels (:mod:`~moe_ep.transport.kernel_launch`: compile cache,
XLA's stream, pointers). The FP8 dispatch's kernels (``kernels/fp8.cu``) give
the bytes and values of the pure-JAX format, :mod:`~moe_ep.transport.fp8`,
and need compute capability 8.9+ (the e4m3 conversion instructions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep.transport import fp8
from moe_ep.transport import kernel_launch as kl
from moe_ep.transport import launch_geometry
from moe_ep.transport import meta as meta_layout
from moe_ep.transport import xla
from moe_ep.transport.kernel_launch import KernelFile, i32, pointer

ROWS = KernelFile("rows.cu", ("expand_rows_v16", "expand_rows_v8", "expand_rows_v4",
                              "expand_rows_v2", "gather_sum_rows_f32", "gather_sum_rows_bf16",
                              "gather_sum_rows_f16"))
LAYOUT = KernelFile("layout.cu", ("route_count", "route_rank", "route_rank_own_count",
                                  "slab_count", "slab_rank", "slab_rank_own_count"))
FP8 = KernelFile("fp8.cu", tuple(f"{op}_{suffix}" for op in ("quantize_pack",
                                                           "unpack_dequantize_expand")
                                 for suffix in kl.DTYPE_SUFFIX.values()))
KERNEL_FILES = (ROWS, LAYOUT)  # the routing and row kernels; FP8's compile on their own


def kernels(ordinal: int) -> dict[str, object]:
  """The routing and row kernels on CUDA device ``ordinal`` (compiled once)."""
  return kl.functions(ordinal, KERNEL_FILES)


def _on_xla_stream(ctx, buffer):
  return kl.on_xla_stream(ctx, buffer, kernels)


# --- the four backend functions ---------------------------------------------------


def route(topk_idx, topk_weights, *, num_experts: int, ep_size: int, send_capacity: int):
  """Kernels ``route_count``, ``route_rank`` (one tile: ``route_rank_own_count``
  alone); see :func:`moe_ep.transport.xla.route`."""
  num_tokens, top_k = topk_idx.shape
  local_experts = num_experts // ep_size
  width = meta_layout.width(send_capacity, top_k, local_experts)
  demand_offset = meta_layout.demand_offset(send_capacity, top_k)
  route_sizes = launch_geometry.RouteSizes(num_tokens, ep_size, num_experts, top_k)
  threads = launch_geometry.route_threads(route_sizes)
  tiles = -(-num_tokens // threads)
  rank_blocks = max(tiles, -(-ep_size * send_capacity // threads))
  workspace = (tiles * ep_size, tiles * num_experts)
  shapes = [jax.ShapeDtypeStruct((num_tokens, ep_size), jnp.int32),
            jax.ShapeDtypeStruct((ep_size, send_capacity), jnp.int32),
            jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
            jax.ShapeDtypeStruct((ep_size, width), jnp.int32),
            jax.ShapeDtypeStruct((sum(workspace),), jnp.int32)]

  counted = launch_geometry.route_counted(num_tokens, threads)
  count_ints = launch_geometry.route_count_shared_ints(threads, route_sizes)
  rank_ints = launch_geometry.route_rank_shared_ints(threads, route_sizes, counted)

  def callback(ctx, outs, idx, weights):
    send_slot, send_token, route_slot, meta, scratch = (pointer(b) for b in outs)
    dest_counts, expert_counts = scratch, scratch + np.uint64(4 * workspace[0])
    sizes = i32(num_tokens, top_k, num_experts, local_experts, ep_size)
    with _on_xla_stream(ctx, idx) as launch:
      if counted:
        launch("route_count", tiles, threads, pointer(idx), *sizes, dest_counts,
               expert_counts,
               shared_ints=count_ints)
      launch("route_rank" if counted else "route_rank_own_count", rank_blocks, threads,
             pointer(idx), pointer(weights), *sizes, *i32(send_capacity, tiles), dest_counts,
             expert_counts, send_slot, send_token, route_slot, meta, *i32(width, demand_offset),
             shared_ints=rank_ints)

  outputs = kl.call("moe_cupy_route", callback, shapes, topk_idx.astype(jnp.int32),
                    topk_weights.astype(jnp.float32), kernels=kernels)
  return tuple(outputs[:4])


def slab_layout(recv_meta, *, top_k: int, num_local_experts: int, expert_capacity: int):
  """Kernels ``slab_count``, ``slab_rank`` (few tiles: ``slab_rank_own_count``
  alone); see :func:`moe_ep.transport.xla.slab_layout`."""
  ep_size, width = recv_meta.shape
  local_experts, capacity = num_local_experts, expert_capacity
  send_capacity = meta_layout.send_capacity(width, top_k, local_experts)
  sizes = launch_geometry.SlabSizes(ep_size, send_capacity, top_k, local_experts, capacity)
  geometry = launch_geometry.slab_geometry(sizes)
  threads, tiles = geometry.threads, geometry.tiles
  shapes = [*launch_geometry.slab_layout_shapes(sizes),
            jax.ShapeDtypeStruct((tiles * local_experts,), jnp.int32)]

  def callback(ctx, outs, meta):
    recv_pos, slab_row, slab_weights, counts, demand, tile_counts = (
        pointer(b) for b in outs)
    with _on_xla_stream(ctx, meta) as launch:
      if geometry.counted:
        launch("slab_count", tiles, threads, pointer(meta),
               *i32(ep_size, send_capacity, top_k, local_experts, width), tile_counts,
               shared_ints=threads // 32 * local_experts)
      launch("slab_rank" if geometry.counted else "slab_rank_own_count", geometry.rank_blocks,
             threads, pointer(meta),
             *i32(ep_size, send_capacity, top_k, local_experts, capacity, width,
                  meta_layout.demand_offset(send_capacity, top_k), tiles),
             tile_counts, recv_pos, slab_row, slab_weights, counts, demand,
             shared_ints=geometry.shared_ints)

  return tuple(kl.call("moe_cupy_slab_layout", callback, shapes, recv_meta,
                       kernels=kernels)[:5])


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
  threads = kl.threads_for(-(-row_vecs // 4))
  zero_blocks = -(-num_out_rows // 8)

  def callback(ctx, outs, rows, target_index, source_index):
    (out,) = outs
    with _on_xla_stream(ctx, rows) as launch:
      launch(f"expand_rows_v{vector}", num_table_rows + zero_blocks, threads, pointer(rows),
             pointer(target_index), pointer(source_index), pointer(out),
             *i32(num_table_rows, fanout, num_out_rows, row_vecs))

  shape = jax.ShapeDtypeStruct((num_out_rows, hidden), table.dtype)
  return kl.call("moe_cupy_expand_rows", callback, [shape], table, targets.astype(jnp.int32),
                 sources.astype(jnp.int32), kernels=kernels)[0]


def gather_sum_rows(table, index):
  """Kernel ``gather_sum_rows_{f32,bf16,f16}``: fixed-order float32 sums;
  see :func:`moe_ep.transport.xla.gather_sum_rows`."""
  suffix = kl.DTYPE_SUFFIX.get(jnp.dtype(table.dtype).name)
  if suffix is None:
    return xla.gather_sum_rows(table, index)
  kernel = f"gather_sum_rows_{suffix}"
  num_table_rows, hidden = table.shape
  num_out_rows, fanin = index.shape
  per_vector = 16 // table.dtype.itemsize
  threads = kl.threads_for(hidden // per_vector if hidden % per_vector == 0 else hidden)

  def callback(ctx, outs, rows, row_index):
    (out,) = outs
    with _on_xla_stream(ctx, rows) as launch:
      launch(kernel, num_out_rows, threads, pointer(rows), pointer(row_index), pointer(out),
             *i32(num_table_rows, fanin, num_out_rows, hidden))

  shape = jax.ShapeDtypeStruct((num_out_rows, hidden), table.dtype)
  return kl.call("moe_cupy_gather_sum_rows", callback, [shape], table, index.astype(jnp.int32),
                 kernels=kernels)[0]


# --- the FP8 dispatch's fused row passes (kernels/fp8.cu) --------------------------

_MIN_COMPUTE_CAPABILITY = 89
_QUANTIZE_WARPS = 8
_CHANNELS_PER_THREAD = 16  # unpack: one 16-byte load of codes per thread
_ZERO_ROWS_PER_BLOCK = 8  # as FP8_ZERO_ROWS_PER_BLOCK in kernels/fp8.cu
_NULL = np.uint64(0)


def check_compute_capability(device_ordinal: int) -> None:
  """RuntimeError unless CUDA device ``device_ordinal`` has the e4m3
  conversion instructions (sm_89+), which every FP8 kernel uses (these and
  the peer dispatch's)."""
  import cupy
  capability = int(cupy.cuda.Device(device_ordinal).compute_capability)
  if capability < _MIN_COMPUTE_CAPABILITY:
    raise RuntimeError(
        f"float8_e4m3fn dispatch needs a GPU of compute capability >= 8.9; cuda:"
        f"{device_ordinal} has {capability // 10}.{capability % 10}")


def fp8_kernels(ordinal: int) -> dict[str, object]:
  """``kernels/fp8.cu``'s kernels on CUDA device ``ordinal`` (compiled once);
  RuntimeError on devices without the e4m3 conversion instructions (before
  sm_89), saying which setting asked for them."""
  try:
    check_compute_capability(ordinal)
  except RuntimeError as error:
    raise RuntimeError(
        f"{error}. FP8 dispatch (MoEConfig.dispatch_dtype / dispatch(wire_dtype=)) with "
        "transport 'cupy' or 'auto' runs these kernels; on this GPU use transport='xla' "
        "(the pure-JAX FP8 path) or no FP8 dispatch") from error
  return kl.functions(ordinal, (FP8,))


def _maps(targets, sources):
  """int32 maps as kernel inputs, or () for the identity map."""
  if targets is None and sources is None:
    return ()
  if targets is None or sources is None:
    raise ValueError("targets and sources must be given together (or neither)")
  if targets.ndim != 2 or sources.ndim != 1:
    raise ValueError(f"targets must be [M, J] and sources [N]; got {targets.shape}, "
                     f"{sources.shape}")
  return targets.astype(jnp.int32), sources.astype(jnp.int32)


def _launch_fp8(kernel: str, num_in_rows: int, threads: int, maps: tuple, num_out_rows: int,
                fanout: int, hidden: int):
  """The callback of one FP8 row pass: ``kernel`` over ``num_in_rows`` rows
  (plus zero-fill blocks with maps), its maps' pointers or null."""
  zero_blocks = -(-num_out_rows // _ZERO_ROWS_PER_BLOCK) if maps else 0

  def callback(ctx, outs, rows, *index):
    (out,) = outs
    target_index, source_index = (pointer(b) for b in index) if index else (_NULL, _NULL)
    with kl.on_xla_stream(ctx, rows, fp8_kernels) as launch:
      launch(kernel, num_in_rows + zero_blocks, threads, pointer(rows), target_index,
             source_index, pointer(out),
             *i32(num_in_rows, fanout, num_out_rows, hidden, fp8.wire_bytes(hidden)))

  return callback


def quantize_pack_expand(table, targets=None, sources=None):
  """Kernel ``quantize_pack_{f32,bf16,f16}``, the bytes of
  :func:`moe_ep.transport.xla.quantize_pack_expand` (without maps: wire row
  ``m`` is table row ``m``)."""
  fp8.check_rows("x", table)
  num_rows, hidden = table.shape
  maps = _maps(targets, sources)
  if maps and maps[0].shape[0] != num_rows:
    raise ValueError(f"targets has {maps[0].shape[0]} rows but x has {num_rows}")
  num_out_rows = maps[1].shape[0] if maps else num_rows
  callback = _launch_fp8(f"quantize_pack_{kl.DTYPE_SUFFIX[jnp.dtype(table.dtype).name]}",
                         num_rows, 32 * min(_QUANTIZE_WARPS, fp8.num_blocks(hidden)), maps,
                         num_out_rows, maps[0].shape[1] if maps else 1, hidden)
  shape = jax.ShapeDtypeStruct((num_out_rows, fp8.wire_bytes(hidden)), jnp.uint8)
  return kl.call("moe_cupy_fp8_quantize_pack", callback, [shape], table, *maps,
                 kernels=fp8_kernels)[0]


def unpack_dequantize_expand(wire, targets=None, sources=None, *, hidden: int,
                             dtype=jnp.bfloat16):
  """Kernel ``unpack_dequantize_expand_{f32,bf16,f16}``: each wire row read
  once, dequantized and written to all its targets (without maps, output row
  ``n`` is wire row ``n``); the values of
  :func:`moe_ep.transport.xla.unpack_dequantize_expand`."""
  dtype = fp8.check_dtype(dtype)
  fp8.check_wire(wire, hidden)
  num_wire_rows = wire.shape[0]
  maps = _maps(targets, sources)
  if maps and maps[0].shape[0] != num_wire_rows:
    raise ValueError(f"targets has {maps[0].shape[0]} rows but wire has {num_wire_rows}")
  num_out_rows = maps[1].shape[0] if maps else num_wire_rows
  callback = _launch_fp8(f"unpack_dequantize_expand_{kl.DTYPE_SUFFIX[dtype.name]}",
                         num_wire_rows, kl.threads_for(-(-hidden // _CHANNELS_PER_THREAD)), maps,
                         num_out_rows, maps[0].shape[1] if maps else 1, hidden)
  shape = jax.ShapeDtypeStruct((num_out_rows, hidden), dtype)
  return kl.call("moe_cupy_fp8_unpack_dequantize_expand", callback, [shape], wire, *maps,
                 kernels=fp8_kernels)[0]


def dequantize_filled_rows(wire, filled, *, hidden: int, dtype):
  """Kernel ``unpack_dequantize_expand_{f32,bf16,f16}`` with every filled row
  its own target and source (the others zero); see
  :func:`moe_ep.transport.xla.dequantize_filled_rows`; an unfilled row's
  codes are not read (faster than reading every row, and than XLA's fusion
  of the same values: ``docs/benchmarks.md``, "Tuning")."""
  fp8.check_filled(filled, wire)
  rows = jnp.where(filled, jnp.arange(wire.shape[0], dtype=jnp.int32), -1)
  return unpack_dequantize_expand(wire, rows[:, None], rows, hidden=hidden, dtype=dtype)
