"""Picks the implementation of the transport's local passes.

A backend is a module (or an object) with the functions of
:mod:`moe_ep.transport.xla` named in :data:`FUNCTIONS`: ``route``,
``slab_layout``, ``expand_rows``, ``gather_sum_rows``, and the FP8 dispatch's
``quantize_pack_expand``, ``unpack_dequantize_expand`` and
``dequantize_filled_rows`` (whose CUDA kernels need compute capability
8.9+). Exchanges, custom_vjp rules and checkpoint names live above the
backends (:mod:`~moe_ep.transport.ops`, :mod:`~moe_ep.transport.row_paths`).
"""

from __future__ import annotations

import functools

import jax

from moe_ep.transport import cupy_backend
from moe_ep.transport import kernel_launch, xla
from moe_ep.options import BACKENDS, check_backend

__all__ = ["BACKENDS", "FUNCTIONS", "check_backend", "resolve"]

FUNCTIONS = ("route", "slab_layout", "expand_rows", "gather_sum_rows",
             "quantize_pack_expand", "unpack_dequantize_expand", "dequantize_filled_rows")


class _PerPlatform:
  """Each function dispatches on the lowering platform: CuPy kernels on CUDA,
  pure JAX elsewhere (``lax.platform_dependent`` lowers only the branch of the
  platform it compiles for)."""

  def __init__(self, cuda, default):
    for name in FUNCTIONS:
      setattr(self, name, functools.partial(
          self._call, getattr(cuda, name), getattr(default, name)))

  @staticmethod
  def _call(cuda_fn, default_fn, *args, **static):
    return jax.lax.platform_dependent(
        *args, cuda=functools.partial(cuda_fn, **static),
        default=functools.partial(default_fn, **static))


@functools.cache
def resolve(backend: str):
  """Returns the backend object for a name in :data:`BACKENDS`.

  ``"auto"`` uses the CuPy kernels on CUDA devices when CuPy imports, pure JAX
  everywhere else; ``"cupy"`` raises ImportError naming the extra to install
  where CuPy is missing.
  """
  check_backend(backend)
  if backend == "xla":
    return xla
  if backend == "cupy":
    kernel_launch.require_cupy()
    return cupy_backend
  if kernel_launch.cupy_available():
    return _PerPlatform(cuda=cupy_backend, default=xla)
  return xla
