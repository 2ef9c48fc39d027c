"""Edge inputs of dispatch/combine with a defined result: ids beyond int32,
repeated ids in one token's top-k, slab capacities above the dropless bound."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh, x64_enabled
from moe_ep.transport import combine, dispatch, expert_capacity_for
from reference import dense_moe, make_routing

HIDDEN = 8
NUM_EXPERTS = 16
TOKENS = 13
TOP_K = 3

# As in test_transport.py: float32 sums in another order than the reference's
# agree to a few ulps of the largest term; a merged route adds one more
# float32 rounding (w1 + w2) * f instead of w1 * f + w2 * f. Gradients pass
# through two such sums.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
F32_GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


def run_transport(tokens, topk_idx, topk_weights, maps, *, ep_size, expert_capacity):
  """Per-rank dispatch -> tanh(x @ M_e) * w -> combine over global arrays
  ``[R*T, ...]``; returns ``(y [R*T, H], counts [E], demand [E])``."""
  axis = "ep" if ep_size > 1 else None
  num_tokens = tokens.shape[0] // ep_size

  def body(x, idx, w, m):
    d = dispatch(x, idx, w, num_experts=NUM_EXPERTS, expert_capacity=expert_capacity,
                 axis_name=axis, transport="xla")
    hidden = jnp.tanh(jnp.einsum("lch,lhg->lcg", d.tokens, m))
    y = combine(hidden * d.weights[..., None], d.handle, num_tokens=num_tokens,
                axis_name=axis, transport="xla")
    return y, d.counts, d.demand

  mesh = make_mesh((ep_size,), ("ep",))
  return jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(
      tokens, topk_idx, topk_weights, maps)


def expert_fn(maps):
  return lambda ids, x: jnp.tanh(jnp.einsum("nh,nhg->ng", x, maps[ids]))


def problem(rng, ep_size):
  tokens = rng.normal(size=(ep_size * TOKENS, HIDDEN)).astype(np.float32)
  weights = rng.uniform(0.1, 1.0, size=(ep_size * TOKENS, TOP_K)).astype(np.float32)
  maps = (rng.normal(size=(NUM_EXPERTS, HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
  idx = make_routing("balanced", rng, ep_size, TOKENS, TOP_K).reshape(-1, TOP_K)
  return tokens, idx, weights, maps


@pytest.mark.parametrize("ep_size", [1, 4])
def test_int64_ids_beyond_int32_are_not_routed(ep_size):
  """Ids that would wrap onto a valid expert when narrowed to int32
  (2**32 + 1 -> 1, -2**32 + 2 -> 2) route exactly like -1: nowhere."""
  rng = np.random.default_rng(ep_size)
  tokens, idx, weights, maps = problem(rng, ep_size)
  capacity = expert_capacity_for(TOKENS, TOP_K, NUM_EXPERTS, ep_size)
  wide = idx.astype(np.int64)
  wide[::3, 0] = 2**32 + 1
  wide[1::4, 1] = -(2**32) + 2
  wide[2, :] = 2**31  # a token with no valid route at all
  not_routed = np.where((wide >= 0) & (wide < NUM_EXPERTS), wide, -1).astype(np.int32)
  run = functools.partial(run_transport, ep_size=ep_size, expert_capacity=capacity)
  want_y, want_counts, want_demand = jax.jit(run)(tokens, not_routed, weights, maps)
  with x64_enabled():
    wide_idx = jnp.asarray(wide)
    assert wide_idx.dtype == jnp.int64
    y, counts, demand = jax.jit(run)(tokens, wide_idx, weights, maps)
    assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(demand), np.asarray(want_demand))
  np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
  # And the -1 case is the dense reference over the valid routes only.
  valid = not_routed >= 0
  assert int(np.asarray(demand).sum()) == valid.sum()
  ref = dense_moe(tokens, not_routed, weights, valid, expert_fn(maps))
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **F32_TOL)


def with_duplicates(idx):
  """Repeats ids inside tokens' top-k: every other token sends all K routes
  to expert 0 (more copies than the dropless slab has rows), others repeat
  one id; one token repeats an invalid id, one has an invalid id next to a
  valid repeat."""
  idx = idx.copy()
  idx[::2, :] = 0
  idx[1::4, 2] = idx[1::4, 0]
  idx[3::8, 1] = idx[3::8, 0]
  idx[5, :] = [-1, 5, -1]
  idx[7, :] = [NUM_EXPERTS, 9, 9]
  return idx


def distinct_valid_demand(idx):
  """Routes per expert counting each (token, expert) pair once, by loops."""
  demand = np.zeros(NUM_EXPERTS, np.int64)
  for row in idx:
    for expert in {int(e) for e in row if 0 <= e < NUM_EXPERTS}:
      demand[expert] += 1
  return demand


@pytest.mark.parametrize("ep_size", [1, 4])
def test_repeated_ids_merge_and_dropless_drops_nothing(ep_size):
  rng = np.random.default_rng(20 + ep_size)
  tokens, idx, weights, maps = problem(rng, ep_size)
  idx = with_duplicates(idx)
  capacity = expert_capacity_for(TOKENS, TOP_K, NUM_EXPERTS, ep_size)
  # If each copy took a row, expert 0's slab would overflow and drop.
  assert (idx == 0).sum() > capacity
  run = jax.jit(functools.partial(run_transport, ep_size=ep_size, expert_capacity=capacity))
  y, counts, demand = run(tokens, idx, weights, maps)

  # Demand and counts count a merged route once; dropless keeps all of them.
  np.testing.assert_array_equal(np.asarray(demand), distinct_valid_demand(idx))
  np.testing.assert_array_equal(np.asarray(counts), np.asarray(demand))

  # The reference keeps duplicates as separate terms: w1 * f_e(x) + w2 * f_e(x).
  valid = (idx >= 0) & (idx < NUM_EXPERTS)
  ref = dense_moe(tokens, idx, weights, valid, expert_fn(maps))
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **F32_TOL)

  cotangent = rng.normal(size=tokens.shape).astype(np.float32)
  loss = lambda x, w, m: jnp.vdot(run(x, idx, w, m)[0], cotangent)
  ref_loss = lambda x, w, m: jnp.vdot(dense_moe(x, idx, w, valid, expert_fn(m)), cotangent)
  grads = jax.grad(loss, argnums=(0, 1, 2))(tokens, weights, maps)
  ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(tokens, weights, maps)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_GRAD_TOL)
  # Each duplicate's weight gets the full gradient of its expert's output
  # (not a share of it): equal entries along the all-zero tokens' rows.
  weight_grad = np.asarray(grads[1])
  np.testing.assert_array_equal(weight_grad[::2, 0], weight_grad[::2, 1])
  np.testing.assert_array_equal(weight_grad[::2, 0], weight_grad[::2, 2])
  assert (weight_grad[::2] != 0).all()


def test_repeated_ids_merge_in_bfloat16_weights():
  """bf16 weights: the merged weight is summed in float32 (as the reference
  does per term), and the weight gradient comes back in bf16."""
  rng = np.random.default_rng(3)
  tokens, idx, weights, maps = problem(rng, 1)
  idx = with_duplicates(idx)
  weights = jnp.asarray(weights, jnp.bfloat16)
  capacity = expert_capacity_for(TOKENS, TOP_K, NUM_EXPERTS, 1)
  run = jax.jit(functools.partial(run_transport, ep_size=1, expert_capacity=capacity))
  y, _, _ = run(tokens, idx, weights, maps)
  valid = (idx >= 0) & (idx < NUM_EXPERTS)
  ref = dense_moe(tokens, idx, weights, valid, expert_fn(maps))
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **F32_TOL)
  grad = jax.grad(lambda w: run(tokens, idx, w, maps)[0].sum())(weights)
  assert grad.dtype == jnp.bfloat16


def test_expert_capacity_above_the_dropless_bound_is_clamped():
  """2e8 rows per slab would need gigabytes; dispatch clamps C to the
  rounded dropless bound R*T and gives the bound's exact result."""
  rng = np.random.default_rng(9)
  tokens, idx, weights, maps = problem(rng, 1)
  bound = expert_capacity_for(TOKENS, TOP_K, NUM_EXPERTS, 1)
  assert bound == 16  # T = 13 rounded up to a multiple of 8
  shape = jax.eval_shape(lambda x, i, w: dispatch(
      x, i, w, num_experts=NUM_EXPERTS, expert_capacity=200_000_000, transport="xla").tokens,
                         tokens, idx, weights)
  assert shape.shape == (NUM_EXPERTS, bound, HIDDEN)
  run = lambda capacity: jax.jit(functools.partial(
      run_transport, ep_size=1, expert_capacity=capacity))(tokens, idx, weights, maps)
  huge, exact = run(np.int64(200_000_000)), run(bound)
  for got, want in zip(huge, exact):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint32])
def test_narrow_and_unsigned_ids_route_like_int32(dtype, jitted):
  """Ids are range-tested before narrowing to int32 and after widening narrow
  types: int8 id 100 against 200 experts is expert 100 (not a wrapped
  comparison), uint32 2**32 - 1 is not routed (not -1 wrapped to a valid id).
  Under jit too, where E = 200 becomes a weakly typed constant of the ids'
  own dtype (200 as int8 is -56) instead of an eager overflow error."""
  info = np.iinfo(dtype)
  ids = np.array([[100, 127], [info.max, 5], [info.min, 100], [7, 7]], np.int64)
  native = np.asarray(ids, dtype)
  want = np.where((ids >= 0) & (ids < 200), ids, -1).astype(np.int32)
  tokens = np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
  weights = np.ones((4, 2), np.float32)
  run = lambda idx: dispatch(tokens, idx, weights, num_experts=200, expert_capacity=8,
                             transport="xla")
  if jitted:
    run = jax.jit(run)
  got, ref = run(native), run(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  valid_pairs = {(t, int(e)) for t, row in enumerate(want) for e in row if e >= 0}
  assert int(np.asarray(got.demand).sum()) == len(valid_pairs)
  assert int(np.asarray(got.demand)[100]) == sum(1 for _, e in valid_pairs if e == 100)


def merged_by_loops(idx, weights):
  """merge_duplicate_routes' rule, token by token: the first occurrence of a
  valid id keeps it with the float64 sum of its occurrences' weights; later
  ones become -1; -1 routes keep their weight."""
  out_idx, out_w = np.array(idx, np.int64), np.array(weights, np.float64)
  for t, row in enumerate(idx):
    for k, expert in enumerate(row):
      if expert < 0:
        continue
      first = list(row).index(expert)
      if first < k:
        out_idx[t, k] = -1
      out_w[t, k] = sum(float(weights[t, j]) for j in range(len(row)) if row[j] == expert)
  return out_idx, out_w


def test_valid_ids_and_merged_routes_follow_their_rules_against_loops():
  """ops.valid_ids: every id outside [0, E) is -1, the edges included, also
  for ids of a narrow dtype against an E beyond it; then merge_duplicate_routes
  against the loop above (a token's two -1 routes are no repeat)."""
  from moe_ep.transport.ops import merge_duplicate_routes, valid_ids  # noqa: PLC0415
  ids = np.array([[-1, 0, 15], [16, 17, -2], [3, 3, 3], [5, -1, 5], [-1, -1, 2],
                  [7, 8, 7], [15, 16, 15]], np.int64)
  want = np.where((ids >= 0) & (ids < NUM_EXPERTS), ids, -1)
  got = jax.jit(valid_ids, static_argnums=1)(jnp.asarray(ids, jnp.int32), NUM_EXPERTS)
  np.testing.assert_array_equal(np.asarray(got), want)
  wide = np.array([[30_000, -5, 32_767]], np.int16)  # E = 40000 does not fit int16
  np.testing.assert_array_equal(np.asarray(jax.jit(valid_ids, static_argnums=1)(wide, 40_000)),
                                [[30_000, -1, 32_767]])
  weights = np.random.default_rng(4).uniform(0.1, 1.0, ids.shape).astype(np.float32)
  merged_idx, merged_w = jax.jit(merge_duplicate_routes)(got, weights)
  ref_idx, ref_w = merged_by_loops(want, weights)
  np.testing.assert_array_equal(np.asarray(merged_idx), ref_idx)
  # float32 sums of at most three weights against float64: a few ulps.
  np.testing.assert_allclose(np.asarray(merged_w), ref_w, rtol=1e-6)
