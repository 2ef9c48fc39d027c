"""The layer's functional core: one call of
:class:`~moe_ep.layer.ExpertParallelMoE` as pure functions of the
configuration, the mesh, the parameters and the tokens.

:func:`apply` brings any input onto the mesh's batch sharding, runs
:func:`moe_shard` on every shard (``shard_map``) and brings the output back;
:func:`moe_shard` is the whole data flow, route -> dispatch -> experts ->
combine, and the batch-global aux. The NNX module (:mod:`moe_ep.layer`) only
registers the parameters and forwards to :func:`apply`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_ep import router
from moe_ep import sharding
from moe_ep.activations import small_activation
from moe_ep.capacity import expert_capacity_for, send_capacity_for
from moe_ep.config import DTYPES, MoEConfig
from moe_ep.experts import bank_layout, expert_mlp, grouped_expert_mlp
from moe_ep.experts import fp8 as fp8_experts
from moe_ep.layer_mesh import MeshSplit, check_no_ep_mesh, mesh_split
from moe_ep.precision import exact_float32
from moe_ep.row_groups import grouped_rows_for
from moe_ep.transport.ops import combine, dispatch

# jax.named_scope names of the layer's parts (the transport's are
# moe_ep.transport.NAMED_SCOPES): they reach the compiled HLO's op_name
# metadata, so profiles attribute time to them.
NAMED_SCOPES = {"router": "moe_router", "experts": "moe_experts",
                "shared_experts": "moe_shared_experts"}


class MoEAux(NamedTuple):
  """Auxiliary outputs of one layer call (global over the whole batch).

  Attributes:
    aux_loss: scalar load-balancing loss, already times ``aux_loss_coeff``.
    z_loss: scalar router z-loss, already times ``z_loss_coeff``.
    tokens_per_expert: ``[E]`` int32 routes per expert before any drop.
    dropped_fraction: scalar share of routes dropped for capacity.
  """

  aux_loss: jax.Array
  z_loss: jax.Array
  tokens_per_expert: jax.Array
  dropped_fraction: jax.Array


def apply(config: MoEConfig, mesh, params: dict, x: jax.Array) -> tuple[jax.Array, MoEAux]:
  """``x [..., H]`` -> ``(y [..., H] shaped, typed and, on Explicit mesh axes,
  sharded like x, MoEAux)``.

  ``params`` holds the whole parameters (:func:`moe_shard` names them);
  ``mesh`` is the layer's (None: one device). The tokens are split over the
  batch axes and the EP axis; a token count that does not divide is padded
  inside with rows that are routed nowhere.
  """
  if mesh is None:
    check_no_ep_mesh(config, x)
  split = mesh_split(config, mesh)
  if x.ndim < 1 or x.shape[-1] != config.hidden_size:
    raise ValueError(f"x must be [..., hidden_size={config.hidden_size}]; got shape {x.shape}")
  dtype = compute_dtype(config, x)
  check_expert_precision(config, dtype)
  num_valid = math.prod(x.shape[:-1])
  if num_valid == 0:  # nothing routed, nothing to exchange
    return jnp.zeros(x.shape, x.dtype), zero_aux(config.num_experts)

  rows = -(-num_valid // split.num_shards) * split.num_shards
  tokens = sharding.token_rows(x, rows, mesh, split.batch_axes)
  body = functools.partial(moe_shard, config, split, mesh, dtype, num_valid)
  if config.remat.apply:
    body = jax.checkpoint(body, policy=config.remat.policy())
  if mesh is None:
    y, aux = body(tokens, params)
  else:
    param_specs = {key: P(config.ep_axis) if key in ("w_in", "w_out") else P()
                   for key in params}
    params = {key: sharding.place(value, mesh, param_specs[key])
              for key, value in params.items()}
    token_spec = P(split.batch_axes)
    y, aux = jax.shard_map(body, mesh=mesh, in_specs=(token_spec, param_specs),
                           out_specs=(token_spec, MoEAux(P(), P(), P(), P())))(tokens, params)
  return sharding.like_input(y, x, mesh), aux


def moe_shard(config: MoEConfig, split: MeshSplit, mesh, dtype, num_valid: int,
              tokens: jax.Array, params: dict) -> tuple[jax.Array, MoEAux]:
  """One shard's MoE: ``tokens [t, H]`` -> ``(y [t, H] in dtype, aux)``.

  ``params`` holds this shard's slices: ``router [H, E]``, ``w_in [L, H, n*F]``,
  ``w_out [L, F, H]``, optionally ``expert_bias [E]``, ``shared_w_in [H, n*F_s]``,
  ``shared_w_out [F_s, H]``, ``shared_gate [H, 1]``. The global rows from
  ``num_valid`` on are padding: routed nowhere and counted nowhere. ``mesh``
  is the layer's (for the peer exchange).
  """
  num_tokens = tokens.shape[0]
  remat = config.remat
  name = lambda value_name, value: checkpoint_name(value, remat.name(value_name))
  tokens = tokens.astype(dtype)
  real = _real_rows(split, num_tokens, num_valid)

  # Route (float32 router). The scopes name the layer's parts in profiles.
  with jax.named_scope(NAMED_SCOPES["router"]):
    logits = exact_float32(tokens) @ params["router"].astype(jnp.float32)
    routing = router.route(
        logits, top_k=config.top_k, score_function=config.score_function,
        normalize_top_k=config.normalize_top_k, routed_scaling=config.routed_scaling,
        num_groups=config.num_groups, group_top_k=config.group_top_k,
        group_score=config.group_score, expert_bias=params.get("expert_bias"), name=name)
  if real is not None:
    routing = routing._replace(
        topk_idx=jnp.where(real[:, None], routing.topk_idx, -1),
        topk_weights=jnp.where(real[:, None], routing.topk_weights, 0.0))

  # Dispatch.
  capacity_args = (num_tokens, config.top_k, config.num_experts, split.ep_size)
  expert_capacity = config.expert_capacity or expert_capacity_for(
      *capacity_args, config.capacity_factor)
  grouped_rows = (grouped_rows_for(*capacity_args, config.receive_factor, config.group_align)
                  if _grouped_layout(config, dtype) else None)
  dispatched = dispatch(
      tokens, routing.topk_idx, routing.topk_weights, num_experts=config.num_experts,
      expert_capacity=expert_capacity, axis_name=split.ep_axis,
      send_capacity=send_capacity_for(*capacity_args, config.capacity_factor),
      checkpoint_name=remat.name("dispatch"), transport=config.transport,
      exchange=config.exchange, mesh=mesh, wire_dtype=config.dispatch_dtype,
      grouped_rows=grouped_rows, group_align=config.group_align,
      fp8_rows=_fp8_dispatch_feed(config))

  # Experts, their outputs weighted in float32 for the unweighted combine:
  # through the activation [M, F] where that costs less than a pass over the
  # output [M, H] (moe_ep.activations.small_activation), else on the output.
  with jax.named_scope(NAMED_SCOPES["experts"]):
    weights = (dispatched.weights if small_activation(config.hidden_size, config.ffn_size)
               else None)
    if config.expert_precision == "fp8":
      # Quantized once here from the master weights, named: a remat saving
      # "expert_weights" keeps the codes; the gradient reaches the masters.
      w_in_fp8, w_out_fp8 = (name("expert_weights", fp8_experts.quantize_weights(params[key]))
                             for key in ("w_in", "w_out"))
      out = fp8_experts.fp8_grouped_expert_mlp(
          dispatched.tokens, dispatched.counts, params["w_in"], params["w_out"], w_in_fp8,
          w_out_fp8, config.activation, name, row_weights=weights,
          rows_fp8=dispatched.fp8_tokens)
    else:
      out = _expert_mlp(config, dtype, name, dispatched, params, grouped_rows, weights)
    if weights is None:
      out = (exact_float32(out) * dispatched.weights[..., None]).astype(dtype)

  # Combine.
  y = name("combine.output", combine(out, dispatched.handle, num_tokens=num_tokens,
                                     axis_name=split.ep_axis, transport=config.transport,
                                     exchange=config.exchange, mesh=mesh))
  if "shared_w_in" in params:
    with jax.named_scope(NAMED_SCOPES["shared_experts"]):
      shared = expert_mlp(tokens[None], params["shared_w_in"][None],
                          params["shared_w_out"][None], config.activation)[0]
      if "shared_gate" in params:  # Qwen2-MoE: a per-token sigmoid gate on the shared output
        gate = jax.nn.sigmoid(tokens @ params["shared_gate"].astype(dtype))
        shared = shared * gate
      y = y + shared

  aux = _aux(config, split, routing, logits, kept=dispatched.counts.sum(), real=real,
             num_valid=num_valid)
  return y, aux


def _expert_mlp(config: MoEConfig, dtype, name, dispatched, params: dict,
                grouped_rows: int | None, weights: jax.Array | None) -> jax.Array:
  """The bank in the compute dtype: on slabs, or on the grouped layout."""
  # Cast once here, named: a remat saving "expert_weights" keeps the cast.
  w_in, w_out = (name("expert_weights", params[key].astype(dtype)) for key in ("w_in", "w_out"))
  if grouped_rows is None:
    return expert_mlp(dispatched.tokens, w_in, w_out, config.activation, name,
                      row_weights=weights)
  return grouped_expert_mlp(dispatched.tokens, dispatched.counts, w_in, w_out,
                            config.activation, name, row_weights=weights,
                            group_align=config.group_align)


def _grouped_layout(config: MoEConfig, dtype) -> bool:
  """Whether the expert bank runs on the grouped layout (``expert_layout``;
  always with FP8 GEMMs)."""
  if config.expert_precision is not None:
    return True
  return bank_layout(config.expert_layout, dtype, config.hidden_size,
                     config.ffn_size) == "grouped"


def _fp8_dispatch_feed(config: MoEConfig) -> bool:
  """Whether the FP8 dispatch's codes and scales feed the FP8 bank's first GEMM."""
  return config.expert_precision == "fp8" and config.dispatch_dtype is not None


def check_expert_precision(config: MoEConfig, dtype) -> None:
  """The FP8 bank's call-time rules: bfloat16 compute, a GPU of compute
  capability 9.0 where there is a GPU."""
  if config.expert_precision is None:
    return
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(
        f"MoEConfig.expert_precision={config.expert_precision!r} computes in bfloat16, but "
        f"MoEConfig.dtype=None computes in the input's dtype {jnp.dtype(dtype).name}: cast x "
        f"to bfloat16 or set MoEConfig.dtype='bfloat16'")
  fp8_experts.check_device()


def _real_rows(split: MeshSplit, num_tokens: int, num_valid: int) -> jax.Array | None:
  """``[t]`` bool: which of this shard's rows are real tokens (None: all are).
  Padding sits at the end of the global row order, which is the order of the
  batch axes' linear shard index."""
  if num_valid == num_tokens * split.num_shards:
    return None
  shard = jax.lax.axis_index(split.batch_axes) if split.batch_axes else 0
  return shard * num_tokens + jnp.arange(num_tokens) < num_valid


def _aux(config: MoEConfig, split: MeshSplit, routing: router.Routing,
         logits: jax.Array, kept: jax.Array, real: jax.Array | None,
         num_valid: int) -> MoEAux:
  """Batch-global statistics and losses: one int and one float all-reduce."""
  total = lambda value: (jax.lax.psum(value, split.batch_axes) if split.batch_axes
                         else value)
  num_experts = config.num_experts
  counts = total(jnp.concatenate([router.expert_histogram(routing.topk_idx, num_experts),
                                  kept[None].astype(jnp.int32)]))
  # The batch-global form of the dispatch counts: saved with them, so a remat
  # policy saving "dispatch" re-runs no all-reduce either.
  counts = checkpoint_name(counts, config.remat.name("dispatch.counts"))
  tokens_per_expert, kept_total = counts[:num_experts], counts[num_experts]
  routes_total = tokens_per_expert.sum()
  dropped = 1.0 - kept_total.astype(jnp.float32) / jnp.maximum(routes_total, 1)

  zero = jnp.zeros((), jnp.float32)
  aux_loss, z_loss = zero, zero
  if config.aux_loss_coeff > 0 or config.z_loss_coeff > 0:
    weight = 1.0 if real is None else real.astype(jnp.float32)[:, None]
    per_token = [router.score_distribution(routing.scores, config.score_function)]
    if config.z_loss_coeff > 0:
      per_token.append(router.z_loss_terms(logits)[:, None])
    # One column sum over [t, E (+1)]: XLA emits it as a parallel reduction,
    # a scalar sum fused into the concatenate as a serial loop (docs/grouped.md).
    sums = total((jnp.concatenate(per_token, axis=1) * weight).sum(axis=0)) / num_valid
    if config.aux_loss_coeff > 0:
      aux_loss = config.aux_loss_coeff * router.load_balancing_loss(
          tokens_per_expert, sums[:num_experts])
    if config.z_loss_coeff > 0:
      z_loss = config.z_loss_coeff * sums[num_experts]
  return MoEAux(aux_loss, z_loss, tokens_per_expert, dropped)


def zero_aux(num_experts: int) -> MoEAux:
  zero = jnp.zeros((), jnp.float32)
  return MoEAux(zero, zero, jnp.zeros((num_experts,), jnp.int32), zero)


def compute_dtype(config: MoEConfig, x: jax.Array):
  """The dtype the layer computes in: ``config.dtype``, else the input's (one
  of :data:`~moe_ep.config.DTYPES`)."""
  if config.dtype is not None:
    return jnp.dtype(config.dtype)
  dtype = jnp.dtype(x.dtype)
  if dtype.name not in DTYPES:
    raise ValueError(
        f"x has dtype {dtype.name}; with MoEConfig.dtype=None the layer computes in the input's "
        f"dtype, which must be one of {DTYPES} (the transport's sums and routing weights are "
        "float32, so float64 would silently lose precision): cast x or set MoEConfig.dtype")
  return dtype
