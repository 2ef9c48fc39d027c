"""Benchmarks (programs, not tests): ``python -m benchmarks <name>``, run
from a checkout (the wheel leaves out this package: it measures, it does not
run models), with the one-GPU peer loopback that tests use too
(:mod:`~benchmarks.peer_loopback`).

Each writes one JSON file (device, versions, shapes, timings), under
``runs/bench/`` unless ``--out`` says otherwise, and prints a short summary;
the results the documentation cites are kept in ``benchmarks/results/``.
Figures that are compared (kernels against baselines, against the copy or
matmul ceiling) are measured side by side in the same run.
"""
