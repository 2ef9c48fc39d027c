"""moe_ep: a Flax NNX Mixture-of-Experts layer with expert parallelism.

The public names below, imported from their modules on first use."""

from moe_ep.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    "config": ("MoEConfig", "RematConfig"),
    "layer": ("ExpertBias", "ExpertParallelMoE", "MoEAux", "SownAux"),
    "model_aux": ("collect_aux", "moe_layers", "total_aux_loss", "update_expert_biases"),
})
