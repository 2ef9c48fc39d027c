"""float32 views of narrow values that hold exactly the narrow values.

On GPUs XLA may keep a bfloat16 value in the float32 it was computed in
(``--xla_allow_excess_precision``, on by default; its pass drops a
float32 -> bfloat16 -> float32 round trip) depending on how it fuses the
program. The same layer with and without remat, or in two programs, then
reads other values where a bf16 value is widened: a router's logits move by
a bf16 ulp (a route can change), an activation's intermediate roundings
come and go, and one bf16 ulp moves an e4m3 code. Rounding to bfloat16
again (``reduce_precision``, which XLA keeps) is the identity on a bfloat16
value and fixes what such a widening reads.

Below everything else in the package (JAX only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exact_float32(x: jax.Array) -> jax.Array:
  """``x`` in float32, holding exactly the values of its own dtype, whatever
  XLA fuses: a bfloat16 ``x`` is rounded to bfloat16 again after the widening
  (the identity on every bfloat16 value, subnormals included). float16 is
  left as it is (XLA's ``reduce_precision`` flushes its subnormals to zero),
  float32 too."""
  x32 = x.astype(jnp.float32)
  if x.dtype != jnp.bfloat16:
    return x32
  return jax.lax.reduce_precision(x32, exponent_bits=8, mantissa_bits=7)
