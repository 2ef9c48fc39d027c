"""How the three kernel loaders (the CuPy backend's, the FP8 kernels', the
peer exchange's) compile their kernel files, against a stand-in for CuPy that
records what NVRTC would be asked: every file through ``cupy.compile_module``
with the project's source and options, on the device asked for, cached per
device; an NVRTC failure becomes an error naming the file; FP8 refuses GPUs
before compute capability 8.9. (Real compilation: test_kernel_compile.py with
nvcc here, and every GPU test on a GPU.)"""

from __future__ import annotations

import sys
import types

import pytest

from moe_ep.transport import cupy as cupy_backend
from moe_ep.transport import fp8, kernel_source, peer


class FakeCompileException(Exception):
  pass


def fake_cupy(calls: list, *, capability: str = "90", failing_file: str | None = None):
  """A module standing in for ``cupy``: ``RawModule(code, options)`` records
  (device, kernel file, options) on compile; ``get_function`` returns
  (kernel file, name)."""
  current = []

  class Device:
    def __init__(self, ordinal):
      self.id, self.compute_capability = ordinal, capability

    def __enter__(self):
      current.append(self.id)
      return self

    def __exit__(self, *exc):
      current.pop()

  class RawModule:
    def __init__(self, code, options):
      self.file = next(name for name in kernel_source.KERNEL_FILES
                       if code == kernel_source.source(name))
      self.options = options

    def compile(self):
      calls.append((current[-1] if current else None, self.file, self.options))
      if self.file == failing_file:
        raise FakeCompileException(f"{self.file}(12): error: identifier undefined")

    def get_function(self, name):
      return (self.file, name)

  compiler = types.SimpleNamespace(CompileException=FakeCompileException)
  return types.SimpleNamespace(RawModule=RawModule,
                               cuda=types.SimpleNamespace(Device=Device, compiler=compiler))


@pytest.fixture
def fresh_caches(monkeypatch):
  monkeypatch.setattr(cupy_backend, "_compiled", {})
  monkeypatch.setattr(fp8, "_compiled", {})
  monkeypatch.setattr(peer, "_modules", {})


def test_each_loader_compiles_its_files_once_per_device(monkeypatch, fresh_caches):
  calls = []
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls))
  options = kernel_source.COMPILE_OPTIONS

  functions = cupy_backend.compile_kernels(3)
  assert calls == [(3, name, options) for name in cupy_backend.KERNELS]
  assert functions == {name: (file, name) for file, names in cupy_backend.KERNELS.items()
                       for name in names}
  assert fp8.compile_kernels(3)["quantize_pack_bf16"] == ("fp8.cu", "quantize_pack_bf16")
  assert peer._kernels(5)["exchange_v16"] == ("peer.cu", "peer_exchange_v16")
  assert calls[len(cupy_backend.KERNELS):] == [(3, "fp8.cu", options), (5, "peer.cu", options)]
  count = len(calls)
  cupy_backend.compile_kernels(3), fp8.compile_kernels(3), peer._kernels(5)  # cached
  assert len(calls) == count


@pytest.mark.parametrize("loader, kernel_file", [
    (cupy_backend.compile_kernels, "layout.cu"),
    (fp8.compile_kernels, "fp8.cu"),
    (peer._kernels, "peer.cu")])
def test_an_nvrtc_failure_names_the_kernel_file_and_keeps_the_log(monkeypatch, fresh_caches,
                                                                   loader, kernel_file):
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy([], failing_file=kernel_file))
  with pytest.raises(RuntimeError, match=rf"compiling kernels/{kernel_file} failed:\n"
                                         rf".*{kernel_file}\(12\): error"):
    loader(0)


def test_fp8_kernels_refuse_gpus_before_compute_capability_8_9(monkeypatch, fresh_caches):
  calls = []
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls, capability="80"))
  with pytest.raises(RuntimeError, match=r"compute capability >= 8\.9; cuda:1 has 8\.0"):
    fp8.compile_kernels(1)
  assert calls == []  # refused before compiling
