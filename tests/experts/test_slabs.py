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
