"""ExpertParallelMoE: remat guarantees, scan, overflow, and a dense reference."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import BACKENDS, device_count, layer_mesh_cases, make_mesh, nested_jaxprs
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from benchmarks import hlo
from moe_ep.layer_core import NAMED_SCOPES as LAYER_SCOPES
from moe_ep.transport import NAMED_SCOPES
from reference import reference_moe_layer

HIDDEN, FFN, EXPERTS, TOP_K = 16, 24, 8, 2
# float32 throughout: remat and sharding change what is stored and where, not
# the arithmetic, so variants agree to float32 rounding of differently fused
# sums (1e-5); gradients go through two more reductions (1e-4).
TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
ROWS = f"{NAMED_SCOPES['dispatch']}/exchange_rows"
META = f"{NAMED_SCOPES['dispatch']}/exchange_meta"


LAYER_MESHES = layer_mesh_cases()
FIRST_MESH_PER_BACKEND = [case for i, case in enumerate(LAYER_MESHES)
                          if case[0] not in [c[0] for c in LAYER_MESHES[:i]]]


def config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=FFN, num_experts=EXPERTS, top_k=TOP_K,
              dtype="float32", transport="xla")
  return MoEConfig(**{**base, **overrides})


def batch(seed: int, size: int = 8, seq: int = 6) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(size, seq, HIDDEN)).astype(np.float32)


def loss_fn(layer, x):
  y, aux = layer(x)
  return jnp.mean(y ** 2) + aux.aux_loss + aux.z_loss, aux


def compiled_value_and_grad(layer, x, policy=None):
  """``(hlo_text, ((loss, aux), param_grads))`` of value_and_grad, optionally
  through ``jax.checkpoint(policy=policy)`` around the whole layer."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def pure(params, x):
    return loss_fn(nnx.merge(graphdef, params, rest), x)

  if policy is not None:
    pure = jax.checkpoint(pure, policy=policy)
  step = jax.jit(jax.value_and_grad(pure, has_aux=True))
  return step.lower(params, x).compile().as_text(), step(params, x)


def assert_trees_close(got, want, tol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jnp.issubdtype(jnp.asarray(b).dtype, jnp.integer):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


def biased_sigmoid_layer(mesh, **overrides):
  """Sigmoid router whose bias forces every token onto experts 0 and 1."""
  layer = ExpertParallelMoE(config(score_function="sigmoid", use_expert_bias=True,
                                   **overrides), mesh=mesh, rngs=nnx.Rngs(0))
  layer.expert_bias[...] = jnp.zeros(EXPERTS).at[:2].set(10.0)
  return layer


@pytest.mark.parametrize("backend, mesh_shape", LAYER_MESHES)
@pytest.mark.parametrize("routing", ["softmax", "sigmoid_biased"])
def test_saved_dispatch_removes_redispatch(routing, backend, mesh_shape):
  mesh = make_mesh(mesh_shape, ("dp", "ep"), backend)
  if routing == "softmax":
    layer = ExpertParallelMoE(config(aux_loss_coeff=0.01, z_loss_coeff=1e-3, transport=backend),
                              mesh=mesh, rngs=nnx.Rngs(0))
  else:
    layer = biased_sigmoid_layer(mesh, transport=backend)
  x = batch(0)
  names = jax.checkpoint_policies.save_only_these_names
  text_plain, plain = compiled_value_and_grad(layer, x)
  text_saved, saved = compiled_value_and_grad(layer, x, RematConfig(save=("dispatch",)).policy())
  text_nothing, nothing = compiled_value_and_grad(layer, x,
                                                  jax.checkpoint_policies.nothing_saveable)
  # The upstream bug: saving the dispatched tokens but not the routing state.
  text_partial, partial = compiled_value_and_grad(
      layer, x, names("moe.dispatch.tokens", "moe.dispatch.weights"))

  if routing == "sigmoid_biased":
    tokens_per_expert = np.asarray(plain[0][1].tokens_per_expert)
    assert (tokens_per_expert[2:] == 0).all() and (tokens_per_expert[:2] > 0).all()

  assert hlo.count(text_plain, scope=ROWS) == 1
  # The router's and the experts' matmuls carry the layer's scopes (profiles).
  for part in ("router", "experts"):
    assert re.search(rf'op_name="[^"]*{LAYER_SCOPES[part]}/[^"]*dot_general', text_plain), part
  assert hlo.count(text_saved, scope=ROWS) == 1
  assert hlo.count(text_nothing, scope=ROWS) == 2
  # Saving dispatch and combine outputs re-runs no collective at all (the
  # global load counts are saved with the dispatch counts).
  text_both, both = compiled_value_and_grad(layer, x,
                                            RematConfig(save=("dispatch", "combine")).policy())
  assert len(hlo.collectives(text_both)) == len(hlo.collectives(text_plain))
  assert_trees_close(both, plain, GRAD_TOL)
  dispatch_exchanges = lambda text: hlo.count(text, scope=NAMED_SCOPES["dispatch"] + "/")
  assert dispatch_exchanges(text_saved) == dispatch_exchanges(text_plain) == 2
  assert dispatch_exchanges(text_partial) > dispatch_exchanges(text_saved)
  assert hlo.count(text_partial, scope=META) == 2, "routing state recomputed"
  for variant in (saved, nothing, partial):
    assert_trees_close(variant, plain, GRAD_TOL)


def is_integer_psum(eqn) -> bool:
  return eqn.primitive.name.startswith("psum") and all(
      jnp.issubdtype(var.aval.dtype, jnp.integer) for var in eqn.outvars)


def integer_psums(jaxpr) -> list:
  """The integer all-reduces: in the layer, only the batch-global counts.
  Counted in the jaxpr because XLA's all-reduce combiner merges a re-run of
  them with the forward one into a single tuple all-reduce in the HLO."""
  return [eqn for inner in nested_jaxprs(jaxpr) for eqn in inner.eqns if is_integer_psum(eqn)]


def checkpoint_names_of_integer_psums(jaxpr) -> list[str]:
  """The ``checkpoint_name`` attached directly to each integer all-reduce."""
  names = []
  for inner in nested_jaxprs(jaxpr):
    summed = {var for eqn in inner.eqns if is_integer_psum(eqn) for var in eqn.outvars}
    names += [eqn.params["name"] for eqn in inner.eqns
              if eqn.primitive.name == "name" and eqn.invars[0] in summed]
  return names


@pytest.mark.parametrize("backend, mesh_shape", LAYER_MESHES)
def test_saved_dispatch_keeps_the_global_counts(backend, mesh_shape):
  """The batch-global counts (the aux loss's backward reads them) carry the
  checkpoint name "moe.dispatch.counts": saving "dispatch" re-runs no counts
  all-reduce in backward, saving everything of it but the counts does."""
  mesh = make_mesh(mesh_shape, ("dp", "ep"), backend)
  layer = ExpertParallelMoE(config(aux_loss_coeff=0.01, transport=backend), mesh=mesh,
                            rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def pure(params, x):
    return loss_fn(nnx.merge(graphdef, params, rest), x)

  def jaxpr(fn):
    return jax.make_jaxpr(fn)(params, batch(0)).jaxpr

  counts_name = RematConfig().name("dispatch.counts")
  assert counts_name == "moe.dispatch.counts"
  assert checkpoint_names_of_integer_psums(jaxpr(pure)) == [counts_name]

  def backward_counts_psums(policy):
    step = pure if policy is None else jax.checkpoint(pure, policy=policy)
    return len(integer_psums(jaxpr(jax.value_and_grad(step, has_aux=True))))

  all_but_counts = [name for name in RematConfig(save=("dispatch",)).names if name != counts_name]
  assert backward_counts_psums(None) == 1
  assert backward_counts_psums(RematConfig(save=("dispatch",)).policy()) == 1
  assert backward_counts_psums(jax.checkpoint_policies.save_only_these_names(
      *all_but_counts)) == 2


def test_remat_apply_true_checkpoints_the_layer_itself():
  mesh = make_mesh((2, 4), ("dp", "ep"))
  x = batch(1)
  results = {}
  for save in (("dispatch",), ()):
    layer = ExpertParallelMoE(config(remat=RematConfig(save=save, apply=True)), mesh=mesh,
                              rngs=nnx.Rngs(0))
    text, results[save] = compiled_value_and_grad(layer, x)
    assert hlo.count(text, scope=ROWS) == (1 if save else 2)
  plain = ExpertParallelMoE(config(), mesh=mesh, rngs=nnx.Rngs(0))
  _, expected = compiled_value_and_grad(plain, x)
  for result in results.values():
    assert_trees_close(result, expected, GRAD_TOL)


def stacked_layers(cfg, mesh, count=2):
  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
  def create(rngs):
    return ExpertParallelMoE(cfg, mesh=mesh, rngs=rngs)
  return create(nnx.Rngs(0))


@pytest.mark.parametrize("backend, mesh_shape", FIRST_MESH_PER_BACKEND)
def test_saved_handles_in_scan_match_plain_scan_and_unrolled_loop(backend, mesh_shape):
  """Two stacked layers through nnx.scan with the dispatch saved, against a
  plain scan and a Python loop over the two layers, on two batches run by the
  same compiled executables (no stale routing state)."""
  mesh = make_mesh(mesh_shape, ("dp", "ep"), backend)
  cfg = config(aux_loss_coeff=0.01, transport=backend)
  stack = stacked_layers(cfg, mesh)
  graphdef, params, rest = nnx.split(stack, nnx.Param, ...)

  def scanned(policy):
    def run(params, x):
      layers = nnx.merge(graphdef, params, rest)

      def step(layer, h):
        y, aux = layer(h)
        return h + y, aux
      if policy is not None:
        step = nnx.remat(step, policy=policy)
      h, aux = nnx.scan(step, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))(layers, x)
      return jnp.mean(h ** 2) + aux.aux_loss.sum(), aux
    return run

  def unrolled(params, x):
    h, total = x, 0.0
    auxes = []
    for i in range(2):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], params),
                        jax.tree.map(lambda a: a[i], rest))
      y, aux = layer(h)
      h, total = h + y, total + aux.aux_loss
      auxes.append(aux)
    return jnp.mean(h ** 2) + total, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

  variants = {
      "saved": scanned(RematConfig(save=("dispatch",)).policy()),
      "plain": scanned(None),
      "unrolled": unrolled,
  }
  steps = {key: jax.jit(jax.value_and_grad(fn, has_aux=True)) for key, fn in variants.items()}
  text = steps["saved"].lower(params, batch(2)).compile().as_text()
  # One forward dispatch, inside the scan body (sites: XLA may unroll the
  # 2-step loop around the peer exchange's custom call).
  assert hlo.count_sites(text, scope=ROWS) == 1
  rematted = jax.jit(jax.value_and_grad(
      scanned(jax.checkpoint_policies.nothing_saveable), has_aux=True))
  text = rematted.lower(params, batch(2)).compile().as_text()
  assert hlo.count_sites(text, scope=ROWS) == 2  # the backward re-runs it
  outputs = {}
  for seed in (2, 3):
    results = {key: step(params, batch(seed)) for key, step in steps.items()}
    assert_trees_close(results["saved"], results["unrolled"], GRAD_TOL)
    assert_trees_close(results["plain"], results["unrolled"], GRAD_TOL)
    outputs[seed] = results["saved"][0][0]
  assert not np.isclose(float(outputs[2]), float(outputs[3]))
  for step in steps.values():
    assert step._cache_size() == 1


@pytest.mark.parametrize("backend, mesh_shape", FIRST_MESH_PER_BACKEND)
def test_overflow_backward_saved_equals_recomputed(backend, mesh_shape):
  mesh = make_mesh(mesh_shape, ("dp", "ep"), backend)
  capacity = 4
  layer = biased_sigmoid_layer(mesh, expert_capacity=capacity, transport=backend)
  x = batch(4)
  _, plain = compiled_value_and_grad(layer, x)
  _, saved = compiled_value_and_grad(layer, x, RematConfig(save=("dispatch",)).policy())
  _, nothing = compiled_value_and_grad(layer, x, jax.checkpoint_policies.nothing_saveable)
  (loss, aux), grads = saved
  dp_size = mesh.shape["dp"]
  assert np.asarray(aux.tokens_per_expert).max() > capacity * dp_size
  assert float(aux.dropped_fraction) > 0.5
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(saved))
  assert_trees_close(saved, nothing, GRAD_TOL)
  assert_trees_close(saved, plain, GRAD_TOL)


REFERENCE_CASES = [(1, a) for a in ("swiglu", "geglu", "gelu")] + [
    (2, "swiglu"), (4, "geglu")] + [(8, a) for a in ("swiglu", "geglu", "gelu")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep_size, activation", REFERENCE_CASES)
def test_layer_matches_dense_reference(ep_size, activation, backend):
  devices = device_count(backend)
  if ep_size > devices or devices % ep_size:
    pytest.skip(f"EP={ep_size} needs a multiple of {ep_size} {backend} devices")
  mesh = make_mesh((devices // ep_size, ep_size), ("dp", "ep"), backend)
  cfg = config(activation=activation, num_shared_experts=1, aux_loss_coeff=0.01,
               z_loss_coeff=1e-3, routed_scaling=1.5, transport=backend)
  layer = ExpertParallelMoE(cfg, mesh=mesh, rngs=nnx.Rngs(ep_size))
  x = batch(5)
  (loss, aux), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(layer, x)
  params = {key: np.asarray(value) for key, value in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}

  def ref_loss(params, x):
    y, aux_loss, z_loss, counts = reference_moe_layer(params, x, cfg)
    return jnp.mean(y ** 2) + aux_loss + z_loss, counts

  (ref_value, ref_counts), ref_grads = jax.value_and_grad(ref_loss, has_aux=True)(params, x)
  np.testing.assert_allclose(float(loss), float(ref_value), **TOL)
  np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), np.asarray(ref_counts))
  assert float(aux.dropped_fraction) == 0.0
  got_grads = nnx.to_pure_dict(grads)
  for key in params:
    np.testing.assert_allclose(np.asarray(got_grads[key]), np.asarray(ref_grads[key]),
                               err_msg=key, **GRAD_TOL)


@pytest.mark.parametrize("backend, mesh_shape", FIRST_MESH_PER_BACKEND)
def test_layer_output_matches_reference_in_bfloat16(backend, mesh_shape):
  """Default dtype: bf16 compute against the float32 reference with bf16
  tolerance (inputs and weights rounded to bf16, ~2**-8 relative each)."""
  mesh = make_mesh(mesh_shape, ("dp", "ep"), backend)
  cfg = dataclasses.replace(config(transport=backend), dtype="bfloat16")
  layer = ExpertParallelMoE(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  x = batch(6)
  y, _ = nnx.jit(lambda m, v: m(v))(layer, jnp.asarray(x, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  params = {key: np.asarray(value) for key, value in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}
  ref, _, _, _ = reference_moe_layer(params, x, dataclasses.replace(cfg, dtype="float32"))
  err = np.abs(np.asarray(y, np.float32) - np.asarray(ref))
  assert err.max() <= 0.05 * np.abs(np.asarray(ref)).max(), err.max()


def test_nnx_split_merge_and_state_round_trip():
  mesh = make_mesh((2, 4), ("dp", "ep"))
  layer = biased_sigmoid_layer(mesh)
  graphdef, state = nnx.split(layer)
  clone = nnx.merge(graphdef, jax.tree.map(lambda a: a.copy(), state))
  x = batch(7)
  y1, _ = nnx.jit(lambda m, v: m(v))(layer, x)
  y2, _ = nnx.jit(lambda m, v: m(v))(clone, x)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
  assert "expert_bias" in nnx.to_pure_dict(nnx.state(layer, nnx.Variable))
  assert "expert_bias" not in nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  assert layer.w_in[...].sharding.spec[0] == "ep"


def test_update_expert_bias_inside_nnx_jit_moves_toward_balance():
  mesh = make_mesh((2, 4), ("dp", "ep"))
  layer = ExpertParallelMoE(config(score_function="sigmoid", use_expert_bias=True,
                                   expert_bias_update_rate=0.05), mesh=mesh, rngs=nnx.Rngs(0))
  x = batch(8) + np.linspace(-1, 1, HIDDEN).astype(np.float32)  # skews the router

  @nnx.jit
  def step(layer, x):
    _, aux = layer(x)
    layer.update_expert_bias(aux)
    return aux.tokens_per_expert

  spread = lambda c: float(np.std(np.asarray(c)) / np.mean(np.asarray(c)))
  first = spread(step(layer, x))
  for _ in range(60):
    # Read each step's counts: XLA's CPU client deadlocks once a few dozen
    # multi-device programs with collectives are queued (over 32 with jax
    # 0.10.2), then aborts the process (a rendezvous's termination timeout).
    last = np.asarray(step(layer, x))
  assert spread(last) < first
  assert np.abs(np.asarray(layer.expert_bias[...])).max() > 0


@pytest.mark.parametrize("layout", ["slabs", "grouped"])
def test_saved_expert_weights_spare_backward_their_cast(layout):
  """With float32 parameters and bf16 compute, a remat saving
  "expert_weights" casts w_in and w_out as often as no remat at all (once,
  forward); without it backward's recomputation casts both again. The
  gradients are the same either way."""
  mesh = make_mesh((2, 4), ("dp", "ep"))
  layer = ExpertParallelMoE(config(dtype="bfloat16", param_dtype="float32",
                                   expert_layout=layout), mesh=mesh, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  x = batch(2)

  def pure(params, x):
    return loss_fn(nnx.merge(graphdef, params, rest), x)

  def step(save):
    body = pure if save is None else jax.checkpoint(pure, policy=RematConfig(save=save).policy())
    return jax.value_and_grad(body, has_aux=True)

  def casts(save) -> int:
    """float32 -> bf16 casts of w_in's or w_out's per-shard shape (the weight
    gradients' own casts, where a backward rule makes one, count alike in
    every variant)."""
    shapes = {(EXPERTS // 4, HIDDEN, 2 * FFN), (EXPERTS // 4, FFN, HIDDEN)}
    jaxpr = jax.make_jaxpr(step(save))(params, x).jaxpr
    return sum(eqn.primitive.name == "convert_element_type"
               and eqn.invars[0].aval.dtype == jnp.float32
               and eqn.outvars[0].aval.dtype == jnp.bfloat16
               and eqn.invars[0].aval.shape in shapes
               for inner in nested_jaxprs(jaxpr) for eqn in inner.eqns)

  assert casts(("dispatch", "expert_weights")) == casts(None)
  assert casts(("dispatch",)) == casts(None) + 2
  saving, recomputing = (jax.jit(step(save))(params, x)
                         for save in (("dispatch", "expert_weights"), ("dispatch",)))
  assert_trees_close(saving, recomputing, dict(rtol=0, atol=0))
