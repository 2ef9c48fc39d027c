"""The block-scaled FP8 kernels against float64 NumPy of the same quantized
math: codes and power-of-two scales drawn directly (every product of a code
and its scale is exact in float32), so what is checked is the kernels'
arithmetic, not a quantizer's. Lowering on any machine; values on Hopper."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_ep.experts import grouped, hopper_fp8
from moe_ep.row_groups import ROW_TILE

F8 = jnp.float8_e4m3fn
BLOCK = hopper_fp8.BLOCK
# Sizes: whole blocks, gpt-oss's 2880 (a 64-wide last block) and 144 x 200
# (partial blocks of both, under one CTA's columns).
SHAPES = [(256, 512), (2880, 5760), (144, 200)]
# Rows per group: empty, one row, a tile and one row, two tiles; a tile of no
# group follows them.
SIZES = [0, 1, 129, 256]


def _codes(rng, shape):
  """Random e4m3 codes (normal values across their range) as float8."""
  return jnp.asarray(rng.normal(size=shape) * 4, jnp.float32).astype(F8)


def _scales(rng, shape):
  """Powers of two from 2**-12 to 2**-4: code * scale is exact."""
  return jnp.asarray(2.0 ** rng.integers(-12, -4, size=shape), jnp.float32)


def _as64(x):
  return np.asarray(x.astype(jnp.float32), np.float64)


def _layout(sizes):
  """Each group's first row (whole tiles), the tile groups and the rows in all."""
  starts, tile_group, row = [], [], 0
  for g, size in enumerate(sizes):
    starts.append(row)
    tiles = -(-size // ROW_TILE)
    tile_group += [g] * tiles
    row += tiles * ROW_TILE
  tile_group.append(-1)  # a tile of no group
  return np.asarray(starts), np.asarray(tile_group, np.int32), row + ROW_TILE


def _expand(scales, axis, size):
  """Block scales repeated over their 128 elements along ``axis`` and cut to ``size``."""
  return np.repeat(scales, BLOCK, axis=axis).take(np.arange(size), axis=axis)


# FP8 wgmma keeps fewer bits than float32 inside each 128-deep step, before
# the promotion (DeepSeek-V3 measured about 14 on H800): a model of it (each
# k=32 wgmma aligning its products and the running sum to the largest and
# truncating them to 13 fraction bits), run over 4M random 128-deep dot
# products of these codes, is off by at most 2**-11.6 of the products'
# magnitudes (2**-12.9 with 14 bits; over 2**-13 in 5e-4 of them, so a
# 2880x5760 one-block gradient, 16.6M sums, has thousands past 2**-13 where
# 256x512 has none). So 2**-11 of the magnitudes, summed over the steps; then
# one rounding to bfloat16 (2**-8) where the output is bfloat16.
def _bound(want, magnitude, out_dtype=jnp.bfloat16):
  rounding = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 2.0 ** -24
  return 2.0 ** -11 * magnitude + rounding * np.abs(want) * (1 + rounding)


def _forward_case(k, n, seed=0):
  rng = np.random.default_rng(seed)
  starts, tile_group, rows = _layout(SIZES)
  groups = len(SIZES)
  a, sa = _codes(rng, (rows, k)), _scales(rng, (rows, -(-k // BLOCK)))
  b, sb = _codes(rng, (groups, n, k)), _scales(rng, (groups, -(-n // BLOCK), -(-k // BLOCK)))
  return a, sa, b, sb, starts, tile_group


def test_overlapping_the_promotion_needs_the_rows_split():
  with pytest.raises(ValueError, match="overlap_promotion needs split_rows=True"):
    hopper_fp8.FP8TileConfig(split_rows=False, overlap_promotion=True)


def test_fp8_kernels_lower_for_sizes_off_the_blocks():
  """Both kernels lower to Mosaic GPU, their shared memory within Hopper's,
  for whole and partial blocks (the GPU tests check their values)."""
  S = jax.ShapeDtypeStruct
  configs = (hopper_fp8.FP8TileConfig(chain_wgrad=True),
             hopper_fp8.FP8TileConfig(split_rows=False, max_concurrent_steps=3,
                                      chain_wgrad=True),
             hopper_fp8.FP8TileConfig(overlap_promotion=True, chain_tiles=True))
  for (k, n), config in zip(SHAPES, configs):
    kb, nb, m, g = -(-k // BLOCK), -(-n // BLOCK), 4 * ROW_TILE, 3
    calls = [
        (lambda *x: hopper_fp8.grouped_matmul_fp8(*x, num_sms=132, config=config),
         (S((m, k), F8), S((m, kb), jnp.float32), S((g, n, k), F8),
          S((g, nb, kb), jnp.float32), S((m // ROW_TILE,), jnp.int32))),
        (lambda *x: hopper_fp8.grouped_matmul_fp8_wgrad(*x, g, num_sms=132, config=config),
         (S((k, m), F8), S((k, m // BLOCK), jnp.float32), S((n, m), F8),
          S((n, m // BLOCK), jnp.float32), S((g,), jnp.int32), S((g,), jnp.int32))),
    ]
    for fn, args in calls:
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text


# The warpgroups splitting the CTA's rows (the default) or its columns, and
# the forward's tiles chained (where the blocks are whole rounds of the stages),
# and each step's promotion beside the next step's wgmma.
_CONFIGS = {"split_rows": hopper_fp8.FP8TileConfig(),
            "split_columns": hopper_fp8.FP8TileConfig(split_rows=False, max_concurrent_steps=3),
            "chained": hopper_fp8.FP8TileConfig(chain_tiles=True),
            "overlapped": hopper_fp8.FP8TileConfig(overlap_promotion=True)}
CONFIGS = pytest.mark.parametrize("config", list(_CONFIGS.values()), ids=list(_CONFIGS))
# The forward's chain is not the weight gradient's, which has its own ring.
_WGRAD_CONFIGS = {**{name: c for name, c in _CONFIGS.items() if name != "chained"},
                  "ring": hopper_fp8.FP8TileConfig(chain_wgrad=True),
                  "ring_split_columns": hopper_fp8.FP8TileConfig(
                      split_rows=False, max_concurrent_steps=3, chain_wgrad=True)}
WGRAD_CONFIGS = pytest.mark.parametrize("config", list(_WGRAD_CONFIGS.values()),
                                        ids=list(_WGRAD_CONFIGS))
needs_hopper = pytest.mark.skipif(not grouped.hopper_available(),
                                  reason="needs a GPU of compute capability 9.0")


@pytest.mark.gpu
@needs_hopper
@CONFIGS
@pytest.mark.parametrize("k, n", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_grouped_matmul_fp8_matches_float64(k, n, config):
  a, sa, b, sb, starts, tile_group = _forward_case(k, n)
  out = hopper_fp8.grouped_matmul_fp8(a, sa, b, sb, jnp.asarray(tile_group), config=config)
  assert out.shape == (a.shape[0], n) and out.dtype == jnp.bfloat16
  a64 = _as64(a) * _expand(np.asarray(sa), 1, k)
  b64 = _as64(b) * _expand(_expand(np.asarray(sb), 1, n), 2, k)
  want, magnitude = np.zeros((a.shape[0], n)), np.zeros((a.shape[0], n))
  for t, g in enumerate(tile_group):
    if g >= 0:
      rows = slice(t * ROW_TILE, (t + 1) * ROW_TILE)
      want[rows] = a64[rows] @ b64[g].T
      magnitude[rows] = np.abs(a64[rows]) @ np.abs(b64[g]).T
  got = _as64(out)
  assert not np.any(got[tile_group.repeat(ROW_TILE) < 0])  # exactly zero off the groups
  assert np.all(np.abs(got - want) <= _bound(want, magnitude)), _worst(got, want, magnitude)


def _worst(got, want, magnitude, out_dtype=jnp.bfloat16):
  """How far past its bound the worst element is (> 1 fails), for the message."""
  return float(np.max(np.abs(got - want) / np.maximum(_bound(want, magnitude, out_dtype),
                                                      1e-300)))


@pytest.mark.gpu
@needs_hopper
@WGRAD_CONFIGS
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k, n", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_grouped_matmul_fp8_wgrad_matches_float64(k, n, out_dtype, config):
  """Both output dtypes: the layer asks for float32 (the master weights')."""
  rng = np.random.default_rng(1)
  starts, tile_group, rows = _layout(SIZES)
  blocks = np.asarray([-(-s // BLOCK) for s in SIZES], np.int32)
  a, sa = _codes(rng, (k, rows)), _scales(rng, (k, rows // BLOCK))
  b, sb = _codes(rng, (n, rows)), _scales(rng, (n, rows // BLOCK))
  out = hopper_fp8.grouped_matmul_fp8_wgrad(a, sa, b, sb, jnp.asarray(starts, jnp.int32),
                                            jnp.asarray(blocks), len(SIZES), config=config,
                                            out_dtype=out_dtype)
  assert out.shape == (len(SIZES), k, n) and out.dtype == out_dtype
  a64 = _as64(a) * _expand(np.asarray(sa), 1, rows)
  b64 = _as64(b) * _expand(np.asarray(sb), 1, rows)
  for g, (start, count) in enumerate(zip(starts, blocks)):
    cols = slice(start, start + count * BLOCK)
    want = a64[:, cols] @ b64[:, cols].T
    magnitude = np.abs(a64[:, cols]) @ np.abs(b64[:, cols]).T
    got = _as64(out[g])
    assert np.all(np.abs(got - want) <= _bound(want, magnitude, out_dtype)), (
        g, _worst(got, want, magnitude, out_dtype))


@pytest.mark.gpu
@needs_hopper
def test_the_weight_gradients_ring_gives_the_tile_by_tile_bits():
  """The ring sums each tile's blocks in the same order as each tile's own
  pipeline: the same bits, over groups of 0 to 23 blocks."""
  rng = np.random.default_rng(4)
  sizes = [0, 128, 2944, 384, 0, 1024]
  starts, _, rows = _layout(sizes)
  blocks = jnp.asarray([-(-s // BLOCK) for s in sizes], jnp.int32)
  a, sa = _codes(rng, (2880, rows)), _scales(rng, (2880, rows // BLOCK))
  b, sb = _codes(rng, (640, rows)), _scales(rng, (640, rows // BLOCK))
  run = lambda config: np.asarray(hopper_fp8.grouped_matmul_fp8_wgrad(
      a, sa, b, sb, jnp.asarray(starts, jnp.int32), blocks, len(sizes), config=config,
      out_dtype=jnp.float32))
  np.testing.assert_array_equal(run(hopper_fp8.FP8TileConfig(chain_wgrad=True)),
                                run(hopper_fp8.FP8TileConfig()))


@pytest.mark.gpu
@needs_hopper
def test_fp8_kernels_are_bitwise_deterministic():
  a, sa, b, sb, _, tile_group = _forward_case(2880, 5760, seed=2)
  run = jax.jit(hopper_fp8.grouped_matmul_fp8)
  first = np.asarray(run(a, sa, b, sb, jnp.asarray(tile_group)).astype(jnp.float32))
  second = np.asarray(run(a, sa, b, sb, jnp.asarray(tile_group)).astype(jnp.float32))
  assert np.array_equal(first, second)
