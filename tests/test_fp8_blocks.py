"""moe_ep.fp8_blocks against its own rule on values computed in the same
program (the rule itself is held to float64 NumPy in tests/transport/test_fp8.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep import fp8_blocks
from moe_ep.precision import exact_float32


def test_a_bfloat16_value_computed_in_the_program_is_quantized_as_rounded():
  """A bf16 value that XLA computes in the same program as its quantization
  gets the codes and scales of the rounded bf16 value. On GPUs XLA may keep
  the float32 value it came from (excess precision, by how it fuses), and
  one bf16 ulp moves an e4m3 code in about 3% of the elements; remat changes
  the fusion, so without the rounding the same layer quantizes other values
  with and without remat. CPU XLA keeps the rounding anyway: there this
  checks only that the rule is unchanged."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 384)), jnp.float32)

  def computed_then_quantized(x):
    return fp8_blocks.quantize((x * 3.0 + 0.1).astype(jnp.bfloat16), (1, 128))

  rounded = jax.jit(lambda x: (x * 3.0 + 0.1).astype(jnp.bfloat16))(x)
  want_codes, want_scales = jax.jit(lambda v: fp8_blocks.quantize(v, (1, 128)))(rounded)
  codes, scales = jax.jit(computed_then_quantized)(x)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  np.testing.assert_array_equal(np.asarray(codes.astype(jnp.float32)),
                                np.asarray(want_codes.astype(jnp.float32)))


def test_the_rounding_again_is_the_identity_on_every_bfloat16_value():
  """Every finite bfloat16 (all 65536 bit patterns but the NaNs and
  infinities, subnormals and signed zeros included) reaches float32 with the
  same bits through the quantizer's rounding as through a plain convert."""
  bits = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
  values = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
  want = np.asarray(values.astype(jnp.float32))
  got = np.asarray(jax.jit(exact_float32)(values))
  finite = np.isfinite(want)
  assert finite.sum() == 2 ** 16 - 2 * 2 ** 7  # less the top exponent: 254 NaNs, two infinities
  np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
