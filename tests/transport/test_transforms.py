"""dispatch/combine under jit, grad, jax.checkpoint and lax.scan, and the
handle as plain data that can leave one computation and enter another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import BACKENDS, make_mesh
from moe_ep.transport import RoutingHandle, combine, dispatch, expert_capacity_for
from reference import make_routing

EP, TOKENS, HIDDEN, EXPERTS, TOP_K = 2, 12, 8, 8, 2  # EP=2 also runs on a 2-GPU machine
CAPACITY = expert_capacity_for(TOKENS, TOP_K, EXPERTS, EP)


def inputs(seed, steps=None):
  rng = np.random.default_rng(seed)
  lead = () if steps is None else (steps,)
  tokens = rng.normal(size=lead + (EP * TOKENS, HIDDEN)).astype(np.float32)
  idx = np.stack([make_routing("balanced", rng, EP, TOKENS, TOP_K, EXPERTS).reshape(-1, TOP_K)
                  for _ in range(steps or 1)])
  weights = rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32)
  if steps is None:
    idx, weights = idx[0], weights[0]
  return tokens, idx, weights


def moe_step(x, idx, w, backend):
  d = dispatch(x, idx, w, num_experts=EXPERTS, expert_capacity=CAPACITY, axis_name="ep",
               checkpoint_name="moe.dispatch", transport=backend)
  out = jnp.sin(d.tokens) * d.weights[..., None]
  return combine(out, d.handle, num_tokens=x.shape[0], axis_name="ep", transport=backend)


def sharded(fn, in_specs=P("ep"), out_specs=P("ep"), backend="xla"):
  return jax.shard_map(fn, mesh=make_mesh((EP,), ("ep",), backend),
                       in_specs=in_specs, out_specs=out_specs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_matches_unrolled_loop_values_and_grads(backend):
  """Two steps through lax.scan of a checkpointed body equal a Python loop."""
  tokens, idx, weights = inputs(0, steps=2)
  tokens = tokens[0]

  def one(x, i, w):
    return x + moe_step(x, i, w, backend)

  def scanned(x, idx, w):
    body = jax.checkpoint(lambda carry, step: (one(carry, *step), None))
    return jax.lax.scan(body, x, (idx, w))[0]

  def unrolled(x, idx, w):
    for step in range(idx.shape[0]):
      x = one(x, idx[step], w[step])
    return x

  specs = (P("ep"), P(None, "ep"), P(None, "ep"))
  results = []
  for fn in (scanned, unrolled):
    f = sharded(fn, in_specs=specs, backend=backend)
    loss = lambda x, w: jnp.sum(f(x, idx, w) ** 2)
    results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(tokens, weights))
  for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handle_is_plain_data_between_computations(backend):
  """A handle taken to the host as numpy and fed to another jit combines
  exactly like the one that never left the device."""
  tokens, idx, weights = inputs(1)

  def dispatch_only(x, i, w):
    d = dispatch(x, i, w, num_experts=EXPERTS, expert_capacity=CAPACITY, axis_name="ep",
                 transport=backend)
    return jnp.sin(d.tokens) * d.weights[..., None], d.handle

  def combine_only(out, handle):
    return combine(out, handle, num_tokens=TOKENS, axis_name="ep", transport=backend)

  out, handle = jax.jit(sharded(dispatch_only, backend=backend))(tokens, idx, weights)
  host_handle = RoutingHandle(*(np.asarray(a) for a in handle))
  assert all(a.dtype == np.int32 for a in host_handle)
  y_from_host = jax.jit(sharded(combine_only, backend=backend))(np.asarray(out), host_handle)
  y_direct = jax.jit(sharded(lambda x, i, w: moe_step(x, i, w, backend), backend=backend))(
      tokens, idx, weights)
  np.testing.assert_array_equal(np.asarray(y_from_host), np.asarray(y_direct))


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_executable_on_new_routing_gives_new_results(backend):
  """No routing state survives between calls of one compiled function."""
  step = jax.jit(sharded(lambda x, i, w: moe_step(x, i, w, backend), backend=backend))
  first, second = inputs(2), inputs(3)
  y1, y2 = step(*first), step(*second)
  fresh = jax.jit(sharded(lambda x, i, w: moe_step(x, i, w, backend), backend=backend))
  np.testing.assert_array_equal(np.asarray(y2), np.asarray(fresh(*second)))
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(step(*first)))
  assert not np.allclose(np.asarray(y1), np.asarray(y2))
