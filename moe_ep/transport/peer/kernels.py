"""The peer kernels (``kernels/peer_*.cu``): which file holds each, compiled
once per device, and one launch of one of them (:class:`Kernel`)."""

from __future__ import annotations

import dataclasses
import functools

from moe_ep.transport import kernel_launch
from moe_ep.transport.kernel_launch import DTYPE_SUFFIX, KernelFile

THREADS = 512  # threads per block of every peer kernel but the fused slab layout
_SUFFIXES = tuple(DTYPE_SUFFIX.values())
KERNEL_FILES = (
    KernelFile("peer_exchange.cu", (*(f"peer_exchange_v{v}" for v in (16, 8, 4, 2, 1)),
                                    "peer_send_v16", "peer_drain_v16")),
    KernelFile("peer_dispatch.cu", ("peer_dispatch", "peer_dispatch_layout",
                                    *(f"peer_dispatch_fp8_{s}" for s in _SUFFIXES))),
    KernelFile("peer_combine.cu", (*(f"peer_combine_{s}" for s in _SUFFIXES),
                                   *(f"peer_combine_own_first_{s}" for s in _SUFFIXES))),
    KernelFile("peer_layout.cu", ("peer_slab_layout_v16",)),
)


def compile_kernels(ordinal: int) -> dict[str, object]:
  """Every peer kernel on CUDA device ``ordinal``, by name (compiled once)."""
  return kernel_launch.functions(ordinal, KERNEL_FILES)


def kernel(ordinal: int, name: str):
  """Kernel ``peer_<name>`` on CUDA device ``ordinal``."""
  return compile_kernels(ordinal)[f"peer_{name}"]


@functools.cache
def multiprocessors(ordinal: int) -> int:
  import cupy
  return cupy.cuda.Device(ordinal).attributes["MultiProcessorCount"]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One launch of a peer kernel: the pointers of the callback's buffers
  ``buffers`` (indices into its inputs then outputs) lead the arguments;
  ``threads`` per block, ``shared_bytes`` of dynamic shared memory."""

  function: object
  blocks: int
  buffers: tuple[int, ...]
  args: tuple
  threads: int = THREADS
  shared_bytes: int = 0

  def launch(self, buffers) -> None:
    """Launches on CuPy's current device and stream; ``buffers``: the
    callback's inputs then outputs (pointers or CuPy arrays)."""
    self.function((self.blocks,), (self.threads,),
                  (*(buffers[i] for i in self.buffers), *self.args),
                  shared_mem=self.shared_bytes)
