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
