"""The layer on the grouped expert layout against the slab layout: the same
routes kept, the same outputs and gradients, and drops counted the same way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import BACKENDS, layer_mesh_cases, make_mesh, nested_jaxprs
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from moe_ep.transport import expert_capacity_for

HIDDEN, FFN, EXPERTS, TOP_K = 16, 24, 8, 2
# float32: the two layouts run the same products in other groupings (batched
# slabs against grouped rows), so outputs agree to float32 rounding of
# differently ordered sums (1e-5) and gradients, two reductions further, 1e-4.
TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


def config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=FFN, num_experts=EXPERTS, top_k=TOP_K,
              dtype="float32", transport="xla", score_function="sigmoid",
              use_expert_bias=True)
  return MoEConfig(**{**base, **overrides})


def value_and_grads(layer, x):
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y ** 2), (y, aux)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)


def skewed_layer(cfg, mesh):
  """A layer whose expert bias sends most routes to experts 0 and 1."""
  layer = ExpertParallelMoE(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  layer.expert_bias[...] = jnp.zeros(EXPERTS).at[:2].set(0.5)
  return layer


def both_layouts(mesh, x, **overrides):
  """``{layout: ((loss, (y, aux)), grads)}`` for the slab and grouped layouts."""
  return {layout: value_and_grads(skewed_layer(config(expert_layout=layout, **overrides), mesh),
                                  x)
          for layout in ("slabs", "grouped")}


def assert_close(got, want, tol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


def _cases():
  return [(backend, (1, 1)) for backend in BACKENDS] + layer_mesh_cases()


@pytest.mark.parametrize("backend, mesh_shape", _cases())
def test_dropless_grouped_equals_slabs_at_the_dropless_capacity(backend, mesh_shape):
  mesh = make_mesh(mesh_shape, ("dp", "ep"), backend)
  x = np.random.default_rng(0).normal(size=(8, 6, HIDDEN)).astype(np.float32)
  results = both_layouts(mesh, x, transport=backend)
  (loss_s, (y_s, aux_s)), grads_s = results["slabs"]
  (loss_g, (y_g, aux_g)), grads_g = results["grouped"]
  assert float(aux_g.dropped_fraction) == 0.0 == float(aux_s.dropped_fraction)
  np.testing.assert_array_equal(aux_g.tokens_per_expert, aux_s.tokens_per_expert)
  assert_close(y_g, y_s, TOL)
  assert_close(loss_g, loss_s, TOL)
  assert_close(grads_g, grads_s, GRAD_TOL)


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_grouped_on_half_tiles_equals_slabs(mesh_shape):
  """Groups starting at multiples of half a row tile (``group_align=64``: the
  transport fills them, the bank's tile list reads them): the same layer as
  the slabs."""
  mesh = make_mesh(mesh_shape, ("dp", "ep"))
  x = np.random.default_rng(5).normal(size=(8, 6, HIDDEN)).astype(np.float32)
  results = both_layouts(mesh, x, group_align=64)
  (loss_s, (y_s, aux_s)), grads_s = results["slabs"]
  (loss_g, (y_g, aux_g)), grads_g = results["grouped"]
  assert float(aux_g.dropped_fraction) == 0.0 == float(aux_s.dropped_fraction)
  assert_close(y_g, y_s, TOL)
  assert_close(grads_g, grads_s, GRAD_TOL)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_grouped_keeps_and_drops_what_slabs_keep_and_drop(capacity_factor):
  """With a capacity the grouped layout keeps exactly the slab layout's rows."""
  mesh = make_mesh((2, 4), ("dp", "ep"))
  x = np.random.default_rng(1).normal(size=(8, 6, HIDDEN)).astype(np.float32)
  outs = both_layouts(mesh, x, capacity_factor=capacity_factor)
  (_, (y_s, aux_s)), grads_s = outs["slabs"]
  (_, (y_g, aux_g)), grads_g = outs["grouped"]
  assert float(aux_s.dropped_fraction) > 0
  np.testing.assert_allclose(float(aux_g.dropped_fraction), float(aux_s.dropped_fraction))
  assert_close(y_g, y_s, TOL)
  assert_close(grads_g, grads_s, GRAD_TOL)


def test_receive_factor_drops_the_overflow_and_counts_it():
  """EP=4: a small receive factor overflows the rank that owns the hot experts."""
  mesh = make_mesh((1, 4), ("dp", "ep"))
  x = np.random.default_rng(2).normal(size=(4, 128, HIDDEN)).astype(np.float32)
  dropless = skewed_layer(config(expert_layout="grouped"), mesh)
  tight = skewed_layer(config(expert_layout="grouped", receive_factor=0.25), mesh)
  (_, (y_d, aux_d)), _ = value_and_grads(dropless, x)
  (_, (y_t, aux_t)), _ = value_and_grads(tight, x)
  assert float(aux_d.dropped_fraction) == 0.0
  assert 0.0 < float(aux_t.dropped_fraction) < 1.0
  assert not np.allclose(np.asarray(y_t), np.asarray(y_d))
  assert np.all(np.isfinite(np.asarray(y_t)))


def test_grouped_saved_dispatch_is_the_row_buffer():
  """Remat names keep their meaning: dispatch.tokens is the [M, H] buffer."""
  mesh = make_mesh((1, 1), ("dp", "ep"))
  cfg = config(expert_layout="grouped", remat=RematConfig(save=("dispatch",), apply=True))
  layer = skewed_layer(cfg, mesh)
  x = np.random.default_rng(3).normal(size=(2, 8, HIDDEN)).astype(np.float32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x)[0])))(params)
  text = str(jaxpr)
  rows = expert_capacity_for(16, TOP_K, EXPERTS, 1)  # not a slab shape: the buffer is [M, H]
  assert "moe.dispatch.tokens" in text
  assert f"f32[{EXPERTS},{rows},{HIDDEN}]" not in text


@pytest.mark.parametrize("layout, capacity_factor", [("grouped", None), ("slabs", 1.25)])
def test_the_layer_step_runs_no_while_loop(layout, capacity_factor):
  """Dispatch and the grouped bank find each row's group with unrolled
  searches: XLA's GPU runtime reads a while loop's predicate back on the host
  at every step (a default ``jnp.searchsorted`` is such a loop)."""
  layer = ExpertParallelMoE(config(expert_layout=layout, capacity_factor=capacity_factor),
                            rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y ** 2) + aux.aux_loss

  x = jnp.ones((2, 32, HIDDEN), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(params, x).jaxpr
  loops = [eqn for inner in nested_jaxprs(jaxpr) for eqn in inner.eqns
           if eqn.primitive.name in ("while", "scan")]
  assert loops  # the searches are there, as scans
  for eqn in loops:  # a scan unrolled whole lowers to no loop
    assert eqn.primitive.name == "scan", eqn
    assert eqn.params["unroll"] is True or eqn.params["unroll"] >= eqn.params["length"], eqn



@pytest.mark.gpu
def test_hopper_grouped_layer_matches_slabs_in_bfloat16(group_align):
  """The Hopper kernels inside the layer (bf16, tile-sized H and F) against
  the slab bank's batched GEMMs."""
  from moe_ep.experts import kernels_apply
  if not kernels_apply("bfloat16", 256, 256):
    pytest.skip("needs a GPU of compute capability 9.0")
  mesh = make_mesh((1, 1), ("dp", "ep"), "cupy")
  x = np.random.default_rng(4).normal(size=(4, 512, 256)).astype(np.float32)
  outs = both_layouts(mesh, x, hidden_size=256, ffn_size=256, dtype="bfloat16",
                      transport="cupy", group_align=group_align)
  (_, (y_s, _)), grads_s = outs["slabs"]
  (_, (y_g, aux_g)), grads_g = outs["grouped"]
  assert float(aux_g.dropped_fraction) == 0.0
  # bf16 GEMM outputs (hidden, activation, output) each rounded once, in
  # either layout, but from float32 sums in another order: an element may
  # differ by an ulp (2^-8) at each of three roundings, so ~1-2% of the
  # scale; gradients pass three more.
  for got, want, tol in ((y_g, y_s, 0.02), (grads_g, grads_s, 0.03)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())


@pytest.mark.parametrize("group_align", [128, 64])
def test_the_layers_group_align_sizes_the_row_buffer(group_align):
  """``MoEConfig.group_align`` reaches the layout: the dispatched buffer has
  the rows ``grouped_rows_for`` gives at that alignment (one rank, 2 x 8
  tokens, 8 experts: 32 routed rows plus 8 x 63 or 8 x 127 of padding)."""
  from moe_ep.transport import grouped_rows_for
  layer = skewed_layer(config(expert_layout="grouped", group_align=group_align,
                              remat=RematConfig(save=("dispatch",), apply=True)),
                       make_mesh((1, 1), ("dp", "ep")))
  x = np.random.default_rng(3).normal(size=(2, 8, HIDDEN)).astype(np.float32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  text = str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p, rest)(x)[0])(params))
  other = 64 if group_align == 128 else 128
  rows, other_rows = (grouped_rows_for(16, TOP_K, EXPERTS, 1, group_align=align)
                      for align in (group_align, other))
  assert rows != other_rows
  assert f"f32[{rows},{HIDDEN}]" in text and f"f32[{other_rows},{HIDDEN}]" not in text
