"""dispatch/combine against dense per-token references, on 1-8 devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_ep.transport as transport
from conftest import BACKENDS, make_mesh
from moe_ep.transport import combine, dispatch, expert_capacity_for
from reference import dense_moe, kept_routes, make_routing

HIDDEN = 8
NUM_EXPERTS = 16
TOKENS = 13  # per rank: divisible by nothing convenient

# float32: the transport copies rows exactly and sums in float32 in a fixed
# order; the reference sums in another order, so values agree to a few ulps of
# the largest term (1e-5 on O(1) values); gradients pass through two such sums.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
F32_GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


def run_transport(tokens, topk_idx, topk_weights, expert_maps, *, ep_size,
                  expert_capacity, send_capacity=None, backend="xla", wrap=None):
  """Per-rank dispatch -> tanh(x @ M_e) * w -> combine, under shard_map.

  Args: global arrays ``tokens [R*T, H]``, ``topk_idx/topk_weights [R*T, K]``,
  ``expert_maps [E, H, H]``. ``wrap`` optionally transforms the per-rank body
  (e.g. ``jax.checkpoint``).

  Returns ``(y [R*T, H], counts [E], demand [E])``.
  """
  axis = "ep" if ep_size > 1 else None
  num_tokens = tokens.shape[0] // ep_size

  def body(x, idx, w, maps):
    d = dispatch(x, idx, w, num_experts=NUM_EXPERTS, expert_capacity=expert_capacity,
                 axis_name=axis, send_capacity=send_capacity, transport=backend)
    hidden = jnp.tanh(jnp.einsum("lch,lhg->lcg", d.tokens.astype(jnp.float32), maps))
    out = (hidden * d.weights[..., None]).astype(x.dtype)
    y = combine(out, d.handle, num_tokens=num_tokens, axis_name=axis, transport=backend)
    return y, d.counts, d.demand

  if wrap is not None:
    body = wrap(body)
  mesh = make_mesh((ep_size,), ("ep",), backend)
  return jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(
      tokens, topk_idx, topk_weights, expert_maps)


def expert_fn(maps):
  return lambda ids, x: jnp.tanh(jnp.einsum("nh,nhg->ng", x.astype(jnp.float32), maps[ids]))


def random_problem(rng, ep_size, top_k, routing="balanced", dtype=np.float32):
  tokens = rng.normal(size=(ep_size * TOKENS, HIDDEN)).astype(dtype)
  idx = make_routing(routing, rng, ep_size, TOKENS, top_k)
  weights = rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32)
  maps = (rng.normal(size=(NUM_EXPERTS, HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
  return tokens, idx, weights, maps


@functools.lru_cache(maxsize=None)
def compiled_transport(ep_size, expert_capacity, send_capacity, backend):
  """``(run, grads)`` jitted once per static configuration: the routing is
  data, so every routing of a shape reuses the same executables."""
  run = jax.jit(functools.partial(run_transport, ep_size=ep_size,
                                  expert_capacity=expert_capacity,
                                  send_capacity=send_capacity, backend=backend))

  def loss(x, w, m, idx, cotangent):
    return jnp.vdot(run(x, idx, w, m)[0], cotangent)

  return run, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@jax.jit
def reference_and_grads(tokens, idx, weights, keep, maps, cotangent):
  """The dense reference's output and its gradients for ``(tokens, weights, maps)``."""
  def ref_loss(x, w, m):
    return jnp.vdot(dense_moe(x, idx, w, keep, expert_fn(m)), cotangent)
  ref = dense_moe(tokens, idx, weights, keep, expert_fn(maps))
  return ref, jax.grad(ref_loss, argnums=(0, 1, 2))(tokens, weights, maps)


def check_against_reference(rng, *, ep_size, top_k, routing="balanced", capacity=None,
                            send_capacity=None, backend="xla", idx_override=None):
  tokens, idx, weights, maps = random_problem(rng, ep_size, top_k, routing)
  if idx_override is not None:
    idx = idx_override
  capacity = capacity or expert_capacity_for(TOKENS, top_k, NUM_EXPERTS, ep_size)
  keep, demand, counts, _ = kept_routes(
      idx, num_experts=NUM_EXPERTS, ep_size=ep_size, expert_capacity=capacity,
      send_capacity=send_capacity or TOKENS)
  flat = lambda a: a.reshape(ep_size * TOKENS, -1)
  idx_flat, keep_flat = flat(idx), flat(keep)
  cotangent = rng.normal(size=tokens.shape).astype(np.float32)

  run, grad_fn = compiled_transport(ep_size, capacity, send_capacity, backend)
  y, got_counts, got_demand = run(tokens, idx_flat, flat(weights), maps)
  ref, ref_grads = reference_and_grads(tokens, idx_flat, flat(weights), keep_flat, maps,
                                       cotangent)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **F32_TOL)
  np.testing.assert_array_equal(np.asarray(got_demand), demand)
  np.testing.assert_array_equal(np.asarray(got_counts), counts)

  grads = grad_fn(tokens, flat(weights), maps, idx_flat, cotangent)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_GRAD_TOL)
  return keep, demand, counts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("routing", ["balanced", "skewed", "empty_experts"])
@pytest.mark.parametrize("ep_size", [1, 2, 4, 8])
def test_dropless_matches_dense_reference(ep_size, routing, backend):
  rng = np.random.default_rng(ep_size * 10 + len(routing))
  keep, demand, counts = check_against_reference(
      rng, ep_size=ep_size, top_k=3, routing=routing, backend=backend)
  assert keep.all(), "dropless capacity must keep every route"
  np.testing.assert_array_equal(counts, demand)
  if routing == "empty_experts":
    assert (demand[NUM_EXPERTS // 2:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep_size", [1, 4])
def test_tight_capacity_keeps_the_first_rows_in_slab_order(ep_size, backend):
  rng = np.random.default_rng(7)
  _, demand, counts = check_against_reference(
      rng, ep_size=ep_size, top_k=4, routing="skewed", capacity=3, backend=backend)
  assert (counts < demand).any(), "the skewed routing must overflow capacity 3"
  assert (counts <= 3).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_capacity_drops_on_the_wire_and_shows_in_counts(backend):
  rng = np.random.default_rng(3)
  _, demand, counts = check_against_reference(
      rng, ep_size=4, top_k=4, routing="skewed", send_capacity=5, backend=backend)
  assert (counts < demand).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep_size", [1, 4])
def test_out_of_range_ids_are_not_routed(ep_size, backend):
  rng = np.random.default_rng(11)
  idx = make_routing("balanced", rng, ep_size, TOKENS, 3)
  idx[:, ::3, 0] = -1
  idx[:, 1::4, 1] = NUM_EXPERTS
  idx[:, 2, :] = NUM_EXPERTS + 5  # a token with no valid route at all
  _, demand, _ = check_against_reference(rng, ep_size=ep_size, top_k=3, idx_override=idx,
                                         backend=backend)
  assert demand.sum() == ((idx >= 0) & (idx < NUM_EXPERTS)).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [1, NUM_EXPERTS])
def test_extreme_top_k(top_k, backend):
  check_against_reference(np.random.default_rng(top_k), ep_size=4, top_k=top_k, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_tokens(backend):
  """bf16 rows are copied exactly; each expert output is rounded to bf16, each
  rank's partial sum once more on the wire and the total once at the end:
  at most ~3 bf16 roundings (2**-8 each) of sum_k |w f(x)|."""
  ep_size, top_k = 4, 3
  rng = np.random.default_rng(5)
  tokens, idx, weights, maps = random_problem(rng, ep_size, top_k)
  tokens = jnp.asarray(tokens, jnp.bfloat16)
  flat = lambda a: a.reshape(ep_size * TOKENS, -1)
  capacity = expert_capacity_for(TOKENS, top_k, NUM_EXPERTS, ep_size)
  y, _, _ = jax.jit(functools.partial(run_transport, ep_size=ep_size, expert_capacity=capacity,
                                      backend=backend))(tokens, flat(idx), flat(weights), maps)
  assert y.dtype == jnp.bfloat16
  keep = np.ones(flat(idx).shape, bool)
  ref = dense_moe(tokens, flat(idx), flat(weights), keep, expert_fn(maps))
  magnitude = dense_moe(tokens, flat(idx), flat(weights), keep,
                        lambda i, x: jnp.abs(expert_fn(maps)(i, x)))
  err = np.abs(np.asarray(y, np.float32) - np.asarray(ref))
  assert (err <= 3 * 2.0**-8 * np.asarray(magnitude) + 1e-6).all(), err.max()


def test_expert_capacity_for():
  assert expert_capacity_for(13, 3, 16, 4) == 56  # dropless: R*T = 52 -> multiple of 8
  assert expert_capacity_for(4096, 8, 64, 8) == 32768  # dropless, large: multiple of 128
  assert expert_capacity_for(4096, 8, 64, 8, capacity_factor=1.0) == 4096  # R*T*K/E
  assert expert_capacity_for(4096, 8, 64, 8, capacity_factor=1.25) == 5120
  assert expert_capacity_for(10, 2, 64, 1, capacity_factor=1.0) == 8  # ceil(0.3125) -> 8
  with pytest.raises(ValueError, match="top_k=5 must be <= num_experts=4"):
    expert_capacity_for(8, 5, 4, 1)
  with pytest.raises(ValueError, match="num_experts=10 is not divisible by the ep axis size 4"):
    expert_capacity_for(8, 2, 10, 4)


def test_recv_pos_marks_routes_dropped_for_capacity():
  """recv_pos against an unrolled loop over the received members in
  (source, slot, k) order with a running count per local expert: the slab
  position while the count is below the capacity, -2 (dropped) past it, -1
  where the member is not routed here (combine tells slots that held a row
  from empty ones by it)."""
  from moe_ep.transport import meta as meta_layout
  from moe_ep.transport import xla as xla_backend
  ep_size, send_capacity, top_k, local_experts, capacity = 3, 20, 4, 5, 6
  rng = np.random.default_rng(0)
  ids = rng.integers(-2, local_experts + 2, (ep_size, send_capacity, top_k)).astype(np.int32)
  meta = meta_layout.pack(ids, rng.random(ids.shape).astype(np.float32),
                          np.zeros((ep_size, local_experts), np.int32))
  recv_pos = np.asarray(xla_backend.slab_layout(meta, top_k=top_k, num_local_experts=local_experts,
                                                expert_capacity=capacity)[0])
  want, seen = np.full(ids.shape, -1), np.zeros(local_experts, int)
  for member in np.ndindex(ids.shape):
    expert = ids[member]
    if 0 <= expert < local_experts:
      want[member] = expert * capacity + seen[expert] if seen[expert] < capacity else -2
      seen[expert] += 1
  assert (want == -2).any() and (want == -1).any() and (want >= 0).any()
  np.testing.assert_array_equal(recv_pos, want)


@pytest.mark.parametrize("send_capacity,top_k,local_experts",
                         [(1, 1, 1), (20, 4, 5), (128, 8, 128), (2560, 8, 32)])
def test_meta_row_width_and_send_capacity_are_inverse(send_capacity, top_k, local_experts):
  """meta.send_capacity recovers S from a row's width, and unpack splits a
  packed row back into what went in (the row that width() sizes)."""
  from moe_ep.transport import meta as meta_layout
  width = meta_layout.width(send_capacity, top_k, local_experts)
  assert meta_layout.send_capacity(width, top_k, local_experts) == send_capacity
  rng = np.random.default_rng(send_capacity)
  ids = rng.integers(-1, local_experts, (2, send_capacity, top_k)).astype(np.int32)
  weights = rng.random(ids.shape).astype(np.float32)
  demand = rng.integers(0, 9, (2, local_experts)).astype(np.int32)
  packed = meta_layout.pack(ids, weights, demand)
  assert packed.shape == (2, width)
  for got, want in zip(meta_layout.unpack(packed, top_k=top_k, num_local_experts=local_experts),
                       (ids, weights, demand)):
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("width,top_k,local_experts", [(10, 2, 3), (3, 2, 3), (2, 1, 4)])
def test_meta_send_capacity_rejects_widths_no_row_has(width, top_k, local_experts):
  from moe_ep.transport import meta as meta_layout
  with pytest.raises(ValueError, match=f"meta width {width} must be 2 \\* S \\* K \\+ L"):
    meta_layout.send_capacity(width, top_k, local_experts)
