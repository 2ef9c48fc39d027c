"""dispatch into the grouped layout (moe_ep/transport/receive_grouped.py):
each local expert's rows land contiguously from a multiple of the layout's
``group_align`` on, in the slab layout's order, against a numpy placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep.transport import combine, dispatch, grouped_rows_for

TOKENS, HIDDEN, EXPERTS, TOP_K = 100, 8, 4, 2


def routing(seed: int):
  """``(tokens [T, H], topk_idx [T, K], topk_weights [T, K])``, skewed so
  that expert 0 gets more than a half tile's rows and expert 3 none."""
  rng = np.random.default_rng(seed)
  idx = np.stack([rng.choice(3, size=TOP_K, replace=False, p=[0.6, 0.3, 0.1])
                  for _ in range(TOKENS)])
  return (jnp.asarray(rng.normal(size=(TOKENS, HIDDEN)), jnp.float32), jnp.asarray(idx, jnp.int32),
          jnp.asarray(rng.uniform(0.1, 1.0, size=(TOKENS, TOP_K)), jnp.float32))


@pytest.mark.parametrize("group_align", [128, 64])
def test_grouped_rows_start_at_multiples_of_group_align(group_align):
  tokens, idx, weights = routing(0)
  capacity = TOKENS
  slabs = dispatch(tokens, idx, weights, num_experts=EXPERTS, expert_capacity=capacity)
  num_rows = grouped_rows_for(TOKENS, TOP_K, EXPERTS, 1, group_align=group_align)
  grouped = dispatch(tokens, idx, weights, num_experts=EXPERTS, expert_capacity=capacity,
                     grouped_rows=num_rows, group_align=group_align)
  counts = np.asarray(grouped.counts)
  np.testing.assert_array_equal(counts, slabs.counts)
  assert counts[0] > 64 and counts[3] == 0  # a group longer than a half tile, an empty one
  padded = -(-counts // group_align) * group_align
  starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
  want = np.zeros((num_rows, HIDDEN), np.float32)
  for expert, (start, count) in enumerate(zip(starts, counts)):
    want[start:start + count] = np.asarray(slabs.tokens)[expert, :count]
  np.testing.assert_array_equal(np.asarray(grouped.tokens), want)  # copies: exact
  # Combine reads the rows back from wherever dispatch put them.
  out = combine(grouped.tokens * grouped.weights[:, None], grouped.handle, num_tokens=TOKENS)
  slab_out = combine(slabs.tokens * slabs.weights[..., None], slabs.handle, num_tokens=TOKENS)
  np.testing.assert_allclose(np.asarray(out), np.asarray(slab_out), rtol=1e-6, atol=1e-6)


def test_a_group_align_that_is_neither_tile_is_refused_naming_it():
  tokens, idx, weights = routing(1)
  with pytest.raises(ValueError, match=r"group_align=96: groups start on whole row tiles "
                                       r"\(128\) or half tiles \(64\)"):
    dispatch(tokens, idx, weights, num_experts=EXPERTS, expert_capacity=TOKENS,
             grouped_rows=grouped_rows_for(TOKENS, TOP_K, EXPERTS, 1), group_align=96)
  with pytest.raises(ValueError, match=r"group_align=32"):
    grouped_rows_for(TOKENS, TOP_K, EXPERTS, 1, group_align=32)
