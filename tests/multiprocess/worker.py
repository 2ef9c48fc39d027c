"""One process of a multi-process test job; started N times by ``moe_ep.launch``.

    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 2 -- \\
        python tests/multiprocess/worker.py /tmp/out.npz --mesh 2x2 --mesh 1x4
    python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 -- \\
        python tests/multiprocess/worker.py /tmp/out.npz --platform gpu --transport cupy \\
        --mesh 1x2

Joins the job (:func:`moe_ep.distributed.initialize_from_env`), runs
:func:`multiprocess_cases.run_cases` over every process's devices, and
process 0 writes the gathered results to the .npz given first.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

from moe_ep.distributed import initialize_from_env
from multiprocess_cases import CASES, parse_mesh, run_cases

PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out", help=".npz that process 0 writes the results to")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cases", default=",".join(CASES),
                      help=f"comma-separated subset of {CASES}")
  parser.add_argument("--mesh", type=parse_mesh, action="append", default=[],
                      help="(dp)x(ep) mesh of the layer cases; repeat for several")
  parser.add_argument("--platform", choices=tuple(PLATFORMS), default="cpu")
  parser.add_argument("--transport", "--backend", dest="transport",
                      choices=("xla", "cupy", "auto"), default="xla")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  # JAX starts its backends at the first device query, so these still apply.
  # On GPU no process may reserve most of a GPU that another process shares,
  # and float32 GEMMs stay float32 (not TF32) to compare with a CPU reference.
  jax.config.update("jax_platforms", PLATFORMS[args.platform])
  if args.platform == "gpu":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax.config.update("jax_default_matmul_precision", "highest")
  initialize_from_env()
  results = run_cases(jax.devices(), args.cases.split(","), args.mesh, args.seed,
                      args.transport)
  if jax.process_index() == 0:
    np.savez(args.out, **results)
  print(f"process {jax.process_index()} of {jax.process_count()}: "
        f"{len(results)} results on {jax.device_count()} {jax.devices()[0].platform} devices")
  return 0


if __name__ == "__main__":
  sys.exit(main())
