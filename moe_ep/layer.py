"""ExpertParallelMoE: route -> dispatch -> experts -> combine, as one NNX layer.

The whole data flow is :func:`_moe_shard`, the per-shard body that
``shard_map`` runs on every device of the mesh; :meth:`ExpertParallelMoE.__call__`
only brings any input onto the mesh's batch sharding and back.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import errors, nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_ep import router
from moe_ep import sharding
from moe_ep.config import DTYPES, MoEConfig
from moe_ep.experts import bank_layout, expert_mlp, grouped_expert_mlp
from moe_ep.experts import fp8 as fp8_experts
from moe_ep.transport import (combine, dispatch, expert_capacity_for, grouped_rows_for,
                              send_capacity_for)

# jax.named_scope names of the layer's parts (the transport's are
# moe_ep.transport.NAMED_SCOPES): they reach the compiled HLO's op_name
# metadata, so profiles attribute time to them.
NAMED_SCOPES = {"router": "moe_router", "experts": "moe_experts",
                "shared_experts": "moe_shared_experts"}


class ExpertBias(nnx.Variable):
  """Per-expert selection bias for auxiliary-loss-free balancing.

  Not an ``nnx.Param``: optimizers built on ``nnx.Param`` leave it alone, and
  it changes only through :meth:`ExpertParallelMoE.update_expert_bias` (or
  :func:`moe_ep.update_expert_biases`).
  """


class SownAux(nnx.Intermediate):
  """One field of the :class:`MoEAux` of the layer's latest call, kept when
  ``MoEConfig.return_aux`` is False (read them with :func:`moe_ep.collect_aux`,
  :func:`moe_ep.total_aux_loss`).

  Like values that ``nnx.Module.sow`` keeps, they appear at the layer's
  first call: a model as built holds only its parameters (and an
  :class:`ExpertBias` where ``use_expert_bias``), so ``nnx.split(model,
  nnx.Param)`` covers it. After a call that split alone meets Flax's
  "Non-exhaustive filters, got a non-empty remainder" listing these: split
  the rest off too, ``nnx.split(model, nnx.Param, ...)``, or drop them after
  reading them, ``nnx.pop(model, moe_ep.SownAux)``, which brings the model
  back to its structure as built (a loop under ``nnx.jit`` then compiles
  once; docs/moving_from_dense.md). Every field is float32, the route counts too (exact up to
  2**24 routes per expert and call), so ``jax.grad`` over all of a model's
  state meets no integer; :meth:`LatestAux.get` gives them back as int32.
  """


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


def _zero_aux(num_experts: int) -> MoEAux:
  zero = jnp.zeros((), jnp.float32)
  return MoEAux(zero, zero, jnp.zeros((num_experts,), jnp.int32), zero)


class LatestAux(nnx.Module):
  """The :class:`MoEAux` of a layer's latest call, one float32
  :class:`SownAux` per field (so ``nnx.state`` tools and checkpoints see
  plain arrays); empty until the first :meth:`set` (and after
  ``nnx.pop(model, SownAux)``)."""

  def is_empty(self) -> bool:
    return not all(hasattr(self, field) for field in MoEAux._fields)

  def get(self) -> MoEAux:
    """Raises ValueError where nothing is kept (the layer was not called)."""
    if self.is_empty():
      raise ValueError("the MoE layer keeps its MoEAux from its latest call, and has not been "
                       "called since it was built (or since nnx.pop(model, moe_ep.SownAux)): "
                       "run the model's forward pass first")
    aux = MoEAux(*(getattr(self, field).get_value() for field in MoEAux._fields))
    return aux._replace(tokens_per_expert=aux.tokens_per_expert.astype(jnp.int32))

  def set(self, aux: MoEAux) -> None:
    for field, value in zip(MoEAux._fields, aux):
      value = value.astype(jnp.float32)
      if hasattr(self, field):
        getattr(self, field).set_value(value)
      else:  # the first call sows it, as nnx.Module.sow does
        setattr(self, field, SownAux(value))


class _ShardLayout(NamedTuple):
  """Static facts about how one call is split over the mesh."""

  ep_axis: str | None  # None: one EP rank, no exchange
  ep_size: int
  batch_axes: tuple[str, ...]  # every mesh axis that shards the batch, ep last
  num_shards: int  # product of their sizes


def _weights_on_activation(config: MoEConfig) -> bool:
  """Whether the routing weights scale the activation rather than the output.

  Per row, weighting the output costs a pass over ``[M, H]`` forward and two
  backward (about ``6H`` elements read or written); weighting the activation
  costs nothing forward (its pass exists) and, backward, the weights'
  gradient reads the activation's input and gradient (``3F``, ``2F + F``
  gated or not); docs/grouped.md has the measurements."""
  return config.ffn_size < 2 * config.hidden_size


def _moe_shard(config: MoEConfig, layout: _ShardLayout, mesh, dtype, num_valid: int,
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
  real = _real_rows(layout, num_tokens, num_valid)

  # Route (float32 router). The scopes name the layer's parts in profiles.
  with jax.named_scope(NAMED_SCOPES["router"]):
    logits = tokens.astype(jnp.float32) @ params["router"].astype(jnp.float32)
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
  capacity_args = (num_tokens, config.top_k, config.num_experts, layout.ep_size)
  expert_capacity = config.expert_capacity or expert_capacity_for(
      *capacity_args, config.capacity_factor)
  grouped_rows = (grouped_rows_for(*capacity_args, config.receive_factor, config.group_align)
                  if _grouped_layout(config, dtype) else None)
  dispatched = dispatch(
      tokens, routing.topk_idx, routing.topk_weights, num_experts=config.num_experts,
      expert_capacity=expert_capacity, axis_name=layout.ep_axis,
      send_capacity=send_capacity_for(*capacity_args, config.capacity_factor),
      checkpoint_name=remat.name("dispatch"), backend=config.transport,
      exchange=config.exchange, mesh=mesh, wire_dtype=config.dispatch_dtype,
      grouped_rows=grouped_rows, group_align=config.group_align,
      fp8_rows=_fp8_dispatch_feed(config))

  # Experts, their outputs weighted in float32 for the unweighted combine:
  # through the activation [M, F] where that costs less than a pass over the
  # output [M, H] (moe_ep.experts.activate), else on the output.
  with jax.named_scope(NAMED_SCOPES["experts"]):
    weights = dispatched.weights if _weights_on_activation(config) else None
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
      out = (out.astype(jnp.float32) * dispatched.weights[..., None]).astype(dtype)

  # Combine.
  y = name("combine.output", combine(out, dispatched.handle, num_tokens=num_tokens,
                                     axis_name=layout.ep_axis, backend=config.transport,
                                     exchange=config.exchange, mesh=mesh))
  if "shared_w_in" in params:
    with jax.named_scope(NAMED_SCOPES["shared_experts"]):
      shared = expert_mlp(tokens[None], params["shared_w_in"][None],
                          params["shared_w_out"][None], config.activation)[0]
      if "shared_gate" in params:  # Qwen2-MoE: a per-token sigmoid gate on the shared output
        gate = jax.nn.sigmoid(tokens @ params["shared_gate"].astype(dtype))
        shared = shared * gate
      y = y + shared

  aux = _aux(config, layout, routing, logits, kept=dispatched.counts.sum(), real=real,
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


def _check_expert_precision(config: MoEConfig, dtype) -> None:
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


def _real_rows(layout: _ShardLayout, num_tokens: int, num_valid: int) -> jax.Array | None:
  """``[t]`` bool: which of this shard's rows are real tokens (None: all are).
  Padding sits at the end of the global row order, which is the order of the
  batch axes' linear shard index."""
  if num_valid == num_tokens * layout.num_shards:
    return None
  shard = jax.lax.axis_index(layout.batch_axes) if layout.batch_axes else 0
  return shard * num_tokens + jnp.arange(num_tokens) < num_valid


def _aux(config: MoEConfig, layout: _ShardLayout, routing: router.Routing,
         logits: jax.Array, kept: jax.Array, real: jax.Array | None,
         num_valid: int) -> MoEAux:
  """Batch-global statistics and losses: one int and one float all-reduce."""
  total = lambda value: (jax.lax.psum(value, layout.batch_axes) if layout.batch_axes
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
    # One column sum over [t, E (+1)]: XLA emits a scalar sum fused into a
    # concatenate as one serial loop (0.15 ms at 16,384 tokens), a column
    # sum as a parallel reduction.
    sums = total((jnp.concatenate(per_token, axis=1) * weight).sum(axis=0)) / num_valid
    if config.aux_loss_coeff > 0:
      aux_loss = config.aux_loss_coeff * router.load_balancing_loss(
          tokens_per_expert, sums[:num_experts])
    if config.z_loss_coeff > 0:
      z_loss = config.z_loss_coeff * sums[num_experts]
  return MoEAux(aux_loss, z_loss, tokens_per_expert, dropped)


def _scaled_init(fan_in_axis: int):
  return jax.nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=fan_in_axis, out_axis=-1)


_warned_meshes: set = set()


def _layer_mesh(config: MoEConfig, mesh):
  """An explicit ``mesh`` wins; otherwise the ambient one (``jax.set_mesh``)
  if it has ``config.ep_axis``; otherwise None (one device, no EP).

  Raises:
    ValueError: no mesh, inside the legacy ``with mesh:`` whose ``ep`` axis
      has size > 1 (the layer does not read it: its experts would sit on
      one device).
  """
  if mesh is not None:
    return mesh
  ambient = sharding.ambient_mesh()
  if ambient is None:
    legacy = sharding.legacy_mesh()
    if legacy is not None and legacy.shape.get(config.ep_axis, 1) > 1:
      raise ValueError(
          f"ExpertParallelMoE is built inside the legacy `with mesh:` (axis "
          f"{config.ep_axis!r} of size {legacy.shape[config.ep_axis]}), which it does not "
          "read: its experts would sit on one device, without expert parallelism. Build it "
          "inside `with jax.set_mesh(mesh):` or pass mesh=mesh")
    return None
  if config.ep_axis not in ambient.axis_names:
    key = (tuple(ambient.axis_names), config.ep_axis)
    if key not in _warned_meshes:
      _warned_meshes.add(key)
      warnings.warn(
          f"ExpertParallelMoE: the ambient mesh has axes {tuple(ambient.axis_names)} but no "
          f"MoEConfig.ep_axis={config.ep_axis!r}; the layer runs without expert parallelism "
          "(experts replicated). Name a mesh axis 'ep' or set MoEConfig.ep_axis.",
          stacklevel=3)
    return None
  return ambient


def _check_no_ep_mesh(config: MoEConfig, x) -> None:
  """Raises where a layer built without a mesh is called under ``jax.set_mesh``
  with an ``config.ep_axis`` of size > 1, or with ``x`` sharded over a mesh
  with such an axis (where its sharding can be seen: a concrete array, or a
  traced one on Explicit axes): it would run with its experts replicated,
  without EP."""
  ambient = sharding.ambient_mesh()
  if ambient is None or ambient.shape.get(config.ep_axis, 1) == 1:
    input_mesh = sharding.input_mesh(x)
    if input_mesh is None or dict(input_mesh.shape).get(config.ep_axis, 1) == 1:
      return
    raise ValueError(
        f"ExpertParallelMoE was built without a mesh (no mesh= and no jax.set_mesh around its "
        f"construction), so its experts are not sharded, but x is sharded over a mesh with "
        f"axis {config.ep_axis!r} of size {dict(input_mesh.shape)[config.ep_axis]}: the "
        f"experts would be replicated on every device, without expert parallelism. Build the "
        f"layer (the model) inside `with jax.set_mesh(mesh):` or pass mesh=mesh")
  raise ValueError(
      f"ExpertParallelMoE was built without a mesh (no mesh= and no jax.set_mesh around its "
      f"construction), so its experts are not sharded, but it is called under jax.set_mesh "
      f"with axis {config.ep_axis!r} of size {ambient.shape[config.ep_axis]}: it would run "
      f"without expert parallelism. Build the layer (the model) inside "
      f"`with jax.set_mesh(mesh):` or pass mesh=mesh; or call it outside the mesh")


def _compute_dtype(config: MoEConfig, x: jax.Array):
  if config.dtype is not None:
    return jnp.dtype(config.dtype)
  dtype = jnp.dtype(x.dtype)
  if dtype.name not in DTYPES:
    raise ValueError(
        f"x has dtype {dtype.name}; with MoEConfig.dtype=None the layer computes in the input's "
        f"dtype, which must be one of {DTYPES} (the transport's sums and routing weights are "
        "float32, so float64 would silently lose precision): cast x or set MoEConfig.dtype")
  return dtype


class ExpertParallelMoE(nnx.Module):
  """Mixture-of-Experts FFN with experts sharded over a mesh axis.

  >>> layer = ExpertParallelMoE(MoEConfig(hidden_size=8, ffn_size=16, num_experts=4,
  ...                                     top_k=2), rngs=nnx.Rngs(0))
  >>> y, aux = layer(jnp.ones((2, 3, 8)))
  >>> y.shape, aux.tokens_per_expert.shape
  ((2, 3, 8), (4,))

  Args:
    config: the :class:`~moe_ep.MoEConfig`.
    mesh: a ``jax.sharding.Mesh`` containing ``config.ep_axis`` (and any of
      ``config.batch_axes``). None: the ambient mesh of ``jax.set_mesh`` if it
      has ``config.ep_axis`` (a warning once if it has not), else one device
      without EP (then a call under ``jax.set_mesh`` with an ``ep`` axis of
      size > 1 is an error: the layer was built outside the mesh).
    rngs: parameter initialisation keys (``rngs.params()``).

  Calling ``layer(x)`` with ``x [..., H]`` of any leading shape and sharding
  returns ``y`` shaped and typed like ``x`` (on Explicit mesh axes also
  sharded like it): ``(y, MoEAux)`` with ``config.return_aux`` (the default),
  else ``y`` alone with the :class:`MoEAux` kept in ``layer.latest_aux``
  (``nnx.Intermediate`` values, overwritten by every call) for
  :func:`moe_ep.total_aux_loss` and :func:`moe_ep.update_expert_biases`. The
  tokens are split over the batch axes and the EP axis; a token count that
  does not divide is padded inside with rows that are routed nowhere.
  """

  def __init__(self, config: MoEConfig, *, mesh: jax.sharding.Mesh | None = None,
               rngs: nnx.Rngs):
    self.config = config
    self.mesh = _layer_mesh(config, mesh)
    self._shard_layout(config, self.mesh)  # validates the mesh now
    hidden, ffn, experts = config.hidden_size, config.ffn_size, config.num_experts
    n_in = config.num_input_projections
    ep = config.ep_axis if self.mesh is not None else None
    self.router = self._param(rngs, _scaled_init(0), (hidden, experts), (None, None))
    self.w_in = self._param(rngs, _scaled_init(-2), (experts, hidden, n_in * ffn),
                            (ep, None, None))
    self.w_out = self._param(rngs, _scaled_init(-2), (experts, ffn, hidden), (ep, None, None))
    if config.use_expert_bias:
      self.expert_bias = ExpertBias(
          sharding.replicated(jnp.zeros((experts,), jnp.float32), self.mesh))
    if config.num_shared_experts:
      shared = config.shared_width
      self.shared_w_in = self._param(rngs, _scaled_init(0), (hidden, n_in * shared),
                                     (None, None))
      self.shared_w_out = self._param(rngs, _scaled_init(0), (shared, hidden), (None, None))
    if config.shared_expert_gate:
      self.shared_gate = self._param(rngs, _scaled_init(0), (hidden, 1), (None, None))
    if not config.return_aux:
      self.latest_aux = LatestAux()  # empty: the first call sows into it

  @staticmethod
  def _shard_layout(config: MoEConfig, mesh) -> _ShardLayout:
    if mesh is None:
      return _ShardLayout(None, 1, (), 1)
    if config.ep_axis not in mesh.axis_names:
      raise ValueError(f"MoEConfig.ep_axis={config.ep_axis!r} is not an axis of the mesh "
                       f"{tuple(mesh.axis_names)}")
    ep_size = mesh.shape[config.ep_axis]
    if config.num_experts % ep_size:
      raise ValueError(f"MoEConfig.num_experts={config.num_experts} is not divisible by "
                       f"the ep axis size {ep_size}")
    axes = tuple(a for a in config.batch_axes if a in mesh.axis_names) + (config.ep_axis,)
    return _ShardLayout(config.ep_axis if ep_size > 1 else None, ep_size, axes,
                        math.prod(mesh.shape[a] for a in axes))

  def _param(self, rngs: nnx.Rngs, init, shape: tuple, spec: tuple) -> nnx.Param:
    value = init(rngs.params(), shape, jnp.dtype(self.config.param_dtype))
    if self.mesh is None:
      return nnx.Param(value)
    return nnx.Param(value, out_sharding=spec, mesh=self.mesh)

  def update_expert_bias(self, aux: MoEAux | None = None) -> None:
    """Applies one auxiliary-loss-free bias step from ``aux.tokens_per_expert``
    (default: the sown :class:`MoEAux` of the latest call).

    Call it in the train step after the gradient, e.g.::

      (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
      optimizer.update(model, grads)
      model.moe.update_expert_bias(aux)
    """
    if not self.config.use_expert_bias:
      raise ValueError("update_expert_bias needs MoEConfig.use_expert_bias=True")
    if aux is None:
      if self.config.return_aux:
        raise ValueError("update_expert_bias() without aux needs MoEConfig.return_aux=False "
                         "(the layer then keeps its latest MoEAux); otherwise pass the aux "
                         "the layer returned")
      aux = self.latest_aux.get()
    self.expert_bias[...] = router.expert_bias_step(
        self.expert_bias[...], jax.lax.stop_gradient(aux.tokens_per_expert),
        self.config.expert_bias_update_rate)

  def _params(self) -> dict:
    params = {"router": self.router[...], "w_in": self.w_in[...], "w_out": self.w_out[...]}
    if self.config.use_expert_bias:
      params["expert_bias"] = self.expert_bias[...]
    if self.config.num_shared_experts:
      params["shared_w_in"] = self.shared_w_in[...]
      params["shared_w_out"] = self.shared_w_out[...]
    if self.config.shared_expert_gate:
      params["shared_gate"] = self.shared_gate[...]
    return params

  def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None,
               deterministic: bool | None = None) -> jax.Array | tuple[jax.Array, MoEAux]:
    """``x [..., H]`` -> ``y [..., H]`` (and the :class:`MoEAux` with
    ``config.return_aux``). ``rngs`` and ``deterministic`` are the keywords
    an NNX feed-forward's call site often passes; the layer has no dropout,
    so they change nothing."""
    del rngs, deterministic
    config, mesh = self.config, self.mesh
    if mesh is None:
      _check_no_ep_mesh(config, x)
    layout = self._shard_layout(config, mesh)
    if x.ndim < 1 or x.shape[-1] != config.hidden_size:
      raise ValueError(f"x must be [..., hidden_size={config.hidden_size}]; got shape {x.shape}")
    dtype = _compute_dtype(config, x)
    _check_expert_precision(config, dtype)
    num_valid = math.prod(x.shape[:-1])
    if num_valid == 0:  # nothing routed, nothing to exchange
      return self._output(jnp.zeros(x.shape, x.dtype), _zero_aux(config.num_experts))

    rows = -(-num_valid // layout.num_shards) * layout.num_shards
    tokens = sharding.token_rows(x, rows, mesh, layout.batch_axes)
    body = functools.partial(_moe_shard, config, layout, mesh, dtype, num_valid)
    if config.remat.apply:
      body = jax.checkpoint(body, policy=config.remat.policy())
    params = self._params()
    if mesh is None:
      y, aux = body(tokens, params)
    else:
      param_specs = {key: P(config.ep_axis) if key in ("w_in", "w_out") else P()
                     for key in params}
      params = {key: sharding.place(value, mesh, param_specs[key])
                for key, value in params.items()}
      token_spec = P(layout.batch_axes)
      y, aux = jax.shard_map(body, mesh=mesh, in_specs=(token_spec, param_specs),
                             out_specs=(token_spec, MoEAux(P(), P(), P(), P())))(tokens, params)
    return self._output(sharding.like_input(y, x, mesh), aux)

  def _output(self, y: jax.Array, aux: MoEAux):
    if self.config.return_aux:
      return y, aux
    try:
      self.latest_aux.set(aux)
    except errors.TraceContextError as error:
      raise errors.TraceContextError(
          "ExpertParallelMoE with MoEConfig.return_aux=False keeps its MoEAux in layer."
          "latest_aux, which a JAX transform over a closure of the model (jax.grad, jax.jit, "
          "jax.vmap of `lambda x: model(x)`, or a lax.while_loop / lax.scan body that merges "
          "state split outside it) cannot update: use the NNX transforms with the model as an "
          "argument (nnx.grad(loss_fn)(model, x), nnx.value_and_grad, nnx.jit); inside a "
          "loop body merge with fresh variables, nnx.merge(graphdef, state, copy=True); or "
          "set MoEConfig.return_aux=True and use the (y, aux) it returns") from error
    return y
