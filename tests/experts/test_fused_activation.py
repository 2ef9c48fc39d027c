"""The activation fused into the grouped GEMMs (moe_ep.experts.hopper_fused):
its two custom rules compose to the MLP's gradient (on any machine, through
their pure-JAX branches), the kernels lower for sizes off their tiles, and,
on a Hopper GPU, the kernels match float64 with the gradient exactly zero
off the groups."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
import pytest

from moe_ep.experts import grouped, hopper, hopper_fused
from moe_ep.experts.grouped import ROW_TILE

SIZES = [300, 0, 1, 129, 128]  # an empty group, one row, one tile exactly, more


def _bank(rng, sizes, hidden, ffn, activation, dtype, align=ROW_TILE):
  """``(rows, counts, w_in, w_out, weights, member)``: rows in the grouped
  layout of groups starting at multiples of ``align`` (zero padding, two
  spare tiles of no group), ``member [G, M]``."""
  n = hopper_fused.gate_count(activation)
  starts = np.concatenate([[0], np.cumsum(-(-np.asarray(sizes) // align) * align)])
  num_rows = int(starts[-1]) + 2 * ROW_TILE
  rows = np.zeros((num_rows, hidden))
  member = np.zeros((len(sizes), num_rows), bool)
  for g, size in enumerate(sizes):
    rows[starts[g]:starts[g] + size] = rng.normal(size=(size, hidden))
    member[g, starts[g]:starts[g] + size] = True
  w_in = rng.normal(size=(len(sizes), hidden, n * ffn)) / hidden ** 0.5
  w_out = rng.normal(size=(len(sizes), ffn, hidden)) / ffn ** 0.5
  weights = rng.uniform(0.1, 1.0, size=num_rows) * member.any(0)
  cast = lambda v: jnp.asarray(v, dtype)
  return (cast(rows), jnp.asarray(sizes, jnp.int32), cast(w_in), cast(w_out),
          jnp.asarray(weights, jnp.float32), member)


def _loss_and_grads(bank, activation, weighted, fuse, cotangent, align=ROW_TILE,
                    kernels=grouped.BankKernels()):
  """The bank's output and gradients on groups starting at multiples of
  ``align`` (as ``_bank`` laid them out), its kernels configured by ``kernels``."""
  rows, counts, w_in, w_out, weights, _ = bank

  def run(r, a, b, w):
    return grouped.grouped_expert_mlp(r, counts, a, b, activation,
                                      row_weights=w if weighted else None,
                                      fuse_activation=fuse, group_align=align,
                                      kernels=kernels)

  out, vjp = jax.vjp(run, rows, w_in, w_out, weights)
  return (out, *vjp(cotangent))


@pytest.mark.parametrize("activation, weighted",
                         list(itertools.product(hopper_fused.ACTIVATIONS, [True, False])))
def test_the_fused_rules_compose_to_the_unfused_gradient(monkeypatch, activation, weighted):
  """On CPU, with the kernels pretended present, the fused structure runs
  the rules' pure-JAX branches: the same products as the unfused bank, so
  the same values and gradients, rows, weights and routing weights alike,
  to bfloat16's rounding of one intermediate (2^-7 relative, 1e-2 of each
  output's scale)."""
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  monkeypatch.setattr(hopper, "num_sms_here", lambda: 132)
  # On the CPU backend, also on a GPU machine: the rules' pure-JAX branches.
  with jax.default_device(jax.devices("cpu")[0]):
    _compare_fused_and_plain_branches(activation, weighted)


def _compare_fused_and_plain_branches(activation, weighted):
  rng = np.random.default_rng(0)
  bank = _bank(rng, SIZES, 64, 48, activation, jnp.bfloat16)
  cotangent = jnp.asarray(rng.normal(size=(bank[0].shape[0], 64)) * bank[5].any(0)[:, None],
                          jnp.bfloat16)
  fused = _loss_and_grads(bank, activation, weighted, True, cotangent)
  plain = _loss_and_grads(bank, activation, weighted, False, cotangent)
  jaxpr = jax.make_jaxpr(lambda *a: _loss_and_grads(bank, activation, weighted, True,
                                                    cotangent))()
  assert "custom_vjp_call" in str(jaxpr)  # the fused rules ran, not the plain bank
  for got, want in zip(fused, plain):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-2 * np.abs(want).max())
  if not weighted:
    assert not np.any(np.asarray(fused[4]))  # unused routing weights get no gradient


def test_saving_expert_hidden_recomputes_no_expert_gemm(monkeypatch):
  """Under remat saving "expert_hidden" (both the activation's input and its
  output where it is fused), backward runs the four gradient GEMMs and no
  forward GEMM again; saving nothing recomputes the first (backward needs
  the second's input, not its output)."""
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  monkeypatch.setattr(hopper, "num_sms_here", lambda: 132)
  rng = np.random.default_rng(1)
  rows, counts, w_in, w_out, weights, _ = _bank(rng, [130, 7], 32, 24, "swiglu", jnp.bfloat16)

  def loss(policy):
    def mlp(r, a, b, w):
      named = lambda name, v: checkpoint_name(v, name)
      return grouped.grouped_expert_mlp(r, counts, a, b, "swiglu", named, row_weights=w)
    body = jax.checkpoint(mlp, policy=policy)
    return lambda *a: jnp.sum(body(*a).astype(jnp.float32))

  def ragged_dots(policy):
    text = str(jax.make_jaxpr(jax.grad(loss(policy), (0, 1, 2, 3)))(rows, w_in, w_out, weights))
    return text.count("ragged_dot_general")

  saving = jax.checkpoint_policies.save_only_these_names("expert_hidden")
  assert ragged_dots(saving) == 2 + 4
  assert ragged_dots(jax.checkpoint_policies.nothing_saveable) == 2 + 1 + 4


@pytest.mark.parametrize("cluster_columns, chain_tiles", itertools.product([1, 2], [False, True]))
@pytest.mark.parametrize("hidden, ffn", [(2880, 1408), (200, 72), (72, 200), (2048, 768)])
@pytest.mark.parametrize("activation", hopper_fused.ACTIVATIONS)
def test_fused_kernels_lower_for_sizes_off_the_tiles(hidden, ffn, activation, cluster_columns,
                                                     chain_tiles):
  """Both kernels, weighted and not, lower to Mosaic GPU on any machine
  (layout inference and shared-memory budget included), alone and in
  clusters of two CTAs, each with and without its tiles chained (where H
  allows)."""
  kernels = grouped.BankKernels().scheduled(cluster_columns=cluster_columns,
                                            chain_tiles=chain_tiles)
  n, groups, rows = hopper_fused.gate_count(activation), 3, 4 * ROW_TILE
  spec = jax.ShapeDtypeStruct
  tile_group = spec((rows // ROW_TILE,), jnp.int32)
  for weights in (spec((rows,), jnp.float32), None):
    calls = [
        (lambda a, b, t, w: hopper_fused.activation_matmul(a, b, t, w, activation,
                                                           config=kernels.matmul, num_sms=132),
         (spec((rows, hidden), jnp.bfloat16), spec((groups, hidden, n * ffn), jnp.bfloat16))),
        (lambda g, b, h, t, w: hopper_fused.activation_grad_matmul(
            g, b, h, t, w, activation, config=kernels.activation_grad, num_sms=132),
         (spec((rows, hidden), jnp.bfloat16), spec((groups, ffn, hidden), jnp.bfloat16),
          spec((rows, n * ffn), jnp.bfloat16))),
    ]
    for fn, args in calls:
      lowered = jax.jit(fn).trace(*args, tile_group, weights).lower(lowering_platforms=("cuda",))
      assert "mosaic_gpu" in lowered.as_text()


def _reference(bank, activation, weighted, cotangent):
  """float64 ``(out, d_rows, d_w_in, d_w_out, d_weights)`` of the bank."""
  rows, _, w_in, w_out, weights, member = (
      np.asarray(v, np.float64) if not isinstance(v, np.ndarray) else v for v in bank)
  d_out = np.asarray(cotangent, np.float64)
  w = weights if weighted else np.ones_like(weights)
  n = hopper_fused.gate_count(activation)
  out, d_rows = np.zeros_like(rows), np.zeros_like(rows)
  d_w_in, d_w_out, d_w = np.zeros_like(w_in), np.zeros_like(w_out), np.zeros_like(weights)
  for g, m in enumerate(member):
    x, dy = rows[m], d_out[m]
    h = x @ w_in[g]
    gate = h[:, :h.shape[1] // n]
    if activation == "swiglu":
      s = 1 / (1 + np.exp(-gate))
      f, df = gate * s, s + gate * s * (1 - s)
    else:
      c = np.sqrt(2 / np.pi)
      t = np.tanh(c * (gate + 0.044715 * gate ** 3))
      f = 0.5 * gate * (1 + t)
      df = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * c * (1 + 3 * 0.044715 * gate ** 2)
    a0 = f * h[:, gate.shape[1]:] if n == 2 else f
    act = a0 * w[m][:, None]
    out[m] = act @ w_out[g]
    d_act = dy @ w_out[g].T
    d_w_out[g] = act.T @ dy
    d_w[m] = (d_act * a0).sum(1) if weighted else 0
    d_a0 = d_act * w[m][:, None]
    d_h = (np.concatenate([d_a0 * h[:, gate.shape[1]:] * df, d_a0 * f], 1) if n == 2
           else d_a0 * df)
    d_rows[m] = d_h @ w_in[g].T
    d_w_in[g] = x.T @ d_h
  return out, d_rows, d_w_in, d_w_out, d_w


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, ffn", [(256, 512), (2880, 1408), (200, 72), (72, 200)])
@pytest.mark.parametrize("activation, weighted",
                         list(itertools.product(hopper_fused.ACTIVATIONS, [True, False])))
def test_fused_kernels_match_float64(hidden, ffn, activation, weighted, group_align):
  """The fused bank on the Hopper kernels against float64, every gradient.
  bfloat16 rounds the inputs (compared as rounded), then ``hidden``, ``act``
  and ``d_hidden`` once each (2^-8 relative apiece) before float32 sums:
  within 2e-2 of each output's Frobenius norm. The unfused kernels are held
  to the same bound, and outputs and input gradients are exactly zero on
  rows of no group."""
  if not grouped.hopper_available():
    pytest.skip("needs a GPU of compute capability 9.0")
  rng = np.random.default_rng(hidden + ffn)
  bank = _bank(rng, SIZES + [64, 65], hidden, ffn, activation, jnp.bfloat16, group_align)
  member = bank[5]
  no_group = ~member.any(0) & (np.arange(member.shape[1]) >= member.shape[1] - 2 * ROW_TILE)
  cotangent = jnp.asarray(rng.normal(size=(member.shape[1], hidden))
                          * (member.any(0) | no_group)[:, None], jnp.bfloat16)
  wants = _reference(bank, activation, weighted, cotangent)
  for fuse in (True, False):
    gots = _loss_and_grads(bank, activation, weighted, fuse, cotangent, group_align)
    for name, got, want in zip(("out", "d_rows", "d_w_in", "d_w_out", "d_weights"), gots,
                               wants):
      got = np.asarray(got, np.float64)
      error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
      assert error <= 2e-2, (fuse, name, error)
    for value in gots[:2]:
      assert not np.any(np.asarray(value, np.float32)[no_group])


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, ffn", [(1024, 512), (2880, 1408)])
def test_clusters_of_two_ctas_change_no_bit(hidden, ffn, group_align):
  """Two CTAs of a cluster sharing their row blocks by TMA multicast
  (every kernel's ``TileConfig.cluster_columns = 2``) compute each output tile as one CTA
  alone does, in the same order: the fused and the unfused bank's outputs
  and every gradient equal bit for bit. Both shapes give some kernels an
  even number of column tiles (clustered) and (2880, 1408) others an odd
  one (not) and edge tiles."""
  if not grouped.hopper_available():
    pytest.skip("needs a GPU of compute capability 9.0")
  rng = np.random.default_rng(hidden)
  bank = _bank(rng, SIZES + [64, 65], hidden, ffn, "swiglu", jnp.bfloat16, group_align)
  cotangent = jnp.asarray(rng.normal(size=(bank[0].shape[0], hidden)), jnp.bfloat16)
  for fuse in (True, False):
    results = []
    for columns in (1, 2):
      kernels = grouped.BankKernels().scheduled(cluster_columns=columns)
      results.append(_loss_and_grads(bank, "swiglu", True, fuse, cotangent, group_align,
                                     kernels))
    for single, clustered in zip(*results):
      np.testing.assert_array_equal(np.asarray(clustered, np.float32),
                                    np.asarray(single, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, ffn", [(768, 512), (2048, 768)])
def test_chained_tiles_change_no_bit(hidden, ffn, group_align):
  """A CTA's tiles' pipelines run as one chain (``TileConfig.chain_tiles``: the
  next tile's blocks load while this one is finished and stored) compute
  each output tile in the same order as tile by tile: the fused and the
  unfused bank's outputs and every gradient equal bit for bit. Every kernel
  over row tiles chains at both shapes (H, F and 2F whole rounds of four
  stages), but the fused input gradient's three stages at H = 2048; the
  weight gradient chains on its own ring (its config's ``chain_tiles``)."""
  if not grouped.hopper_available():
    pytest.skip("needs a GPU of compute capability 9.0")
  chained = hopper.TileConfig(chain_tiles=True)
  steps = lambda size: size // chained.tile_k
  assert all(hopper.chain({}, chained, steps(size)) for size in (hidden, ffn, 2 * ffn))
  grad_config = dataclasses.replace(hopper_fused.GRAD_CONFIG, chain_tiles=True)
  assert (hopper.chain({}, grad_config, steps(hidden)) is not None) == (hidden == 768)
  rng = np.random.default_rng(hidden)
  bank = _bank(rng, SIZES + [64, 65], hidden, ffn, "swiglu", jnp.bfloat16, group_align)
  cotangent = jnp.asarray(rng.normal(size=(bank[0].shape[0], hidden)), jnp.bfloat16)
  for fuse in (True, False):
    results = []
    for chain in (False, True):  # the weight gradient's ring too
      kernels = grouped.BankKernels().scheduled(chain_tiles=chain, chain_wgrad=chain)
      results.append(_loss_and_grads(bank, "swiglu", True, fuse, cotangent, group_align,
                                     kernels))
    for alone, chained_result in zip(*results):
      np.testing.assert_array_equal(np.asarray(chained_result, np.float32),
                                    np.asarray(alone, np.float32))


def test_tiles_chain_on_whole_rounds_of_the_stages_without_delayed_release():
  config = hopper.TileConfig(chain_tiles=True, max_concurrent_steps=4)
  assert [hopper.chain({}, config, k) is not None for k in (12, 32, 22, 45, 2, 3)] == [
      True, True, False, False, True, True]  # fewer steps than stages: the stages shrink
  assert hopper.chain({}, dataclasses.replace(config, delay_release=1), 32) is None
  assert hopper.chain({}, hopper.TileConfig(), 32) is not None  # on by default
  assert hopper.chain({}, hopper.TileConfig(chain_tiles=False), 32) is None


def test_clusters_divide_the_column_tiles_or_are_not_formed():
  config = hopper.TileConfig(cluster_columns=2)
  assert (config.cluster(4), config.cluster(3)) == (2, 1)
  assert hopper.TileConfig().cluster(6) == 1  # no clusters by default


def test_a_bad_tile_schedule_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"TileConfig.cluster_columns=0 must be an int >= 1"):
    hopper.TileConfig(cluster_columns=0)
  with pytest.raises(ValueError, match=r"TileConfig.chain_tiles=None must be a bool"):
    hopper.TileConfig(chain_tiles=None)

