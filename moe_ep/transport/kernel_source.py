"""Finds and assembles the CUDA sources in ``kernels/`` (no CuPy needed).

Used by the CuPy backend (NVRTC) and by the test that compiles every kernel
with ``nvcc``, so both see the same text: ``common.cuh``, the headers the
kernel file uses (:data:`HEADERS`), then the kernel file, each under a
``#line`` directive so compiler errors name the file and line.
"""

from __future__ import annotations

import importlib.resources
import pathlib

COMMON_HEADER = "common.cuh"
KERNEL_FILES = ("rows.cu", "layout.cu", "fp8.cu", "peer_exchange.cu", "peer_dispatch.cu",
                "peer_combine.cu", "peer_layout.cu")
# Headers prepended after COMMON_HEADER, in order: the FP8 format's rules
# serve the FP8 row passes and the peer dispatch that quantizes as it sends;
# the slab layout serves the layout kernels and the peer launches fused with
# it; the peer protocol (peer.cuh) every peer kernel, its row machinery
# (peer_rows.cuh) the fused row kernels, and its metadata landing
# (peer_layout.cuh) the launches that lay the slabs out themselves.
_PEER_ROWS = ("peer.cuh", "peer_rows.cuh")
HEADERS = {"fp8.cu": ("fp8.cuh",), "layout.cu": ("slab_layout.cuh",),
           "peer_exchange.cu": ("peer.cuh",),
           "peer_dispatch.cu": ("fp8.cuh", "slab_layout.cuh", *_PEER_ROWS, "peer_layout.cuh"),
           "peer_combine.cu": _PEER_ROWS,
           "peer_layout.cu": ("slab_layout.cuh", *_PEER_ROWS, "peer_layout.cuh")}
# NVRTC options; nvcc understands the same ones.
COMPILE_OPTIONS = ("-std=c++17",)


def kernel_dir() -> pathlib.Path:
  """``kernels/`` of a source checkout, or the copy shipped in the wheel."""
  checkout = pathlib.Path(__file__).resolve().parents[2] / "kernels"
  if (checkout / COMMON_HEADER).is_file():
    return checkout
  shipped = pathlib.Path(str(importlib.resources.files("moe_ep.kernels")))
  if (shipped / COMMON_HEADER).is_file():
    return shipped
  raise FileNotFoundError(f"moe_ep kernels not found in {checkout} or {shipped}")


def source(kernel_file: str) -> str:
  """The full translation unit of one kernel file."""
  if kernel_file not in KERNEL_FILES:
    raise ValueError(f"kernel_file={kernel_file!r} is not one of {KERNEL_FILES}")
  folder = kernel_dir()
  parts = []
  for name in (COMMON_HEADER, *HEADERS.get(kernel_file, ()), kernel_file):
    path = folder / name
    parts.append(f'#line 1 "{path}"\n{path.read_text()}')
  return "\n".join(parts)
