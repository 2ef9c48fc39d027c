"""The layer as a one-line drop-in: ambient mesh, any input shape and sharding,
sown aux with the model-wide helpers, compute in the input's dtype, an NNX
feed-forward's call keywords, clear errors where a mesh or a transform would
silently lose EP or the aux, and its state restored onto another mesh.

Every result is checked against the explicit-mesh path with ``return_aux=True``
(which the dense-reference tests in test_layer.py pin down) or a one-device
layer with the same parameters.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import errors, nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_ep
from conftest import BACKENDS, devices_for
from moe_ep import ExpertParallelMoE, MoEConfig
from moe_ep.router import expert_bias_step
from reference import reference_moe_layer

HIDDEN, VOCAB = 16, 32
# float32 compute everywhere; paths differ only in how sums are split over
# shards and ordered: 1e-5 on values, 1e-4 on gradients (two more reductions).
TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


def moe_config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=32, num_experts=8, top_k=2, return_aux=False,
              use_expert_bias=True, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, transport="xla")
  return MoEConfig(**{**base, **overrides})


def cpu_mesh(kind: str, shape=(2, 4), backend="xla"):
  devices = devices_for(backend, int(np.prod(shape)))
  if kind == "make_mesh":  # Explicit axes
    return jax.make_mesh(shape, ("dp", "ep"), devices=devices)
  return jax.sharding.Mesh(np.array(devices).reshape(shape), ("dp", "ep"))  # Auto axes


@contextlib.contextmanager
def on(mesh):
  with jax.set_mesh(mesh), jax.default_device(mesh.devices.flat[0]):
    yield


class Block(nnx.Module):
  """Pre-norm residual block whose MLP is the MoE: the user's one-line swap."""

  def __init__(self, config: MoEConfig, rngs: nnx.Rngs):
    self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
    self.mlp = ExpertParallelMoE(config, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))


class TinyLM(nnx.Module):
  """Two MoE blocks, as a Python list or as an nnx.vmap stack run by nnx.scan."""

  def __init__(self, config: MoEConfig, stacked: bool, rngs: nnx.Rngs):
    self.stacked = stacked
    self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
    if stacked:
      @nnx.split_rngs(splits=2)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def create(rngs):
        return Block(config, rngs)
      self.blocks = create(rngs)
    else:
      self.blocks = nnx.List([Block(config, rngs) for _ in range(2)])
    self.unembed = nnx.Linear(HIDDEN, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.stacked:
      x = nnx.scan(lambda block, h: block(h), in_axes=(0, nnx.Carry),
                   out_axes=nnx.Carry)(self.blocks, x)
    else:
      for block in self.blocks:
        x = block(x)
    return self.unembed(x)


def token_batch(seed: int, batch: int, seq: int = 9) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_kind, stacked", [("make_mesh", False), ("Mesh", True)])
def test_user_training_loop_runs_unchanged(mesh_kind, stacked):
  """The issue's code, verbatim in spirit: no mesh=, y = moe(x), the helpers
  in the loss and after the update; batch 8, then 1 on 8 devices; the
  loss falls; one trace per batch shape where the step pops the sown aux
  (nnx's sow idiom: the model keeps the structure it was built with)."""
  mesh = cpu_mesh(mesh_kind)
  traces = []
  with on(mesh):
    model = TinyLM(moe_config(), stacked, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
      traces.append(batch.shape)

      def loss_fn(model):
        logits = model(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return ce + moe_ep.total_aux_loss(model)
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      moe_ep.update_expert_biases(model)
      nnx.pop(model, moe_ep.SownAux)
      return loss

    batch = token_batch(0, 8)
    losses = [float(train_step(model, optimizer, batch)) for _ in range(5)]
    for seed in (1, 2):
      assert np.isfinite(float(train_step(model, optimizer, token_batch(seed, 1))))
  assert losses[-1] < losses[0] - 0.1, losses
  assert traces == [(8, 9), (1, 9)], traces
  biases = [np.asarray(layer.expert_bias[...]) for layer in moe_ep.moe_layers(model).values()]
  assert len(biases) == (1 if stacked else 2)
  assert all(np.abs(b).max() > 0 for b in biases)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mesh_kind", ["make_mesh", "Mesh"])
def test_ambient_mesh_matches_explicit_mesh_values_and_grads(mesh_kind, backend):
  """``mesh=`` left out under jax.set_mesh gives the same experts sharding,
  outputs, aux and gradients as passing the mesh (return_aux=True)."""
  shape = (2, 4) if backend == "xla" else (1, len(devices_for(backend, 2)))
  mesh = cpu_mesh(mesh_kind, shape, backend)
  x = np.random.default_rng(1).normal(size=(8, 6, HIDDEN)).astype(np.float32)

  def loss(layer, x):
    out = layer(x)
    if isinstance(out, tuple):
      y, aux = out
    else:
      y, aux = out, moe_ep.collect_aux(layer)[""]
    return jnp.mean(y ** 2) + aux.aux_loss + aux.z_loss, (y, aux.tokens_per_expert)

  results = {}
  with on(mesh):
    ambient = ExpertParallelMoE(moe_config(transport=backend), rngs=nnx.Rngs(3))
    assert ambient.mesh is mesh and ambient.w_in[...].sharding.spec[0] == "ep"
    results["ambient"] = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(ambient, x)
  explicit = ExpertParallelMoE(moe_config(transport=backend, return_aux=True), mesh=mesh,
                               rngs=nnx.Rngs(3))
  results["explicit"] = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(explicit, x)
  (value, (y, counts)), grads = results["ambient"]
  (want_value, (want_y, want_counts)), want_grads = results["explicit"]
  np.testing.assert_allclose(float(value), float(want_value), **TOL)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), **TOL)
  np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
  got, want = nnx.to_pure_dict(grads), nnx.to_pure_dict(want_grads)
  assert set(got) == set(want) == {"router", "w_in", "w_out"}
  for key in want:
    np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), err_msg=key,
                               **GRAD_TOL)


@pytest.mark.parametrize("mesh_kind, shape, spec", [
    ("make_mesh", (1, 1, HIDDEN), P()),                  # decode: one token on 8 devices
    ("Mesh", (1, 1, HIDDEN), P()),
    ("make_mesh", (8, 4, HIDDEN), P(None, "ep")),        # sequence-sharded
    ("make_mesh", (8, 4, HIDDEN), P("dp", None, "ep")),  # hidden-sharded too
    ("Mesh", (5, HIDDEN), P()),                          # [T, H], padded to 8
    ("make_mesh", (2, 3, 1, HIDDEN), P()),               # any leading shape, padded
])
def test_any_token_count_shape_and_sharding(mesh_kind, shape, spec):
  """Each token's output equals a one-device layer's with the same parameters
  (dropless: a token's output does not depend on the others); y is shaped,
  typed and (on Explicit axes) sharded like x; padding rows count nowhere."""
  mesh = cpu_mesh(mesh_kind)
  x_host = np.random.default_rng(2).normal(size=shape).astype(np.float32)
  with on(mesh):
    layer = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(4))
    x = jax.device_put(x_host, NamedSharding(mesh, spec))
    y, aux = nnx.jit(lambda m, v: m(v))(layer, x)
  single = ExpertParallelMoE(moe_config(return_aux=True), mesh=None, rngs=nnx.Rngs(4))
  nnx.update(single, jax.tree.map(np.asarray, nnx.state(layer)))
  with jax.default_device(jax.devices("cpu")[0]):
    want_y, want_aux = nnx.jit(lambda m, v: m(v))(single, x_host)
  assert y.shape == x.shape and y.dtype == x.dtype
  if mesh_kind == "make_mesh":
    assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec
  np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), **TOL)
  np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert),
                                np.asarray(want_aux.tokens_per_expert))
  assert int(np.asarray(aux.tokens_per_expert).sum()) == 2 * int(np.prod(shape[:-1]))
  np.testing.assert_allclose(float(aux.aux_loss), float(want_aux.aux_loss), **TOL)
  np.testing.assert_allclose(float(aux.z_loss), float(want_aux.z_loss), **TOL)


INPUT_KINDS = {
    "numpy": lambda x, mesh: x,
    "jnp made before the mesh": lambda x, mesh: jnp.asarray(x),
    "device_put numpy": lambda x, mesh: jax.device_put(x),
}


@pytest.mark.parametrize("mesh_kind, kind, shape", [
    ("make_mesh", "numpy", (4, 16, HIDDEN)),
    ("make_mesh", "numpy", (3, 5, HIDDEN)),                       # padded to 8 rows
    ("make_mesh", "jnp made before the mesh", (2, 32, HIDDEN)),
    ("make_mesh", "device_put numpy", (60, HIDDEN)),
    ("Mesh", "numpy", (4, 16, HIDDEN)),
])
def test_input_without_a_mesh_sharding_is_taken_on_a_full_ep_mesh(mesh_kind, kind, shape):
  """x that carries no sharding of the mesh (a data loader's NumPy batch, an
  array made before entering the mesh) runs on a (dp=1, ep=8) mesh, inside
  nnx.jit (and once eagerly), and gives each token the output of a one-device layer
  with the same parameters; y comes back whole (replicated)."""
  mesh = cpu_mesh(mesh_kind, shape=(1, 8))
  x_host = np.random.default_rng(3).normal(size=shape).astype(np.float32)
  single = ExpertParallelMoE(moe_config(return_aux=True), mesh=None, rngs=nnx.Rngs(5))
  with jax.default_device(jax.devices("cpu")[0]):
    want_y, _ = nnx.jit(lambda m, v: m(v))(single, x_host)
    x = INPUT_KINDS[kind](x_host, mesh)
  with on(mesh):
    layer = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(5))
    y_jit, _ = nnx.jit(lambda m, v: m(v))(layer, x)
    # Eagerly (every op dispatched on its own: slow on CPU) once.
    outputs = [y_jit, layer(x)[0]] if shape == (3, 5, HIDDEN) else [y_jit]
  for y in outputs:
    assert y.shape == shape and y.dtype == np.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), **TOL)
  if mesh_kind == "make_mesh":
    assert all(axis is None for axis in jax.typeof(y_jit).sharding.spec)


def test_float32_input_computes_in_float32_by_default():
  """dtype=None: float32 in -> float32 compute, equal to the float32 dense
  reference to float32 rounding (bfloat16 compute would be ~1e-2 off); a
  bfloat16 input computes and returns bfloat16."""
  mesh = cpu_mesh("Mesh")
  config = moe_config(return_aux=True, use_expert_bias=False)
  assert config.dtype is None
  layer = ExpertParallelMoE(config, mesh=mesh, rngs=nnx.Rngs(5))
  x = np.random.default_rng(5).normal(size=(8, 6, HIDDEN)).astype(np.float32)
  y, _ = nnx.jit(lambda m, v: m(v))(layer, x)
  params = {key: np.asarray(value)
            for key, value in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}
  want, _, _, _ = reference_moe_layer(params, x, config)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), **TOL)
  y16, _ = nnx.jit(lambda m, v: m(v))(layer, jnp.asarray(x, jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  assert np.abs(np.asarray(y16, np.float32) - np.asarray(want)).max() > 1e-4


def test_stacked_update_expert_biases_uses_each_layers_own_load():
  mesh = cpu_mesh("make_mesh")
  with on(mesh):
    model = TinyLM(moe_config(expert_bias_update_rate=0.1), stacked=True, rngs=nnx.Rngs(6))
    before = np.asarray(model.blocks.mlp.expert_bias[...])

    @nnx.jit
    def step(model, batch):
      model(batch)
      loads = moe_ep.collect_aux(model)["blocks/mlp"].tokens_per_expert
      moe_ep.update_expert_biases(model)
      return loads

    loads = np.asarray(step(model, token_batch(7, 8)))
  after = np.asarray(model.blocks.mlp.expert_bias[...])
  assert before.shape == after.shape == loads.shape == (2, 8)
  assert not np.array_equal(loads[0], loads[1])
  np.testing.assert_array_equal(after, np.asarray(expert_bias_step(before, loads, 0.1)))
  assert model.blocks.mlp.expert_bias[...].sharding.is_fully_replicated


def test_bias_is_on_the_mesh_from_construction_and_aux_is_sown_at_the_first_call():
  """The bias is created replicated on the mesh; the kept aux appears at the
  first call (as nnx's sow does), replicated too, and float32 throughout."""
  mesh = cpu_mesh("Mesh")
  with on(mesh):
    layer = ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0))
    assert not nnx.state(layer, moe_ep.SownAux)
    nnx.jit(lambda m, v: m(v))(layer, np.ones((8, HIDDEN), np.float32))
  sown = jax.tree.leaves(nnx.state(layer, moe_ep.SownAux))
  assert len(sown) == 4 and all(value.dtype == jnp.float32 for value in sown)
  for value in [layer.expert_bias[...], *sown]:
    assert value.sharding.mesh == mesh and value.sharding.is_fully_replicated


def test_helpers_refuse_layers_that_return_their_aux():
  layer = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="return_aux=True"):
    moe_ep.total_aux_loss(nnx.List([layer]))
  with pytest.raises(ValueError, match="return_aux=False"):
    layer.update_expert_bias()
  assert float(moe_ep.total_aux_loss(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))) == 0.0


def test_mesh_resolution_explicit_ambient_warning_none():
  mesh = cpu_mesh("Mesh")
  other = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "model"))
  with on(other):
    assert ExpertParallelMoE(moe_config(), mesh=mesh, rngs=nnx.Rngs(0)).mesh is mesh
    with pytest.warns(UserWarning, match="no MoEConfig.ep_axis='ep'"):
      assert ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0)).mesh is None
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # once per mesh layout, not per layer
      ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0))
  assert ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0)).mesh is None


def test_zero_tokens_give_empty_output_and_zero_stats():
  mesh = cpu_mesh("Mesh")
  layer = ExpertParallelMoE(moe_config(return_aux=True), mesh=mesh, rngs=nnx.Rngs(0))
  y, aux = layer(np.zeros((0, 4, HIDDEN), np.float32))
  assert y.shape == (0, 4, HIDDEN) and y.dtype == jnp.float32
  assert int(aux.tokens_per_expert.sum()) == 0 and float(aux.aux_loss) == 0.0


def test_bad_input_shapes_and_dtypes_are_named():
  layer = ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"x must be \[\.\.\., hidden_size=16\]"):
    layer(np.zeros((2, 8), np.float32))
  with pytest.raises(ValueError, match="x has dtype int32"):
    layer(np.zeros((2, HIDDEN), np.int32))


def test_call_takes_the_keywords_of_an_nnx_feed_forward():
  """``mlp(x, rngs=..., deterministic=...)``, as Gemma's and nanoGPT-style
  blocks call their feed-forward, runs unchanged and gives ``mlp(x)``."""
  layer = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(0))
  x = np.random.default_rng(8).normal(size=(2, 3, HIDDEN)).astype(np.float32)

  @nnx.jit
  def calls(layer, x):
    return (layer(x), layer(x, deterministic=True),
            layer(x, rngs=nnx.Rngs(dropout=1), deterministic=False))

  (want_y, want_aux), *others = calls(layer, x)
  for y, aux in others:
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert),
                                  np.asarray(want_aux.tokens_per_expert))


def test_layer_built_outside_a_mesh_refuses_a_call_under_an_ep_mesh():
  """Built with no mesh, its experts are whole on one device; called under
  jax.set_mesh with an "ep" axis (eagerly or jitted) it would silently run
  without EP."""
  layer = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(0))
  x = np.ones((8, HIDDEN), np.float32)
  call = nnx.jit(lambda m, v: m(v))
  for run in (lambda m, v: m(v), call):
    with on(cpu_mesh("Mesh")), pytest.raises(
        ValueError, match=r"built without a mesh .* axis 'ep' of size 4: .* jax.set_mesh\(mesh\)"):
      run(layer, x)
  # No ep axis, or one of size 1: nothing to shard, so it runs as built.
  for mesh in (jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("data",)),
               cpu_mesh("Mesh", shape=(2, 1))):
    with on(mesh):
      y, _ = call(layer, x)
    assert y.shape == x.shape


def test_plain_jax_grad_over_a_closure_says_to_use_nnx_grad():
  """return_aux=False keeps the aux in the layer, which a JAX transform of a
  closure cannot update: the error names the NNX transforms. The same
  closure works with return_aux=True, and nnx.grad with either, to the same
  input gradient."""
  x = np.random.default_rng(9).normal(size=(4, HIDDEN)).astype(np.float32)
  sown = ExpertParallelMoE(moe_config(), rngs=nnx.Rngs(0))
  with pytest.raises(errors.TraceContextError,
                     match=r"cannot update: use the NNX transforms .*nnx\.grad\(loss_fn\)"):
    jax.grad(lambda v: sown(v).sum())(x)
  returned = ExpertParallelMoE(moe_config(return_aux=True), rngs=nnx.Rngs(0))
  want = jax.jit(jax.grad(lambda v: returned(v)[0].sum()))(x)
  got = nnx.jit(nnx.grad(lambda model, v: model(v).sum(), argnums=1))(sown, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **GRAD_TOL)


def restore_target(create, mesh):
  """``(graphdef, target)``: the module ``create()`` builds, traced under
  ``mesh``, with restore targets placed by its partition specs on ``mesh``
  (docs/multinode.md's pattern: nnx.eval_shape's own shardings name an
  AbstractMesh, which Orbax cannot place arrays on)."""
  with jax.set_mesh(mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(create))
  specs = nnx.get_partition_spec(abstract)
  target = jax.tree.map(
      lambda value, spec: jax.ShapeDtypeStruct(value.shape, value.dtype,
                                               sharding=NamedSharding(mesh, spec)),
      abstract, specs, is_leaf=lambda x: isinstance(x, P))
  return graphdef, target


def test_layer_state_restores_onto_another_mesh_bitwise(tmp_path):
  """Saved from a 2x4 mesh, the layer's state (experts, bias; the kept aux
  popped, as a freshly built layer has none) restores onto 1x2, 1x1 and 1x8 meshes bit for bit, experts split over the
  new ep axis, and the restored layer computes what the saved one does."""
  config = moe_config()
  x = np.random.default_rng(10).normal(size=(8, HIDDEN)).astype(np.float32)
  forward = nnx.jit(lambda layer, v: layer(v))
  with on(cpu_mesh("Mesh")):
    layer = ExpertParallelMoE(config, rngs=nnx.Rngs(11))
    layer.expert_bias[...] = jnp.arange(8, dtype=jnp.float32) / 10
    want_y = np.asarray(forward(layer, x))
  nnx.pop(layer, moe_ep.SownAux)
  saved = nnx.state(layer)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "layer", saved)
  checkpointer.wait_until_finished()
  for shape in ((1, 2), (1, 1), (1, 8)):
    mesh = cpu_mesh("Mesh", shape)
    graphdef, target = restore_target(lambda: ExpertParallelMoE(config, rngs=nnx.Rngs(0)), mesh)
    restored = checkpointer.restore(tmp_path / "layer", target)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
      assert got.sharding.mesh == mesh
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert restored["w_in"][...].addressable_shards[0].data.shape[0] == 8 // shape[1]
    with on(mesh):
      moved = nnx.merge(graphdef, restored)
      assert moved.mesh == mesh
      np.testing.assert_allclose(np.asarray(forward(moved, x)), want_y, **TOL)
