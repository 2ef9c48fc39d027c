"""Examples: a small MoE language model pretrained with moe_ep, and an ablation runner."""
