"""The expert bank against a per-expert loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep.experts import expert_mlp


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
def test_expert_mlp_matches_per_expert_loop(activation):
  rng = np.random.default_rng(0)
  experts, rows, hidden, ffn = 3, 5, 4, 6
  n_in = 1 if activation == "gelu" else 2
  tokens = rng.normal(size=(experts, rows, hidden)).astype(np.float32)
  w_in = rng.normal(size=(experts, hidden, n_in * ffn)).astype(np.float32)
  w_out = rng.normal(size=(experts, ffn, hidden)).astype(np.float32)
  got = expert_mlp(jnp.asarray(tokens), w_in, w_out, activation)
  gelu = lambda v: np.asarray(jax.nn.gelu(v))
  for e in range(experts):
    h = tokens[e] @ w_in[e]
    if activation == "gelu":
      act = gelu(h)
    else:
      gate, up = h[:, :ffn], h[:, ffn:]
      act = (gate / (1 + np.exp(-gate)) if activation == "swiglu" else gelu(gate)) * up
    np.testing.assert_allclose(np.asarray(got[e]), act @ w_out[e], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
def test_row_weights_through_the_activation_equal_weighting_the_output(activation):
  """(w * a) @ W_out == w * (a @ W_out): values and every gradient (the
  routing weights' included) of the two ways the layer may weight a row, in
  float32 (1e-5: float32 rounding of sums of a few dozen terms of order 1,
  added in another order)."""
  rng = np.random.default_rng(1)
  experts, rows, hidden, ffn = 2, 5, 4, 6
  n_in = 1 if activation == "gelu" else 2
  tokens = jnp.asarray(rng.normal(size=(experts, rows, hidden)), jnp.float32)
  w_in = jnp.asarray(rng.normal(size=(experts, hidden, n_in * ffn)), jnp.float32)
  w_out = jnp.asarray(rng.normal(size=(experts, ffn, hidden)), jnp.float32)
  weights = jnp.asarray(rng.uniform(size=(experts, rows)), jnp.float32).at[1, -1].set(0.0)
  cotangent = jnp.asarray(rng.normal(size=(experts, rows, hidden)), jnp.float32)

  def through_activation(x, a, b, w):
    return jnp.vdot(expert_mlp(x, a, b, activation, row_weights=w), cotangent)

  def on_output(x, a, b, w):
    return jnp.vdot(expert_mlp(x, a, b, activation) * w[..., None], cotangent)

  args = (tokens, w_in, w_out, weights)
  got = jax.value_and_grad(through_activation, argnums=(0, 1, 2, 3))(*args)
  with jax.default_matmul_precision("highest"):
    want = jax.value_and_grad(on_output, argnums=(0, 1, 2, 3))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  # A row of weight zero contributes nothing, and gets nothing back.
  assert not np.any(np.asarray(got[1][0])[1, -1])
