"""A config small enough that a test can compile and train it in seconds."""

import json
import pathlib
import sys

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
  return [*FAST_OVERRIDES, f"train.run_dir={json.dumps(str(run_dir))}", *extra]
