"""examples/mesh.py: ep inside a node, dp across nodes, and the one line when
a config asks for an ep that spans nodes. The 8 CPU devices stand in for
the devices of several nodes (the node of each device is given)."""

import jax
import numpy as np
import pytest

from tiny_run import TINY_YAML
from examples import mesh as device_mesh
from examples.train_config import load_config

# Experts 8, batch 32 (tiny.yaml): every mesh of 8 devices fits.
DEVICES = jax.devices("cpu")[:8]


def nodes_of(names) -> dict[int, str]:
  """Device id -> node name, the i-th of DEVICES on ``names[i]``."""
  return {device.id: name for device, name in zip(DEVICES, names)}


def config(*overrides):
  return load_config(TINY_YAML, list(overrides))


def test_automatic_mesh_keeps_ep_inside_each_node():
  # Two nodes of 4 devices, listed interleaved (as a job's processes may be).
  node_of = nodes_of(["a", "b"] * 4)
  mesh = device_mesh.make_mesh(config(), DEVICES, node_of)
  assert dict(mesh.shape) == {"dp": 2, "ep": 4}
  for row in mesh.devices:  # each ep group: one node, its devices in id order
    assert len({node_of[d.id] for d in row}) == 1
    assert [d.id for d in row] == sorted(d.id for d in row)
  assert node_of[mesh.devices[0, 0].id] == "a"  # nodes in the order of their first device
  assert device_mesh.ep_span_note(mesh, config(), node_of) is None


def test_one_node_is_the_single_machine_mesh():
  mesh = device_mesh.make_mesh(config(), DEVICES, nodes_of(["host"] * 8))
  assert dict(mesh.shape) == {"dp": 1, "ep": 8}
  assert list(mesh.devices.flat) == DEVICES


@pytest.mark.parametrize("nodes, want", [
    (["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["d"] * 2, (4, 2)),  # 4 nodes of 2
    (["a"] * 8, (1, 8)),
    ([str(i) for i in range(8)], (8, 1)),                    # one device per node: no EP
])
def test_automatic_ep_is_the_largest_that_fits_a_node(nodes, want):
  assert device_mesh.mesh_shape(config(), DEVICES, nodes_of(nodes)) == want


def test_ep_across_nodes_is_allowed_and_named_in_one_line():
  node_of = nodes_of(["a"] * 4 + ["b"] * 4)
  mesh = device_mesh.make_mesh(config("mesh.ep=8"), DEVICES, node_of)
  assert dict(mesh.shape) == {"dp": 1, "ep": 8}
  note = device_mesh.ep_span_note(mesh, config("mesh.ep=8"), node_of)
  assert note == ("note: ep=8 spans 2 nodes (2 nodes of 4 devices): the dispatch and combine "
                  "rows cross between nodes by all_to_all over the network instead of NVLink "
                  "inside a node; mesh.dp=null mesh.ep=null chooses ep=4, inside each node, "
                  "usually faster")
  assert "\n" not in note


def test_mesh_is_the_same_whatever_order_the_devices_come_in():
  """Every process builds the mesh from its own jax.devices(): the layout
  depends only on the devices and their nodes."""
  node_of = nodes_of(["a", "b"] * 4)
  order = np.random.default_rng(0).permutation(8)
  shuffled = device_mesh.make_mesh(config(), [DEVICES[i] for i in order], node_of)
  assert (shuffled.devices == device_mesh.make_mesh(config(), DEVICES, node_of).devices).all()
