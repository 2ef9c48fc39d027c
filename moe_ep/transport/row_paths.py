"""Dispatch's and combine's row paths, shared by their forward and backward
rules: ``rows [T, H]`` -> the receiver's ``[L, C, H]`` slabs and back, the
metadata exchange and the receiver's layout, and the routing weights'
way back.

Data flow of a forward dispatch on each rank (``handle.py`` names them)::

  route(topk_idx, w)      -> send_slot, send_token, route_slot, meta [R, 2SK+L]
  exchange(meta)          -> recv_meta                               (small exchange)
  slab_layout(recv_meta)  -> recv_pos, slab_row, weights, counts, demand
  expand_rows(tokens)     -> send_rows [R, S, H]   (each token once per rank)
  exchange(send_rows)     -> recv_rows [R, S, H]                     (the row exchange)
  expand_rows(recv_rows)  -> slabs [L, C, H]       (each row once per local expert)

Combine runs the row path backwards with sums (``gather_sum_rows``): per
received row, the sum of its members' slab rows (partial sums reduced before
they travel), one exchange, then per token the sum over destination ranks.
With one rank the two passes on each side compose into one and nothing is
exchanged. Every row movement has its map in both directions in the handle,
so a backend can read each input row once (``expand_rows``) or write each
output row once (``gather_sum_rows``).

Every function here executes a :class:`~moe_ep.transport.plan.DispatchPlan`,
which chose each path once where dispatch or combine was called; none
chooses again. On the peer exchange the row paths (and at decode sizes the
metadata exchange with the layout) can run as one fused launch each, which
runs when lowering for CUDA and the plan's ``all_to_all`` branch everywhere
else (:func:`_fused_on_cuda`), with bitwise the same results. Where the
output rows land is the receiver's layout, :mod:`~moe_ep.transport.receive_slabs`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_ep.transport import cupy_backend, fp8, peer, receive_grouped, receive_slabs, xla
from moe_ep.transport.handle import RoutingHandle
from moe_ep.transport.peer import dispatch_layout, fused_layout, rows as peer_rows
from moe_ep.transport.plan import DispatchPlan


# Each local pass as (its CuPy kernels, its pure-JAX twin), the one pair of
# functions a call through _local_pass may run.
_ROUTE = (cupy_backend.route, xla.route)
_SLAB_LAYOUT = (cupy_backend.slab_layout, xla.slab_layout)
_EXPAND_ROWS = (cupy_backend.expand_rows, xla.expand_rows)
_GATHER_SUM_ROWS = (cupy_backend.gather_sum_rows, xla.gather_sum_rows)
_QUANTIZE_PACK_EXPAND = (cupy_backend.quantize_pack_expand, xla.quantize_pack_expand)
_UNPACK_DEQUANTIZE_EXPAND = (cupy_backend.unpack_dequantize_expand, xla.unpack_dequantize_expand)
_DEQUANTIZE_FILLED_ROWS = (cupy_backend.dequantize_filled_rows, xla.dequantize_filled_rows)


def _local_pass(plan: DispatchPlan, passes: tuple, *args, **static):
  """One local pass, ``passes = (kernel_pass, xla_pass)``: the CuPy kernels
  (:mod:`~moe_ep.transport.cupy_backend`) or their pure-JAX twin
  (:mod:`~moe_ep.transport.xla`), as ``plan.local_passes`` says;
  ``"per_platform"`` lowers the kernels where the program is lowered for
  CUDA and the twin elsewhere."""
  kernel_pass, xla_pass = passes
  if plan.local_passes == "xla":
    return xla_pass(*args, **static)
  if plan.local_passes == "cupy":
    return kernel_pass(*args, **static)
  return jax.lax.platform_dependent(*args, cuda=functools.partial(kernel_pass, **static),
                                    default=functools.partial(xla_pass, **static))


def _fused_on_cuda(scope: str, fused, unfused, *args):
  """``fused(*args)`` (one peer launch) when lowered for CUDA, else
  ``unfused(*args)`` (the same values through XLA's ``all_to_all``), under
  the named scope ``scope``."""
  with jax.named_scope(scope):
    return jax.lax.platform_dependent(*args, cuda=fused, default=unfused)


def exchange(plan: DispatchPlan, x: jax.Array, what: str) -> jax.Array:
  """``all_to_all`` over the leading [R] axis: row d goes to rank d, and the
  result's row src is what rank src sent here; by direct stores into the
  peers' memory when ``plan.exchange == "peer"`` (bitwise the same result).
  ``what`` names the exchange inside the enclosing pass's scope
  (``moe_dispatch_fwd/exchange_rows``)."""
  if plan.exchange == "peer":
    return peer.exchange(x, plan.axis_name, plan.mesh, what)
  with jax.named_scope(what):
    return jax.lax.all_to_all(x, plan.axis_name, 0, 0, tiled=True)


def _lookup(table: jax.Array, index: jax.Array, fill) -> jax.Array:
  """``table[index]`` for the small int/float tables of the handle side;
  ``fill`` where ``index`` is out of range (-1)."""
  valid = (index >= 0) & (index < table.shape[0])
  rows = table[jnp.where(valid, index, 0)]
  return jnp.where(valid.reshape(valid.shape + (1,) * (table.ndim - 1)), rows, fill)


def _send_positions(handle: RoutingHandle) -> jax.Array:
  """``[T, R]`` flat send-buffer row ``d * S + slot`` of each (token, rank), or -1."""
  ranks = jnp.arange(handle.ep_size, dtype=jnp.int32)
  return jnp.where(handle.send_slot >= 0, ranks * handle.send_capacity + handle.send_slot, -1)


def _token_member_pos(handle: RoutingHandle) -> jax.Array:
  """One rank only: ``[T, K]`` output positions of each token's members,
  composed through its single wire slot."""
  return _lookup(handle.recv_pos.reshape(-1, handle.top_k), handle.send_slot[:, 0], -1)


# --- the row paths ------------------------------------------------------------


def rows_to_slabs(plan: DispatchPlan, rows: jax.Array, handle: RoutingHandle,
                  path: str | None = None) -> jax.Array:
  """``rows [T, H]`` (one per token) -> ``[L, C, H]`` slabs along ``handle``,
  by ``path``: ``"local"``, ``"fused"`` or ``"exchange"``. None: the plan's
  ``dispatch_row_path`` (the one-launch dispatch's rows alone: its fused row
  launch), of a plan whose rows cross as they are (FP8 plans:
  :func:`rows_to_slabs_fp8`); :func:`rows_to_fp8_slabs` passes the path of
  its wire rows of ``W`` bytes, which cross like any rows."""
  if path is None:
    if plan.wire_dtype is not None:
      raise ValueError(f"rows_to_slabs moves rows as they are, not on a {plan.wire_dtype} "
                       "wire; use rows_to_slabs_fp8 or rows_to_fp8_slabs")
    path = "fused" if plan.dispatch_row_path == "one_launch" else plan.dispatch_row_path
  hidden = rows.shape[-1]
  shape = receive_slabs.output_shape(handle, hidden)
  output_sources = receive_slabs.output_sources(handle)
  if path == "local":
    token_of_output_row = _lookup(handle.send_token.reshape(-1), output_sources, -1)
    return _local_pass(plan, _EXPAND_ROWS, rows, _token_member_pos(handle),
                       token_of_output_row).reshape(shape)
  if path == "fused":
    flat = _fused_on_cuda(
        "exchange_rows",
        functools.partial(peer_rows.dispatch_rows, axis_name=plan.axis_name, mesh=plan.mesh),
        lambda rows, *maps: _exchanged_rows_to_slabs(plan.on_all_to_all(), rows, handle),
        rows, handle.send_token, handle.send_slot, handle.recv_pos, output_sources)
    return flat.reshape(shape)
  if path == "exchange":
    return _exchanged_rows_to_slabs(plan, rows, handle).reshape(shape)
  raise ValueError(f"no row path {path!r} from rows to slabs")


def _exchanged_rows_to_slabs(plan: DispatchPlan, rows: jax.Array,
                             handle: RoutingHandle) -> jax.Array:
  """R > 1, unfused: ``expand_rows`` to ``[R, S, H]``, the exchange, ``expand_rows``
  to the flat output rows ``[L * C, H]``."""
  hidden = rows.shape[-1]
  send_rows = _local_pass(plan, _EXPAND_ROWS, rows, _send_positions(handle),
                          handle.send_token.reshape(-1))
  recv_rows = exchange(plan, send_rows.reshape(plan.ep_size, -1, hidden), "exchange_rows")
  return _local_pass(plan, _EXPAND_ROWS, recv_rows.reshape(-1, hidden),
                     handle.recv_pos.reshape(-1, handle.top_k),
                     receive_slabs.output_sources(handle))


def slabs_to_rows(plan: DispatchPlan, slab_values: jax.Array, handle: RoutingHandle) -> jax.Array:
  """``slab_values [L, C, H]`` -> ``[T, H]``: each token's sum over its kept
  rows, by ``plan.combine_row_path``."""
  hidden = slab_values.shape[-1]
  flat = slab_values.reshape(-1, hidden)
  path = plan.combine_row_path
  if path == "local":
    return _local_pass(plan, _GATHER_SUM_ROWS, flat, _token_member_pos(handle))
  if path == "fused":
    return _fused_on_cuda(
        "exchange_rows",
        functools.partial(peer_rows.combine_rows, axis_name=plan.axis_name, mesh=plan.mesh),
        lambda flat, *maps: _exchanged_slabs_to_rows(plan.on_all_to_all(), flat, handle),
        flat, handle.recv_pos, handle.send_slot)
  return _exchanged_slabs_to_rows(plan, flat, handle)


def _exchanged_slabs_to_rows(plan: DispatchPlan, flat: jax.Array,
                             handle: RoutingHandle) -> jax.Array:
  """R > 1, unfused: per received row the sum of its members (``gather_sum_rows``),
  the exchange, per token the sum over ranks: ``[L * C, H]`` -> ``[T, H]``."""
  hidden = flat.shape[-1]
  partial_sums = _local_pass(plan, _GATHER_SUM_ROWS, flat,
                             handle.recv_pos.reshape(-1, handle.top_k))
  returned = exchange(plan, partial_sums.reshape(plan.ep_size, -1, hidden), "exchange_rows")
  return _local_pass(plan, _GATHER_SUM_ROWS, returned.reshape(-1, hidden), _send_positions(handle))


def rows_to_slabs_fp8(plan: DispatchPlan, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """:func:`rows_to_slabs` with the rows on the wire in FP8: ``rows [T, H]``
  -> ``[L, C, H]`` in ``rows.dtype``.

  Each token is quantized once (``[W]`` uint8 wire rows: e4m3 codes and
  power-of-two per-128-channel scales, :mod:`~moe_ep.transport.fp8`); the
  wire rows cross in one exchange. One rank: quantize, then expand, so the
  slabs do not depend on ``R``.

  The receiving side depends on ``plan.fp8_slabs`` (a checkpoint name).
  Without one, each received row is dequantized straight into its slab rows
  (one fused pass), the quantize fused with the send expand, the wire rows
  crossing by either exchange's drop-in. With one, the receiver only expands
  the wire rows into FP8 slabs ``[L, C, W]`` (:func:`rows_to_fp8_slabs`: on
  the peer path one fused kernel quantizes, moves and places them), which
  carry the name ``"{checkpoint_name}.tokens"``, and the backend's ``dequantize_filled_rows``
  dequantizes them: a remat policy that saves the dispatch then keeps the
  FP8 slabs (about half the bf16 residual) and backward recomputes only the
  dequantize, never the exchange. The dequantize zeroes every slab row no
  member fills (the FP8 slabs' own padding may be unwritten). Both give
  bitwise the same slabs (the dequantize is exact before its one rounding)."""
  if plan.wire_dtype is None:
    raise ValueError("rows_to_slabs_fp8 needs a plan with wire_dtype='float8_e4m3fn'")
  hidden = rows.shape[-1]
  shape = receive_slabs.output_shape(handle, hidden)
  if plan.fp8_slabs:
    fp8_slabs = plan.name("tokens", rows_to_fp8_slabs(plan, rows, handle))
    return _local_pass(plan, _DEQUANTIZE_FILLED_ROWS, fp8_slabs.reshape(-1, fp8_slabs.shape[-1]),
                       receive_slabs.filled(handle), hidden=hidden,
                       dtype=rows.dtype).reshape(shape)
  output_sources = receive_slabs.output_sources(handle)
  if plan.dispatch_row_path == "local":
    wire = _local_pass(plan, _QUANTIZE_PACK_EXPAND, rows)
    targets = _token_member_pos(handle)
    sources = _lookup(handle.send_token.reshape(-1), output_sources, -1)
  else:
    wire = _exchanged_wire_rows(plan, rows, handle)
    targets, sources = handle.recv_pos.reshape(-1, handle.top_k), output_sources
  return _local_pass(plan, _UNPACK_DEQUANTIZE_EXPAND, wire, targets, sources, hidden=hidden,
                     dtype=rows.dtype).reshape(shape)


def rows_to_grouped_fp8(plan: DispatchPlan, rows: jax.Array, handle: RoutingHandle):
  """An FP8 dispatch into the grouped layout that also returns the rows as
  they crossed (``plan.fp8_rows``): ``rows [T, H]`` -> ``(grouped [M, H] in
  rows.dtype, (codes [M, H] float8_e4m3fn, scales [M, B] float32))``.

  The wire rows land as FP8 slabs (:func:`rows_to_fp8_slabs`, named
  ``"{checkpoint_name}.tokens"`` where the plan has a name); the codes and
  scales are their bytes unpacked (a copy, on every backend and exchange:
  no kernel), zero on rows no member fills, for the FP8 expert bank's first
  GEMM; the grouped rows are the backend's ``dequantize_filled_rows`` of
  them (bitwise those of :func:`rows_to_slabs_fp8`), which carry the
  tokens' gradient and which a consumer of the codes alone leaves unread
  (XLA drops the pass)."""
  if not plan.fp8_rows:
    raise ValueError("rows_to_grouped_fp8 needs the plan of an FP8 dispatch into the grouped "
                     "layout with fp8_rows=True (plan_dispatch)")
  hidden = rows.shape[-1]
  fp8_slabs = plan.name("tokens", rows_to_fp8_slabs(plan, rows, handle))
  wire = fp8_slabs.reshape(-1, fp8_slabs.shape[-1])
  filled = receive_slabs.filled(handle)
  grouped = _local_pass(plan, _DEQUANTIZE_FILLED_ROWS, wire, filled, hidden=hidden,
                        dtype=rows.dtype)
  return (grouped.reshape(receive_slabs.output_shape(handle, hidden)),
          fp8.unpack_filled_wire(wire, hidden, filled))


def rows_to_fp8_slabs(plan: DispatchPlan, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """``rows [T, H]`` -> FP8 slabs ``[L, C, W]`` uint8 (the wire rows of the
  slab rows; padding rows all-zero bytes, or unwritten where the peer kernel
  quantizes: read them only through a backend's ``dequantize_filled_rows``,
  :func:`moe_ep.transport.xla.dequantize_filled_rows`). On the peer path one
  fused kernel quantizes each token as it sends it or places it (H % 16 ==
  0), or else, where the fused kernels take rows of ``W`` bytes, each token
  is quantized once and its wire row moved like a bf16 row
  (:func:`rows_to_slabs`); elsewhere the quantize is fused with the send
  expand, the wire rows cross by the exchange's drop-in and are expanded
  into the slabs. The path is ``plan.dispatch_row_path`` of a plan with
  :attr:`~moe_ep.transport.plan.DispatchPlan.fp8_slabs` (a checkpoint name)."""
  if not plan.fp8_slabs:
    raise ValueError("rows_to_fp8_slabs needs the plan of a dispatch that lands FP8 slabs: "
                     "wire_dtype='float8_e4m3fn' and a checkpoint_name (plan_dispatch)")
  width = fp8.wire_bytes(rows.shape[-1])
  shape = receive_slabs.output_shape(handle, width)
  path = plan.dispatch_row_path
  if path == "fused":
    flat = _fused_on_cuda(
        "exchange_rows",
        functools.partial(peer_rows.dispatch_rows, axis_name=plan.axis_name, mesh=plan.mesh,
                          wire_dtype=plan.wire_dtype),
        lambda rows, *maps: rows_to_fp8_slabs(plan.on_all_to_all(), rows, handle).reshape(
            -1, width),
        rows, handle.send_token, handle.send_slot, handle.recv_pos,
        receive_slabs.output_sources(handle))
    return flat.reshape(shape)
  if path in ("local", "fused_wire"):
    return rows_to_slabs(plan, _local_pass(plan, _QUANTIZE_PACK_EXPAND, rows), handle,
                         path="local" if path == "local" else "fused")
  wire = _exchanged_wire_rows(plan, rows, handle)
  return _local_pass(plan, _EXPAND_ROWS, wire, handle.recv_pos.reshape(-1, handle.top_k),
                     receive_slabs.output_sources(handle)).reshape(shape)


def _exchanged_wire_rows(plan: DispatchPlan, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """R > 1: each token quantized once, fused with its expand into the send
  rows, and the exchange: ``rows [T, H]`` -> received wire rows ``[R * S,
  W]`` uint8."""
  send_wire = _local_pass(plan, _QUANTIZE_PACK_EXPAND, rows, _send_positions(handle),
                          handle.send_token.reshape(-1))
  width = send_wire.shape[-1]
  return exchange(plan, send_wire.reshape(plan.ep_size, -1, width),
                  "exchange_rows").reshape(-1, width)


def weights_to_routes(plan: DispatchPlan, slab_values: jax.Array,
                      handle: RoutingHandle) -> jax.Array:
  """``[L, C]`` per-output-row float32 values -> ``[T, K]`` per route (0 if
  dropped). Small: plain jnp on every backend."""
  top_k = handle.top_k
  per_member = _lookup(slab_values.reshape(-1), handle.recv_pos, 0.0)  # [R, S, K]
  if plan.ep_size > 1:
    per_member = exchange(plan, per_member, "exchange_weights")
  member = jnp.where(handle.route_slot >= 0,
                     handle.route_slot * top_k + jnp.arange(top_k, dtype=jnp.int32), -1)
  return _lookup(per_member.reshape(-1), member, 0.0)


# --- routing: the metadata exchange and the receiver's layout ------------------


def _slab_sizes(plan: DispatchPlan, top_k: int) -> dict:
  return dict(top_k=top_k, num_local_experts=plan.num_local_experts,
              expert_capacity=plan.expert_capacity)


def _slab_layout(plan: DispatchPlan, recv_meta, top_k: int):
  """The receiver's slab layout of the received metadata ``[R, W]``:
  ``(recv_pos [R, S, K], slab_row [L, C], slab_weights [L, C], counts [L],
  demand [L])``."""
  return _local_pass(plan, _SLAB_LAYOUT, recv_meta, **_slab_sizes(plan, top_k))


def _route(plan: DispatchPlan, topk_idx, topk_weights):
  """The sender's routing: ``(send_slot, send_token, route_slot, meta)``."""
  return _local_pass(plan, _ROUTE, topk_idx, topk_weights.astype(jnp.float32),
                     num_experts=plan.num_experts, ep_size=plan.ep_size,
                     send_capacity=plan.send_capacity)


def routing(plan: DispatchPlan, topk_idx, topk_weights):
  """Dispatch's routing: ``(handle, slab weights [L, C], counts [L], demand
  [L])`` from the ids and weights, with the metadata exchange
  (``plan.meta_path``)."""
  if plan.meta_path is None:
    raise ValueError("routing needs a dispatch's plan (plan_dispatch); a combine's routes nothing")
  send_slot, send_token, route_slot, meta = _route(plan, topk_idx, topk_weights)
  top_k = topk_idx.shape[1]
  if plan.meta_path == "fused_layout":  # decode: the exchange and the layout in one launch
    laid_out = _fused_on_cuda(
        "exchange_meta",
        functools.partial(fused_layout.slab_layout, **_slab_sizes(plan, top_k),
                          axis_name=plan.axis_name, mesh=plan.mesh),
        lambda meta: _slab_layout(plan.on_all_to_all(),
                                  exchange(plan.on_all_to_all(), meta, "exchange_meta"), top_k),
        meta)
  else:
    if plan.meta_path == "exchange":
      meta = exchange(plan, meta, "exchange_meta")
    laid_out = _slab_layout(plan, meta, top_k)
  recv_pos, slab_row, slab_weights, counts, demand = laid_out
  if plan.grouped_rows is not None:
    recv_pos, slab_row, slab_weights, counts = receive_grouped.from_slabs(
        recv_pos, slab_row, slab_weights, counts, plan.grouped_rows, plan.group_align)
  return (RoutingHandle(send_slot, send_token, route_slot, recv_pos, slab_row), slab_weights,
          counts, demand)


def dispatch_in_one_launch(plan: DispatchPlan, tokens, topk_idx, topk_weights):
  """Decode sizes on the peer path (``plan.dispatch_row_path == "one_launch"``):
  route, then one launch for the metadata exchange, the layout and the rows
  (:func:`~moe_ep.transport.peer.dispatch_layout.dispatch_with_layout`);
  ``(handle, slabs [L, C, H], slab weights, counts, demand)``."""
  send_slot, send_token, route_slot, meta = _route(plan, topk_idx, topk_weights)
  top_k = topk_idx.shape[1]

  def all_to_all_path(rows, meta, *maps):  # the maps: send_token, send_slot, as outside
    on_all_to_all = plan.on_all_to_all()
    recv_pos, slab_row, *rest = _slab_layout(
        on_all_to_all, exchange(on_all_to_all, meta, "exchange_meta"), top_k)
    handle = RoutingHandle(send_slot, send_token, route_slot, recv_pos, slab_row)
    return (_exchanged_rows_to_slabs(on_all_to_all, rows, handle), recv_pos, slab_row, *rest)

  flat, recv_pos, slab_row, slab_weights, counts, demand = _fused_on_cuda(
      "exchange_rows",
      functools.partial(dispatch_layout.dispatch_with_layout, **_slab_sizes(plan, top_k),
                        axis_name=plan.axis_name, mesh=plan.mesh),
      all_to_all_path, tokens, meta, send_token, send_slot)
  handle = RoutingHandle(send_slot, send_token, route_slot, recv_pos, slab_row)
  return (handle, flat.reshape(receive_slabs.output_shape(handle, tokens.shape[-1])), slab_weights,
          counts, demand)

