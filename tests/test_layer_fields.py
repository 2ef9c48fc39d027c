"""Every MoEConfig field reaches the layer: for each, the layer matches the
dense reference (tests/layer_reference.py) under two settings, and the two
settings give clearly different results, so a layer that drops or
mis-plumbs the field fails.

All on the 2x4 ("dp", "ep") CPU mesh with float32 compute unless a test says
otherwise. Tolerances: float32 against a float64 reference differs only by
float32 rounding of differently ordered sums, ~1e-6 relative per value;
1e-5 leaves a margin. The scalar losses (sums of a few hundred positive
terms, ~1e-7 relative off) get 1e-5 relative and no absolute slack: their
values are ~1e-2, where an absolute 1e-5 would hide a 1e-4 relative error
such as a router fed tokens not rounded to the compute dtype. Integers
(counts, kept routes) are exact. Settings are
"clearly different" when they differ by more than 10x that tolerance, so a
layer that ignores the field cannot be within tolerance of both.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import cpu_compiler_options, make_mesh
from layer_reference import reference_bias_update, reference_layer, select_experts
from moe_ep import ExpertParallelMoE, MoEConfig

HIDDEN, FFN, EXPERTS, TOP_K = 16, 24, 8, 2
MESH_SHAPE = (2, 4)  # dp x ep: 8 shards, EP groups of R = 4 ranks
TOL = dict(rtol=1e-5, atol=1e-5)
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
# float32 scores are within ~1e-6 of the float64 ones: routing decisions whose
# gap is above this are the same in both.
MIN_MARGIN = 1e-5


def config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=FFN, num_experts=EXPERTS, top_k=TOP_K,
              dtype="float32", transport="xla", aux_loss_coeff=0.03, z_loss_coeff=2e-3)
  return MoEConfig(**{**base, **overrides})


def batch(seed: int = 0, shape=(8, 6)) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(*shape, HIDDEN)).astype(np.float32)


@functools.cache
def mesh(names=("dp", "ep")) -> jax.sharding.Mesh:
  return make_mesh(MESH_SHAPE, names)


@functools.cache
def _forward(graphdef):
  """One jitted forward per layer structure (config), shared by all tests."""
  return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x),
                 compiler_options=cpu_compiler_options())


def forward(layer, x):
  graphdef, state = nnx.split(layer)
  return _forward(graphdef)(state, x)


def set_value(variable, value) -> None:
  """Overwrites a variable in place, keeping its dtype and sharding (so the
  cached executable still fits)."""
  old = variable[...]
  variable[...] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)


# Fan-in axis of each parameter: values are drawn N(0, 1 / fan_in) like the
# layer's own initialiser.
FAN_IN_AXIS = {"router": 0, "w_in": -2, "w_out": -2, "shared_w_in": 0, "shared_w_out": 0,
               "shared_gate": 0}


def make_layer(cfg: MoEConfig, *, seed: int = 0, skew: float = 0.0, bias_scale: float = 0.0,
               names=("dp", "ep")) -> ExpertParallelMoE:
  """A layer built abstractly (its own __init__ decides every variable's
  shape, dtype and sharding) and filled from NumPy: eager initialisers would
  compile op by op for every new shape and dtype, slower than the layer.

  ``skew`` adds to experts 0 and 1's router weight on feature 0 (see
  :func:`skewed`); ``bias_scale`` draws a random expert bias."""
  layer_mesh = mesh(names)
  layer = nnx.eval_shape(lambda: ExpertParallelMoE(cfg, mesh=layer_mesh, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for name, axis in FAN_IN_AXIS.items():
    if hasattr(layer, name):
      abstract = getattr(layer, name).get_value()
      value = rng.normal(size=abstract.shape) / np.sqrt(abstract.shape[axis])
      getattr(layer, name).set_value(jax.device_put(value.astype(abstract.dtype),
                                                    abstract.sharding))
  if cfg.use_expert_bias:
    bias = random_bias(bias_scale, seed) if bias_scale else np.zeros(EXPERTS, np.float32)
    layer.expert_bias.set_value(jax.device_put(bias, NamedSharding(layer_mesh, P())))
  unfilled = [path for path, value in nnx.to_flat_state(nnx.state(layer))
              if isinstance(value.get_value(), jax.ShapeDtypeStruct)]
  assert not unfilled, f"make_layer does not know variables {unfilled}"
  if skew:
    set_value(layer.router, np.asarray(layer.router[...]) + skew * np.outer(
        np.eye(HIDDEN)[0], (np.arange(EXPERTS) < 2)))
  return layer


def random_bias(scale: float, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed + 100).uniform(-scale, scale, EXPERTS).astype(np.float32)


def skewed(x: np.ndarray, shift: float = 1.0) -> np.ndarray:
  """Tokens with feature 0 raised, so a skewed router favours experts 0, 1
  (both on EP rank 0)."""
  x = x.copy()
  x[..., 0] += shift
  return x


def params_of(layer) -> dict:
  params = {key: np.asarray(value)
            for key, value in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}
  if layer.config.use_expert_bias:
    params["expert_bias"] = np.asarray(layer.expert_bias[...])
  return params


def run(layer, x):
  """``(y, aux, reference)``: the layer's outputs and the reference's."""
  y, aux = forward(layer, x)
  ep_size = layer.mesh.shape[layer.config.ep_axis]
  shard_axes = [a for a in layer.config.batch_axes if a in layer.mesh.axis_names]
  num_shards = ep_size * int(np.prod([layer.mesh.shape[a] for a in shard_axes]))
  ref = reference_layer(layer.config, params_of(layer), x, num_shards=num_shards,
                        ep_size=ep_size)
  assert ref.margin > MIN_MARGIN, f"routing too close to a tie: {ref.margin}"
  return y, aux, ref


def assert_matches(x, y, aux, ref, y_tol=TOL) -> None:
  assert y.shape == x.shape and y.dtype == x.dtype
  np.testing.assert_allclose(np.asarray(y, np.float64), ref.y, **y_tol)
  np.testing.assert_allclose(float(aux.aux_loss), ref.aux_loss, **LOSS_TOL)
  np.testing.assert_allclose(float(aux.z_loss), ref.z_loss, **LOSS_TOL)
  np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), ref.tokens_per_expert)
  routes = ref.keep.size
  kept = round((1.0 - float(aux.dropped_fraction)) * routes)  # exact: routes << 2**24
  assert kept == ref.keep.sum(), (kept, ref.keep.sum())
  np.testing.assert_allclose(float(aux.dropped_fraction), ref.dropped_fraction, rtol=1e-6,
                             atol=1e-7)


def far_apart(a, b) -> bool:
  """Differ by more than 10x the tolerance somewhere."""
  return not np.allclose(a, b, rtol=10 * TOL["rtol"], atol=10 * TOL["atol"])


def check_field(first: MoEConfig, second: MoEConfig, x=None, **layer_args):
  """Both settings match the reference; returns their references."""
  x = batch() if x is None else x
  refs = []
  for cfg in (first, second):
    y, aux, ref = run(make_layer(cfg, **layer_args), x)
    assert_matches(x, y, aux, ref)
    refs.append(ref)
  return refs


# --- router ------------------------------------------------------------------


def test_score_function_and_sigmoid_aux_normalisation():
  softmax, sigmoid = check_field(config(), config(score_function="sigmoid"))
  assert far_apart(softmax.y, sigmoid.y)
  assert far_apart(softmax.aux_loss, sigmoid.aux_loss)
  # P_e for sigmoid is the per-token-normalised score: without the
  # normalisation the loss would be far off.
  fraction = sigmoid.tokens_per_expert / sigmoid.tokens_per_expert.sum()
  unnormalised = 0.03 * EXPERTS * np.sum(fraction * sigmoid.scores.mean(0))
  assert far_apart(unnormalised, sigmoid.aux_loss)


def test_normalize_top_k():
  normalised, raw = check_field(config(), config(normalize_top_k=False))
  np.testing.assert_allclose(normalised.topk_weights.sum(1), 1.0, rtol=1e-12)
  assert far_apart(normalised.y, raw.y)


def test_routed_scaling():
  plain, scaled = check_field(config(), config(routed_scaling=2.5))
  assert far_apart(plain.y, scaled.y)


def test_use_expert_bias_shifts_selection_not_weights():
  plain, biased = check_field(config(score_function="sigmoid"),
                              config(score_function="sigmoid", use_expert_bias=True),
                              bias_scale=0.3)
  assert (plain.topk_idx != biased.topk_idx).any()
  # Weights are the unbiased scores of the chosen experts.
  chosen = np.take_along_axis(biased.scores, biased.topk_idx, axis=1)
  np.testing.assert_allclose(biased.topk_weights, chosen / chosen.sum(1, keepdims=True))
  assert far_apart(plain.y, biased.y)


@pytest.mark.parametrize("score_function, num_groups, group_top_k, bias_scale", [
    ("sigmoid", 2, 1, 0.3),  # groups of 4: top-2 sum != sum of all
    ("softmax", 4, 2, 0.0),
])
def test_group_limited_routing(score_function, num_groups, group_top_k, bias_scale):
  use_bias = bias_scale > 0
  free, grouped = check_field(
      config(score_function=score_function, use_expert_bias=use_bias),
      config(score_function=score_function, use_expert_bias=use_bias, num_groups=num_groups,
             group_top_k=group_top_k),
      bias_scale=bias_scale)
  assert (free.topk_idx != grouped.topk_idx).any()
  assert far_apart(free.y, grouped.y)
  if num_groups == 2:
    # The data tells DeepSeek's group score (the best two experts, bias
    # included) from the sum of the whole group and from unbiased group scores.
    selection = grouped.scores + random_bias(bias_scale)
    chosen = np.sort(grouped.topk_idx, 1)
    for wrong_rule in (dict(group_score_experts=None), dict(group_selection=grouped.scores)):
      wrong, _ = select_experts(selection, TOP_K, num_groups, group_top_k, **wrong_rule)
      assert (np.sort(wrong, 1) != chosen).any(), wrong_rule


def test_group_score_max_of_deepseek_v2():
  """Groups of 4, one chosen, top-2 inside it: the group with the best expert
  (V2's group_limited_greedy) is not always the one with the best pair."""
  top2, best = check_field(config(num_groups=2, group_top_k=1),
                           config(num_groups=2, group_top_k=1, group_score="max"))
  assert (np.sort(top2.topk_idx, 1) != np.sort(best.topk_idx, 1)).any()
  assert far_apart(top2.y, best.y)


def test_aux_and_z_loss_coefficients():
  base, other = check_field(config(), config(aux_loss_coeff=0.0, z_loss_coeff=0.01))
  assert far_apart(base.aux_loss, 0.0) and other.aux_loss == 0.0
  assert far_apart(base.z_loss, other.z_loss)


def test_expert_bias_update_rate():
  cfg = config(score_function="sigmoid", use_expert_bias=True)
  layer = make_layer(cfg, bias_scale=0.3)
  x = batch()
  y, aux, ref = run(layer, x)
  assert_matches(x, y, aux, ref)
  start = np.asarray(layer.expert_bias[...])
  assert len(set(ref.tokens_per_expert)) > 1  # some experts above, some below the mean
  updated = {}
  for rate in (cfg.expert_bias_update_rate, 0.05):
    other = make_layer(dataclasses.replace(cfg, expert_bias_update_rate=rate), bias_scale=0.3)
    other.update_expert_bias(aux)
    updated[rate] = np.asarray(other.expert_bias[...])
    # float32 bias + rate: one rounding of values ~0.3.
    np.testing.assert_allclose(updated[rate], reference_bias_update(
        start, ref.tokens_per_expert, rate), rtol=1e-6, atol=1e-7)
  assert far_apart(*updated.values())


# --- experts -----------------------------------------------------------------


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_activation(activation):
  swiglu, other = check_field(config(), config(activation=activation))
  assert far_apart(swiglu.y, other.y)


def test_num_shared_experts():
  routed, shared = check_field(config(), config(num_shared_experts=2))
  layer = make_layer(config(num_shared_experts=2))
  assert layer.shared_w_out[...].shape == (2 * FFN, HIDDEN)
  assert far_apart(routed.y, shared.y)


def test_shared_ffn_size():
  """Qwen2-MoE's shared expert has a width of its own."""
  default, wide = check_field(config(num_shared_experts=1),
                              config(num_shared_experts=1, shared_ffn_size=40))
  layer = make_layer(config(num_shared_experts=1, shared_ffn_size=40))
  assert layer.shared_w_in[...].shape == (HIDDEN, 2 * 40)
  assert layer.shared_w_out[...].shape == (40, HIDDEN)
  assert far_apart(default.y, wide.y)


def test_shared_expert_gate():
  plain, gated = check_field(config(num_shared_experts=1),
                             config(num_shared_experts=1, shared_expert_gate=True))
  assert make_layer(config(num_shared_experts=1, shared_expert_gate=True)
                    ).shared_gate[...].shape == (HIDDEN, 1)
  assert far_apart(plain.y, gated.y)


# --- capacity ----------------------------------------------------------------


def test_capacity_factor_drops_by_slab_order():
  x = skewed(batch())
  dropless, capped = check_field(config(), config(capacity_factor=1.0), x=x, skew=1.5)
  assert dropless.dropped_fraction == 0.0
  assert capped.expert_capacity == 8 and capped.dropped_fraction > 0
  assert far_apart(dropless.y, capped.y)


def test_expert_capacity_overrides_the_factor():
  x = skewed(batch())
  by_factor, fixed = check_field(config(capacity_factor=1.0),
                                 config(capacity_factor=1.0, expert_capacity=4), x=x, skew=1.5)
  assert (by_factor.expert_capacity, fixed.expert_capacity) == (8, 4)
  assert fixed.dropped_fraction > by_factor.dropped_fraction
  assert far_apart(by_factor.y, fixed.y)


def test_top_k():
  """K=3 routes per token, and K in the capacity: C = ceil(4 * 6 * 3 / 8) = 9
  rounded to 16 rows (K=2: 8)."""
  x = skewed(batch())
  two, three = check_field(config(capacity_factor=1.0), config(capacity_factor=1.0, top_k=3),
                           x=x, skew=1.5)
  assert three.topk_idx.shape[1] == 3 and (two.expert_capacity, three.expert_capacity) == (8, 16)
  assert three.dropped_fraction > 0  # so a smaller C would drop more
  assert far_apart(two.y, three.y)


def test_send_capacity_drops_on_the_wire():
  """32 tokens per rank, factor 1: S = ceil(32 * 2 / R=4) = 16 rows per
  destination chunk, C = 32. Tokens lean to EP rank 0's experts, so chunks to
  rank 0 overflow and drop on the wire, and slabs drop too; S computed with
  another count (E: 8 rows, L = E / R: 32) keeps other routes."""
  cfg = config(capacity_factor=1.0)
  x = skewed(batch(2, shape=(8, 32)), shift=0.5)
  dropless, capped = check_field(config(), cfg, x=x, skew=0.5)
  assert dropless.dropped_fraction == 0.0
  assert (capped.expert_capacity, capped.send_capacity) == (32, 16)
  assert 0 < capped.wire_dropped < (~capped.keep).sum()  # both drops bite
  params = params_of(make_layer(cfg, skew=0.5))
  for wrong in (8, 32):
    other = reference_layer(cfg, params, x, num_shards=8, ep_size=4,
                            send_capacity_override=wrong)
    assert other.keep.sum() != capped.keep.sum()


def test_batch_and_ep_axes_choose_the_shards():
  """batch_axes=() on the 2x4 mesh splits the tokens over the 4 EP ranks only
  (each dp row holds the whole batch), so an EP group sees twice the tokens
  competing for the same C = 4 rows; the EP axis is named "expert" here."""
  x = skewed(batch())
  y, aux, both = run(make_layer(config(expert_capacity=4), skew=1.5), x)
  assert_matches(x, y, aux, both)
  layer = make_layer(config(expert_capacity=4, ep_axis="expert", batch_axes=()), skew=1.5,
                     names=("data", "expert"))
  y, aux, ep_only = run(layer, x)
  assert_matches(x, y, aux, ep_only)
  assert layer.w_in[...].sharding.spec[0] == "expert"
  assert ep_only.dropped_fraction > both.dropped_fraction
  assert far_apart(both.y, ep_only.y)


# --- dtypes ------------------------------------------------------------------


def bfloat16_representable(values) -> bool:
  values = np.asarray(values, np.float32)
  return bool((values.astype(jnp.bfloat16).astype(np.float32) == values).all())


def test_compute_dtype():
  """dtype="bfloat16": inputs and expert weights rounded to bfloat16 and the
  expert path computed in it; y comes back float32 but holds bfloat16 values.
  The bound: about six bfloat16 roundings (2**-9 relative each) along the
  expert path, 2% of the largest output."""
  x = batch()
  y32, aux32, ref32 = run(make_layer(config()), x)
  assert_matches(x, y32, aux32, ref32)
  y16, aux16, ref16 = run(make_layer(config(dtype="bfloat16")), x)
  bound = 0.02 * np.abs(ref16.y).max()
  assert_matches(x, y16, aux16, ref16, y_tol=dict(rtol=0, atol=bound))
  assert bfloat16_representable(y16) and not bfloat16_representable(y32)
  assert far_apart(ref32.y, ref16.y)


def test_output_has_the_input_dtype():
  """bfloat16 x, float32 compute: y is bfloat16, the float32 result rounded
  once (half a bfloat16 ulp, <= 2**-8 relative, plus float32 rounding)."""
  x = batch().astype(jnp.bfloat16)
  y, aux, ref = run(make_layer(config()), x)
  assert y.dtype == jnp.bfloat16
  assert_matches(x, y, aux, ref,
                 y_tol=dict(rtol=2.0 ** -8, atol=TOL["atol"] * np.abs(ref.y).max()))


def test_param_dtype():
  layer = make_layer(config(param_dtype="bfloat16"))
  assert layer.w_in[...].dtype == jnp.bfloat16 and layer.router[...].dtype == jnp.bfloat16
  x = batch()
  y, aux, ref = run(layer, x)
  assert_matches(x, y, aux, ref)
  _, _, ref32 = run(make_layer(config()), x)
  assert far_apart(ref.y, ref32.y)
