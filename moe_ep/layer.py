"""ExpertParallelMoE: route -> dispatch -> experts -> combine, as one NNX layer.

The NNX shell: the module registers its parameters (and the variables it
keeps: the expert bias, the latest aux) and forwards each call to the
functional core, :func:`moe_ep.layer_core.apply`, whose per-shard body
:func:`~moe_ep.layer_core.moe_shard` is the whole data flow. Which mesh the
layer runs on is :mod:`moe_ep.layer_mesh`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import errors, nnx

from moe_ep import layer_core
from moe_ep import router
from moe_ep import sharding
from moe_ep.config import MoEConfig
from moe_ep.layer_core import MoEAux
from moe_ep.layer_mesh import layer_mesh, mesh_split


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


def _scaled_init(fan_in_axis: int):
  return jax.nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=fan_in_axis, out_axis=-1)



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
    self.mesh = layer_mesh(config, mesh)
    mesh_split(config, self.mesh)  # validates the mesh now
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
    return self._output(*layer_core.apply(self.config, self.mesh, self._params(), x))

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
