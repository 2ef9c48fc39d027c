"""Router math against hand-computed references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep import router


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_and_weights(score_function, normalize):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(10, 6)).astype(np.float32)
  out = router.route(jnp.asarray(logits), top_k=3, score_function=score_function,
                     normalize_top_k=normalize, routed_scaling=2.5)
  scores = softmax(logits) if score_function == "softmax" else 1 / (1 + np.exp(-logits))
  for t in range(10):
    best = sorted(range(6), key=lambda e: -scores[t, e])[:3]
    assert list(np.asarray(out.topk_idx[t])) == best
    weights = scores[t, best]
    if normalize:
      weights = weights / weights.sum()
    np.testing.assert_allclose(np.asarray(out.topk_weights[t]), 2.5 * weights, rtol=1e-6)


def test_group_limited_routing():
  """8 experts in 4 groups of 2; each token keeps its best 2 groups (scored by
  the sum of both experts) and picks its top 3 experts inside them."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(20, 8)).astype(np.float32)
  out = router.route(jnp.asarray(logits), top_k=3, score_function="sigmoid",
                     num_groups=4, group_top_k=2)
  scores = 1 / (1 + np.exp(-logits))
  for t in range(20):
    group_scores = [scores[t, 2 * g] + scores[t, 2 * g + 1] for g in range(4)]
    groups = sorted(range(4), key=lambda g: -group_scores[g])[:2]
    allowed = [e for g in groups for e in (2 * g, 2 * g + 1)]
    best = sorted(allowed, key=lambda e: -scores[t, e])[:3]
    assert list(np.asarray(out.topk_idx[t])) == best


def test_group_limited_routing_by_the_best_expert_of_each_group():
  """DeepSeek-V2's group_limited_greedy (group_score="max"): 8 experts in 2
  groups of 4; each token keeps the group holding its best expert and picks
  its top 3 inside it."""
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(40, 8)).astype(np.float32)
  out = router.route(jnp.asarray(logits), top_k=3, score_function="softmax", num_groups=2,
                     group_top_k=1, group_score="max")
  by_sum = router.route(jnp.asarray(logits), top_k=3, score_function="softmax", num_groups=2,
                        group_top_k=1)
  scores = softmax(logits)
  for t in range(40):
    group = int(np.argmax(scores[t]) // 4)
    best = sorted(range(4 * group, 4 * group + 4), key=lambda e: -scores[t, e])[:3]
    assert list(np.asarray(out.topk_idx[t])) == best
  assert (np.asarray(out.topk_idx) != np.asarray(by_sum.topk_idx)).any()  # the rules differ here


def test_bias_changes_selection_not_weights():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(16, 8)).astype(np.float32)
  bias = np.zeros(8, np.float32)
  bias[5] = 10.0  # expert 5 always selected
  plain = router.route(jnp.asarray(logits), top_k=2, score_function="sigmoid")
  biased = router.route(jnp.asarray(logits), top_k=2, score_function="sigmoid",
                        expert_bias=jnp.asarray(bias))
  assert (np.asarray(biased.topk_idx) == 5).any(axis=1).all()
  assert not (np.asarray(plain.topk_idx) == 5).any(axis=1).all()
  scores = 1 / (1 + np.exp(-logits))
  picked = np.take_along_axis(scores, np.asarray(biased.topk_idx), axis=1)
  np.testing.assert_allclose(np.asarray(biased.topk_weights),
                             picked / picked.sum(1, keepdims=True), rtol=1e-6)
  # No gradient reaches the bias.
  grad = jax.grad(lambda b: router.route(jnp.asarray(logits), top_k=2, score_function="sigmoid",
                                         expert_bias=b).topk_weights.sum())(jnp.asarray(bias))
  assert not np.asarray(grad).any()


def test_load_balancing_and_z_loss_values():
  tokens_per_expert = jnp.array([6, 2, 0, 4])  # 12 routes
  mean_scores = jnp.array([0.4, 0.1, 0.2, 0.3])
  expected = 4 * (0.5 * 0.4 + (2 / 12) * 0.1 + 0 * 0.2 + (4 / 12) * 0.3)
  np.testing.assert_allclose(float(router.load_balancing_loss(tokens_per_expert, mean_scores)),
                             expected, rtol=1e-6)
  balanced = router.load_balancing_loss(jnp.array([3, 3, 3, 3]), jnp.full(4, 0.25))
  np.testing.assert_allclose(float(balanced), 1.0, rtol=1e-6)
  logits = np.array([[0.0, np.log(3.0)], [1.0, 1.0]], np.float32)
  expected_z = [np.log(4.0) ** 2, (1 + np.log(2.0)) ** 2]
  np.testing.assert_allclose(np.asarray(router.z_loss_terms(jnp.asarray(logits))), expected_z,
                             rtol=1e-6)


def test_expert_bias_update_moves_load_toward_balance():
  """Fixed, skewed logits: repeated bias steps even out the routed load."""
  rng = np.random.default_rng(3)
  num_experts = 8
  logits = jnp.asarray(rng.normal(size=(512, num_experts)) + np.linspace(0, 2, num_experts),
                       jnp.float32)
  bias = jnp.zeros(num_experts)

  def load(bias):
    idx = router.route(logits, top_k=2, score_function="sigmoid", expert_bias=bias).topk_idx
    return router.expert_histogram(idx, num_experts)

  spread = lambda counts: float(np.std(np.asarray(counts)) / np.mean(np.asarray(counts)))
  start = spread(load(bias))
  for _ in range(200):
    bias = router.expert_bias_step(bias, load(bias), rate=0.01)
  assert spread(load(bias)) < 0.25 * start, (start, spread(load(bias)))


def test_expert_bias_step_balances_stacked_layers_separately():
  bias = jnp.zeros((2, 3))
  load = jnp.array([[1, 2, 6], [30, 30, 0]])  # means 3 and 20
  np.testing.assert_array_equal(np.asarray(router.expert_bias_step(bias, load, 0.5)),
                                [[0.5, 0.5, -0.5], [-0.5, -0.5, 0.5]])


def test_expert_histogram_skips_out_of_range():
  idx = jnp.array([[0, 3], [-1, 3], [4, 1]])
  np.testing.assert_array_equal(np.asarray(router.expert_histogram(idx, 4)), [1, 1, 0, 2])


@pytest.mark.parametrize("shape,k", [((64, 128), 8), ((4, 3, 256), 2), ((40, 512), 16),
                                     ((33, 7), 7), ((40, 64), 8), ((40, 512), 17)])
def test_top_k_indices_orders_as_a_stable_sort(shape, k):
  """Largest first, the lower index first among equal values (ties and -inf
  rows made on purpose): the arg-max passes (rows of 128 and more, k <= 16)
  and lax.top_k (the others) against NumPy's stable sort."""
  rng = np.random.default_rng(k)
  values = rng.normal(size=shape).astype(np.float32)
  values[..., ::3] = np.round(values[..., ::3]) + 0.0  # + 0.0: no -0.0 (NumPy ties it with 0.0)
  values.reshape(-1)[::5] = -np.inf
  want = np.argsort(-values, axis=-1, kind="stable")[..., :k]
  got = jax.jit(router.top_k_indices, static_argnums=1)(jnp.asarray(values), k)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), want)


def test_top_k_indices_matches_lax_top_k_on_signed_zeros_and_nans():
  values = jnp.asarray([[0.0, -0.0, 1.0, np.nan, -np.nan, -np.inf, 0.0, -0.0] * 16], jnp.float32)
  np.testing.assert_array_equal(np.asarray(router.top_k_indices(values, 8)),
                                np.asarray(jax.lax.top_k(values, 8)[1]))
