"""The expert bank: ``[L, C, H]`` slabs (:mod:`~moe_ep.experts.slabs`) or the
grouped layout (:mod:`~moe_ep.experts.grouped`)."""

from moe_ep.activations import activate
from moe_ep.experts.grouped import (BankKernels, GroupTiles, bank_layout, group_tiles,
                                    grouped_expert_mlp, grouped_matmul, kernels_apply)
from moe_ep.experts.slabs import expert_mlp

__all__ = ["BankKernels", "GroupTiles", "activate", "bank_layout", "expert_mlp", "group_tiles",
           "grouped_expert_mlp", "grouped_matmul", "kernels_apply"]
