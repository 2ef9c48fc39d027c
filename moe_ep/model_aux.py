"""Model-wide helpers over every :class:`~moe_ep.ExpertParallelMoE` in a module
graph: the auxiliary losses and load statistics the layers kept
(``MoEConfig.return_aux=False``), and the expert-bias step.

A layer stacked by ``nnx.vmap`` (run by ``nnx.scan``) is one module whose
values carry a leading ``[num_layers]`` axis; the helpers treat it as that
many layers.

>>> with jax.set_mesh(mesh):                                     # doctest: +SKIP
...   def loss_fn(model):
...     return cross_entropy(model(batch)) + moe_ep.total_aux_loss(model)
...   loss, grads = nnx.value_and_grad(loss_fn)(model)
...   optimizer.update(model, grads)
...   moe_ep.update_expert_biases(model)
...   nnx.pop(model, moe_ep.SownAux)   # optional: the model as built again
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_ep.layer import ExpertParallelMoE
from moe_ep.layer_core import MoEAux


def moe_layers(model: nnx.Module) -> dict[str, ExpertParallelMoE]:
  """Every MoE layer in ``model``'s graph, by its path (``"blocks/0/mlp"``)."""
  return {"/".join(str(part) for part in path): node
          for path, node in nnx.iter_graph(model)
          if isinstance(node, ExpertParallelMoE)}


def _sown(path: str, layer: ExpertParallelMoE) -> MoEAux:
  if layer.config.return_aux:
    raise ValueError(f"the MoE layer at {path!r} has MoEConfig.return_aux=True: it returns its "
                     "MoEAux instead of keeping it; set return_aux=False to use the model-wide "
                     "helpers, or sum the returned aux yourself")
  return layer.latest_aux.get()


def collect_aux(model: nnx.Module) -> dict[str, MoEAux]:
  """The :class:`MoEAux` each MoE layer kept from its latest call, by path
  (stacked layers: each field with a leading ``[num_layers]`` axis).

  Raises:
    ValueError: naming a layer built with ``return_aux=True``.
  """
  return {path: _sown(path, layer) for path, layer in moe_layers(model).items()}


def total_aux_loss(model: nnx.Module) -> jax.Array:
  """Scalar float32: the sum of every MoE layer's ``aux_loss + z_loss`` from
  its latest call (already scaled by the layers' coefficients; 0.0 without
  MoE layers). Differentiable: call it in the loss function after the
  model's forward pass."""
  total = jnp.zeros((), jnp.float32)
  for aux in collect_aux(model).values():
    total = total + aux.aux_loss.sum() + aux.z_loss.sum()
  return total


def update_expert_biases(model: nnx.Module) -> None:
  """One auxiliary-loss-free bias step for every MoE layer with
  ``use_expert_bias``, each from its own latest load (stacked layers each
  against their own row). Call after the optimizer update."""
  for path, layer in moe_layers(model).items():
    if layer.config.use_expert_bias:
      layer.update_expert_bias(_sown(path, layer))
