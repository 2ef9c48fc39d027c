"""A Hugging Face checkpoint directory's MoE layers onto a mesh.

The directory holds ``config.json`` and either ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``'s ``weight_map``. Every
shard is opened with ``safetensors.safe_open(..., framework="numpy")`` and
read through ``get_slice``: nothing is read until a device's shard asks for
it, so a process reads the router, the shared experts and only its own
devices' experts.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterator, Mapping, NamedTuple

import numpy as np
from safetensors import safe_open

from moe_ep.config import MoEConfig
from moe_ep.interop.convert import from_hf, stacked_from_hf
from moe_ep.interop.families import HFInteropError, config_from_hf, family_of, moe_layer_indices

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class _LoggedSlice:
  """A safetensors lazy slice that records each read in ``log`` as
  ``(name, index)``; ``shape`` and ``dtype`` (safetensors' name, e.g.
  ``"BF16"``) need no read."""

  def __init__(self, handle, name: str, log: list):
    self._slice, self.name, self._log = handle.get_slice(name), name, log
    self.shape = tuple(self._slice.get_shape())
    self.dtype = self._slice.get_dtype()

  def __getitem__(self, index) -> np.ndarray:
    self._log.append((self.name, index))
    return self._slice[index]


class CheckpointDir(Mapping):
  """The tensors of a checkpoint directory, by name, read lazily.

  ``reads`` lists every ``(name, index)`` read so far (which experts a
  process read); ``config`` is ``config.json``.
  """

  def __init__(self, path):
    self.path = pathlib.Path(path)
    if not self.path.is_dir():
      raise HFInteropError(f"{self.path} is not a directory (a Hugging Face checkpoint "
                           "directory with config.json and *.safetensors)")
    config_path = self.path / "config.json"
    if not config_path.is_file():
      raise HFInteropError(f"{self.path} has no config.json")
    try:
      self.config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
      raise HFInteropError(f"{config_path} is not JSON: {error}") from None
    self.weight_map = self._weight_map()
    self.reads: list = []
    self._handles: dict[str, object] = {}

  def _weight_map(self) -> dict[str, str]:
    index = self.path / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise HFInteropError(f"{index} has no weight_map ({error!r})") from None
      for shard in sorted(set(weight_map.values())):
        if not (self.path / shard).is_file():
          raise HFInteropError(f"{index} lists shard {shard}, which is not in {self.path}")
      return dict(weight_map)
    single = self.path / SINGLE_FILE
    if single.is_file():
      with safe_open(single, framework="numpy") as handle:
        return {name: SINGLE_FILE for name in handle.keys()}
    raise HFInteropError(f"{self.path} has neither {INDEX_FILE} nor {SINGLE_FILE}")

  def _handle(self, shard: str):
    if shard not in self._handles:
      try:
        self._handles[shard] = safe_open(self.path / shard, framework="numpy")
      except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise HFInteropError(f"cannot read shard {self.path / shard}: {error}") from None
    return self._handles[shard]

  def __getitem__(self, name: str) -> _LoggedSlice:
    if name not in self.weight_map:
      raise KeyError(name)
    return _LoggedSlice(self._handle(self.weight_map[name]), name, self.reads)

  def __contains__(self, name) -> bool:
    return name in self.weight_map

  def __iter__(self) -> Iterator[str]:
    return iter(self.weight_map)

  def __len__(self) -> int:
    return len(self.weight_map)


class LoadedLayers(NamedTuple):
  """What :func:`load_checkpoint` found.

  Attributes:
    layers: ``{decoder layer index: ExpertParallelMoE}``, or with
      ``stacked=True`` one layer stacked over the MoE layers (leading ``[L]``).
    moe_layers: the decoder layers loaded, in order.
    dense_layers: the decoder layers skipped (their MLP is dense).
    prefixes: each MoE layer's block prefix, in the order of ``moe_layers``.
    config: the layers' :class:`~moe_ep.MoEConfig`.
    checkpoint: the :class:`CheckpointDir` (its ``reads``, ``config``).
  """

  layers: object
  moe_layers: list[int]
  dense_layers: list[int]
  prefixes: list[str]
  config: MoEConfig
  checkpoint: CheckpointDir


def block_prefix(hf_config: dict, tensors: Mapping, layer: int) -> str:
  """The MoE block prefix of decoder layer ``layer`` that ``tensors`` holds
  (Mixtral's checkpoints ``block_sparse_moe``, transformers' own ``mlp``)."""
  family = family_of(hf_config)
  candidates = [f"model.layers.{layer}.{name}" for name in family.block_names]
  for prefix in candidates:
    if f"{prefix}.gate.weight" in tensors:
      return prefix
  raise HFInteropError(f"missing tensor {candidates[0]}.gate.weight: decoder layer {layer} of "
                       f"the {family.model_type} checkpoint should hold a MoE block (its "
                       "config says so)")


def load_checkpoint(path, *, mesh=None, stacked: bool = False, layout: str = "auto",
                    **overrides) -> LoadedLayers:
  """Every MoE layer of the checkpoint at ``path`` as
  :class:`~moe_ep.ExpertParallelMoE` layers on ``mesh``.

  Args:
    path: a Hugging Face checkpoint directory.
    mesh: as for the layer (each device's experts read only for it).
    stacked: one layer stacked by ``nnx.vmap`` over all MoE layers (for
      ``nnx.scan``) instead of one layer each.
    layout, overrides: as for :func:`~moe_ep.interop.from_hf`.

  Raises:
    HFInteropError: a bad directory, config or tensor (one line each).
  """
  checkpoint = CheckpointDir(path)
  hf_config = checkpoint.config
  config = config_from_hf(hf_config, **overrides)
  moe_layers, dense_layers = moe_layer_indices(hf_config)
  if not moe_layers:
    raise HFInteropError(f"{path}: the {hf_config.get('model_type')} config has no MoE layer")
  prefixes = [block_prefix(hf_config, checkpoint, i) for i in moe_layers]
  if stacked:
    layers = stacked_from_hf(hf_config, checkpoint, prefixes, mesh=mesh, layout=layout,
                             **overrides)
  else:
    layers = {i: from_hf(hf_config, checkpoint, prefix, mesh=mesh, layout=layout, **overrides)
              for i, prefix in zip(moe_layers, prefixes)}
  return LoadedLayers(layers, moe_layers, dense_layers, prefixes, config, checkpoint)
