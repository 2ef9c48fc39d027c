"""moe_ep.transport.peer.release on CPU: the runtime's state is filled by
hand (the device memory stands in as plain objects, CuPy as a recorder), so
the test sees what release frees, in which order, and that programs traced
before it refuse to run. The GPU tests run it on real channels."""

import ctypes
import gc
import sys
import types
import weakref

import pytest

from moe_ep.transport import peer
from moe_ep.transport.peer.channel import ALIGN
from moe_ep.transport.peer.failures import Failure
from moe_ep.transport.peer.runtime import MAX_LOCAL_DEVICES, Channel, OnDevice, Runtime

CHANNEL_BYTES = 1 << 20


class DeviceMemory:
  """Stands in for a cupy.cuda.Memory: freed when its last reference goes."""


def fake_cupy(calls: list) -> types.ModuleType:
  """A ``cupy`` whose device and runtime calls append to ``calls``."""
  current = []

  class Device:
    def __init__(self, ordinal):
      self.ordinal = ordinal

    def __enter__(self):
      current.append(self.ordinal)

    def __exit__(self, *exc):
      current.pop()

  def recorder(name):
    return lambda *args: calls.append((name, current[-1] if current else None, *args))

  runtime = types.SimpleNamespace(**{name: recorder(name) for name in (
      "deviceSynchronize", "ipcCloseMemHandle", "freeHost")})
  module = types.ModuleType("cupy")
  module.cuda = types.SimpleNamespace(Device=Device, runtime=runtime)
  return module


def filled_runtime() -> tuple[Runtime, list]:
  """A runtime holding one channel on cuda:0 and cuda:1, a failure word on
  each, one IPC mapping (cuda:1 of another process's buffer) and the
  records; and weak references to every piece of device memory."""
  runtime = Runtime()
  layout = types.SimpleNamespace(total_bytes=CHANNEL_BYTES)
  memories = [DeviceMemory() for _ in range(4)]
  runtime.channels["key"] = Channel("key", layout, {
      ordinal: OnDevice(ordinal, ordinal, (), memories[ordinal], None) for ordinal in (0, 1)})
  runtime.failed_words.update({0: memories[2], 1: memories[3]})
  runtime.opened[(1, "key", 7)] = 0xD00D
  runtime.records = (Failure * MAX_LOCAL_DEVICES)()
  runtime.records_device_ptr = 0xBEEF
  runtime.site("exchange", (2, 4), "float32", runtime.channels["key"])
  return runtime, [weakref.ref(memory) for memory in memories]


def test_release_frees_every_allocation_after_synchronising(monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls))
  runtime, memories = filled_runtime()
  records_address = ctypes.addressof(runtime.records)
  held = 2 * CHANNEL_BYTES + 2 * ALIGN
  assert runtime.buffer_bytes() == held

  assert runtime.release() == held
  # Every device idle first, then the mapping closed on the device that
  # opened it, then the host-mapped records.
  assert calls == [("deviceSynchronize", 0), ("deviceSynchronize", 1),
                   ("ipcCloseMemHandle", 1, 0xD00D), ("freeHost", None, records_address)]
  gc.collect()
  assert all(memory() is None for memory in memories), "device memory still referenced"
  assert runtime.buffer_bytes() == 0 and runtime.generation == 1
  assert (runtime.channels, runtime.failed_words, runtime.opened, runtime.sites) == ({}, {}, {},
                                                                                     [])
  assert runtime.records is None and runtime.records_device_ptr == 0
  runtime.raise_if_failed()  # nothing recorded, nothing to raise
  runtime.reset()  # nothing to rearm

  # Nothing held: nothing to free, and no CuPy needed.
  monkeypatch.setitem(sys.modules, "cupy", None)
  calls.clear()
  assert runtime.release() == 0 and calls == [] and runtime.generation == 2


def test_programs_traced_before_a_release_refuse_to_run(monkeypatch):
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy([]))
  runtime, _ = filled_runtime()
  traced = runtime.generation
  runtime.check_traced(traced, "exchange_rows")  # same generation: runs
  runtime.release()
  with pytest.raises(RuntimeError, match=r"peer exchange_rows was traced before "
                                         r"moe_ep.transport.peer.release\(\) freed its channels"):
    runtime.check_traced(traced, "exchange_rows")
  runtime.check_traced(runtime.generation, "exchange_rows")


def test_module_release_frees_this_process_runtime(monkeypatch):
  """``peer.release()`` acts on the process's runtime (a fresh one here, so
  a GPU session's own channels stay)."""
  calls = []
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls))
  runtime, _ = filled_runtime()
  monkeypatch.setattr(peer.runtime, "RUNTIME", runtime)
  assert peer.buffer_bytes() == 2 * CHANNEL_BYTES + 2 * ALIGN
  assert peer.release() == 2 * CHANNEL_BYTES + 2 * ALIGN
  assert peer.buffer_bytes() == 0 and runtime.generation == 1 and calls
  assert "release" in peer.__all__
