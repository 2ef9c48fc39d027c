"""How the one kernel loader (moe_ep/transport/kernel_launch.py) compiles
the kernel files of its users (the CuPy backend's routing and row kernels,
its FP8 kernels, the peer exchange's), against a stand-in for CuPy that
records what NVRTC would be asked: every file through ``compile_module``
with the project's source and options, on the device asked for, cached per
device and file; an NVRTC failure becomes an error naming the file; FP8
refuses GPUs before compute capability 8.9. (Real compilation:
test_kernel_compile.py with nvcc here, and every GPU test on a GPU.)"""

from __future__ import annotations

import sys
import types

import pytest

from moe_ep.experts import fp8_passes
from moe_ep.transport import cupy_backend
from moe_ep.transport import kernel_launch, kernel_source
from moe_ep.transport.peer import kernels as peer_kernels


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
  monkeypatch.setattr(kernel_launch, "_modules", {})
  monkeypatch.setattr(kernel_launch, "_tables", {})


def test_each_user_compiles_its_files_once_per_device(monkeypatch, fresh_caches):
  calls = []
  monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls))
  options = kernel_source.compile_options()

  functions = cupy_backend.kernels(3)
  assert calls == [(3, f.name, options) for f in cupy_backend.KERNEL_FILES]
  assert functions == {name: (f.name, name) for f in cupy_backend.KERNEL_FILES
                       for name in f.kernels}
  assert cupy_backend.fp8_kernels(3)["quantize_pack_bf16"] == ("fp8.cu", "quantize_pack_bf16")
  assert peer_kernels.kernel(5, "exchange_v16") == ("peer_exchange.cu", "peer_exchange_v16")
  assert fp8_passes._kernels(3)["fp8_act_quantize_swiglu"] == (
      "fp8_bank.cu", "fp8_act_quantize_swiglu")
  assert calls[len(cupy_backend.KERNEL_FILES):] == (
      [(3, "fp8.cu", options)] + [(5, f.name, options) for f in peer_kernels.KERNEL_FILES]
      + [(3, "fp8_bank.cu", options)])
  # every kernel file has one user (that its kernels exist: test_kernel_compile.py)
  users = (*cupy_backend.KERNEL_FILES, cupy_backend.FP8, *peer_kernels.KERNEL_FILES,
           fp8_passes.KERNELS)
  assert sorted(f.name for f in users) == sorted(kernel_source.KERNEL_FILES)
  count = len(calls)
  cupy_backend.kernels(3), cupy_backend.fp8_kernels(3), peer_kernels.compile_kernels(5)  # cached
  assert len(calls) == count


@pytest.mark.parametrize("loader, kernel_file", [
    (cupy_backend.kernels, "layout.cu"),
    (cupy_backend.fp8_kernels, "fp8.cu"),
    (peer_kernels.compile_kernels, "peer_dispatch.cu")])
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
    cupy_backend.fp8_kernels(1)
  assert calls == []  # refused before compiling
