"""Hugging Face MoE blocks into :class:`~moe_ep.ExpertParallelMoE` layers and back.

A layer is built abstractly (``nnx.eval_shape``: no random initialisation of
weights about to be replaced) and each parameter is made with
``jax.make_array_from_callback`` on its sharding, so every device's shard is
read from the checkpoint only where that device lives: a process reads only
the experts its devices hold.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.config import MoEConfig
from moe_ep.interop.families import HFInteropError, config_from_hf, family_of
from moe_ep.interop.tensors import BlockTensors, block_to_hf
from moe_ep.layer import ExpertParallelMoE
from moe_ep.layer_mesh import mesh_split

Reader = Callable[[str, tuple], np.ndarray]


def _build(make: Callable[[], nnx.Module], mesh, read: Reader) -> nnx.Module:
  """``make()``'s module with every variable's value from ``read(path_key, index)``,
  made on the variable's sharding (replicated where it has none)."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  flat = []
  for path, variable in nnx.to_flat_state(state):
    abstract = variable.get_value()
    key = path[-1]
    dtype = abstract.dtype
    if mesh is None:
      full = tuple(slice(None) for _ in abstract.shape)
      value = jax.numpy.asarray(read(key, full).astype(dtype))
    else:
      sharding = getattr(abstract, "sharding", None) or NamedSharding(mesh, P())
      value = jax.make_array_from_callback(
          abstract.shape, sharding, _cached(lambda index, k=key: read(k, index).astype(dtype)))
    flat.append((path, variable.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _cached(read_block):
  """``read_block`` read once per distinct index (replicas over the batch axes
  share their shard)."""
  cache: dict = {}

  def read(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in cache:
      cache[key] = read_block(index)
    return cache[key]

  return read


def from_hf(hf_config: dict, tensors: Mapping, prefix: str, *, mesh=None, layout: str = "auto",
            **overrides) -> ExpertParallelMoE:
  """The :class:`~moe_ep.ExpertParallelMoE` holding one Hugging Face MoE block.

  Args:
    hf_config: the model's ``config.json`` as a dict (see :func:`config_from_hf`).
    tensors: names -> NumPy arrays, or lazy slices such as
      ``safe_open(path, framework="numpy").get_slice(name)``.
    prefix: the block's module path, e.g. ``"model.layers.1.mlp"``
      (Mixtral checkpoints: ``"model.layers.1.block_sparse_moe"``).
    mesh: as for the layer; each device's experts are read only for it.
    layout: ``"auto"`` (fused where ``{prefix}.experts.gate_up_proj``
      exists), ``"per_expert"`` or ``"fused"``.
    overrides: further :class:`~moe_ep.MoEConfig` fields (``param_dtype``,
      ``dtype``, ``capacity_factor``, ...).

  Raises:
    HFInteropError: a missing tensor (named with the family), a shape
      mismatch (tensor, expected, found), FP8 weights, an unsupported family.
  """
  config = config_from_hf(hf_config, **overrides)
  block = BlockTensors(family_of(hf_config), config, tensors, prefix, layout)
  block.check()
  _check_mesh(config, mesh)
  return _build(lambda: ExpertParallelMoE(config, mesh=mesh, rngs=nnx.Rngs(0)), mesh,
                lambda key, index: block.read(key, index))


def stacked_from_hf(hf_config: dict, tensors: Mapping, prefixes: Sequence[str], *, mesh=None,
                    layout: str = "auto", **overrides) -> ExpertParallelMoE:
  """Layers stacked by ``nnx.vmap`` (every parameter with a leading ``[L]``
  axis, for ``nnx.scan``), layer ``l`` from the block at ``prefixes[l]``."""
  config = config_from_hf(hf_config, **overrides)
  family = family_of(hf_config)
  blocks = [BlockTensors(family, config, tensors, prefix, layout) for prefix in prefixes]
  for block in blocks:
    block.check()
  _check_mesh(config, mesh)

  @nnx.split_rngs(splits=len(blocks))
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
  def create(rngs):
    return ExpertParallelMoE(config, mesh=mesh, rngs=rngs)

  def read(key, index):
    layers = range(*index[0].indices(len(blocks)))
    return np.stack([blocks[i].read(key, index[1:]) for i in layers])

  return _build(lambda: create(nnx.Rngs(0)), mesh, read)


def _check_mesh(config: MoEConfig, mesh) -> None:
  if mesh is None:
    return
  try:
    mesh_split(config, mesh)
  except ValueError as error:
    raise HFInteropError(str(error)) from None


def layer_params(layer: ExpertParallelMoE, index: int | None = None) -> dict[str, np.ndarray]:
  """The layer's parameters (and expert bias) as host NumPy arrays, of
  stacked layers the one at ``index``. Every process must address the whole
  array (one process; several: gather first, e.g. with
  ``multihost_utils.process_allgather``)."""
  state = nnx.to_pure_dict(nnx.state(layer))
  params = {}
  for key, value in state.items():
    if isinstance(value, dict):  # a submodule (the sown aux): no parameters
      continue
    array = np.asarray(jax.device_get(value))
    params[key] = array if index is None else array[index]
  return params


def to_hf(layer: ExpertParallelMoE, hf_config: dict, prefix: str, layout: str = "per_expert",
          *, index: int | None = None, dtype=None) -> dict[str, np.ndarray]:
  """The layer's block as Hugging Face tensors (names -> NumPy arrays), the
  inverse of :func:`from_hf`: a round trip is bitwise.

  Args:
    layout: ``"per_expert"`` (the checkpoints' keys) or ``"fused"``
      (current transformers' ``experts.gate_up_proj``/``down_proj``).
    index: of stacked layers, which one.
    dtype: the tensors' dtype (e.g. ``ml_dtypes.bfloat16``); None keeps the
      parameters' own.
  """
  config = layer.config
  expected = config_from_hf(hf_config)
  for field in ("hidden_size", "ffn_size", "num_experts", "top_k", "shared_width"):
    if getattr(expected, field) != getattr(config, field):
      raise HFInteropError(f"the layer's {field}={getattr(config, field)} differs from the "
                           f"{hf_config.get('model_type')} config's {getattr(expected, field)}")
  tensors = block_to_hf(family_of(hf_config), config, layer_params(layer, index), prefix, layout)
  if dtype is not None:
    tensors = {name: value.astype(dtype) for name, value in tensors.items()}
  return tensors
