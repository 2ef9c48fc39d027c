"""The options the configuration and the transport share: which transports,
exchanges and wire dtypes a caller may ask for, which dtypes the layer
computes, and which values a remat policy may save.

Below both (JAX only): :mod:`moe_ep.config` validates against these
without loading :mod:`moe_ep.transport`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The local passes' implementations: CuPy kernels on CUDA (pure JAX
# elsewhere), pure JAX, or CuPy kernels always.
TRANSPORTS = ("auto", "xla", "cupy")
EXCHANGES = ("auto", "all_to_all", "peer")
WIRE_DTYPES = ("float8_e4m3fn",)
# Floating dtypes the transport moves exactly: its sums and routing weights
# are float32, so float64 would silently lose precision (refused by name).
# The FP8 wire's quantize reads the same three exactly.
TOKEN_DTYPES = ("bfloat16", "float16", "float32")
# The values dispatch names f"{checkpoint_name}.{field}" (and their residual).
CHECKPOINT_FIELDS = ("tokens", "weights", "handle", "counts")

def check_transport(transport: str) -> None:
  if transport not in TRANSPORTS:
    raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")


def check_wire_dtype(wire_dtype, name: str = "wire_dtype") -> str | None:
  """``wire_dtype`` as None or its name in :data:`WIRE_DTYPES` (a dtype
  object is read by its name); ValueError naming ``name`` otherwise, or where
  this JAX has no ``jnp.float8_e4m3fn``."""
  if wire_dtype is None:
    return None
  dtype_name = wire_dtype if isinstance(wire_dtype, str) else getattr(
      wire_dtype, "__name__", getattr(wire_dtype, "name", None))
  if dtype_name not in WIRE_DTYPES:
    raise ValueError(f"{name}={wire_dtype!r} must be None or one of {WIRE_DTYPES}")
  if not hasattr(jnp, dtype_name):
    raise ValueError(f"{name}={dtype_name!r} needs a JAX with jnp.{dtype_name}; "
                     f"jax {jax.__version__} has none: upgrade JAX or set {name}=None")
  return dtype_name
