"""moe_ep: a Flax NNX Mixture-of-Experts layer with expert parallelism."""

from moe_ep.config import MoEConfig, RematConfig
from moe_ep.layer import ExpertBias, ExpertParallelMoE, MoEAux, SownAux
from moe_ep.model_aux import collect_aux, moe_layers, total_aux_loss, update_expert_biases

__all__ = ["ExpertBias", "ExpertParallelMoE", "MoEAux", "MoEConfig", "RematConfig", "SownAux",
           "collect_aux", "moe_layers", "total_aux_loss", "update_expert_biases"]
