"""Dispatch and combine: move token rows to the experts that own them and back.

Both are ``custom_vjp`` operations whose backward passes read only the routing
handle (plain int32 data), so remat can save it and backward never re-runs the
routing or the forward exchange. The local passes come from a backend
(:mod:`~moe_ep.transport.xla` or :mod:`~moe_ep.transport.cupy`); the exchanges
over the EP mesh axis are issued here, once, by one of two paths with bitwise
the same results: XLA's ``all_to_all``, or direct NVLink stores into the
other GPUs' memory (:mod:`~moe_ep.transport.peer`), which also fuses the row
exchanges with the expands and sums around them, and at decode sizes the
metadata exchange with the slab layout (``exchange=`` picks).
With ``wire_dtype="float8_e4m3fn"`` the dispatch rows travel as FP8
(:mod:`~moe_ep.transport.fp8`).

Data flow of a forward dispatch on each rank (see ``layout.py`` for the names)::

  route(topk_idx, w)      -> send_slot, send_token, route_slot, meta [R, 2SK+L]
  all_to_all(meta)        -> recv_meta                               (small exchange)
  slab_layout(recv_meta)  -> recv_pos, slab_row, weights, counts, demand
  expand_rows(tokens)     -> send_rows [R, S, H]   (each token once per rank)
  all_to_all(send_rows)   -> recv_rows [R, S, H]                     (the row exchange)
  expand_rows(recv_rows)  -> slabs [L, C, H]       (each row once per local expert)

Combine runs the row path backwards with sums (``gather_sum_rows``): per
received row, the sum of its members' slab rows (partial sums reduced before
they travel), one exchange, then per token the sum over destination ranks.
With one rank the two passes on each side compose into one and nothing is
exchanged. Every row movement has its map in both directions in the handle,
so a backend can read each input row once (``expand_rows``) or write each
output row once (``gather_sum_rows``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name as _attach_name

from moe_ep.transport import backend as _backend
from moe_ep.transport.grouped_layout import ROW_TILE, grouped_from_slabs, grouped_rows_for
from moe_ep.transport.layout import (
    Dispatched,
    RoutingHandle,
    check_experts,
    check_num_tokens,
    expert_capacity_for,
    positive_int,
    send_capacity_for,
)

__all__ = [
    "Dispatched",
    "RoutingHandle",
    "combine",
    "dispatch",
    "expert_capacity_for",
    "grouped_rows_for",
    "send_capacity_for",
    "CHECKPOINT_FIELDS",
    "EXCHANGES",
    "NAMED_SCOPES",
]

CHECKPOINT_FIELDS = ("tokens", "weights", "handle", "counts")

# Every exchange is issued under one of these scopes, which reach the compiled
# HLO's op_name metadata: tests and profiles tell the four passes apart by them.
NAMED_SCOPES = {
    "dispatch": "moe_dispatch_fwd",
    "combine": "moe_combine_fwd",
    "dispatch_bwd": "moe_dispatch_bwd",
    "combine_bwd": "moe_combine_bwd",
}


def _ep_size(axis_name, caller: str) -> int:
  if axis_name is None:
    return 1
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"{caller}(axis_name={axis_name!r}): no mapped axis of that name here; call {caller} "
        f"inside jax.shard_map over the {axis_name!r} mesh axis (or pass axis_name=None for "
        f"one rank)") from None


EXCHANGES = ("auto", "all_to_all", "peer")


def _peer():
  from moe_ep.transport import peer  # imports CuPy only when a peer exchange runs
  return peer


def _fp8():
  from moe_ep.transport import fp8  # imports this package: a module-level import would cycle
  return fp8


def _exchange(spec: "_Spec", x: jax.Array, what: str) -> jax.Array:
  """``all_to_all`` over the leading [R] axis: row d goes to rank d, and the
  result's row src is what rank src sent here; by direct stores into the
  peers' memory when ``spec.exchange == "peer"`` (bitwise the same result).
  ``what`` names the exchange inside the enclosing pass's scope
  (``moe_dispatch_fwd/exchange_rows``)."""
  if spec.exchange == "peer":
    return _peer().exchange(x, spec.axis_name, spec.mesh, what)
  with jax.named_scope(what):
    return jax.lax.all_to_all(x, spec.axis_name, 0, 0, tiled=True)


def _resolve_exchange(exchange: str, backend: str, axis_name, ep_size: int, mesh) -> str:
  """The exchange one dispatch/combine uses: ``"peer"`` or ``"all_to_all"``.

  ``"auto"`` takes the peer path where it runs: more than one rank, the
  kernels' backend (not ``"xla"``), a ``mesh`` given, and every pair of GPUs
  of each EP group reaching the other by peer access on one host
  (:func:`moe_ep.transport.peer.supported`); ``"peer"`` insists and says why
  not."""
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange={exchange!r} is not one of {EXCHANGES}")
  if ep_size == 1 or exchange == "all_to_all":
    return "all_to_all"
  if exchange == "auto" and (backend == "xla" or mesh is None):
    return "all_to_all"
  if mesh is None:
    raise ValueError(f"exchange='peer' needs mesh=, the mesh of the enclosing shard_map over "
                     f"axis {axis_name!r}")
  reason = _peer().unsupported_reason(mesh, axis_name)
  if reason is None:
    return "peer"
  if exchange == "peer":
    raise ValueError(f"exchange='peer' cannot run on this mesh: {reason}; use "
                     "exchange='auto' or 'all_to_all'")
  return "all_to_all"


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Static arguments of one dispatch/combine pair."""

  num_experts: int
  ep_size: int
  expert_capacity: int
  send_capacity: int
  axis_name: object
  backend: str
  checkpoint_name: str | None = None
  weight_dtype: str = "float32"
  exchange: str = "all_to_all"  # resolved: "all_to_all" or "peer"
  mesh: object = None
  wire_dtype: str | None = None  # dispatch rows on the wire: None (as-is) or "float8_e4m3fn"
  grouped_rows: int | None = None  # None: [L, C] slabs; M: the grouped layout's rows

  @property
  def ops(self):
    return _backend.resolve(self.backend)


# --- the two row paths, shared by the forward and backward rules ------------


def _lookup(table: jax.Array, index: jax.Array, fill) -> jax.Array:
  """``table[index]`` for the small int/float tables of the handle side;
  ``fill`` where ``index`` is out of range (-1)."""
  valid = (index >= 0) & (index < table.shape[0])
  rows = table[jnp.where(valid, index, 0)]
  return jnp.where(valid.reshape(valid.shape + (1,) * (table.ndim - 1)), rows, fill)


def _wire_rows(handle: RoutingHandle) -> jax.Array:
  """``[T, R]`` flat send-buffer row ``d * S + slot`` of each (token, rank), or -1."""
  ranks = jnp.arange(handle.ep_size, dtype=jnp.int32)
  return jnp.where(handle.send_slot >= 0, ranks * handle.send_capacity + handle.send_slot, -1)


def _token_member_pos(handle: RoutingHandle) -> jax.Array:
  """One rank only: ``[T, K]`` slab positions of each token's members,
  composed through its single wire slot."""
  return _lookup(handle.recv_pos.reshape(-1, handle.top_k), handle.send_slot[:, 0], -1)


def _fused_peer_rows(spec: _Spec, dtype, hidden: int, top_k: int, sums: bool,
                     wire_dtype: str | None = None) -> bool:
  """Whether the peer exchange moves these rows with its fused row kernels
  (:func:`~moe_ep.transport.peer.dispatch_rows` / ``combine_rows``) rather
  than the drop-in exchange between the local row passes (``wire_dtype``:
  quantizing them on the way)."""
  return spec.exchange == "peer" and _peer().fused_rows_problem(
      dtype, hidden, spec.ep_size, top_k, sums=sums, wire_dtype=wire_dtype) is None


def _on_all_to_all(spec: _Spec) -> _Spec:
  return dataclasses.replace(spec, exchange="all_to_all", mesh=None)


def _rows_to_slabs(spec: _Spec, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """``rows [T, H]`` (one per token) -> ``[L, C, H]`` slabs along ``handle``."""
  ops = spec.ops
  hidden = rows.shape[-1]
  slab_shape = handle.slab_row.shape + (hidden,)
  slab_row = handle.slab_row.reshape(-1)
  if spec.ep_size == 1:
    token_of_slab_row = _lookup(handle.send_token.reshape(-1), slab_row, -1)
    return ops.expand_rows(rows, _token_member_pos(handle), token_of_slab_row).reshape(slab_shape)
  if _fused_peer_rows(spec, rows.dtype, hidden, handle.top_k, sums=False):
    slabs = _peer().dispatch_rows(
        rows, handle.send_token, handle.send_slot, handle.recv_pos, slab_row,
        axis_name=spec.axis_name, mesh=spec.mesh,
        all_to_all_path=lambda r: _exchanged_rows_to_slabs(_on_all_to_all(spec), r, handle))
    return slabs.reshape(slab_shape)
  return _exchanged_rows_to_slabs(spec, rows, handle).reshape(slab_shape)


def _exchanged_rows_to_slabs(spec: _Spec, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """R > 1, unfused: ``expand_rows`` to ``[R, S, H]``, the exchange, ``expand_rows``
  to the flat slabs ``[L * C, H]``."""
  ops = spec.ops
  hidden = rows.shape[-1]
  send_rows = ops.expand_rows(rows, _wire_rows(handle), handle.send_token.reshape(-1))
  recv_rows = _exchange(spec, send_rows.reshape(spec.ep_size, -1, hidden), "exchange_rows")
  return ops.expand_rows(recv_rows.reshape(-1, hidden),
                         handle.recv_pos.reshape(-1, handle.top_k), handle.slab_row.reshape(-1))


def _slabs_to_rows(spec: _Spec, slabs: jax.Array, handle: RoutingHandle) -> jax.Array:
  """``slabs [L, C, H]`` -> ``[T, H]``: each token's sum over its kept rows."""
  ops = spec.ops
  hidden = slabs.shape[-1]
  flat_slabs = slabs.reshape(-1, hidden)
  if spec.ep_size == 1:
    return ops.gather_sum_rows(flat_slabs, _token_member_pos(handle))
  if _fused_peer_rows(spec, slabs.dtype, hidden, handle.top_k, sums=True):
    return _peer().combine_rows(
        flat_slabs, handle.recv_pos, handle.send_slot, axis_name=spec.axis_name,
        mesh=spec.mesh,
        all_to_all_path=lambda s: _exchanged_slabs_to_rows(_on_all_to_all(spec), s, handle))
  return _exchanged_slabs_to_rows(spec, flat_slabs, handle)


def _exchanged_slabs_to_rows(spec: _Spec, flat_slabs: jax.Array,
                             handle: RoutingHandle) -> jax.Array:
  """R > 1, unfused: per received row the sum of its members (``gather_sum_rows``),
  the exchange, per token the sum over ranks: ``[L * C, H]`` -> ``[T, H]``."""
  ops = spec.ops
  hidden = flat_slabs.shape[-1]
  partial_sums = ops.gather_sum_rows(flat_slabs, handle.recv_pos.reshape(-1, handle.top_k))
  returned = _exchange(spec, partial_sums.reshape(spec.ep_size, -1, hidden), "exchange_rows")
  return ops.gather_sum_rows(returned.reshape(-1, hidden), _wire_rows(handle))


def _rows_to_slabs_fp8(spec: _Spec, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """:func:`_rows_to_slabs` with the rows on the wire in FP8: ``rows [T, H]``
  -> ``[L, C, H]`` in ``rows.dtype``.

  Each token is quantized once (``[W]`` uint8 wire rows: e4m3 codes and
  power-of-two per-128-channel scales, :mod:`~moe_ep.transport.fp8`); the
  wire rows cross in one exchange. One rank: quantize, then expand, so the
  slabs do not depend on ``R``.

  The receiving side depends on ``spec.checkpoint_name``. Without one, each
  received row is dequantized straight into its slab rows (one fused pass),
  the quantize fused with the send expand, the wire rows crossing by either
  exchange's drop-in. With one, the receiver only expands the wire rows into
  FP8 slabs ``[L, C, W]`` (:func:`_rows_to_fp8_slabs`: on the peer path one
  fused kernel quantizes, moves and places them), which carry the name
  ``"{checkpoint_name}.tokens"``, and the backend's ``dequantize_filled_rows``
  dequantizes them: a remat policy
  that saves the dispatch then keeps the FP8 slabs (about half the bf16
  residual) and backward recomputes only the dequantize, never the exchange.
  The dequantize zeroes every slab row no member fills (the FP8 slabs' own
  padding may be unwritten). Both give bitwise the same slabs (the
  dequantize is exact before its one rounding)."""
  hidden = rows.shape[-1]
  slab_shape = handle.slab_row.shape + (hidden,)
  if spec.checkpoint_name is not None:
    fp8_slabs = _name(spec, "tokens", _rows_to_fp8_slabs(spec, rows, handle))
    slab_row = handle.slab_row.reshape(-1)
    filled = (slab_row >= 0) & (slab_row < handle.send_token.size)
    return spec.ops.dequantize_filled_rows(fp8_slabs.reshape(-1, fp8_slabs.shape[-1]), filled,
                                           hidden=hidden, dtype=rows.dtype).reshape(slab_shape)
  ops = spec.ops
  slab_row = handle.slab_row.reshape(-1)
  if spec.ep_size == 1:
    wire = ops.quantize_pack_expand(rows)
    targets = _token_member_pos(handle)
    sources = _lookup(handle.send_token.reshape(-1), slab_row, -1)
  else:
    wire = _exchanged_wire_rows(spec, rows, handle)
    targets, sources = handle.recv_pos.reshape(-1, handle.top_k), slab_row
  slabs = ops.unpack_dequantize_expand(wire, targets, sources, hidden=hidden, dtype=rows.dtype)
  return slabs.reshape(slab_shape)


def _rows_to_fp8_slabs(spec: _Spec, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """``rows [T, H]`` -> FP8 slabs ``[L, C, W]`` uint8 (the wire rows of the
  slab rows; padding rows all-zero bytes, or unwritten where the peer kernel
  quantizes: read them only through a backend's ``dequantize_filled_rows``,
  :func:`moe_ep.transport.xla.dequantize_filled_rows`). On the peer path one fused
  kernel quantizes each token as it sends it or places it (H % 16 == 0), or
  else, where the fused kernels take rows of ``W`` bytes, each token is
  quantized once and its wire row moved like a bf16 row
  (:func:`_rows_to_slabs`); elsewhere the quantize is fused with the send
  expand, the wire rows cross by the exchange's drop-in and are expanded
  into the slabs."""
  ops = spec.ops
  width = _fp8().wire_bytes(rows.shape[-1])
  slab_shape = handle.slab_row.shape + (width,)
  if spec.ep_size > 1 and _fused_peer_rows(spec, rows.dtype, rows.shape[-1], handle.top_k,
                                           sums=False, wire_dtype=WIRE_DTYPES[0]):
    slabs = _peer().dispatch_rows(
        rows, handle.send_token, handle.send_slot, handle.recv_pos, handle.slab_row.reshape(-1),
        axis_name=spec.axis_name, mesh=spec.mesh, wire_dtype=WIRE_DTYPES[0],
        all_to_all_path=lambda r: _rows_to_fp8_slabs(_on_all_to_all(spec), r, handle).reshape(
            -1, width))
    return slabs.reshape(slab_shape)
  if spec.ep_size == 1 or _fused_peer_rows(spec, jnp.uint8, width, handle.top_k, sums=False):
    return _rows_to_slabs(spec, ops.quantize_pack_expand(rows), handle)
  wire = _exchanged_wire_rows(spec, rows, handle)
  return ops.expand_rows(wire, handle.recv_pos.reshape(-1, handle.top_k),
                         handle.slab_row.reshape(-1)).reshape(slab_shape)


def _exchanged_wire_rows(spec: _Spec, rows: jax.Array, handle: RoutingHandle) -> jax.Array:
  """R > 1: each token quantized once, fused with its expand into the send
  rows, and the exchange: ``rows [T, H]`` -> received wire rows ``[R * S,
  W]`` uint8."""
  send_wire = spec.ops.quantize_pack_expand(rows, _wire_rows(handle),
                                            handle.send_token.reshape(-1))
  width = send_wire.shape[-1]
  return _exchange(spec, send_wire.reshape(spec.ep_size, -1, width),
                   "exchange_rows").reshape(-1, width)


def _weights_to_routes(spec: _Spec, slab_values: jax.Array, handle: RoutingHandle) -> jax.Array:
  """``[L, C]`` per-slab-row float32 values -> ``[T, K]`` per route (0 if
  dropped). Small: plain jnp on every backend."""
  top_k = handle.top_k
  per_member = _lookup(slab_values.reshape(-1), handle.recv_pos, 0.0)  # [R, S, K]
  if spec.ep_size > 1:
    per_member = _exchange(spec, per_member, "exchange_weights")
  member = jnp.where(handle.route_slot >= 0,
                     handle.route_slot * top_k + jnp.arange(top_k, dtype=jnp.int32), -1)
  return _lookup(per_member.reshape(-1), member, 0.0)


# --- dispatch ----------------------------------------------------------------


def _name(spec: _Spec, field: str, value):
  if spec.checkpoint_name is None:
    return value
  return _attach_name(value, f"{spec.checkpoint_name}.{field}")


def _layout_sizes(spec: _Spec, top_k: int) -> dict:
  return dict(top_k=top_k, num_local_experts=spec.num_experts // spec.ep_size,
              expert_capacity=spec.expert_capacity)


def _exchanged_layout(spec: _Spec, meta, top_k: int):
  """The metadata exchange (R > 1), then the receiver's slab layout."""
  if spec.ep_size > 1:
    meta = _exchange(spec, meta, "exchange_meta")
  return spec.ops.slab_layout(meta, **_layout_sizes(spec, top_k))


def _routing(spec: _Spec, topk_idx, topk_weights):
  """Dispatch's routing: ``(handle, slab weights [L, C], counts [L], demand
  [L])`` from the ids and weights, with the metadata exchange."""
  send_slot, send_token, route_slot, meta = _route(spec, topk_idx, topk_weights)
  top_k = topk_idx.shape[1]
  sizes = _layout_sizes(spec, top_k)
  if spec.exchange == "peer" and _peer().fused_layout_fits(
      spec.ep_size, spec.send_capacity, top_k, sizes["num_local_experts"],
      spec.expert_capacity):  # decode: the exchange and the layout in one launch
    layout = _peer().slab_layout(
        meta, **sizes, axis_name=spec.axis_name, mesh=spec.mesh,
        all_to_all_path=lambda m: _exchanged_layout(_on_all_to_all(spec), m, top_k))
  else:
    layout = _exchanged_layout(spec, meta, top_k)
  recv_pos, slab_row, slab_weights, counts, demand = layout
  if spec.grouped_rows is not None:
    recv_pos, slab_row, slab_weights, counts = grouped_from_slabs(
        recv_pos, slab_row, slab_weights, counts, spec.grouped_rows)
  return (RoutingHandle(send_slot, send_token, route_slot, recv_pos, slab_row), slab_weights,
          counts, demand)


def _route(spec: _Spec, topk_idx, topk_weights):
  """The sender's routing: ``(send_slot, send_token, route_slot, meta)``."""
  return spec.ops.route(topk_idx, topk_weights.astype(jnp.float32), num_experts=spec.num_experts,
                        ep_size=spec.ep_size, send_capacity=spec.send_capacity)


def _dispatch_with_layout(spec: _Spec, tokens, topk_idx, topk_weights):
  """Decode sizes on the peer path: route, then one launch for the metadata
  exchange, the slab layout and the rows (``peer.dispatch_with_layout``);
  ``(handle, slabs [L, C, H], slab weights, counts, demand)``."""
  send_slot, send_token, route_slot, meta = _route(spec, topk_idx, topk_weights)
  top_k = topk_idx.shape[1]
  sizes = _layout_sizes(spec, top_k)

  def all_to_all_path(rows, meta):
    on_all_to_all = _on_all_to_all(spec)
    recv_pos, slab_row, *rest = _exchanged_layout(on_all_to_all, meta, top_k)
    handle = RoutingHandle(send_slot, send_token, route_slot, recv_pos, slab_row)
    slabs = _exchanged_rows_to_slabs(on_all_to_all, rows, handle)
    return (slabs, recv_pos, slab_row, *rest)

  slabs, recv_pos, slab_row, slab_weights, counts, demand = _peer().dispatch_with_layout(
      tokens, meta, send_token, send_slot, **sizes, axis_name=spec.axis_name, mesh=spec.mesh,
      all_to_all_path=all_to_all_path)
  handle = RoutingHandle(send_slot, send_token, route_slot, recv_pos, slab_row)
  return handle, slabs.reshape(slab_row.shape + (tokens.shape[-1],)), slab_weights, counts, demand


def _dispatch_forward(spec: _Spec, tokens, topk_idx, topk_weights) -> Dispatched:
  with jax.named_scope(NAMED_SCOPES["dispatch"]):
    if (spec.exchange == "peer" and not spec.wire_dtype and spec.grouped_rows is None
        and _peer().dispatch_layout_enabled()
        and _peer().dispatch_layout_fits(tokens.dtype, tokens.shape[-1], spec.ep_size,
                                         spec.send_capacity, topk_idx.shape[1],
                                         spec.num_experts // spec.ep_size,
                                         spec.expert_capacity)):
      handle, slabs, slab_weights, counts, demand = _dispatch_with_layout(
          spec, tokens, topk_idx, topk_weights)
    else:
      handle, slab_weights, counts, demand = _routing(spec, topk_idx, topk_weights)
      slabs = (_rows_to_slabs_fp8 if spec.wire_dtype else _rows_to_slabs)(spec, tokens, handle)
  # Names go on the outputs here, inside the forward rule, so they also mark
  # the residual (the handle) that the backward rule reads.
  # The FP8 path names its FP8 slabs (the smaller residual) itself.
  return Dispatched(
      tokens=slabs if spec.wire_dtype else _name(spec, "tokens", slabs),
      weights=_name(spec, "weights", slab_weights),
      handle=_name(spec, "handle", handle),
      counts=_name(spec, "counts", counts),
      demand=demand,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(spec, tokens, topk_idx, topk_weights):
  return _dispatch_forward(spec, tokens, topk_idx, topk_weights)


def _dispatch_fwd(spec, tokens, topk_idx, topk_weights):
  out = _dispatch_forward(spec, tokens, topk_idx, topk_weights)
  return out, out.handle


def _dispatch_bwd(spec, handle, grads: Dispatched):
  with jax.named_scope(NAMED_SCOPES["dispatch_bwd"]):
    token_grad = _slabs_to_rows(spec, grads.tokens, handle)
    weight_grad = _weights_to_routes(spec, grads.weights.astype(jnp.float32), handle)
  # Slabs carry the tokens' dtype, so grads.tokens has it too.
  return token_grad.astype(grads.tokens.dtype), None, weight_grad.astype(spec.weight_dtype)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _check_rank(name: str, value, rank: int, shape_doc: str) -> None:
  if value.ndim != rank:
    raise ValueError(f"{name} must be {shape_doc} (rank {rank}); got shape {value.shape}")


def _valid_ids(topk_idx: jax.Array, num_experts: int) -> jax.Array:
  """``[T, K]`` int32 ids with every id outside ``[0, E)`` set to -1. The range
  test runs in the input's dtype, before narrowing: an int64 id of 2**32 + 1
  must not wrap onto expert 1. Narrow types are widened first, where ``E``
  itself would not fit (int8 ids against 300 experts)."""
  if jnp.iinfo(topk_idx.dtype).bits < 32:
    topk_idx = topk_idx.astype(jnp.int32)
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  return jnp.where(valid, topk_idx.astype(jnp.int32), -1)


def _merge_duplicate_routes(topk_idx: jax.Array, topk_weights: jax.Array):
  """Merges repeated ids inside one token's top-k into one route.

  The first occurrence of an id keeps it, with the sum of the weights of all
  its occurrences; later ones become -1. The dropless bound ``R * T`` counts
  one row per (token, expert), so a repeat must not take a second row. Plain
  jnp, outside the custom_vjp, so each repeat's weight gets the gradient of
  the merged route (the same expert output, as if it were routed on its own).

  Args:
    topk_idx: ``[T, K]`` int32, -1 where not routed.
    topk_weights: ``[T, K]`` any float dtype.

  Returns:
    ``(topk_idx [T, K] int32, topk_weights [T, K] float32)``; equal to the
    inputs (the weights cast to float32) where a token has no repeats; a
    merged weight sums its occurrences in k order.
  """
  # Column by column (K is static): all elementwise, which XLA fuses whole,
  # rather than reductions over a [T, K, K] comparison.
  top_k = topk_idx.shape[1]
  ids = [topk_idx[:, k] for k in range(top_k)]
  weights = [w for w in topk_weights.astype(jnp.float32).T]
  merged_ids, merged_weights = [], []
  for k in range(top_k):
    same = [(ids[j] == ids[k]) & (ids[k] >= 0) for j in range(top_k)]
    repeat = functools.reduce(jnp.logical_or, same[:k], jnp.zeros_like(same[k]))
    shared = functools.reduce(jnp.logical_or, same[:k] + same[k + 1:], jnp.zeros_like(same[k]))
    summed = jnp.zeros_like(weights[k])
    for j in range(top_k):
      # where, not a product: an inf weight must not turn the others' zeros into NaN.
      summed = summed + jnp.where(same[j], weights[j], 0.0)
    merged_ids.append(jnp.where(repeat, -1, ids[k]))
    merged_weights.append(jnp.where(shared, summed, weights[k]))
  return jnp.stack(merged_ids, axis=1), jnp.stack(merged_weights, axis=1)


WIRE_DTYPES = ("float8_e4m3fn",)
_FP8_TOKEN_DTYPES = ("float32", "bfloat16", "float16")


def check_wire_dtype(wire_dtype, name: str = "wire_dtype") -> str | None:
  """``wire_dtype`` as None or its name in :data:`WIRE_DTYPES` (a dtype
  object is read by its name); ValueError naming ``name`` otherwise, or where
  this JAX has no ``jnp.float8_e4m3fn``."""
  if wire_dtype is None:
    return None
  dtype_name = wire_dtype if isinstance(wire_dtype, str) else getattr(
      wire_dtype, "__name__", getattr(wire_dtype, "name", None))
  if dtype_name not in WIRE_DTYPES:
    raise ValueError(f"{name}={wire_dtype!r} must be None or one of {WIRE_DTYPES}")
  if not hasattr(jnp, dtype_name):
    raise ValueError(f"{name}={dtype_name!r} needs a JAX with jnp.{dtype_name}; "
                     f"jax {jax.__version__} has none: upgrade JAX or set {name}=None")
  return dtype_name


def dispatch(tokens: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, *,
             num_experts: int, expert_capacity: int, axis_name=None,
             send_capacity: int | None = None, checkpoint_name: str | None = None,
             backend: str = "auto", exchange: str = "auto", mesh=None,
             wire_dtype: str | None = None, grouped_rows: int | None = None) -> Dispatched:
  """Sends each token's rows to the experts it is routed to.

  Call it per rank inside ``shard_map`` over the EP mesh axis ``axis_name``
  (size ``R``); with ``axis_name=None`` there is one rank and no collective.

  Duplicate ids in one token's top-k are merged into one route with the
  summed weight; demand/counts count it once (the gradient of each duplicate's
  weight is that route's, as if it had been routed separately).

  Args:
    tokens: ``[T, H]`` this rank's tokens, ``T >= 1``.
    topk_idx: ``[T, K]`` integer global expert ids (any integer dtype); ids
      outside ``[0, num_experts)`` mean "not routed", also int64 ids beyond
      the int32 range.
    topk_weights: ``[T, K]`` floating routing weights (differentiable).
    num_experts: ``E``; rank ``r`` owns experts ``[r*L, (r+1)*L)``, ``L = E // R``.
    expert_capacity: ``C`` rows per expert slab; a slab keeps its first ``C``
      rows in (source rank, source token, k) order and drops the rest. Values
      above the dropless bound (``expert_capacity_for`` with
      ``capacity_factor=None``, ``R * T`` rounded up) are clamped to it.
    axis_name: the EP mesh axis (call inside ``jax.shard_map`` over it), or None.
    send_capacity: ``S`` rows per destination chunk (None: ``T``, never drops;
      values above ``T`` are clamped to ``T``).
    checkpoint_name: when set, the outputs and the residual the backward keeps
      are named ``f"{checkpoint_name}.{field}"`` for ``field`` in
      :data:`CHECKPOINT_FIELDS`, so a remat policy can save them.
    backend: ``"auto"``, ``"xla"`` or ``"cupy"``: the local passes.
    exchange: how rows cross between ranks: ``"all_to_all"`` (XLA's
      collective), ``"peer"`` (direct NVLink stores into the other GPUs'
      memory, :mod:`moe_ep.transport.peer`; needs ``mesh``) or ``"auto"``
      (peer wherever it runs: see ``_resolve_exchange``). Same results,
      bitwise, either way.
    mesh: the ``jax.sharding.Mesh`` of the enclosing ``shard_map`` (only the
      peer exchange needs it).
    wire_dtype: None (rows travel in ``tokens.dtype``) or ``"float8_e4m3fn"``:
      each token is quantized once on its rank (e4m3 codes, one power-of-two
      float32 scale per 128 channels, :mod:`~moe_ep.transport.fp8`), its
      codes and scales cross as one uint8 row (about half the bytes of
      bfloat16), and the receiver dequantizes them into the slabs, which
      keep ``tokens.dtype``. ``tokens`` must then be float32, bfloat16 or
      float16. With the CuPy kernels (backend ``"cupy"``, or ``"auto"`` on
      CUDA) the GPU needs compute capability 8.9+; ``backend="xla"`` runs
      the FP8 path in pure JAX anywhere. Backward is straight-through: the
      tokens' gradient is the unquantized combine of the slab gradient,
      exactly as without FP8. With ``checkpoint_name`` the value named
      ``"tokens"`` is the FP8 slab ``[L, C, W]`` uint8 (codes and scales),
      which the slabs are dequantized from: saved by remat it is about half
      the bf16 residual, at the cost of one more pass over the slabs in the
      forward (without a name the dequantize is fused into the receive).
    grouped_rows: None: the rows land in ``[L, C, H]`` slabs. ``M`` (a
      multiple of ``ROW_TILE``, :func:`grouped_rows_for`): in the grouped
      layout, ``[M, H]`` with each local expert's kept rows contiguous from a
      multiple of ``ROW_TILE`` on (:mod:`~moe_ep.transport.grouped_layout`);
      ``expert_capacity`` still caps each expert, and rows past ``M`` are
      dropped (and counted) like capacity drops.

  Returns:
    :class:`Dispatched`: ``tokens [L, C, H]`` (``[M, H]`` grouped),
    ``weights [L, C]`` (``[M]``) float32, ``handle``, ``counts [L]``,
    ``demand [L]``.
  """
  _backend.check_name(backend)
  wire_dtype = check_wire_dtype(wire_dtype)
  _check_rank("tokens", tokens, 2, "[T, H]")
  _check_rank("topk_idx", topk_idx, 2, "[T, K]")
  if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
    raise ValueError(f"topk_idx must hold integer expert ids; got dtype {topk_idx.dtype}")
  if topk_weights.shape != topk_idx.shape:
    raise ValueError(f"topk_weights shape {topk_weights.shape} must equal "
                     f"topk_idx shape {topk_idx.shape}")
  if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
    raise ValueError(f"topk_weights must be floating; got dtype {topk_weights.dtype}")
  if topk_idx.shape[0] != tokens.shape[0]:
    raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but tokens has "
                     f"{tokens.shape[0]}: both must be [T, ...]")
  if tokens.shape[0] == 0:
    raise ValueError(f"tokens has 0 rows: dispatch needs T >= 1 (got shape {tokens.shape})")
  if checkpoint_name is not None and not isinstance(checkpoint_name, str):
    raise ValueError(f"checkpoint_name={checkpoint_name!r} must be a string or None")
  if wire_dtype is not None and jnp.dtype(tokens.dtype).name not in _FP8_TOKEN_DTYPES:
    raise ValueError(f"tokens dtype {tokens.dtype} must be one of {_FP8_TOKEN_DTYPES} "
                     f"with wire_dtype={wire_dtype!r}")
  num_tokens, top_k = topk_idx.shape
  ep_size = _ep_size(axis_name, "dispatch")
  num_experts, top_k, ep_size = check_experts(num_experts, top_k, ep_size)
  dropless_capacity = expert_capacity_for(num_tokens, top_k, num_experts, ep_size)
  expert_capacity = min(positive_int("expert_capacity", expert_capacity), dropless_capacity)
  send_capacity = (num_tokens if send_capacity is None
                   else min(positive_int("send_capacity", send_capacity), num_tokens))
  if grouped_rows is not None and positive_int("grouped_rows", grouped_rows) % ROW_TILE:
    raise ValueError(f"grouped_rows={grouped_rows} must be a multiple of {ROW_TILE} (the "
                     "grouped GEMM's row tile); see grouped_rows_for")
  topk_idx, topk_weights = _merge_duplicate_routes(_valid_ids(topk_idx, num_experts),
                                                   topk_weights)
  spec = _Spec(num_experts=num_experts, ep_size=ep_size, expert_capacity=expert_capacity,
               send_capacity=send_capacity, axis_name=axis_name,
               backend=backend, checkpoint_name=checkpoint_name,
               weight_dtype=jnp.dtype(topk_weights.dtype).name,
               exchange=_resolve_exchange(exchange, backend, axis_name, ep_size, mesh),
               mesh=mesh, wire_dtype=wire_dtype,
               grouped_rows=None if grouped_rows is None else int(grouped_rows))
  spec.ops  # resolves the backend now: a missing CuPy fails at trace time
  return _dispatch(spec, tokens, topk_idx, topk_weights)


# --- combine -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(spec, expert_outputs, handle):
  with jax.named_scope(NAMED_SCOPES["combine"]):
    return _slabs_to_rows(spec, expert_outputs, handle)


def _combine_fwd(spec, expert_outputs, handle):
  return _combine(spec, expert_outputs, handle), handle


def _combine_bwd(spec, handle, output_grad):
  # y has expert_outputs' dtype, so output_grad (and the slab grad) does too.
  with jax.named_scope(NAMED_SCOPES["combine_bwd"]):
    slab_grad = _rows_to_slabs(spec, output_grad, handle)
  return slab_grad, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(expert_outputs: jax.Array, handle: RoutingHandle, *, num_tokens: int,
            axis_name=None, backend: str = "auto", exchange: str = "auto",
            mesh=None) -> jax.Array:
  """Brings expert outputs back to their tokens and sums them.

  Args:
    expert_outputs: ``[L, C, H]`` in the slab layout of the dispatch that made
      ``handle`` (``[M, H]`` in its grouped layout). Unweighted: multiply by
      ``Dispatched.weights`` first.
    handle: the dispatch's :class:`RoutingHandle`.
    num_tokens: ``T >= 1``, this rank's token count.
    axis_name: the EP mesh axis the dispatch used, or None.
    backend: ``"auto"``, ``"xla"`` or ``"cupy"``.
    exchange, mesh: as for :func:`dispatch`.

  Returns:
    ``[T, H]`` in ``expert_outputs.dtype``: ``y[t]`` is the sum over the kept
    routes of ``t`` of their rows, summed in float32 in a fixed order (a
    token's experts on one rank first, on that rank, then over ranks).
  """
  _backend.check_name(backend)
  if not isinstance(handle, RoutingHandle):
    raise ValueError(f"handle must be the RoutingHandle from dispatch; got {type(handle)}")
  shape_doc = "[M, H]" if handle.grouped else "[L, C, H]"
  _check_rank("expert_outputs", expert_outputs, handle.slab_row.ndim + 1, shape_doc)
  if expert_outputs.shape[:-1] != handle.slab_row.shape:
    raise ValueError(f"expert_outputs shape {expert_outputs.shape} must be {shape_doc} with "
                     f"{shape_doc[:-4]}] = {handle.slab_row.shape} from the handle")
  num_tokens = check_num_tokens(num_tokens, "combine")
  if num_tokens != handle.num_tokens:
    raise ValueError(f"num_tokens={num_tokens} does not match the handle's "
                     f"{handle.num_tokens} tokens")
  ep_size = _ep_size(axis_name, "combine")
  if ep_size != handle.ep_size:
    raise ValueError(f"axis_name={axis_name!r} has size {ep_size} but the handle was "
                     f"made for {handle.ep_size} ranks")
  # Combine needs no expert count or capacity: its passes read the handle's flat rows.
  spec = _Spec(num_experts=ep_size, ep_size=ep_size,
               expert_capacity=handle.slab_row.size, send_capacity=handle.send_capacity,
               axis_name=axis_name, backend=backend,
               exchange=_resolve_exchange(exchange, backend, axis_name, ep_size, mesh),
               mesh=mesh)
  spec.ops
  return _combine(spec, expert_outputs, handle)
