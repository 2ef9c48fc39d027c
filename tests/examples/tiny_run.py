"""A config small enough that a test can compile and train it in seconds."""

import json
import pathlib
import sys

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The examples are a folder of the repository, not part of the installed package.
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))


TINY_YAML = REPO / "configs" / "tiny.yaml"
FAST_OVERRIDES = [
    "model.vocab_size=64", "model.d_model=32", "moe.hidden_size=32", "model.mlp_size=64",
    "moe.ffn_size=32", "train.batch_size=8", "train.seq_len=16", "train.warmup_steps=2",
    "train.learning_rate=0.01", "train.log_every=1",
]


def fast_overrides(run_dir, *extra) -> list[str]:
  """FAST_OVERRIDES writing into ``run_dir`` (None: a new ``runs/tiny-<time>``)."""
  run_dir = None if run_dir is None else str(run_dir)
  return [*FAST_OVERRIDES, f"train.run_dir={json.dumps(run_dir)}", *extra]


def skip_unless_devices_fit(config):
  """Returns ``config``, or skips the test where this machine's device count
  (``jax.devices()``: the GPUs on a GPU machine) cannot split its batch."""
  count = jax.device_count()
  try:
    config.mesh_shape(count)
  except ValueError:
    pytest.skip(f"needs a device count that divides train.batch_size={config.train.batch_size} "
                f"(1, 2, 4 or 8 devices); jax.devices() has {count}")
  return config
