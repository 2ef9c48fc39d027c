"""The activations against float64 numpy references, their input widths
against the configuration's, and the ``F < 2H`` rule at its boundary."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep import activations
from moe_ep.config import MoEConfig


def gelu(x):  # tanh form, as jax.nn.gelu's default
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
  return x / (1 + np.exp(-x))


REFERENCES = {"gelu": gelu, "swiglu": lambda g, u: silu(g) * u, "geglu": lambda g, u: gelu(g) * u}


@pytest.mark.parametrize("activation", activations.ACTIVATIONS)
def test_activate_matches_float64_and_reads_n_input_projections(activation):
  n = activations.input_projections(activation)
  assert n == MoEConfig(hidden_size=4, ffn_size=6, num_experts=2, top_k=1,
                        activation=activation).num_input_projections
  hidden = np.random.default_rng(0).normal(size=(5, n * 6))
  want = REFERENCES[activation](*np.split(hidden, n, axis=-1))
  got = activations.activate(jnp.asarray(hidden, jnp.float32), activation)
  assert got.shape == (5, 6)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)  # float32 rounding


def test_row_weights_scale_each_row_of_the_activation():
  hidden = np.random.default_rng(1).normal(size=(4, 12)).astype(np.float32)
  weights = np.array([0.5, 2.0, 0.0, 1.25], np.float32)
  got = activations.activate(jnp.asarray(hidden), "swiglu", jnp.asarray(weights))
  want = weights[:, None] * REFERENCES["swiglu"](*np.split(hidden.astype(np.float64), 2, -1))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_an_unknown_activation_is_named():
  with pytest.raises(ValueError, match="activation='relu'"):
    activations.activate(jnp.ones((2, 4)), "relu")


def test_the_activation_is_small_where_ffn_is_below_twice_hidden():
  assert activations.small_activation(hidden=2048, ffn=768)
  assert activations.small_activation(hidden=2048, ffn=4095)
  assert not activations.small_activation(hidden=2048, ffn=4096)
  assert not activations.small_activation(hidden=6144, ffn=16384)


@pytest.mark.parametrize("activation", activations.ACTIVATIONS)
def test_a_bfloat16_activation_is_the_float32_value_rounded_once(activation):
  """bf16 in, bf16 out, one rounding: against float64 of the bf16 inputs
  (and row weights) rounded once to bf16, equal but where float32's own
  error (2**-24) lands on the other side of a bf16 rounding boundary, and
  never a bf16 ulp (2**-8 of the value) apart. With bf16 intermediates
  (sigmoid, silu, the product, the weighting each rounded), half of the
  swiglu values differ. Gates from -1 on: below, gelu's ``1 + tanh``
  cancels and float32 itself is off by more."""
  n = activations.input_projections(activation)
  rng = np.random.default_rng(3)
  hidden = jnp.asarray(rng.uniform(-1, 4, size=(256, n * 64)), jnp.bfloat16)
  weights = jnp.asarray(rng.uniform(0.1, 1, size=256), jnp.float32)
  got = np.asarray(activations.activate(hidden, activation, weights).astype(jnp.float32),
                   np.float64)
  exact = (np.asarray(weights, np.float64)[:, None]
           * REFERENCES[activation](*np.split(np.asarray(hidden.astype(jnp.float32),
                                                        np.float64), n, axis=-1)))
  want = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
  apart = got != want
  assert apart.mean() < 1e-3, apart.mean()
  np.testing.assert_allclose(got[apart], want[apart], rtol=2 ** -8)
  assert activations.activate(hidden, activation).dtype == jnp.bfloat16
