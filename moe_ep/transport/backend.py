"""Picks the implementation of the transport's local passes.

A backend is a module (or an object) with the functions of
:mod:`moe_ep.transport.xla` named in :data:`_FUNCTIONS`: ``route``,
``slab_layout``, ``expand_rows``, ``gather_sum_rows``, and the FP8 dispatch's
``quantize_pack_expand``, ``unpack_dequantize_expand`` and
``dequantize_filled_rows`` (whose CUDA kernels need compute capability
8.9+). Exchanges, custom_vjp rules and checkpoint names live above the
backends, in :mod:`moe_ep.transport`.
"""

from __future__ import annotations

import functools

import jax

from moe_ep.transport import xla

BACKENDS = ("auto", "xla", "cupy")
_FUNCTIONS = ("route", "slab_layout", "expand_rows", "gather_sum_rows",
              "quantize_pack_expand", "unpack_dequantize_expand", "dequantize_filled_rows")


def check_name(backend: str) -> None:
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")


class _PerPlatform:
  """Each function dispatches on the lowering platform: CuPy kernels on CUDA,
  pure JAX elsewhere (``lax.platform_dependent`` lowers only the branch of the
  platform it compiles for)."""

  def __init__(self, cuda, default):
    for name in _FUNCTIONS:
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
  check_name(backend)
  if backend == "xla":
    return xla
  from moe_ep.transport import cupy as cupy_backend  # imports cupy lazily
  if backend == "cupy":
    cupy_backend.require_cupy()
    return cupy_backend
  if cupy_backend.cupy_available():
    return _PerPlatform(cuda=cupy_backend, default=xla)
  return xla
