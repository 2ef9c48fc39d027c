"""The grouped expert bank's pure-JAX path against float64 numpy, and
against the slab bank."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep.experts import grouped, slabs
from moe_ep.experts.grouped import ROW_TILE

# Sizes that exercise empty groups, a group of one row, sizes that are not
# multiples of the row tile and one that is, and a group holding every row.
SIZE_CASES = {
    "mixed": [300, 0, 1, 129, 128, 64],
    "one_group_holds_all": [0, 0, 517, 0],
    "all_empty_but_first": [5, 0, 0],
    "half_tiles": [64, 65, 1, 192, 0, 63],
}


def _grouped_rows(sizes, num_rows, hidden, rng, align=ROW_TILE):
  """``(rows [M, H] float64 with zero padding, group id per row or -1)``."""
  starts = np.concatenate([[0], np.cumsum(-(-np.asarray(sizes) // align) * align)])[:-1]
  rows = np.zeros((num_rows, hidden))
  group_of_row = np.full(num_rows, -1)
  for g, size in enumerate(sizes):
    rows[starts[g]:starts[g] + size] = rng.normal(size=(size, hidden))
    group_of_row[starts[g]:starts[g] + size] = g
  return rows, group_of_row


def _layout_rows(sizes, align=ROW_TILE):
  padded = sum(-(-s // align) * align for s in sizes)
  return -(-padded // ROW_TILE) * ROW_TILE + 2 * ROW_TILE  # spare tiles of no group


# The Hopper kernels take 16-bit operands with K and N any multiple of 8:
# whole tiles, edge tiles past the sizes (DeepSeek-V2-Lite's F = 1408,
# gpt-oss's H = F = 2880), sizes below one tile and of only 8 | size.
IMPLEMENTATION_CASES = [
    pytest.param("xla", dtype, 16, 24, id=f"xla-{dtype}")
    for dtype in ("float32", "bfloat16", "float16")] + [
    pytest.param("xla", "float32", 200, 72, id="xla-float32-200x72")] + [
    pytest.param("hopper", dtype, 256, 512, id=f"hopper-{dtype}", marks=pytest.mark.gpu)
    for dtype in ("bfloat16", "float16")] + [
    pytest.param("hopper", "bfloat16", k, n, id=f"hopper-bfloat16-{k}x{n}", marks=pytest.mark.gpu)
    for k, n in ((1408, 2880), (2880, 1408), (200, 72), (72, 200))]


@pytest.mark.parametrize("case", list(SIZE_CASES))
@pytest.mark.parametrize("implementation, dtype, hidden, columns", IMPLEMENTATION_CASES)
def test_grouped_matmul_and_its_gradients_match_float64(case, implementation, dtype, hidden,
                                                        columns, group_align):
  if implementation == "hopper" and not grouped.hopper_available():
    pytest.skip("needs a GPU of compute capability 9.0")
  sizes = SIZE_CASES[case]
  rng = np.random.default_rng(len(sizes))
  groups = len(sizes)
  num_rows = _layout_rows(sizes, group_align)
  lhs, group_of_row = _grouped_rows(sizes, num_rows, hidden, rng, group_align)
  rhs = rng.normal(size=(groups, hidden, columns)) / hidden ** 0.5
  tiles = grouped.group_tiles(jnp.asarray(sizes, jnp.int32), num_rows, group_align)
  # The cotangent is zero on a group's padding rows (as combine leaves it)
  # and nonzero on rows of no group, where the input gradient must still be
  # exactly zero.
  starts, rows = np.asarray(tiles.group_start), np.asarray(tiles.group_rows)
  no_group = ~((np.arange(num_rows)[:, None] >= starts) & (np.arange(num_rows)[:, None]
                                                          < starts + rows)).any(1)
  cotangent = rng.normal(size=(num_rows, columns)) * ((group_of_row >= 0) | no_group)[:, None]
  # References from the inputs as rounded to the dtype, in float64.
  cast = lambda v: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64)
  lhs, rhs, cotangent = cast(lhs), cast(rhs), cast(cotangent)
  member = [(group_of_row == g)[:, None] for g in range(groups)]

  def products(a, b, c):  # (out, lhs grad, rhs grad) of the grouped layer
    return (sum(m * (a @ b[g]) for g, m in enumerate(member)),
            sum(m * (c @ b[g].T) for g, m in enumerate(member)),
            np.stack([(a * m).T @ c for m in member]))

  wants = products(lhs, rhs, cotangent)
  # Each value of the sums of |terms| bounds its float32 accumulation error.
  magnitudes = products(np.abs(lhs), np.abs(rhs), np.abs(cotangent))
  contraction = (hidden, columns, max(sizes))

  args = (jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype))
  out, vjp = jax.vjp(lambda a, b: grouped.grouped_matmul(a, b, tiles, implementation), *args)
  lhs_grad, rhs_grad = vjp(jnp.asarray(cotangent, dtype))
  for value in (out, lhs_grad):  # exactly zero, not merely small, off the groups
    assert not np.any(np.asarray(value.astype(jnp.float32))[no_group])

  # A float32 sum of n terms is within n * 2^-24 of the sum of their
  # magnitudes (Higham's gamma_n); the one rounding to the dtype then adds
  # its unit roundoff relative to each value: 2^-8 bfloat16, 2^-11 float16,
  # 2^-24 float32; or, where the value is subnormal in the dtype (float16
  # below 2^-14: a group of one row's weight gradient), half the subnormal
  # spacing, absolute.
  roundoff = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[dtype]
  subnormal = float(jnp.finfo(dtype).smallest_subnormal) / 2
  for got, want, magnitude, n in zip((out, lhs_grad, rhs_grad), wants, magnitudes, contraction):
    assert got.dtype == jnp.dtype(dtype)
    got = np.asarray(got.astype(jnp.float32), np.float64)
    bound = n * 2.0 ** -24 * magnitude + roundoff * np.abs(want) * (1 + 2.0 ** -8) + subnormal
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_group_tiles_places_groups_on_whole_tiles():
  sizes = jnp.asarray([300, 0, 1, 129], jnp.int32)
  tiles = grouped.group_tiles(sizes, 10 * ROW_TILE, align=ROW_TILE)
  np.testing.assert_array_equal(tiles.group_start, [0, 384, 384, 512])
  np.testing.assert_array_equal(tiles.group_rows, [384, 0, 128, 256])
  # The weight gradient's 64-row blocks: each group's rows, not its padding.
  np.testing.assert_array_equal(tiles.group_blocks, [5, 0, 1, 3])
  np.testing.assert_array_equal(tiles.tile_group, [0, 0, 0, 2, 3, 3, -1, -1, -1, -1])


@pytest.mark.parametrize("activation, group_align", [("swiglu", 128), ("gelu", 128),
                                                     ("swiglu", 64)])
def test_grouped_bank_equals_slab_bank_with_its_gradients(activation, group_align):
  """The bank on its layout (whole tiles, or half tiles by ``group_align``)
  against the slab bank."""
  rng = np.random.default_rng(3)
  sizes = [5, 0, 130, 17]
  groups, hidden, ffn = len(sizes), 8, 12
  n_in = 1 if activation == "gelu" else 2
  num_rows = _layout_rows(sizes, group_align)
  rows, group_of_row = _grouped_rows(sizes, num_rows, hidden, rng, group_align)
  capacity = max(sizes)
  slab = np.zeros((groups, capacity, hidden))
  for g in range(groups):
    slab[g, :sizes[g]] = rows[group_of_row == g]
  w_in = rng.normal(size=(groups, hidden, n_in * ffn)) / hidden ** 0.5
  w_out = rng.normal(size=(groups, ffn, hidden)) / ffn ** 0.5
  counts = jnp.asarray(sizes, jnp.int32)

  def grouped_loss(r, a, b):
    y = grouped.grouped_expert_mlp(r, counts, a, b, activation, implementation="xla",
                                   group_align=group_align)
    return jnp.sum(jnp.sin(y)), y

  def slab_loss(s, a, b):
    y = slabs.expert_mlp(s, a, b, activation)
    return jnp.sum(jnp.sin(y)), y

  f32 = lambda v: jnp.asarray(v, jnp.float32)
  (_, y_g), (dr, dwi_g, dwo_g) = jax.value_and_grad(grouped_loss, (0, 1, 2), has_aux=True)(
      f32(rows), f32(w_in), f32(w_out))
  (_, y_s), (ds, dwi_s, dwo_s) = jax.value_and_grad(slab_loss, (0, 1, 2), has_aux=True)(
      f32(slab), f32(w_in), f32(w_out))
  # The same float32 products summed in another order: within n * 2^-24 of
  # the sum of magnitudes (n <= 2F + H = 32 terms of up to ~10), so 1e-5 of
  # each output's scale.
  def close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5 * np.abs(want).max(initial=0))
  for g in range(groups):
    close(y_g[group_of_row == g], y_s[g, :sizes[g]])
    close(dr[group_of_row == g], ds[g, :sizes[g]])
  close(dwi_g, dwi_s)
  close(dwo_g, dwo_s)
  padding = group_of_row < 0
  assert not np.any(np.asarray(y_g)[padding]), "padding rows and rows of no group stay zero"


def test_grouped_matmul_refuses_rows_off_the_tile():
  tiles = grouped.group_tiles(jnp.asarray([3], jnp.int32), ROW_TILE)
  with pytest.raises(ValueError, match="multiple of 128"):
    grouped.grouped_matmul(jnp.zeros((100, 4)), jnp.zeros((1, 4, 4)), tiles)
  with pytest.raises(ValueError, match="implementation="):
    grouped.grouped_matmul(jnp.zeros((128, 4)), jnp.zeros((1, 4, 4)), tiles, "cuda")


def test_auto_layout_is_grouped_only_where_the_kernels_apply(monkeypatch):
  assert grouped.bank_layout("auto", jnp.bfloat16, 256, 512) == (
      "grouped" if grouped.hopper_available() else "slabs")
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)  # an H100/H200
  assert grouped.bank_layout("auto", jnp.bfloat16, 256, 512) == "grouped"
  assert grouped.bank_layout("auto", jnp.float32, 256, 512) == "slabs"  # 16-bit operands only
  assert grouped.bank_layout("auto", jnp.bfloat16, 2880, 1408) == "grouped"  # edge tiles
  assert grouped.bank_layout("auto", jnp.bfloat16, 256, 200) == "grouped"
  assert grouped.bank_layout("auto", jnp.bfloat16, 256, 201) == "slabs"  # rows of 402 bytes
  monkeypatch.setattr(grouped, "hopper_available", lambda: False)
  assert grouped.bank_layout("auto", jnp.bfloat16, 256, 512) == "slabs"
  for insisted in ("grouped", "slabs"):
    assert grouped.bank_layout(insisted, jnp.float32, 3, 5) == insisted


def test_auto_says_once_per_shape_where_a_gpu_runs_slabs(monkeypatch):
  """On a GPU, "auto" falling to slabs warns once per bank shape, naming the
  shape and what it costs; on CPU (slabs are the norm there) it is quiet."""
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  grouped._warn_slabs.cache_clear()
  monkeypatch.setattr(grouped, "_on_gpu", lambda: False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert grouped.bank_layout("auto", jnp.float32, 256, 512) == "slabs"
  monkeypatch.setattr(grouped, "_on_gpu", lambda: True)
  with pytest.warns(UserWarning, match=r"dtype=float32, H=256, F=512\) on slabs.*several times"):
    grouped.bank_layout("auto", jnp.float32, 256, 512)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the same shape again: no second warning
    grouped.bank_layout("auto", jnp.float32, 256, 512)
    assert grouped.bank_layout("auto", jnp.bfloat16, 256, 512) == "grouped"
  with pytest.warns(UserWarning, match=r"H=256, F=201\).*multiples of 8"):
    grouped.bank_layout("auto", jnp.bfloat16, 256, 201)
  grouped._warn_slabs.cache_clear()


@pytest.mark.parametrize("cluster_columns, chain_tiles", itertools.product([1, 2], [False, True]))
@pytest.mark.parametrize("hidden, columns", [(2880, 1408), (200, 72), (2048, 1024)])
def test_hopper_kernels_lower_for_sizes_off_the_tiles(hidden, columns, cluster_columns,
                                                      chain_tiles):
  """The three kernels lower to Mosaic GPU (on any machine) for sizes that
  are not multiples of their tiles: edge tiles and 8 | size alone (the GPU
  tests check their values); alone and in clusters of two CTAs, each with
  and without its tiles chained (where the contraction allows: not 2880 or
  1408)."""
  from moe_ep.experts import hopper, hopper_wgrad
  kernels = grouped.BankKernels().scheduled(cluster_columns=cluster_columns,
                                            chain_tiles=chain_tiles, chain_wgrad=chain_tiles)
  groups, rows = 3, 4 * ROW_TILE
  lhs = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
  tile_group = jax.ShapeDtypeStruct((rows // ROW_TILE,), jnp.int32)
  per_group = jax.ShapeDtypeStruct((groups,), jnp.int32)
  calls = [
      (lambda a, b, t: hopper.grouped_matmul(a, b, t, config=kernels.matmul, num_sms=132),
       (lhs, jax.ShapeDtypeStruct((groups, hidden, columns), jnp.bfloat16), tile_group)),
      (lambda a, b, t: hopper.grouped_matmul(a, b, t, transpose_rhs=True, config=kernels.matmul,
                                             num_sms=132),
       (lhs, jax.ShapeDtypeStruct((groups, columns, hidden), jnp.bfloat16), tile_group)),
      (lambda a, b, s, n: hopper_wgrad.grouped_matmul_wgrad(a, b, s, n, groups,
                                                            config=kernels.wgrad, num_sms=132),
       (lhs, jax.ShapeDtypeStruct((rows, columns), jnp.bfloat16), per_group, per_group)),
  ]
  for fn, args in calls:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_hopper_branch_traces_inside_shard_map_with_the_types_of_the_jax_branch(monkeypatch):
  """Both platform branches must agree in type, shard_map's varying axes
  included (a kernel call drops them): checked by tracing the layer's
  gradient with the Hopper kernels pretended present, lowered for CPU."""
  from flax import nnx

  from conftest import make_mesh
  from moe_ep import ExpertParallelMoE, MoEConfig
  from moe_ep.experts import hopper, hopper_wgrad
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  monkeypatch.setattr(hopper, "num_sms_here", lambda: 132)
  cfg = MoEConfig(hidden_size=256, ffn_size=256, num_experts=8, top_k=2, dtype="bfloat16",
                  transport="xla", expert_layout="grouped")
  layer = ExpertParallelMoE(cfg, mesh=make_mesh((2, 4), ("dp", "ep")), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x)[0].astype(jnp.float32))
  text = jax.jit(jax.grad(loss)).trace(params, jnp.ones((8, 64, 256))).lower().as_text()
  assert "mosaic_gpu" not in text  # the CPU lowering took the pure-JAX branch


@pytest.mark.parametrize("platform, capability", [("gpu", "9.0"), ("gpu", "8.0"),
                                                  ("gpu", "10.0"), ("cpu", None)])
def test_kernels_apply_rule_with_the_device_patched(monkeypatch, platform, capability):
  """The documented rule of ``expert_layout="auto"``: a GPU of compute
  capability 9.0, 16-bit dtype, hidden_size and ffn_size multiples of 8
  (each is the output width of one of the bank's GEMMs, and the other's
  contraction depth: a 16-byte row), checked on a grid of sizes on, off and
  past the tiles."""

  class Device:
    platform = "gpu"
    compute_capability = None

  device = Device()
  device.platform, device.compute_capability = platform, capability
  monkeypatch.setattr(grouped.jax, "devices", lambda *args: [device])
  # The device query itself, uncached, so it reads the patched device.
  monkeypatch.setattr(grouped, "hopper_available", grouped.hopper_available.__wrapped__)
  sizes = (4, 8, 12, 72, 200, 201, 256, 1408, 2880, 2884)
  warnings.simplefilter("ignore", UserWarning)  # auto's note where a GPU runs slabs
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    for hidden, ffn in itertools.product(sizes, sizes):
      want = (capability == "9.0" and jnp.dtype(dtype).itemsize == 2
              and hidden % 8 == 0 and ffn % 8 == 0)
      assert grouped.kernels_apply(dtype, hidden, ffn) == want, (dtype, hidden, ffn)
      assert grouped.bank_layout("auto", dtype, hidden, ffn) == ("grouped" if want else "slabs")


def test_scheduling_the_bank_sets_only_the_fields_asked_for():
  """``BankKernels.scheduled``: clusters for every kernel, the row-tile chain
  for the three row-tile kernels, the ring for the weight gradient alone;
  every other field (the fused gradient's three stages) as it was."""
  from moe_ep.experts import hopper, hopper_fused
  base = grouped.BankKernels()
  assert base.scheduled() == base
  assert (base.matmul, base.activation_grad, base.wgrad) == (
      hopper.TileConfig(), hopper_fused.GRAD_CONFIG, hopper.TileConfig())
  clustered = base.scheduled(cluster_columns=2)
  assert {c.cluster_columns for c in (clustered.matmul, clustered.activation_grad,
                                      clustered.wgrad)} == {2}
  assert clustered.activation_grad.max_concurrent_steps == 3
  unchained = base.scheduled(chain_tiles=False)
  assert (unchained.matmul.chain_tiles, unchained.activation_grad.chain_tiles,
          unchained.wgrad.chain_tiles) == (False, False, True)
  no_ring = base.scheduled(chain_wgrad=False)
  assert (no_ring.matmul, no_ring.activation_grad) == (base.matmul, base.activation_grad)
  assert no_ring.wgrad.chain_tiles is False


@pytest.mark.parametrize("fuse", [True, False])
def test_the_bank_hands_each_kernel_its_tile_config(fuse, monkeypatch):
  """Traced with the kernels pretended present (on CPU the programs run
  their pure-JAX branches), the bank's forward and backward call each
  Hopper kernel with its own configuration of ``kernels``: the products and
  input gradients ``matmul``'s, the fused input gradient
  ``activation_grad``'s, the weight gradients ``wgrad``'s."""
  from moe_ep.experts import hopper, hopper_fused, hopper_wgrad
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  monkeypatch.setattr(hopper, "num_sms_here", lambda: 132)
  kernels = grouped.BankKernels(matmul=hopper.TileConfig(cluster_columns=2),
                                activation_grad=hopper.TileConfig(max_concurrent_steps=2),
                                wgrad=hopper.TileConfig(chain_tiles=False))
  seen = []
  for module, name in ((hopper, "grouped_matmul"), (hopper_fused, "activation_matmul"),
                       (hopper_fused, "activation_grad_matmul"),
                       (hopper_wgrad, "grouped_matmul_wgrad")):
    def recording(*args, _kernel=getattr(module, name), _name=name, **kwargs):
      seen.append((_name, kwargs["config"]))
      return _kernel(*args, **kwargs)
    monkeypatch.setattr(module, name, recording)
  rows = jnp.zeros((2 * ROW_TILE, 64), jnp.bfloat16)
  counts = jnp.asarray([100, 60], jnp.int32)
  w_in, w_out = jnp.zeros((2, 64, 2 * 48), jnp.bfloat16), jnp.zeros((2, 48, 64), jnp.bfloat16)
  loss = lambda r, a, b: jnp.sum(grouped.grouped_expert_mlp(
      r, counts, a, b, "swiglu", fuse_activation=fuse, kernels=kernels).astype(jnp.float32))
  with jax.default_device(jax.devices("cpu")[0]):
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(rows, w_in, w_out)
  want = {"grouped_matmul": kernels.matmul, "activation_matmul": kernels.matmul,
          "activation_grad_matmul": kernels.activation_grad,
          "grouped_matmul_wgrad": kernels.wgrad}
  called = {name for name, _ in seen}
  assert called == ({"grouped_matmul", "activation_matmul", "activation_grad_matmul",
                     "grouped_matmul_wgrad"} if fuse else {"grouped_matmul",
                                                          "grouped_matmul_wgrad"})
  assert all(config == want[name] for name, config in seen), seen
