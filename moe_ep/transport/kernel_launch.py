"""Launching ``kernels/*.cu`` on XLA's own stream: the one place that compiles
them, wraps XLA's streams and reads buffer pointers, for the CuPy backend
(:mod:`~moe_ep.transport.cupy_backend`, its FP8 kernels included) and the peer
exchange (:mod:`~moe_ep.transport.peer`).

A kernel call is one ``jax.experimental.buffer_callback`` (FFI buffers, no
host round trip) whose Python callback only launches kernels: raw pointers
from ``__cuda_array_interface__``, XLA's stream wrapped as a CuPy stream,
scratch space declared as an extra output, so nothing is allocated and
nothing synchronises. Launch shapes depend on static shapes only, so every
callback is ``command_buffer_compatible`` and XLA can replay it from a CUDA
graph. Kernel files compile with NVRTC once per device and file, at trace
time (never inside a step). CuPy is imported lazily, so this module imports
anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import threading

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from moe_ep.sharding import vary_like
from moe_ep.transport import kernel_source

INSTALL_HINT = ("transport='cupy' needs CuPy: pip install 'moe_ep[cuda13]' (CUDA 13) "
                "or 'moe_ep[cuda12]' (CUDA 12)")
# The kernels' name suffix of each row dtype they take (gather_sum_rows_bf16,
# quantize_pack_f32, peer_combine_f16, ...).
DTYPE_SUFFIX = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
MAX_THREADS = 256
SHARED_INTS = 12288  # 48 KiB of dynamic shared memory, the default limit


@dataclasses.dataclass(frozen=True, eq=False)
class KernelFile:
  """One file of ``kernels/`` and the kernels Python launches from it.
  (Compared by identity: a table of them is a cheap dictionary key.)"""

  name: str
  kernels: tuple[str, ...]


_modules: dict[tuple[int, str], object] = {}  # (ordinal, file) -> cupy.RawModule
_tables: dict[tuple[int, tuple], dict] = {}  # (ordinal, files) -> kernel name -> RawKernel
_streams: dict[tuple[int, int], object] = {}  # (ordinal, cudaStream_t) -> CuPy stream
_lock = threading.Lock()


def cupy_available() -> bool:
  return importlib.util.find_spec("cupy") is not None


def require_cupy() -> None:
  if not cupy_available():
    raise ImportError(INSTALL_HINT)


# --- compilation ---------------------------------------------------------------


def compile_module(kernel_file: str):
  """``kernels/<kernel_file>`` compiled by NVRTC for the current CUDA device:
  a ``cupy.RawModule``. Where NVRTC fails, RuntimeError naming the file, with
  the compiler's log."""
  import cupy
  module = cupy.RawModule(code=kernel_source.source(kernel_file),
                          options=kernel_source.compile_options())
  try:
    module.compile()
  except cupy.cuda.compiler.CompileException as error:
    raise RuntimeError(f"compiling kernels/{kernel_file} failed:\n{error}") from error
  return module


def functions(ordinal: int, kernel_files: tuple[KernelFile, ...]) -> dict[str, object]:
  """The kernels of ``kernel_files`` on CUDA device ``ordinal``, by name:
  each file compiled once per device (cached), its kernels looked up once."""
  key = (ordinal, kernel_files)
  table = _tables.get(key)
  if table is not None:
    return table
  with _lock:
    if key not in _tables:
      import cupy
      table = {}
      with cupy.cuda.Device(ordinal):
        for kernel_file in kernel_files:
          module = _modules.get((ordinal, kernel_file.name))
          if module is None:
            module = _modules[(ordinal, kernel_file.name)] = compile_module(kernel_file.name)
          table.update({name: module.get_function(name) for name in kernel_file.kernels})
      _tables[key] = table
    return _tables[key]


def device_ordinal(device) -> int:
  """The CUDA ordinal of a local JAX GPU device."""
  hardware_id = getattr(device, "local_hardware_id", None)
  return device.id if hardware_id is None else hardware_id


def local_gpu_ordinals() -> list[int]:
  try:
    devices = jax.local_devices(backend="gpu")
  except RuntimeError:
    return []
  return [device_ordinal(device) for device in devices]


def compile_for_local_gpus(load) -> None:
  """``load(ordinal)`` (which compiles) for every local GPU now, so no step
  ever waits for NVRTC. Without CuPy or GPUs (e.g. lowering for CUDA on a CPU
  machine) it does nothing; the callbacks then fail only if they run."""
  if not cupy_available():
    return
  for ordinal in local_gpu_ordinals():
    load(ordinal)


# --- launching -----------------------------------------------------------------


def pointer(buffer) -> np.uint64:
  return np.uint64(buffer.__cuda_array_interface__["data"][0])


def i32(*values):
  return tuple(np.int32(v) for v in values)


def buffer_ordinal(buffer) -> int:
  """The CUDA ordinal a callback's buffer lives on."""
  device_type, ordinal = buffer.__dlpack_device__()
  if device_type != 2:  # kDLCUDA
    raise RuntimeError("transport='cupy' ran on a non-CUDA buffer; use transport='auto' or 'xla' "
                       "off CUDA devices")
  return ordinal


class _StreamHandle:
  """A raw ``cudaStream_t`` in the CUDA stream protocol."""

  def __init__(self, handle: int):
    self.handle = handle

  def __cuda_stream__(self):
    return (0, self.handle)


def xla_stream(ordinal: int, handle: int):
  """XLA's stream ``handle`` on GPU ``ordinal`` as a CuPy stream, one per
  stream (``Stream.from_external`` where CuPy has it, the older
  ``ExternalStream`` otherwise)."""
  key = (ordinal, handle)
  stream = _streams.get(key)
  if stream is None:
    import cupy
    if hasattr(cupy.cuda.Stream, "from_external"):
      with cupy.cuda.Device(ordinal):
        stream = cupy.cuda.Stream.from_external(_StreamHandle(handle))
    else:
      stream = cupy.cuda.ExternalStream(handle, ordinal)
    stream = _streams.setdefault(key, stream)
  return stream


@contextlib.contextmanager
def on_xla_stream(ctx, buffer, load):
  """Makes the buffer's device and XLA's stream current; yields
  ``launch(name, grid, block, *args, shared_ints=0)`` over the kernels
  ``load(ordinal)`` returns."""
  import cupy
  ordinal = buffer_ordinal(buffer)
  kernels = load(ordinal)

  def launch(name, grid, block, *args, shared_ints=0):
    kernels[name]((int(grid),), (int(block),), args, shared_mem=4 * shared_ints)

  with cupy.cuda.Device(ordinal), xla_stream(ordinal, ctx.stream):
    yield launch


def varying_like(outputs, inputs, also=frozenset()) -> list:
  """buffer_callback drops shard_map's varying-axes type; restore the union
  of the inputs' (and ``also``), so both platform branches agree."""
  return [vary_like(out, *inputs, also=also) for out in outputs]


def call(scope: str, callback, result_shapes, *inputs, kernels) -> list:
  """One command-buffer-compatible ``buffer_callback`` under the named
  scope ``scope``, its outputs varying like its inputs; ``kernels(ordinal)``
  (which compiles the kernels ``callback`` launches) runs for every local GPU
  first (:func:`compile_for_local_gpus`)."""
  compile_for_local_gpus(kernels)
  with jax.named_scope(scope):
    outputs = buffer_callback(callback, result_shapes, command_buffer_compatible=True)(*inputs)
  return varying_like(outputs, inputs)


def threads_for(row_work: int) -> int:
  """Threads per block for ``row_work`` units of a row: whole warps, at
  most :data:`MAX_THREADS`."""
  return int(min(MAX_THREADS, max(32, -(-row_work // 32) * 32)))
