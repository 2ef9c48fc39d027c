"""moe_ep: a Flax NNX Mixture-of-Experts layer with expert parallelism.

The public names below, imported from their modules on first use (so that
``moe_ep.config`` imports without the layer); the ``TYPE_CHECKING`` block
states the same imports for readers and tools."""

from typing import TYPE_CHECKING

from moe_ep.lazy import exports

if TYPE_CHECKING:
  from moe_ep.config import MoEConfig, RematConfig
  from moe_ep.layer import ExpertBias, ExpertParallelMoE, SownAux
  from moe_ep.layer_core import MoEAux
  from moe_ep.model_aux import collect_aux, moe_layers, total_aux_loss, update_expert_biases

__all__, __getattr__, __dir__ = exports(__name__, {
    "config": ("MoEConfig", "RematConfig"),
    "layer": ("ExpertBias", "ExpertParallelMoE", "SownAux"),
    "layer_core": ("MoEAux",),
    "model_aux": ("collect_aux", "moe_layers", "total_aux_loss", "update_expert_biases"),
})
