"""Hugging Face MoE checkpoints in and out: Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V2 and DeepSeek-V3 sparse MoE blocks as
:class:`~moe_ep.ExpertParallelMoE` layers (docs/interop.md)."""

from typing import TYPE_CHECKING

from moe_ep.lazy import exports

if TYPE_CHECKING:
  from moe_ep.interop.checkpoint import CheckpointDir, LoadedLayers, load_checkpoint
  from moe_ep.interop.convert import from_hf, layer_params, stacked_from_hf, to_hf
  from moe_ep.interop.families import (SUPPORTED, HFInteropError, config_from_hf,
                                       moe_layer_indices)

__all__, __getattr__, __dir__ = exports(__name__, {
    "checkpoint": ("CheckpointDir", "LoadedLayers", "load_checkpoint"),
    "convert": ("from_hf", "layer_params", "stacked_from_hf", "to_hf"),
    "families": ("SUPPORTED", "HFInteropError", "config_from_hf", "moe_layer_indices"),
})
