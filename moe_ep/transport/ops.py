"""Dispatch and combine: move token rows to the experts that own them and back.

Both are ``custom_vjp`` operations whose backward passes read only the routing
handle (plain int32 data), so remat can save it and backward never re-runs the
routing or the forward exchange. This module checks the arguments, has the
call's :class:`~moe_ep.transport.plan.DispatchPlan` resolved once
(:mod:`~moe_ep.transport.plan`), and holds the forward and backward rules and
the checkpoint names; the rows move by :mod:`~moe_ep.transport.row_paths`,
which executes the plan with the local passes of a backend
(:mod:`~moe_ep.transport.xla` or :mod:`~moe_ep.transport.cupy_backend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_ep.transport import receive_grouped, receive_slabs, row_paths
from moe_ep.transport.plan import DispatchPlan, ep_size_of, plan_combine, plan_dispatch
from moe_ep.capacity import check_experts, check_num_tokens, expert_capacity_for, positive_int
from moe_ep.row_groups import GROUP_ALIGN, ROW_TILE, check_group_align
from moe_ep.transport.handle import Dispatched, RoutingHandle
from moe_ep.options import TOKEN_DTYPES, check_transport, check_wire_dtype
from moe_ep.transport.scopes import NAMED_SCOPES

__all__ = ["combine", "dispatch"]


# --- dispatch ----------------------------------------------------------------


def _dispatch_forward(plan: DispatchPlan, tokens, topk_idx, topk_weights) -> Dispatched:
  with jax.named_scope(NAMED_SCOPES["dispatch"]):
    if plan.dispatch_row_path == "one_launch":
      handle, slab_values, slab_weights, counts, demand = row_paths.dispatch_in_one_launch(
          plan, tokens, topk_idx, topk_weights)
      fp8_tokens = None
    else:
      handle, slab_weights, counts, demand = row_paths.routing(plan, topk_idx, topk_weights)
      if plan.fp8_rows:
        slab_values, fp8_tokens = row_paths.rows_to_grouped_fp8(plan, tokens, handle)
      elif plan.wire_dtype is not None:
        slab_values, fp8_tokens = row_paths.rows_to_slabs_fp8(plan, tokens, handle), None
      else:
        slab_values, fp8_tokens = row_paths.rows_to_slabs(plan, tokens, handle), None
  # Names go on the outputs here, inside the forward rule, so they also mark
  # the residual (the handle) that the backward rule reads.
  # The FP8 path names its FP8 slabs (the smaller residual) itself.
  return Dispatched(
      tokens=slab_values if plan.wire_dtype else plan.name("tokens", slab_values),
      weights=plan.name("weights", slab_weights),
      handle=plan.name("handle", handle),
      counts=plan.name("counts", counts),
      demand=demand,
      fp8_tokens=fp8_tokens,
  )


_dispatch = jax.custom_vjp(_dispatch_forward, nondiff_argnums=(0,))


def _dispatch_fwd(plan, tokens, topk_idx, topk_weights):
  out = _dispatch_forward(plan, tokens, topk_idx, topk_weights)
  return out, out.handle


def _dispatch_bwd(plan, handle, grads: Dispatched):
  with jax.named_scope(NAMED_SCOPES["dispatch_bwd"]):
    token_grad = row_paths.slabs_to_rows(plan, grads.tokens, handle)
    weight_grad = row_paths.weights_to_routes(plan, grads.weights.astype(jnp.float32), handle)
  # Slabs carry the tokens' dtype, so grads.tokens has it too.
  return token_grad.astype(grads.tokens.dtype), None, weight_grad.astype(plan.weight_dtype)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _check_rank(name: str, value, rank: int, shape_doc: str) -> None:
  if value.ndim != rank:
    raise ValueError(f"{name} must be {shape_doc} (rank {rank}); got shape {value.shape}")


def _check_rows(name: str, rows: jax.Array) -> None:
  """ValueError naming ``name`` unless its rows have channels and a dtype the
  transport moves exactly (float64 would lose precision in its float32 sums)."""
  if jnp.dtype(rows.dtype).name not in TOKEN_DTYPES:
    raise ValueError(f"{name} dtype {rows.dtype} must be one of {TOKEN_DTYPES}: the "
                     "transport sums rows and routing weights in float32; cast first")
  if rows.shape[-1] == 0:
    raise ValueError(f"{name} has shape {rows.shape}: rows need H >= 1 channels")


def valid_ids(topk_idx: jax.Array, num_experts: int) -> jax.Array:
  """``[T, K]`` int32 ids with every id outside ``[0, E)`` set to -1. The range
  test runs in the input's dtype, before narrowing: an int64 id of 2**32 + 1
  must not wrap onto expert 1. Narrow types are widened first, where ``E``
  itself would not fit (int8 ids against 300 experts)."""
  if jnp.iinfo(topk_idx.dtype).bits < 32:
    topk_idx = topk_idx.astype(jnp.int32)
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  return jnp.where(valid, topk_idx.astype(jnp.int32), -1)


def merge_duplicate_routes(topk_idx: jax.Array, topk_weights: jax.Array):
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


def dispatch(tokens: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, *,
             num_experts: int, expert_capacity: int, axis_name=None,
             send_capacity: int | None = None, checkpoint_name: str | None = None,
             transport: str = "auto", exchange: str = "auto", mesh=None,
             wire_dtype: str | None = None, grouped_rows: int | None = None,
             group_align: int = GROUP_ALIGN, fp8_rows: bool = False) -> Dispatched:
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
      :data:`~moe_ep.options.CHECKPOINT_FIELDS`, so a remat policy can save them.
    transport: ``"auto"`` (the CuPy kernels where the program is lowered for
      CUDA and CuPy imports, pure JAX elsewhere), ``"xla"`` or ``"cupy"``: the
      local passes (``MoEConfig.transport``).
    exchange: how rows cross between ranks: ``"all_to_all"`` (XLA's
      collective), ``"peer"`` (direct NVLink stores into the other GPUs'
      memory, :mod:`moe_ep.transport.peer`; needs ``mesh``) or ``"auto"``
      (peer wherever it runs:
      :func:`~moe_ep.transport.plan.resolve_exchange`). Same results,
      bitwise, either way.
    mesh: the ``jax.sharding.Mesh`` of the enclosing ``shard_map`` (only the
      peer exchange needs it).
    wire_dtype: None (rows travel in ``tokens.dtype``) or ``"float8_e4m3fn"``:
      each token is quantized once on its rank (e4m3 codes, one power-of-two
      float32 scale per 128 channels, :mod:`~moe_ep.transport.fp8`), its
      codes and scales cross as one uint8 row (about half the bytes of
      bfloat16), and the receiver dequantizes them into the slabs, which
      keep ``tokens.dtype``. ``tokens`` must then be float32, bfloat16 or
      float16. With the CuPy kernels (transport ``"cupy"``, or ``"auto"`` on
      CUDA) the GPU needs compute capability 8.9+; ``transport="xla"`` runs
      the FP8 path in pure JAX anywhere. Backward is straight-through: the
      tokens' gradient is the unquantized combine of the slab gradient,
      exactly as without FP8. With ``checkpoint_name`` the value named
      ``"tokens"`` is the FP8 slab ``[L, C, W]`` uint8 (codes and scales),
      which the slabs are dequantized from: saved by remat it is about half
      the bf16 residual, at the cost of one more pass over the slabs in the
      forward (without a name the dequantize is fused into the receive).
    grouped_rows: None: the rows land in ``[L, C, H]`` slabs. ``M`` (a
      multiple of ``ROW_TILE``, see :func:`~moe_ep.row_groups.grouped_rows_for`):
      in the grouped layout, ``[M, H]`` with each local expert's kept rows
      contiguous from a multiple of ``group_align`` on
      (:mod:`~moe_ep.transport.receive_grouped`); ``expert_capacity`` still caps each
      expert, and rows past ``M`` are dropped and counted like capacity drops.
    group_align: where the grouped layout's groups start: ``ROW_TILE`` (the
      default) or half of it (:data:`~moe_ep.row_groups.GROUP_ALIGNS`), as
      the bank that reads them is told.
    fp8_rows: with ``wire_dtype="float8_e4m3fn"`` and ``grouped_rows``, also
      return the grouped rows as they crossed, e4m3 codes and their scales
      (``Dispatched.fp8_tokens``), for a consumer that multiplies FP8 rows
      (:mod:`moe_ep.experts.fp8`) without a dequantize and a requantize; the
      FP8 rows land as FP8 slabs then, named ``"tokens"`` (see
      ``wire_dtype``), also without ``checkpoint_name``.

  Returns:
    :class:`Dispatched`: ``tokens [L, C, H]`` (grouped ``[M, H]``), ``weights
    [L, C]`` (``[M]``) float32, ``handle``, ``counts [L]``, ``demand [L]``.
  """
  check_transport(transport)
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
  _check_rows("tokens", tokens)
  num_tokens, top_k = topk_idx.shape
  ep_size = ep_size_of(axis_name, "dispatch")
  num_experts, top_k, ep_size = check_experts(num_experts, top_k, ep_size)
  dropless_capacity = expert_capacity_for(num_tokens, top_k, num_experts, ep_size)
  expert_capacity = min(positive_int("expert_capacity", expert_capacity), dropless_capacity)
  send_capacity = (num_tokens if send_capacity is None
                   else min(positive_int("send_capacity", send_capacity), num_tokens))
  if grouped_rows is not None and positive_int("grouped_rows", grouped_rows) % ROW_TILE:
    raise ValueError(f"grouped_rows={grouped_rows} must be a multiple of {ROW_TILE} "
                     "(the grouped GEMM's row tile); see grouped_rows_for")
  group_align = check_group_align(group_align)
  if not isinstance(fp8_rows, bool):
    raise ValueError(f"fp8_rows={fp8_rows!r} must be a bool")
  if fp8_rows and (wire_dtype is None or grouped_rows is None):
    raise ValueError(f"fp8_rows=True returns the FP8 wire's grouped rows: it needs "
                     f"wire_dtype='float8_e4m3fn' and grouped_rows; got wire_dtype={wire_dtype!r}, "
                     f"grouped_rows={grouped_rows!r}")
  topk_idx, topk_weights = merge_duplicate_routes(valid_ids(topk_idx, num_experts),
                                                   topk_weights)
  plan = plan_dispatch(num_experts=num_experts, ep_size=ep_size,
                       expert_capacity=expert_capacity, send_capacity=send_capacity,
                       top_k=top_k, hidden=tokens.shape[-1], row_dtype=tokens.dtype,
                       axis_name=axis_name, transport=transport, exchange=exchange, mesh=mesh,
                       wire_dtype=wire_dtype,
                       grouped_rows=None if grouped_rows is None else int(grouped_rows),
                       group_align=group_align, checkpoint_name=checkpoint_name,
                       weight_dtype=jnp.dtype(topk_weights.dtype).name, fp8_rows=fp8_rows)
  return _dispatch(plan, tokens, topk_idx, topk_weights)


# --- combine -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(plan, expert_outputs, handle):
  with jax.named_scope(NAMED_SCOPES["combine"]):
    return row_paths.slabs_to_rows(plan, expert_outputs, handle)


def _combine_fwd(plan, expert_outputs, handle):
  return _combine(plan, expert_outputs, handle), handle


def _combine_bwd(plan, handle, output_grad):
  # y has expert_outputs' dtype, so output_grad (and the slab grad) does too.
  with jax.named_scope(NAMED_SCOPES["combine_bwd"]):
    slab_grad = row_paths.rows_to_slabs(plan, output_grad, handle)
  return slab_grad, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(expert_outputs: jax.Array, handle: RoutingHandle, *, num_tokens: int,
            axis_name=None, transport: str = "auto", exchange: str = "auto",
            mesh=None) -> jax.Array:
  """Brings expert outputs back to their tokens and sums them.

  Args:
    expert_outputs: ``[L, C, H]`` in the slab layout of the dispatch that made
      ``handle`` (``[M, H]`` in its grouped layout). Unweighted: multiply by
      ``Dispatched.weights`` first.
    handle: the dispatch's :class:`RoutingHandle`.
    num_tokens: ``T >= 1``, this rank's token count.
    axis_name: the EP mesh axis the dispatch used, or None.
    transport: as for :func:`dispatch`.
    exchange, mesh: as for :func:`dispatch`.

  Returns:
    ``[T, H]`` in ``expert_outputs.dtype``: ``y[t]`` is the sum over the kept
    routes of ``t`` of their rows, summed in float32 in a fixed order (a
    token's experts on one rank first, on that rank, then over ranks).
  """
  check_transport(transport)
  if not isinstance(handle, RoutingHandle):
    raise ValueError(f"handle must be the RoutingHandle from dispatch; got {type(handle)}")
  if handle.grouped:
    receive_grouped.check_outputs(expert_outputs, handle)
  else:
    _check_rank("expert_outputs", expert_outputs, 3, "[L, C, H]")
    receive_slabs.check_outputs(expert_outputs, handle)
  _check_rows("expert_outputs", expert_outputs)
  num_tokens = check_num_tokens(num_tokens, "combine")
  if num_tokens != handle.num_tokens:
    raise ValueError(f"num_tokens={num_tokens} does not match the handle's "
                     f"{handle.num_tokens} tokens")
  ep_size = ep_size_of(axis_name, "combine")
  if ep_size != handle.ep_size:
    raise ValueError(f"axis_name={axis_name!r} has size {ep_size} but the handle was "
                     f"made for {handle.ep_size} ranks")
  plan = plan_combine(handle, hidden=expert_outputs.shape[-1], row_dtype=expert_outputs.dtype,
                      axis_name=axis_name, transport=transport, exchange=exchange, mesh=mesh)
  return _combine(plan, expert_outputs, handle)
