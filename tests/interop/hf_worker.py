"""One process of the interop multi-process test; started N times by ``moe_ep.launch``.

    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 4 -- \\
        python tests/interop/hf_worker.py OUT_PREFIX DIR [DIR ...]

Loads each checkpoint directory's MoE layers onto a ``(1, N)`` mesh over
every process's devices, runs them on the directory's reference inputs, and
writes ``OUT_PREFIX.<process>.json``: per directory, which experts this
process read and the max |difference| of the gathered outputs against
transformers'.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.distributed import initialize_from_env
from moe_ep.interop import load_checkpoint
from hf_fixtures import read_all

_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def experts_read(reads: list) -> list[int]:
  """The experts whose tensors were read: per-expert keys by their number,
  fused tensors by the slice of their leading axis."""
  experts = set()
  for name, index in reads:
    match = _EXPERT_KEY.search(name)
    if match:
      experts.add(int(match.group(1)))
    elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
      experts.update(range(index.start, index.stop))
  return sorted(experts)


def main(argv: list[str]) -> int:
  jax.config.update("jax_platforms", "cpu")
  initialize_from_env()
  out, directories = argv[0], [pathlib.Path(d) for d in argv[1:]]
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices).reshape(1, len(devices)), ("dp", "ep"))
  results = {}
  for directory in directories:
    loaded = load_checkpoint(directory, mesh=mesh, dtype="float32", transport="xla")
    reference = read_all(directory / "moe_reference.safetensors")
    worst = 0.0
    for i, layer in loaded.layers.items():
      x = reference[f"layers.{i}.input"]
      x = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda idx: x[idx])
      y, _ = layer(x)
      y = multihost_utils.process_allgather(y, tiled=True)
      worst = max(worst, float(np.abs(y - reference[f"layers.{i}.output"]).max()))
    results[str(directory)] = {"experts_read": experts_read(loaded.checkpoint.reads),
                               "local_devices": [d.id for d in jax.local_devices()],
                               "max_diff": worst}
  path = pathlib.Path(f"{out}.{jax.process_index()}.json")
  path.write_text(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
