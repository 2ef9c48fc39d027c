"""moe_ep: a Flax NNX Mixture-of-Experts layer with expert parallelism."""

from moe_ep.config import MoEConfig, RematConfig
from moe_ep.layer import ExpertBias, ExpertParallelMoE, MoEAux

__all__ = ["ExpertBias", "ExpertParallelMoE", "MoEAux", "MoEConfig", "RematConfig"]
