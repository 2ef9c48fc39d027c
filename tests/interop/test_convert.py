"""moe_ep.interop.from_hf / to_hf against transformers: the fixtures' MoE
blocks (built and run by transformers 5.25, tests/interop/make_fixtures.py)
give the same outputs through the layer, in both layouts; round trips are
bitwise; gradients match finite differences; bad input is one line."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest import make_mesh
from hf_fixtures import (FAMILIES, FUSED, block_prefix, block_tensors, checkpoint_tensors,
                         fused_tensors, hf_config, reference)
from moe_ep import ExpertParallelMoE, router
from moe_ep.interop import HFInteropError, config_from_hf, from_hf, layer_params, to_hf

# Both sides compute in float32, in different orders: each output element is
# a sum over H = 16 and F <= 24 products and at most 3 expert terms, so they
# agree to a few float32 ulps of the output's magnitude (measured: <= 1.4e-7
# of max |y|); 1e-5 of max |y| leaves room and still fails any wrong rule or
# transposed weight (those move outputs by 1e-2 of max |y| and more).
REL_TOL = 1e-5


def assert_matches_transformers(y, want):
  err = np.abs(np.asarray(y, np.float32) - want).max()
  assert err <= REL_TOL * np.abs(want).max(), (err, np.abs(want).max())


def layer_for(model_type, tensors=None, layer=None, mesh=None, **overrides):
  """The fixture's (first) MoE block as a float32 layer on the pure-JAX transport."""
  layer = min(reference(model_type)) if layer is None else layer
  tensors = checkpoint_tensors(model_type) if tensors is None else tensors
  return from_hf(hf_config(model_type), tensors, block_prefix(model_type, layer), mesh=mesh,
                 **{"dtype": "float32", "transport": "xla", **overrides})


@pytest.mark.parametrize("model_type", FAMILIES)
def test_per_expert_checkpoint_matches_transformers_block(model_type):
  tensors = checkpoint_tensors(model_type)
  for i, (x, want) in reference(model_type).items():
    y, _ = layer_for(model_type, tensors, i)(x)
    assert_matches_transformers(y, want)


@pytest.mark.parametrize("model_type", FUSED)
def test_fused_layout_matches_transformers_block(model_type):
  tensors = fused_tensors(model_type)
  for i, (x, want) in reference(model_type).items():
    layer = from_hf(hf_config(model_type), tensors, f"model.layers.{i}.mlp", dtype="float32",
                    transport="xla")
    y, _ = layer(x)
    assert_matches_transformers(y, want)


def test_layer_on_an_ep_mesh_matches_transformers_block():
  mesh = make_mesh((2, 4), ("dp", "ep"))
  (i, (x, want)), = reference("deepseek_v3").items()
  y, _ = layer_for("deepseek_v3", mesh=mesh)(x)
  assert_matches_transformers(y, want)


# Each rule changed alone moves the fixture's outputs: the fixtures tell the
# families' rules apart, so matching them above proves each rule.
RULE_CHANGES = [
    ("deepseek_v3", dict(group_score="max")),
    ("deepseek_v3", dict(normalize_top_k=False)),
    ("deepseek_v3", dict(num_groups=None, group_top_k=None)),
    ("deepseek_v2", dict(group_score="top2_sum")),
    ("deepseek_v2", dict(num_groups=None, group_top_k=None)),
    ("qwen2_moe", dict(normalize_top_k=True)),
    ("mixtral", dict(normalize_top_k=False)),
]


@pytest.mark.parametrize("model_type, change", RULE_CHANGES)
def test_fixture_output_depends_on_each_routing_rule(model_type, change):
  layer = layer_for(model_type)
  layer.config = dataclasses.replace(layer.config, **change)
  (x, want), = list(reference(model_type).values())[:1]
  err = np.abs(np.asarray(layer(x)[0]) - want).max()
  assert err > 1e-3 * np.abs(want).max(), err


def test_fixture_output_depends_on_the_correction_bias():
  layer = layer_for("deepseek_v3")
  layer.expert_bias[...] = jnp.zeros_like(layer.expert_bias[...])
  (x, want), = reference("deepseek_v3").values()
  assert np.abs(np.asarray(layer(x)[0]) - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_through_the_layer_is_bitwise(model_type, layout):
  tensors = checkpoint_tensors(model_type)
  for i in reference(model_type):
    prefix = block_prefix(model_type, i)
    block = block_tensors(tensors, prefix)
    layer = layer_for(model_type, tensors, i)
    back = to_hf(layer, hf_config(model_type), prefix, layout=layout)
    again = layer_for(model_type, back, i)
    for key, value in layer_params(layer).items():
      np.testing.assert_array_equal(layer_params(again)[key], value, err_msg=key)
    if layout == "per_expert":
      assert sorted(back) == sorted(block)
      for name, value in block.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], value, err_msg=name)


@pytest.mark.parametrize("model_type", FUSED)
def test_per_expert_checkpoint_converts_to_transformers_fused_tensors_bitwise(model_type):
  """Our per-expert -> fused conversion against transformers' own: the
  fused tensors it holds in memory (gate rows first in gate_up_proj)."""
  want = fused_tensors(model_type)
  tensors = checkpoint_tensors(model_type)
  got = {}
  for i in reference(model_type):
    got.update(to_hf(layer_for(model_type, tensors, i), hf_config(model_type),
                     f"model.layers.{i}.mlp", layout="fused"))
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_a_trained_layer_round_trips_bitwise(model_type):
  """A layer of random parameters (not from a checkpoint) -> to_hf -> from_hf."""
  hf = hf_config(model_type)
  layer = ExpertParallelMoE(config_from_hf(hf, transport="xla"), rngs=nnx.Rngs(3))
  if layer.config.use_expert_bias:
    layer.expert_bias[...] = jnp.linspace(-1.0, 1.0, layer.config.num_experts)
  for layout in ("per_expert", "fused"):
    again = from_hf(hf, to_hf(layer, hf, "p", layout=layout), "p", transport="xla")
    for key, value in layer_params(layer).items():
      np.testing.assert_array_equal(layer_params(again)[key], value, err_msg=key)


def test_bfloat16_checkpoint_loads_and_writes_back_bitwise():
  tensors = {name: value.astype(ml_dtypes.bfloat16)
             for name, value in checkpoint_tensors("olmoe").items()}
  prefix = block_prefix("olmoe", 0)
  layer = from_hf(hf_config("olmoe"), tensors, prefix, transport="xla")
  assert layer.w_in[...].dtype == jnp.float32  # bf16 widened exactly to param_dtype
  back = to_hf(layer, hf_config("olmoe"), prefix, dtype=ml_dtypes.bfloat16)
  for name, value in back.items():
    np.testing.assert_array_equal(value, tensors[name], err_msg=name)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_bfloat16_layer_matches_transformers_float32_block(model_type):
  """bf16 compute (on the default device: the GPU where there is one) against
  transformers' float32 block: inputs, weights and activations each round to
  bf16 (2**-8 relative), so errors reach a few 2**-8 of max |y|; 3% (as for
  the layer's own bf16 test) bounds them where no route flips between near
  ties, which the fixtures' random scores do not hold."""
  (x, want), = list(reference(model_type).values())[:1]
  layer = layer_for(model_type, dtype="bfloat16", transport="auto")
  y, _ = layer(jnp.asarray(x, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  err = np.abs(np.asarray(y, np.float32) - want).max()
  assert err <= 0.03 * np.abs(want).max(), err


# --- gradients against central finite differences ----------------------------------

# float32 central differences at step EPS along unit-norm random directions.
# Each loss value is a float32 sum of magnitude S = sum |y * probe| (a few
# hundred), off by about u * S (u = 2**-24), so the difference quotient is
# off by up to u * S / EPS (about 5e-3 here); truncation, O(EPS**2) of the
# third derivative, stays under 1e-3 of the derivative (measured: every
# case within 6e-4 relative or 1e-3 absolute).
EPS = 1e-2
FD_REL_TOL = 1e-3
ROUNDING = 2.0 ** -24


def _routing(config, params, tokens):
  """``[T, K]`` experts chosen for ``tokens [..., H]`` under ``params``."""
  logits = tokens.reshape(-1, config.hidden_size) @ params["router"]
  return np.asarray(router.route(
      logits, top_k=config.top_k, score_function=config.score_function,
      num_groups=config.num_groups, group_top_k=config.group_top_k,
      group_score=config.group_score, expert_bias=params.get("expert_bias")).topk_idx)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_gradients_match_central_finite_differences(model_type):
  """d/d(input) and d/d(each parameter) of ``sum(y * probe)``, along a random
  direction, against ``(L(v + EPS d) - L(v - EPS d)) / (2 EPS)``."""
  layer = layer_for(model_type)
  (x, _), = list(reference(model_type).values())[:1]
  probe = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  names = [path[-1] for path, _ in nnx.to_flat_state(params)]
  leaves, treedef = jax.tree.flatten(params)
  fixed = {"expert_bias": np.asarray(layer.expert_bias[...])} if (
      layer.config.use_expert_bias) else {}

  def loss(leaves, x):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)
    return jnp.sum(model(x)[0] * probe)

  value_grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  leaf_grads, x_grad = value_grad(leaves, x)
  scale = float(np.abs(np.asarray(layer(x)[0]) * probe).sum())
  loss = jax.jit(loss)
  rng = np.random.default_rng(2)
  for position, name in [*enumerate(names), (None, "x")]:
    base = np.asarray(x if position is None else leaves[position])
    direction = rng.normal(size=base.shape).astype(np.float32)
    direction /= np.linalg.norm(direction)
    values = {}
    for sign in (1.0, -1.0):
      moved = jnp.asarray(base + sign * EPS * direction)
      new_leaves = [moved if k == position else leaf for k, leaf in enumerate(leaves)]
      new_x = moved if position is None else x
      params_now = {**dict(zip(names, map(np.asarray, new_leaves))), **fixed}
      values[sign] = (float(loss(new_leaves, new_x)),
                      _routing(layer.config, params_now, np.asarray(new_x)))
    # Top-k is piecewise: the step must not change any route.
    assert np.array_equal(values[1.0][1], values[-1.0][1]), f"{name}: a route flipped"
    numeric = (values[1.0][0] - values[-1.0][0]) / (2 * EPS)
    grad = np.asarray(x_grad if position is None else leaf_grads[position])
    analytic = float(np.sum(grad * direction))
    tolerance = FD_REL_TOL * abs(analytic) + ROUNDING * scale / EPS
    assert abs(numeric - analytic) <= tolerance, (name, numeric, analytic, tolerance)


# --- bad input -------------------------------------------------------------------


def test_a_missing_tensor_is_named_with_the_family():
  tensors = checkpoint_tensors("deepseek_v3")
  name = "model.layers.1.mlp.experts.5.up_proj.weight"
  del tensors[name]
  with pytest.raises(HFInteropError) as error:
    layer_for("deepseek_v3", tensors)
  assert str(error.value) == (f"missing tensor {name!r} of the deepseek_v3 MoE block at prefix "
                              "'model.layers.1.mlp' (per_expert layout)")


def test_a_misshapen_tensor_names_expected_and_found():
  tensors = fused_tensors("qwen3_moe")
  name = "model.layers.1.mlp.experts.gate_up_proj"
  tensors[name] = tensors[name].transpose(0, 2, 1)[:, :, :8]  # [E, H, 8]: transposed, cut
  with pytest.raises(HFInteropError) as error:
    from_hf(hf_config("qwen3_moe"), tensors, "model.layers.1.mlp")
  assert str(error.value) == (f"tensor {name!r} has shape [8, 16, 8], expected [8, 16, 16] "
                              "for the qwen3_moe config")


def test_fp8_weights_are_refused_in_one_line():
  tensors = checkpoint_tensors("deepseek_v3")
  name = "model.layers.1.mlp.experts.0.gate_proj.weight"
  tensors[name + "_scale_inv"] = np.ones((1, 1), np.float32)
  with pytest.raises(HFInteropError, match="is FP8") as error:
    layer_for("deepseek_v3", tensors)
  assert "\n" not in str(error.value) and "fp8_cast_bf16" in str(error.value)


def test_an_ep_axis_that_does_not_divide_the_experts_is_refused():
  mesh = make_mesh((2, 4), ("dp", "ep"))
  with pytest.raises(HFInteropError, match="num_experts=6 is not divisible by the ep axis size 4"):
    layer_for("qwen2_moe", mesh=mesh)
