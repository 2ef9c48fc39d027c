"""The ``("dp", "ep")`` mesh of a run on one node or many: ``ep`` inside a
node, where the dispatch and combine exchange rows over NVLink (the peer
path), and ``dp`` across nodes, where only the gradients' all-reduce crosses
the network.

The devices are laid out node by node (nodes in the order of their first
process, a node's devices by process and id), so every row of the
``[dp, ep]`` device array lies inside one node whenever ``ep`` divides each
node's device count. A config may ask for a larger ``ep`` (``mesh.ep``); its
groups then span nodes, the exchange falls back to XLA's ``all_to_all`` over
the network, and :func:`ep_span_note` says so.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import jax
import numpy as np

from examples.train_config import MESH_AXES, Config, MeshConfig
from moe_ep import distributed

# The virtual CPU devices of a one-process run without accelerators.
CPU_DEVICES = 8
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def request_cpu_devices(count: int = CPU_DEVICES) -> None:
  """Asks XLA for ``count`` virtual CPU devices, so that the ``("dp", "ep")``
  mesh has devices to span on a machine without accelerators.

  A command's ``main()`` calls it first: it takes effect only before JAX
  starts its backends. It is skipped where ``JAX_PLATFORMS`` asks for GPUs,
  and a count already in ``XLA_FLAGS`` (``moe_ep.launch`` sets one per
  process) is left alone.
  """
  if (any(p in os.environ.get("JAX_PLATFORMS", "") for p in _GPU_PLATFORMS)
      or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
    return
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={count}").strip()


def device_nodes(devices: Sequence) -> dict[int, str]:
  """Device id -> the node it is on (:func:`moe_ep.distributed.process_nodes`,
  by the device's process); every process of the job must call it."""
  nodes = distributed.process_nodes()
  return {device.id: nodes[device.process_index] for device in devices}


def node_major(devices: Sequence, node_of: dict[int, str]) -> list[list]:
  """``devices`` grouped by node (``node_of``: device id -> node): nodes in
  the order of their lowest process index, each node's devices by process
  index and id. The same on every process (it depends only on its arguments)."""
  groups: dict[str, list] = {}
  for device in devices:
    groups.setdefault(node_of[device.id], []).append(device)
  order = lambda device: (device.process_index, device.id)
  members = [sorted(group, key=order) for group in groups.values()]
  return sorted(members, key=lambda group: order(group[0]))


def devices_per_node(groups: list[list]) -> int:
  """The device count every node's count is a multiple of (their gcd): an
  ``ep`` that divides it keeps each ep group inside one node."""
  return math.gcd(*(len(group) for group in groups))


def mesh_shape(config: Config, devices: Sequence, node_of: dict[int, str] | None = None):
  """``(dp, ep)`` of ``config`` over ``devices`` (:meth:`Config.mesh_shape`
  with the automatic ``ep`` bounded by one node); ``node_of`` as
  :func:`device_nodes` returns (None: it is asked)."""
  node_of = device_nodes(devices) if node_of is None else node_of
  return config.mesh_shape(len(devices), devices_per_node(node_major(devices, node_of)))


def make_mesh(config: Config, devices: Sequence | None = None,
              node_of: dict[int, str] | None = None) -> jax.sharding.Mesh:
  """The ``("dp", "ep")`` mesh of ``config`` over ``devices`` (default: all
  of the job's), laid out node by node (see the module docstring)."""
  devices = jax.devices() if devices is None else list(devices)
  node_of = device_nodes(devices) if node_of is None else node_of
  dp, ep = mesh_shape(config, devices, node_of)
  ordered = [device for group in node_major(devices, node_of) for device in group]
  # Auto axes: XLA propagates the batch sharding through the attention blocks
  # (the MoE layers take any mesh; tests/test_dropin.py covers jax.make_mesh's).
  return jax.sharding.Mesh(np.array(ordered).reshape(dp, ep), MESH_AXES)


def ep_span_note(mesh: jax.sharding.Mesh, config: Config,
                 node_of: dict[int, str] | None = None) -> str | None:
  """One line where some ep group of ``mesh`` spans nodes (the slower
  choice: its rows cross the network by ``all_to_all``), naming the ``ep``
  that would stay inside a node; None where every group is inside one."""
  devices = list(mesh.devices.flat)
  node_of = device_nodes(devices) if node_of is None else node_of
  rows = mesh.devices.reshape(-1, mesh.shape["ep"])
  spans = max(len({node_of[device.id] for device in row}) for row in rows)
  if spans == 1:
    return None
  groups = node_major(devices, node_of)
  automatic = dataclasses.replace(config, mesh=MeshConfig())
  inside = automatic.mesh_shape(len(devices), devices_per_node(groups))[1]
  return (f"note: ep={mesh.shape['ep']} spans {spans} nodes ({len(groups)} nodes of "
          f"{devices_per_node(groups)} devices): the dispatch and combine rows cross between "
          f"nodes by all_to_all over the network instead of NVLink inside a node; "
          f"mesh.dp=null mesh.ep=null chooses ep={inside}, inside each node, usually faster")
