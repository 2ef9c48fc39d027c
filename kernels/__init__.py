"""CUDA sources of the CuPy backend, shipped as package data (see moe_ep.transport.kernel_source)."""
