"""The CuPy kernels against the pure-JAX backend, function by function, on a
GPU; plus run-to-run determinism and bounds handling at realistic sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gpu_devices
from reference import permutation_maps
from moe_ep.transport import combine, dispatch, expert_capacity_for, meta as meta_layout, xla

pytestmark = pytest.mark.gpu


def backends():
  from moe_ep.transport import cupy_backend  # only where CuPy exists
  return cupy_backend, xla


def on_gpu(fn, *args):
  device = gpu_devices()[0]
  return jax.jit(fn)(*(jax.device_put(a, device) for a in args))


def assert_same(got, want, what):
  for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what}[{i}]")


def routing(rng, tokens, top_k, num_experts, invalid_share=0.1):
  idx = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])
  idx = idx.astype(np.int32)
  broken = rng.random(idx.shape) < invalid_share
  idx[broken] = rng.choice([-1, num_experts, num_experts + 7, -100], broken.sum())
  weights = rng.uniform(0.05, 1.0, idx.shape).astype(np.float32)
  return idx, weights


@pytest.mark.parametrize("tokens, top_k, num_experts, ep_size, send_capacity", [
    (1, 1, 4, 1, 1), (37, 3, 16, 1, 37), (300, 8, 64, 4, 300), (300, 8, 64, 4, 40),
    (2500, 4, 32, 8, 2500), (2048, 8, 256, 8, 700),
    (200, 8, 64, 8, 200),  # one token tile, several route_rank blocks
    (128, 8, 256, 2, 128),  # decode
    (96, 32, 64, 2, 96), (256, 16, 64, 2, 100)])  # routes staged in several batches a thread
def test_route_matches_xla_exactly(tokens, top_k, num_experts, ep_size, send_capacity):
  cupy_backend, reference = backends()
  idx, weights = routing(np.random.default_rng(tokens), tokens, top_k, num_experts)
  kwargs = dict(num_experts=num_experts, ep_size=ep_size, send_capacity=send_capacity)
  got = on_gpu(functools.partial(cupy_backend.route, **kwargs), idx, weights)
  want = on_gpu(functools.partial(reference.route, **kwargs), idx, weights)
  assert_same(got, want, "route")


@pytest.mark.parametrize("ep_size, send_capacity, top_k, local_experts, capacity", [
    (1, 5, 1, 1, 1), (1, 400, 8, 64, 40), (4, 300, 8, 16, 90), (8, 700, 4, 4, 3000),
    (2, 1000, 2, 300, 9), (2, 64, 4, 2048, 2),  # more experts than threads a block
    (2, 128, 8, 128, 16), (1, 128, 8, 256, 16)])  # decode: 2 and 1 tiles, no slab_count
def test_slab_layout_matches_xla_exactly(ep_size, send_capacity, top_k, local_experts, capacity):
  cupy_backend, reference = backends()
  rng = np.random.default_rng(send_capacity)
  ids = rng.integers(-2, local_experts + 2, (ep_size, send_capacity, top_k)).astype(np.int32)
  weights = rng.random(ids.shape).astype(np.float32)
  demand = rng.integers(0, 50, (ep_size, local_experts)).astype(np.int32)
  meta = np.asarray(meta_layout.pack(ids, weights, demand))
  kwargs = dict(top_k=top_k, num_local_experts=local_experts, expert_capacity=capacity)
  got = on_gpu(functools.partial(cupy_backend.slab_layout, **kwargs), meta)
  want = on_gpu(functools.partial(reference.slab_layout, **kwargs), meta)
  assert_same(got, want, "slab_layout")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16, jnp.int8])
@pytest.mark.parametrize("hidden", [1, 3, 8, 4096])
def test_expand_rows_copies_exactly(dtype, hidden):
  cupy_backend, reference = backends()
  rng = np.random.default_rng(hidden)
  table = jnp.asarray(rng.normal(size=(300, hidden)) * 8, dtype)
  targets, sources = permutation_maps(rng, 300, 3, 700)
  got = on_gpu(cupy_backend.expand_rows, table, targets, sources)
  want = on_gpu(reference.expand_rows, table, targets, sources)
  assert_same(got, want, "expand_rows")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("hidden", [3, 8, 4096])
def test_gather_sum_rows_matches_xla(dtype, hidden):
  """Both sum in float32 over j in order and round once, so they agree to the
  last bit unless XLA reassociates; allow one ulp of the output dtype."""
  cupy_backend, reference = backends()
  rng = np.random.default_rng(hidden + 1)
  table = jnp.asarray(rng.normal(size=(500, hidden)), dtype)
  index = rng.integers(-3, 520, size=(260, 8)).astype(np.int32)
  got = np.asarray(on_gpu(cupy_backend.gather_sum_rows, table, index), np.float32)
  want = np.asarray(on_gpu(reference.gather_sum_rows, table, index), np.float32)
  ulp = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp)


def round_trip(backend, capacity_factor):
  tokens, hidden, experts, top_k = 2048, 1024, 64, 8
  capacity = expert_capacity_for(tokens, top_k, experts, 1, capacity_factor)

  def loss(x, w, idx):
    d = dispatch(x, idx, w, num_experts=experts, expert_capacity=capacity, transport=backend)
    out = (jnp.tanh(d.tokens.astype(jnp.float32)) * d.weights[..., None]).astype(x.dtype)
    y = combine(out, d.handle, num_tokens=tokens, transport=backend)
    return jnp.sum(y.astype(jnp.float32) ** 2), (y, d.counts, d.demand)

  rng = np.random.default_rng(0)
  idx, weights = routing(rng, tokens, top_k, experts, invalid_share=0.02)
  x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return lambda: step(*(jax.device_put(a, gpu_devices()[0]) for a in (x, weights, idx)))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_round_trip_matches_xla_and_is_deterministic(capacity_factor):
  run_cupy = round_trip("cupy", capacity_factor)
  first, second = run_cupy(), run_cupy()
  assert_same(first, second, "cupy run-to-run")  # bit for bit
  (value, (y, counts, demand)), grads = first
  (ref_value, (ref_y, ref_counts, ref_demand)), ref_grads = round_trip("xla", capacity_factor)()
  np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))
  np.testing.assert_array_equal(np.asarray(demand), np.asarray(ref_demand))
  if capacity_factor is not None:
    assert (np.asarray(counts) < np.asarray(demand)).any()
  # Same fixed-order float32 sums, same bf16 roundings: allow 1 bf16 ulp.
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref_y, np.float32),
                             rtol=2 ** -7, atol=2 ** -7)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2 ** -7, atol=2 ** -7)


def test_auto_uses_the_kernels_on_cuda():
  def fn(x, idx, w):
    d = dispatch(x, idx, w, num_experts=8, expert_capacity=16)
    return combine(d.tokens, d.handle, num_tokens=x.shape[0])
  device = gpu_devices()[0]
  args = [jax.device_put(a, device) for a in (np.ones((16, 8), np.float32),
                                              np.zeros((16, 2), np.int32),
                                              np.ones((16, 2), np.float32))]
  text = jax.jit(fn).lower(*args).compile().as_text()
  assert "xla_buffer_python_gpu_callback" in text
