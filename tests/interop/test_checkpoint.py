"""moe_ep.interop.load_checkpoint: a checkpoint directory (sharded safetensors
with its index) onto a mesh, reading only what each device holds; stacked
layers; ``python -m examples.hf_moe DIR``; bad directories in one line."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from conftest import make_mesh
from hf_fixtures import (FIXTURES, block_prefix, checkpoint_tensors, fused_tensors, hf_config,
                         reference)
from hf_worker import experts_read
from moe_ep.interop import HFInteropError, layer_params, load_checkpoint, to_hf

REPO = pathlib.Path(__file__).resolve().parents[2]
# float32 on both sides (see test_convert.py's REL_TOL).
REL_TOL = 1e-5


def write_checkpoint(directory: pathlib.Path, config: dict, tensors: dict, shards: int,
                     extra=()) -> pathlib.Path:
  """``tensors`` as ``shards`` safetensors files with the index file transformers writes."""
  directory.mkdir(parents=True)
  (directory / "config.json").write_text(json.dumps(config))
  names = sorted(tensors)
  weight_map = {}
  for shard in range(shards):
    file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
    part = names[shard::shards]
    save_file({name: np.ascontiguousarray(tensors[name]) for name in part}, directory / file)
    weight_map.update({name: file for name in part})
  (directory / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map}))
  for name in extra:
    shutil.copy(FIXTURES / config["model_type"] / name, directory / name)
  return directory


def assert_outputs_match(layers: dict, model_type: str):
  for i, (x, want) in reference(model_type).items():
    y, _ = layers[i](x)
    assert np.abs(np.asarray(y) - want).max() <= REL_TOL * np.abs(want).max()


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_a_sharded_directory_loads_onto_the_mesh_reading_each_expert_once(tmp_path, layout):
  tensors = checkpoint_tensors("deepseek_v3")
  if layout == "fused":
    tensors = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    tensors.update(fused_tensors("deepseek_v3"))
  directory = write_checkpoint(tmp_path / "ckpt", hf_config("deepseek_v3"), tensors, shards=3)
  mesh = make_mesh((2, 4), ("dp", "ep"))
  loaded = load_checkpoint(directory, mesh=mesh, dtype="float32", transport="xla")
  assert (loaded.moe_layers, loaded.dense_layers) == ([1], [0])
  assert loaded.layers[1].w_in[...].sharding.spec == jax.sharding.PartitionSpec("ep", None, None)
  assert_outputs_match(loaded.layers, "deepseek_v3")
  read_names = [name for name, _ in loaded.checkpoint.reads]
  assert not any(name.startswith("model.layers.0.") or "embed" in name for name in read_names)
  # Each expert's tensors once, though two dp replicas hold each shard:
  # per expert 3 tensors, or of each fused tensor the 4 ep shards; the
  # router and its bias, the 3 shared projections.
  assert experts_read(loaded.checkpoint.reads) == list(range(8))
  reads = [(name, repr(index)) for name, index in loaded.checkpoint.reads]
  assert len(reads) == len(set(reads))
  assert len(reads) == (8 * 3 if layout == "per_expert" else 4 * 2) + 2 + 3


def test_stacked_layers_get_the_leading_axis_and_match_one_by_one(tmp_path):
  directory = FIXTURES / "mixtral"
  mesh = make_mesh((2, 4), ("dp", "ep"))
  loaded = load_checkpoint(directory, mesh=mesh, stacked=True, dtype="float32", transport="xla")
  one_each = load_checkpoint(directory, mesh=mesh, dtype="float32", transport="xla")
  stacked = loaded.layers
  assert stacked.w_in[...].shape == (2, 4, 16, 24)
  assert stacked.w_in[...].sharding.spec == jax.sharding.PartitionSpec(None, "ep", None, None)
  config = hf_config("mixtral")
  for position, (i, prefix) in enumerate(zip(loaded.moe_layers, loaded.prefixes)):
    for key, value in layer_params(one_each.layers[i]).items():
      np.testing.assert_array_equal(layer_params(stacked, position)[key], value, err_msg=key)
    written = to_hf(stacked, config, prefix, index=position)
    for name, value in to_hf(one_each.layers[i], config, prefix).items():
      np.testing.assert_array_equal(written[name], value, err_msg=name)

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def run(layer, h):
    return layer(h)[0]

  x, _ = reference("mixtral")[0]
  want = x
  for i in loaded.moe_layers:
    want = one_each.layers[i](want)[0]
  np.testing.assert_allclose(np.asarray(run(stacked, x)), np.asarray(want), rtol=1e-6,
                             atol=1e-6)


def test_a_bfloat16_directory_loads_through_safetensors_numpy_reader(tmp_path):
  """safetensors' NumPy API returns BF16 as ml_dtypes.bfloat16 (registered
  on import); the layer's float32 parameters hold those values exactly."""
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in checkpoint_tensors("olmoe").items()}
  directory = write_checkpoint(tmp_path / "bf16", hf_config("olmoe"), tensors, shards=2)
  layer = load_checkpoint(directory, transport="xla").layers[0]
  prefix = block_prefix("olmoe", 0)
  want = tensors[f"{prefix}.experts.3.up_proj.weight"].astype(np.float32).T
  np.testing.assert_array_equal(np.asarray(layer.w_in[...])[3, :, 8:], want)


def test_fp8_tensors_are_refused_in_one_line(tmp_path):
  tensors = checkpoint_tensors("deepseek_v3")
  name = "model.layers.1.mlp.experts.2.down_proj.weight"
  tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
  directory = write_checkpoint(tmp_path / "fp8", hf_config("deepseek_v3"), tensors, shards=2)
  with pytest.raises(HFInteropError, match=f"tensor '{name}' is FP8 \\(dtype F8_E4M3"):
    load_checkpoint(directory)


def run_example(*args) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  env.pop("XLA_FLAGS", None)  # the command asks for its own 8 CPU devices
  return subprocess.run([sys.executable, "-m", "examples.hf_moe", *map(str, args)], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_hf_moe_command_reports_layers_and_the_difference_against_transformers():
  done = run_example(FIXTURES / "qwen2_moe")
  assert done.returncode == 0, done.stderr
  lines = done.stdout.strip().splitlines()
  assert len(lines) == 2 and lines[0].startswith("layer 1: qwen2_moe model.layers.1.mlp, 6 experts")
  assert "dense layers skipped: 0" in lines[1] and "ep=2" in lines[1]
  diff = float(lines[1].rsplit(" ", 1)[1])
  assert diff <= REL_TOL * np.abs(reference("qwen2_moe")[1][1]).max()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no_directory", "missing_key", "bad_index"])
def test_hf_moe_command_fails_in_one_line_with_status_2(tmp_path, case):
  directory = tmp_path / "ckpt"
  if case != "no_directory":
    shutil.copytree(FIXTURES / "deepseek_v3", directory)
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    if case == "missing_key":
      del weight_map["model.layers.1.mlp.shared_experts.up_proj.weight"]
    else:
      weight_map["model.layers.1.mlp.gate.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
  done = run_example(directory)
  assert done.returncode == 2 and done.stdout == ""
  message = done.stderr.strip()
  assert "\n" not in message and message.startswith("hf_moe: error: "), done.stderr
  assert {"no_directory": "is not a directory",
          "missing_key": "missing tensor 'model.layers.1.mlp.shared_experts.up_proj.weight' of "
                         "the deepseek_v3 MoE block",
          "bad_index": "lists shard model-00009-of-00009.safetensors"}[case] in message


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_process_reads_only_the_experts_its_devices_hold(tmp_path):
  """Two processes of four CPU devices each, one (1, 8) mesh: a process
  reads the experts of its own devices only, in both layouts, and the
  layers still match transformers."""
  from moe_ep.launch import launch
  fused = dict(checkpoint_tensors("deepseek_v3"))
  fused = {k: v for k, v in fused.items() if ".mlp.experts." not in k}
  fused.update(fused_tensors("deepseek_v3"))
  directories = [FIXTURES / "deepseek_v3",
                 write_checkpoint(tmp_path / "fused", hf_config("deepseek_v3"), fused, shards=2,
                                  extra=("moe_reference.safetensors",))]
  out = tmp_path / "reads"
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  launch([sys.executable, str(pathlib.Path(__file__).with_name("hf_worker.py")), str(out),
          *map(str, directories)], 2, timeout_s=300, cpu_devices_per_process=4, env=env)
  scale = np.abs(reference("deepseek_v3")[1][1]).max()
  for process in range(2):
    results = json.loads(pathlib.Path(f"{out}.{process}.json").read_text())
    for directory in directories:
      result = results[str(directory)]
      # One expert per device of the ep=8 axis, in device order.
      assert result["experts_read"] == list(range(4 * process, 4 * process + 4)), result
      assert result["max_diff"] <= REL_TOL * scale
