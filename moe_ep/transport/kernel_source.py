"""Finds the CUDA sources in ``kernels/`` (no CuPy needed).

Used by the CuPy backend (NVRTC) and by the test that compiles every kernel
with ``nvcc``, so both see the same text and options: each kernel file
includes (``#include``) its headers (``common.cuh`` and the ``.cuh`` files it uses,
each guarded), found through ``-I`` on :func:`kernel_dir`
(:func:`compile_options`). The text starts with a digest of the headers, so a
compile cache keyed on the text (CuPy's) misses when a header changes, and a
``#line`` directive, so compiler errors name the file and line.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import pathlib

COMMON_HEADER = "common.cuh"
KERNEL_FILES = ("rows.cu", "layout.cu", "fp8.cu", "fp8_bank.cu", "peer_exchange.cu",
                "peer_dispatch.cu", "peer_combine.cu", "peer_layout.cu")
# NVRTC options besides the include path; nvcc understands the same ones.
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


def compile_options() -> tuple[str, ...]:
  """The NVRTC (and nvcc) options: :data:`COMPILE_OPTIONS` and the headers'
  folder as the include path."""
  return (*COMPILE_OPTIONS, f"-I{kernel_dir()}")


def headers_digest(folder: pathlib.Path) -> str:
  """16 hex digits of SHA-256 over every header's name and text in ``folder``."""
  digest = hashlib.sha256()
  for path in sorted(folder.glob("*.cuh")):
    digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()[:16]


def source(kernel_file: str) -> str:
  """The text of one kernel file, as compiled with :func:`compile_options`."""
  if kernel_file not in KERNEL_FILES:
    raise ValueError(f"kernel_file={kernel_file!r} is not one of {KERNEL_FILES}")
  folder = kernel_dir()
  path = folder / kernel_file
  return (f"// headers {headers_digest(folder)}\n"
          f'#line 1 "{path}"\n{path.read_text()}')
