"""Reading the fixtures tests/interop/make_fixtures.py writes (shared by the
interop tests and the multi-process worker)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import safe_open

FIXTURES = pathlib.Path(__file__).with_name("fixtures")
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
FUSED = ("qwen3_moe", "deepseek_v3")  # those with moe_fused.safetensors


def hf_config(model_type: str, root: pathlib.Path = FIXTURES) -> dict:
  return json.loads((root / model_type / "config.json").read_text())


def read_all(path: pathlib.Path) -> dict[str, np.ndarray]:
  with safe_open(path, framework="numpy") as handle:
    return {name: handle.get_tensor(name) for name in handle.keys()}


def checkpoint_tensors(model_type: str, root: pathlib.Path = FIXTURES) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint directory (per-expert keys), read eagerly."""
  directory = root / model_type
  shards = set(json.loads((directory / "model.safetensors.index.json").read_text())
               ["weight_map"].values())
  tensors = {}
  for shard in sorted(shards):
    tensors.update(read_all(directory / shard))
  return tensors


def fused_tensors(model_type: str, root: pathlib.Path = FIXTURES) -> dict[str, np.ndarray]:
  """The MoE blocks' tensors as transformers holds them in memory (fused experts)."""
  return read_all(root / model_type / "moe_fused.safetensors")


def reference(model_type: str, root: pathlib.Path = FIXTURES) -> dict[int, tuple]:
  """``{layer: (input [B, S, H], output [B, S, H])}`` of transformers' blocks."""
  arrays = read_all(root / model_type / "moe_reference.safetensors")
  layers = sorted({int(name.split(".")[1]) for name in arrays})
  return {i: (arrays[f"layers.{i}.input"], arrays[f"layers.{i}.output"]) for i in layers}


def block_prefix(model_type: str, layer: int) -> str:
  name = "block_sparse_moe" if model_type == "mixtral" else "mlp"
  return f"model.layers.{layer}.{name}"


def block_tensors(tensors: dict, prefix: str) -> dict:
  return {name: value for name, value in tensors.items() if name.startswith(prefix + ".")}
