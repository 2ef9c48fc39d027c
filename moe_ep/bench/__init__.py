"""Benchmarks (programs, not tests): ``python -m moe_ep.bench <name>``.

Each writes one JSON file (device, versions, shapes, timings) under
``benchmarks/results/`` and prints a short summary. Figures that are compared
(kernels against baselines, against the copy or matmul ceiling) are measured
side by side in the same run.
"""
