"""Which mesh a layer runs on and how one call splits over it: the guards
that keep a layer from silently running without expert parallelism.

:func:`layer_mesh` picks the mesh when a layer is built, :func:`mesh_split`
checks it against the configuration (at construction and every call), and
:func:`check_no_ep_mesh` refuses a layer built without a mesh that is called
on one with an ``ep`` axis.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

from moe_ep import sharding
from moe_ep.config import MoEConfig


class MeshSplit(NamedTuple):
  """Static facts about how one call is split over the mesh."""

  ep_axis: str | None  # None: one EP rank, no exchange
  ep_size: int
  batch_axes: tuple[str, ...]  # every mesh axis that shards the batch, ep last
  num_shards: int  # product of their sizes


def mesh_split(config: MoEConfig, mesh) -> MeshSplit:
  """The :class:`MeshSplit` of ``config`` on ``mesh`` (None: one device).

  Raises:
    ValueError: ``config.ep_axis`` is not an axis of ``mesh``, or
      ``config.num_experts`` does not divide over it.
  """
  if mesh is None:
    return MeshSplit(None, 1, (), 1)
  if config.ep_axis not in mesh.axis_names:
    raise ValueError(f"MoEConfig.ep_axis={config.ep_axis!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}")
  ep_size = mesh.shape[config.ep_axis]
  if config.num_experts % ep_size:
    raise ValueError(f"MoEConfig.num_experts={config.num_experts} is not divisible by "
                     f"the ep axis size {ep_size}")
  axes = tuple(a for a in config.batch_axes if a in mesh.axis_names) + (config.ep_axis,)
  return MeshSplit(config.ep_axis if ep_size > 1 else None, ep_size, axes,
                     math.prod(mesh.shape[a] for a in axes))


_warned_meshes: set = set()


def layer_mesh(config: MoEConfig, mesh):
  """An explicit ``mesh`` wins; otherwise the ambient one (``jax.set_mesh``)
  if it has ``config.ep_axis``; otherwise None (one device, no EP).

  Raises:
    ValueError: no mesh, inside the legacy ``with mesh:`` whose ``ep`` axis
      has size > 1 (the layer does not read it: its experts would sit on
      one device).
  """
  if mesh is not None:
    return mesh
  ambient = sharding.ambient_mesh()
  if ambient is None:
    legacy = sharding.legacy_mesh()
    if legacy is not None and legacy.shape.get(config.ep_axis, 1) > 1:
      raise ValueError(
          f"ExpertParallelMoE is built inside the legacy `with mesh:` (axis "
          f"{config.ep_axis!r} of size {legacy.shape[config.ep_axis]}), which it does not "
          "read: its experts would sit on one device, without expert parallelism. Build it "
          "inside `with jax.set_mesh(mesh):` or pass mesh=mesh")
    return None
  if config.ep_axis not in ambient.axis_names:
    key = (tuple(ambient.axis_names), config.ep_axis)
    if key not in _warned_meshes:
      _warned_meshes.add(key)
      warnings.warn(
          f"ExpertParallelMoE: the ambient mesh has axes {tuple(ambient.axis_names)} but no "
          f"MoEConfig.ep_axis={config.ep_axis!r}; the layer runs without expert parallelism "
          "(experts replicated). Name a mesh axis 'ep' or set MoEConfig.ep_axis.",
          stacklevel=3)
    return None
  return ambient


def check_no_ep_mesh(config: MoEConfig, x) -> None:
  """Raises where a layer built without a mesh is called under ``jax.set_mesh``
  with an ``config.ep_axis`` of size > 1, or with ``x`` sharded over a mesh
  with such an axis (where its sharding can be seen: a concrete array, or a
  traced one on Explicit axes): it would run with its experts replicated,
  without EP."""
  ambient = sharding.ambient_mesh()
  if ambient is None or ambient.shape.get(config.ep_axis, 1) == 1:
    input_mesh = sharding.input_mesh(x)
    if input_mesh is None or dict(input_mesh.shape).get(config.ep_axis, 1) == 1:
      return
    raise ValueError(
        f"ExpertParallelMoE was built without a mesh (no mesh= and no jax.set_mesh around its "
        f"construction), so its experts are not sharded, but x is sharded over a mesh with "
        f"axis {config.ep_axis!r} of size {dict(input_mesh.shape)[config.ep_axis]}: the "
        f"experts would be replicated on every device, without expert parallelism. Build the "
        f"layer (the model) inside `with jax.set_mesh(mesh):` or pass mesh=mesh")
  raise ValueError(
      f"ExpertParallelMoE was built without a mesh (no mesh= and no jax.set_mesh around its "
      f"construction), so its experts are not sharded, but it is called under jax.set_mesh "
      f"with axis {config.ep_axis!r} of size {ambient.shape[config.ep_axis]}: it would run "
      f"without expert parallelism. Build the layer (the model) inside "
      f"`with jax.set_mesh(mesh):` or pass mesh=mesh; or call it outside the mesh")
