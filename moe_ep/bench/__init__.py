"""Benchmarks (programs, not tests): ``python -m moe_ep.bench <name>``.

Each writes one JSON file (device, versions, shapes, timings), under
``runs/bench/`` unless ``--out`` says otherwise, and prints a short summary;
the results the documentation cites are kept in ``benchmarks/results/``.
Figures that are compared (kernels against baselines, against the copy or
matmul ceiling) are measured side by side in the same run.
"""
