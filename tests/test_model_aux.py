"""moe_ep.model_aux: the model-wide helpers over a model that mixes layers
with and without each loss and the expert bias, plain and stacked
(``nnx.vmap``, run by ``nnx.scan``). The reference is each layer's own kept
:class:`MoEAux`, summed in float64 numpy, and the router's bias step applied
to each layer's own load."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_ep
from moe_ep import ExpertParallelMoE, MoEConfig
from moe_ep.router import expert_bias_step

HIDDEN = 8


def config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=16, num_experts=4, top_k=2, return_aux=False,
              transport="xla", expert_bias_update_rate=0.1)
  return MoEConfig(**{**base, **overrides})


class Mixed(nnx.Module):
  """A z-loss-only layer without bias, a balance-loss layer with bias, and a
  stack of two layers with both losses and the bias."""

  def __init__(self, rngs: nnx.Rngs):
    self.z_only = ExpertParallelMoE(config(z_loss_coeff=0.5), rngs=rngs)
    self.balanced = ExpertParallelMoE(config(aux_loss_coeff=0.5, use_expert_bias=True),
                                      rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return ExpertParallelMoE(config(aux_loss_coeff=0.25, z_loss_coeff=0.25,
                                      use_expert_bias=True), rngs=rngs)
    self.stack = create(rngs)

  def __call__(self, x):
    x = x + self.z_only(x)
    x = x + self.balanced(x)
    return nnx.scan(lambda layer, h: h + layer(h), in_axes=(0, nnx.Carry),
                    out_axes=nnx.Carry)(self.stack, x)


@pytest.fixture(scope="module")
def model():
  model = Mixed(nnx.Rngs(3))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, HIDDEN)), jnp.float32)
  nnx.jit(lambda m, v: m(v))(model, x)
  return model


def kept(layer) -> dict:
  return {field: np.asarray(value, np.float64)
          for field, value in layer.latest_aux.get()._asdict().items()}


def test_total_aux_loss_sums_both_losses_of_every_layer_plain_and_stacked(model):
  layers = (model.z_only, model.balanced, model.stack)
  want = sum(kept(layer)["aux_loss"].sum() + kept(layer)["z_loss"].sum() for layer in layers)
  # Each loss is present where its coefficient is set, so dropping any one
  # layer, any stacked row or either loss changes the total.
  assert kept(model.z_only)["z_loss"] > 0 and kept(model.z_only)["aux_loss"] == 0
  assert kept(model.balanced)["aux_loss"] > 0 and kept(model.balanced)["z_loss"] == 0
  assert kept(model.stack)["aux_loss"].shape == (2,)
  assert np.all(kept(model.stack)["aux_loss"] > 0) and np.all(kept(model.stack)["z_loss"] > 0)
  # float32 sums of five terms against float64: a few ulps.
  np.testing.assert_allclose(float(moe_ep.total_aux_loss(model)), want, rtol=1e-6)
  assert set(moe_ep.collect_aux(model)) == {"z_only", "balanced", "stack"}


def test_update_expert_biases_steps_only_the_layers_with_a_bias(model):
  before = {name: np.asarray(getattr(model, name).expert_bias[...])
            for name in ("balanced", "stack")}
  loads = {name: np.asarray(getattr(model, name).latest_aux.get().tokens_per_expert)
           for name in before}
  assert not hasattr(model.z_only, "expert_bias")
  nnx.jit(moe_ep.update_expert_biases)(model)
  for name, bias in before.items():
    after = np.asarray(getattr(model, name).expert_bias[...])
    np.testing.assert_array_equal(after, np.asarray(expert_bias_step(bias, loads[name], 0.1)))
    assert not np.array_equal(after, bias)


@pytest.mark.parametrize("return_aux", [True, False])
def test_empty_input_honours_return_aux(return_aux):
  """No token: y is empty and the aux is zero, returned or kept as the
  config says (the kept one replaces the previous call's)."""
  layer = ExpertParallelMoE(config(return_aux=return_aux, aux_loss_coeff=0.5, z_loss_coeff=0.5),
                            rngs=nnx.Rngs(0))
  call = nnx.jit(lambda m, v: m(v))
  full = call(layer, jnp.ones((4, HIDDEN)))
  empty = call(layer, jnp.ones((2, 0, HIDDEN)))
  if return_aux:
    assert isinstance(full, tuple) and isinstance(empty, tuple)
    y, aux = empty
  else:
    assert not isinstance(empty, tuple)
    y, aux = empty, layer.latest_aux.get()
  assert y.shape == (2, 0, HIDDEN)
  assert float(aux.aux_loss) == float(aux.z_loss) == float(aux.dropped_fraction) == 0.0
  np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), np.zeros(4, np.int32))


def test_the_kept_aux_reads_back_as_the_aux_a_returning_layer_gives():
  """``return_aux=False`` keeps what ``return_aux=True`` returns, the route
  counts back as int32 (kept as float32), summing to tokens * top_k."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=(12, HIDDEN)), jnp.float32)
  settings = dict(aux_loss_coeff=0.5, z_loss_coeff=0.5)
  keeping = ExpertParallelMoE(config(**settings), rngs=nnx.Rngs(5))
  returning = ExpertParallelMoE(config(**settings, return_aux=True), rngs=nnx.Rngs(5))
  y_kept = keeping(x)
  y_returned, returned = returning(x)
  np.testing.assert_array_equal(np.asarray(y_kept), np.asarray(y_returned))  # the same layer
  got = keeping.latest_aux.get()
  assert got.tokens_per_expert.dtype == jnp.int32
  assert int(got.tokens_per_expert.sum()) == 12 * 2
  for field in got._fields:
    np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                  np.asarray(getattr(returned, field)), err_msg=field)


class Nested(nnx.Module):
  def __init__(self, inner_returns: bool, rngs: nnx.Rngs):
    self.first = ExpertParallelMoE(config(), rngs=rngs)
    self.inner = nnx.Module()
    self.inner.mlp = ExpertParallelMoE(config(return_aux=inner_returns), rngs=rngs)


def test_collect_aux_names_each_layer_by_its_slash_path_and_refuses_a_returning_one():
  x = jnp.ones((4, HIDDEN))
  model = Nested(False, nnx.Rngs(0))
  model.first(x), model.inner.mlp(x)
  assert set(moe_ep.collect_aux(model)) == {"first", "inner/mlp"}
  model = Nested(True, nnx.Rngs(0))
  model.first(x), model.inner.mlp(x)
  with pytest.raises(ValueError, match=r"the MoE layer at 'inner/mlp' has "
                                       r"MoEConfig\.return_aux=True: .*set return_aux=False"):
    moe_ep.total_aux_loss(model)
