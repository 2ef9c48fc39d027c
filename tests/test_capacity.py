"""moe_ep.capacity and moe_ep.row_groups: the buffer bounds of the transport.
Each bound is checked against the worst routing found by enumerating every
top-k choice (or the bound's own documented formula where the routing is
trivial), and the dropless ones against a real dispatch that must keep every
row."""

import itertools
import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from moe_ep.capacity import expert_capacity_for, send_capacity_for
from moe_ep.row_groups import ROW_TILE, grouped_rows_for
from moe_ep.transport import dispatch

SIZES = [  # (T, K, E, R)
    (5, 2, 8, 4), (13, 3, 16, 2), (1, 1, 1, 1), (300, 4, 8, 8), (2000, 8, 16, 1),
    (7, 6, 6, 3), (64, 2, 32, 4), (257, 3, 12, 4),
]


def worst_rows_into_one_rank(top_k: int, num_experts: int, ep_size: int) -> int:
  """Most routes one token can send to rank 0's experts, over every set of
  ``top_k`` distinct experts (a top-k never repeats an id)."""
  local = range(num_experts // ep_size)
  return max(sum(e in local for e in choice)
             for choice in itertools.combinations(range(num_experts), top_k))


@pytest.mark.parametrize("num_tokens, top_k, num_experts, ep_size", SIZES)
def test_dropless_slab_holds_every_token_of_every_rank_and_no_more(num_tokens, top_k,
                                                                    num_experts, ep_size):
  # One expert receives at most one row per token of every source rank.
  worst = ep_size * num_tokens
  capacity = expert_capacity_for(num_tokens, top_k, num_experts, ep_size)
  assert capacity == math.ceil(worst / 8) * 8
  # A factor never sizes a slab above the dropless one, however large.
  for factor in (0.5, 1.0, 4.0, 1e6):
    sized = expert_capacity_for(num_tokens, top_k, num_experts, ep_size, factor)
    balanced = math.ceil(factor * ep_size * num_tokens * top_k / num_experts)
    assert min(balanced, worst) <= sized <= capacity


@pytest.mark.parametrize("num_tokens, top_k, num_experts, ep_size", SIZES)
def test_send_chunk_never_drops_without_a_factor(num_tokens, top_k, num_experts, ep_size):
  # A token crosses to a rank at most once.
  assert send_capacity_for(num_tokens, top_k, num_experts, ep_size) == num_tokens
  for factor in (0.5, 1.0, 1e6):
    sized = send_capacity_for(num_tokens, top_k, num_experts, ep_size, factor)
    assert min(math.ceil(factor * num_tokens * top_k / ep_size), num_tokens) <= sized
    assert sized <= num_tokens


@pytest.mark.parametrize("num_tokens, top_k, num_experts, ep_size", SIZES)
def test_grouped_worst_case_holds_the_worst_routing_and_caps_every_factor(
    num_tokens, top_k, num_experts, ep_size, group_align):
  local_experts = num_experts // ep_size
  routed = ep_size * num_tokens * worst_rows_into_one_rank(top_k, num_experts, ep_size)
  rows = grouped_rows_for(num_tokens, top_k, num_experts, ep_size, group_align=group_align)
  # Every group may waste up to group_align - 1 rows rounding its start.
  need = routed + local_experts * (group_align - 1)
  assert rows % ROW_TILE == 0 and need <= rows < need + ROW_TILE
  # A factor scales the balanced load T * K and is capped at the worst case.
  for factor in (0.25, 1.0, 2.0, 1e6):
    sized = grouped_rows_for(num_tokens, top_k, num_experts, ep_size, factor, group_align)
    kept = min(routed, math.ceil(factor * num_tokens * top_k))
    want = kept + local_experts * (group_align - 1)
    assert want <= sized < want + ROW_TILE and sized <= rows


def test_dropless_capacity_keeps_every_row_when_all_ranks_pick_one_expert():
  """Every token of 4 ranks routes to expert 0 (and one other): the
  dropless slab keeps all of them."""
  tokens, top_k, experts, ranks = 5, 2, 8, 4
  capacity = expert_capacity_for(tokens, top_k, experts, ranks)
  idx = np.stack([np.zeros(ranks * tokens), 1 + np.arange(ranks * tokens) % (experts - 1)],
                 axis=1).astype(np.int32)
  x = np.ones((ranks * tokens, 4), np.float32)
  weights = np.ones((ranks * tokens, top_k), np.float32)

  def body(x, idx, weights):
    d = dispatch(x, idx, weights, num_experts=experts, expert_capacity=capacity,
                 axis_name="ep", transport="xla")
    return d.counts, d.demand

  counts, demand = jax.jit(jax.shard_map(body, mesh=make_mesh((ranks,), ("ep",)),
                                         in_specs=P("ep"), out_specs=P("ep")))(x, idx, weights)
  want = np.bincount(idx.ravel(), minlength=experts)
  assert want[0] == ranks * tokens
  np.testing.assert_array_equal(np.asarray(demand), want)
  np.testing.assert_array_equal(np.asarray(counts), want)


@pytest.mark.parametrize("balanced_rows, slab_rows", [
    (256, 256), (1001, 1008), (1020, 1024), (1024, 1024),  # below 1024 rows: whole 8s
    (1025, 1152), (1030, 1152), (2000, 2048),             # from 1024 on: whole 128-row tiles
])
def test_a_factor_sized_slab_is_rounded_to_8_rows_below_1024_and_to_128_from_it(
    balanced_rows, slab_rows):
  # T=4096, K=2, E=8, R=1: the balanced load is 1024 rows a factor of 1.0, the
  # dropless bound (4096) far above, and these factors are exact binary fractions.
  factor = balanced_rows / 1024
  assert factor * 4096 * 2 / 8 == balanced_rows
  assert expert_capacity_for(4096, 2, 8, 1, factor) == slab_rows
