"""Can an EP group take the peer path: every pair of its GPUs on one host,
with peer access both ways, seen by some process of that host. Every process
publishes what it sees once (the ``jax.distributed`` key-value store), so
all compute the same answer."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket

import jax
import numpy as np

from moe_ep import distributed
from moe_ep.transport import kernel_launch
from moe_ep.transport.peer.channel import check_axis, ep_groups
from moe_ep.transport.peer.runtime import RUNTIME, kv_client, kv_get

# Command buffers could then run two exchanges of one channel at once.
CONCURRENT_FLAG = "xla_gpu_command_buffer_scheduling_mode=CONCURRENT"


@dataclasses.dataclass(frozen=True)
class ProcessFacts:
  """What one process knows about its GPUs: its host, the PCI bus id of each
  of its JAX devices (by global id), every GPU it can see, and which ordered
  pairs of those have peer access (PCI bus ids)."""

  host: str
  device_pci: dict[int, str]
  visible_pci: tuple[str, ...]
  peer_pairs: frozenset[tuple[str, str]]

  def to_json(self) -> str:
    return json.dumps({"host": self.host,
                       "device_pci": {str(k): v for k, v in self.device_pci.items()},
                       "visible_pci": list(self.visible_pci),
                       "peer_pairs": sorted(map(list, self.peer_pairs))})

  @classmethod
  def from_json(cls, text: str) -> "ProcessFacts":
    data = json.loads(text)
    return cls(host=data["host"], device_pci={int(k): v for k, v in data["device_pci"].items()},
               visible_pci=tuple(data["visible_pci"]),
               peer_pairs=frozenset(tuple(pair) for pair in data["peer_pairs"]))


def reachability_problem(groups: list[tuple[int, ...]], facts: list[ProcessFacts],
                         process_of: dict[int, int]) -> str | None:
  """Why some pair of one EP group cannot use the peer path, or None.

  A pair qualifies when both devices are on one host and some process of
  that host sees both GPUs and has peer access between them both ways.

  Args:
    groups: the EP groups as global device ids.
    facts: :class:`ProcessFacts` of every process, by process index.
    process_of: global device id -> process index.
  """
  for group in groups:
    for i, a in enumerate(group):
      for b in group[i + 1:]:
        fa, fb = facts[process_of[a]], facts[process_of[b]]
        if fa.host != fb.host:
          return f"devices {a} and {b} of one EP group are on different hosts"
        pa, pb = fa.device_pci[a], fb.device_pci[b]
        witnesses = [f for f in facts if f.host == fa.host and {pa, pb} <= set(f.visible_pci)]
        if not witnesses:
          return (f"no process sees both GPUs {pa} and {pb} (devices {a} and {b}) to check "
                  f"peer access; keep every GPU visible to every process")
        if not all((pa, pb) in f.peer_pairs and (pb, pa) in f.peer_pairs for f in witnesses):
          return f"GPUs {pa} and {pb} (devices {a} and {b}) have no peer access"
  return None


def unsupported_reason(mesh: jax.sharding.Mesh, axis_name: str) -> str | None:
  """None where :func:`~moe_ep.transport.peer.exchange` can take the peer
  path, else why not."""
  check_axis(mesh, axis_name)
  devices = list(np.asarray(mesh.devices).flat)
  if any(d.platform != "gpu" for d in devices):
    return "the mesh has non-GPU devices"
  if not kernel_launch.cupy_available():
    return "CuPy is not installed"
  if CONCURRENT_FLAG in os.environ.get("XLA_FLAGS", "").replace("--", ""):
    return (f"XLA_FLAGS has --{CONCURRENT_FLAG}, which may run two exchanges of one channel "
            f"at once")
  key = (tuple(d.id for d in devices), mesh.axis_names, axis_name)
  if key not in RUNTIME.support:
    groups = [tuple(d.id for d in group) for group in ep_groups(mesh, axis_name)]
    process_of = {d.id: d.process_index for d in devices}
    RUNTIME.support[key] = reachability_problem(groups, _all_facts(), process_of)
  return RUNTIME.support[key]


def supported(mesh: jax.sharding.Mesh, axis_name: str) -> bool:
  """Whether every pair of GPUs in each EP group of ``mesh`` along
  ``axis_name`` has peer access on one host (and CuPy is installed). False on
  CPU, across hosts, or where a process cannot see a pair to check it. Every
  process computes the same answer from the same published facts."""
  return unsupported_reason(mesh, axis_name) is None


def _host_id() -> str:
  """Hostname plus boot id: two containers of one name on two machines differ."""
  return f"{socket.gethostname()}/{distributed.boot_id()}"


@functools.cache
def _local_facts() -> ProcessFacts:
  import cupy
  runtime = cupy.cuda.runtime
  visible = runtime.getDeviceCount()
  pci = [runtime.deviceGetPCIBusId(o) for o in range(visible)]
  pairs = frozenset((pci[a], pci[b]) for a in range(visible) for b in range(visible)
                    if a != b and runtime.deviceCanAccessPeer(a, b))
  device_pci = {d.id: pci[kernel_launch.device_ordinal(d)]
                for d in jax.local_devices(backend="gpu")}
  return ProcessFacts(host=_host_id(), device_pci=device_pci, visible_pci=tuple(pci),
                      peer_pairs=pairs)


def _all_facts() -> list[ProcessFacts]:
  """Every process's facts, read from the key-value store (published once)."""
  local = _local_facts()
  if jax.process_count() == 1:
    return [local]
  return [ProcessFacts.from_json(text) for text in _gather_facts(local.to_json())]


@functools.cache
def _gather_facts(local_json: str) -> tuple[str, ...]:
  client = kv_client()
  if client is None:
    raise RuntimeError("peer exchange across processes needs jax.distributed.initialize()")
  client.key_value_set_bytes(f"moe_ep/peer/facts/{jax.process_index()}", local_json.encode())
  return tuple(kv_get(client, f"moe_ep/peer/facts/{p}", f"process {p}'s GPU facts").decode()
               for p in range(jax.process_count()))
