"""Dense NNX training and sampling code, written for models that hold only
parameters, runs unmodified with the layer in the model (return_aux=False,
the one-line swap of an MLP):

* lm1b-style: ``graphdef, params = nnx.split(model, nnx.Param)``, a loss that
  merges inside ``jax.grad`` and an optax update of ``params``;
* ``jax.grad`` over all of the model's state (``nnx.split(model)``), sown aux
  and expert bias included: no integer leaf;
* a Gemma-sampler-style greedy decode in ``lax.while_loop`` that merges the
  model inside the loop body;
* and the layer refuses to run without expert parallelism where an ``ep``
  axis exists but its experts would sit on one device or be replicated.

References: the same model's gradients through ``nnx.grad`` (the path
tests/test_dropin.py checks against the explicit-mesh layer), and the
decode's tokens from an unrolled Python loop.
"""

import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import errors, nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_ep
from moe_ep import ExpertParallelMoE, MoEConfig

HIDDEN, VOCAB = 16, 32
# float32 throughout; the two gradient paths differ only in how JAX orders
# the same sums: 1e-5.
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)


def moe_config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=32, num_experts=4, top_k=2, return_aux=False,
              transport="xla")
  return MoEConfig(**{**base, **overrides})


class DenseLM(nnx.Module):
  """A dense model's shape with its MLP swapped for the MoE layer: position-wise
  (embed -> residual MoE -> unembed), so greedy decoding needs no cache."""

  def __init__(self, config: MoEConfig, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
    self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
    self.mlp = ExpertParallelMoE(config, rngs=rngs)
    self.unembed = nnx.Linear(HIDDEN, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    return self.unembed(x + self.mlp(self.norm(x)))


def batch(seed: int = 0, shape=(4, 9)) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def cross_entropy(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def nnx_param_grads(model, tokens) -> dict:
  grads = nnx.grad(lambda m: cross_entropy(m(tokens), tokens))(model)
  return nnx.to_pure_dict(grads)


def test_lm1b_split_by_param_merge_and_grad_runs_unmodified():
  """Flax's examples/lm1b_nnx step: split by nnx.Param (which used to fail
  with "Non-exhaustive filters ... SownAux"), merge inside the loss,
  jax.grad and an optax update of the params; the gradients equal nnx.grad's."""
  model = DenseLM(moe_config(), nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = batch()

  @jax.jit
  def train_step(params, opt_state, tokens):
    def loss_fn(params):
      module = nnx.merge(graphdef, params)
      return cross_entropy(module(tokens), tokens)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  tx = optax.adamw(1e-2)
  opt_state = tx.init(params)
  new_params, opt_state, loss, grads = train_step(params, opt_state, tokens)
  want = nnx_param_grads(model, tokens)
  got = nnx.to_pure_dict(grads)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=str(path), **GRAD_TOL)
  losses = [float(loss)]
  for _ in range(3):
    new_params, opt_state, loss, _ = train_step(new_params, opt_state, tokens)
    losses.append(float(loss))
  assert losses[-1] < losses[0], losses


def test_split_by_param_alone_fails_after_a_call_and_the_documented_ways_work():
  """After a first call the layer holds its kept aux (SownAux), so
  ``nnx.split(model, nnx.Param)`` alone meets Flax's "Non-exhaustive
  filters" error, as docs/moving_from_dense.md says; the two ways it names,
  a ``...`` for the rest or ``nnx.pop(model, moe_ep.SownAux)`` first, give
  the parameters of the model as built, and the rest is only the aux."""
  model = DenseLM(moe_config(), nnx.Rngs(3))
  _, built = nnx.split(model, nnx.Param)
  model(batch(3))
  with pytest.raises(ValueError, match=r"(?s)Non-exhaustive filters.*SownAux"):
    nnx.split(model, nnx.Param)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  assert jax.tree.structure(params) == jax.tree.structure(built)
  assert {type(v) for _, v in nnx.to_flat_state(rest)} == {moe_ep.SownAux}
  sown = nnx.pop(model, moe_ep.SownAux)
  assert jax.tree.structure(sown) == jax.tree.structure(rest)
  _, popped = nnx.split(model, nnx.Param)
  for a, b in zip(jax.tree.leaves(popped), jax.tree.leaves(built)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # a forward pass changes none
  # Both places a reader looks name Flax's error and both ways (lines rewrapped).
  doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "moving_from_dense.md").read_text()
  for where in (doc, moe_ep.SownAux.__doc__):
    for text in ("Non-exhaustive filters", "nnx.split(model, nnx.Param, ...)",
                 "nnx.pop(model, moe_ep.SownAux)"):
      assert text in " ".join(where.split()), text


def test_grad_over_all_state_meets_no_integer():
  """``nnx.split(model)`` after a call holds the sown aux and the expert
  bias; jax.grad over all of it runs (the route counts used to be int32),
  and the parameters' gradients equal nnx.grad's."""
  model = DenseLM(moe_config(use_expert_bias=True), nnx.Rngs(1))
  tokens = batch(1)
  model(tokens)  # sows the aux
  graphdef, state = nnx.split(model)
  assert nnx.state(model, moe_ep.SownAux) and nnx.state(model, moe_ep.ExpertBias)
  assert all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(state))

  def loss_fn(state):
    module = nnx.merge(graphdef, state, copy=True)
    return cross_entropy(module(tokens), tokens)

  grads = jax.grad(loss_fn)(state)
  want = nnx_param_grads(model, tokens)
  got = nnx.to_pure_dict(nnx.filter_state(grads, nnx.Param))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **GRAD_TOL)
  # The bias and the sown values get no gradient (they do not enter the loss
  # differentiably).
  for leaf in jax.tree.leaves(nnx.filter_state(grads, moe_ep.SownAux, moe_ep.ExpertBias)):
    assert not np.any(np.asarray(leaf))


def greedy_decode_in_while_loop(graphdef, state, prompt, steps: int, copy: bool):
  """Gemma's sampler pattern: the model is merged inside the loop body."""
  length = prompt.shape[1] + steps
  tokens = jnp.zeros((prompt.shape[0], length), jnp.int32).at[:, :prompt.shape[1]].set(prompt)

  def body(carry):
    position, tokens = carry
    model = nnx.merge(graphdef, state, copy=copy) if copy else nnx.merge(graphdef, state)
    logits = model(tokens)
    next_token = jnp.argmax(logits[:, position - 1], axis=-1).astype(jnp.int32)
    return position + 1, tokens.at[:, position].set(next_token)

  _, tokens = jax.lax.while_loop(lambda carry: carry[0] < length, body,
                                 (jnp.int32(prompt.shape[1]), tokens))
  return tokens


def unrolled_decode(model, prompt, steps: int) -> np.ndarray:
  tokens = np.asarray(prompt)
  forward = nnx.jit(lambda model, tokens: model(tokens))
  for _ in range(steps):
    logits = forward(model, jnp.asarray(tokens))
    tokens = np.concatenate([tokens, np.asarray(jnp.argmax(logits[:, -1], -1))[:, None]], 1)
  return tokens


def test_while_loop_decode_that_merges_inside_the_loop():
  """A model as built (or as restored) holds only parameters: the plain merge
  inside the loop runs unmodified. Once it was called outside (its aux sown),
  the plain merge reuses variables of the outer trace: the error names
  nnx.merge(..., copy=True), which then decodes the same tokens."""
  model = DenseLM(moe_config(), nnx.Rngs(2))
  prompt = batch(2, (2, 3))
  want = unrolled_decode(model, prompt, steps=4)  # the model is now called: aux sown
  fresh = DenseLM(moe_config(), nnx.Rngs(2))
  graphdef, state = nnx.split(fresh)
  got = jax.jit(lambda s, p: greedy_decode_in_while_loop(graphdef, s, p, 4, copy=False))(
      state, prompt)
  np.testing.assert_array_equal(np.asarray(got), want)

  graphdef, state = nnx.split(model)
  assert nnx.state(model, moe_ep.SownAux)
  with pytest.raises(errors.TraceContextError, match=r"nnx\.merge\(graphdef, state, copy=True\)"):
    greedy_decode_in_while_loop(graphdef, state, prompt, 4, copy=False)
  got = jax.jit(lambda s, p: greedy_decode_in_while_loop(graphdef, s, p, 4, copy=True))(
      state, prompt)
  np.testing.assert_array_equal(np.asarray(got), want)


def dp_ep_mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "ep"))


def test_input_sharded_over_an_ep_mesh_is_refused_by_a_layer_built_without_one():
  """Built outside any mesh, the layer's experts are whole on every device; an
  input put on a dp x ep NamedSharding used to run with them replicated."""
  layer = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(0))
  x = jax.device_put(np.ones((8, 4, HIDDEN), np.float32), NamedSharding(dp_ep_mesh(), P("dp")))
  with pytest.raises(ValueError, match=r"built without a mesh .* x is sharded over a mesh with "
                                       r"axis 'ep' of size 4: .* jax\.set_mesh\(mesh\)"):
    layer(x)
  explicit = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices("cpu")[:8])
  x = jax.device_put(np.ones((8, 4, HIDDEN), np.float32), NamedSharding(explicit, P("dp")))
  with pytest.raises(ValueError, match="x is sharded over a mesh with axis 'ep' of size 4"):
    nnx.jit(lambda m, v: m(v))(layer, x)
  # One device, or a mesh without an ep axis: nothing to shard.
  y, _ = layer(np.ones((8, HIDDEN), np.float32))
  assert y.shape == (8, HIDDEN)


def test_layer_built_inside_the_legacy_with_mesh_is_refused():
  """``with mesh:`` (deprecated in JAX) is not the ambient mesh the layer
  reads: built inside it, the experts used to sit on one device."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # JAX's own, for `with mesh:`
    with dp_ep_mesh():
      with pytest.raises(ValueError, match=r"legacy `with mesh:` \(axis 'ep' of size 4\).* "
                                           r"jax\.set_mesh\(mesh\)"):
        ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0))
