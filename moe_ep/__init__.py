"""moe_ep: a Flax NNX Mixture-of-Experts layer with expert parallelism."""
