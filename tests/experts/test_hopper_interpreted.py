"""The Hopper kernels' forward passes under Pallas's GPU interpreter (on any
machine) against float64: whole tiles and half tiles, the plain product and
the activation in its epilogue. The interpreter runs the kernels' threads,
barriers and TMA copies on the CPU; it reads no block past an array's end
and knows neither transposed shared-memory operands nor layout-cast loads,
so the sizes here are multiples of the tiles, the product is untransposed
and unweighted (the GPU tests cover the rest)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_ep.experts import grouped, hopper, hopper_fused, hopper_wgrad

try:
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # a JAX without the GPU interpreter
  InterpretGPUParams = None

pytestmark = pytest.mark.skipif(InterpretGPUParams is None,
                                reason="this JAX has no Pallas GPU interpreter")
# An empty group, one row, a half tile, one more than a half tile, a whole
# tile and a half, and rows of no group after them.
SIZES = [130, 0, 1, 64, 65, 192]


@pytest.fixture
def interpreted(monkeypatch):
  """The kernels interpreted, on the CPU also where a GPU is the default."""
  kernel = hopper.plgpu.kernel
  monkeypatch.setattr(hopper.plgpu, "kernel", lambda *args, **kwargs: kernel(
      *args, **kwargs, interpret=InterpretGPUParams(detect_races=True)))
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def _problem(align, hidden, columns, seed=0):
  """bf16 rows in the layout (zero padding), weights, the tiles, and float64
  copies of the rows and weights and each row's group (-1: none)."""
  rng = np.random.default_rng(seed)
  num_rows = 1024
  tiles = grouped.group_tiles(jnp.asarray(SIZES, jnp.int32), num_rows, align)
  group_of_row = np.full(num_rows, -1)
  for g, (start, size) in enumerate(zip(np.asarray(tiles.group_start), SIZES)):
    group_of_row[start:start + size] = g
  rows = jnp.asarray(rng.normal(size=(num_rows, hidden)) * (group_of_row >= 0)[:, None],
                     jnp.bfloat16)
  weights = jnp.asarray(rng.normal(size=(len(SIZES), hidden, columns)) / hidden ** 0.5,
                        jnp.bfloat16)
  as64 = lambda v: np.asarray(v.astype(jnp.float32), np.float64)
  return rows, weights, tiles, as64(rows), as64(weights), group_of_row


def _grouped_product(rows, weights, group_of_row):
  out = np.zeros((rows.shape[0], weights.shape[2]))
  for g in range(weights.shape[0]):
    out[group_of_row == g] = rows[group_of_row == g] @ weights[g]
  return out


def _tables(tiles):
  return dict(tile_start=tiles.tile_start, tile_rows=tiles.tile_rows)


# Each CTA's tiles alone, and chained (TileConfig.chain_tiles) over a contraction
# of two rounds of the four stages: the interpreter also checks that every
# barrier phase is waited for.
CHAINS = pytest.mark.parametrize("chain_tiles, contraction", [(False, 128), (True, 512)],
                                 ids=["alone", "chained"])


@CHAINS
@pytest.mark.parametrize("align", [128, 64])
def test_grouped_matmul_interpreted_matches_float64(interpreted, align, chain_tiles,
                                                    contraction):
  rows, weights, tiles, rows64, weights64, group_of_row = _problem(align, contraction, 512)
  config = hopper.TileConfig(chain_tiles=chain_tiles)
  assert (hopper.chain({}, config, contraction // config.tile_k) is not None) == chain_tiles
  got = hopper.grouped_matmul(rows, weights, tiles.tile_group, num_sms=3, config=config,
                              **_tables(tiles))
  want = _grouped_product(rows64, weights64, group_of_row)
  got = np.asarray(got.astype(jnp.float32), np.float64)
  # float32 sums rounded once to bf16: 2^-8 of each value, plus the sums' own
  # error (at most 512 terms of 2^-24) against the magnitudes.
  np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-5)
  assert not got[group_of_row < 0].any()  # padding and rows of no group: exactly zero


@CHAINS
@pytest.mark.parametrize("align", [128, 64])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_activation_matmul_interpreted_matches_float64(interpreted, align, activation,
                                                       chain_tiles, contraction):
  n = hopper_fused.gate_count(activation)
  ffn = 256
  rows, weights, tiles, rows64, weights64, group_of_row = _problem(align, contraction, n * ffn,
                                                                   seed=1)
  hidden, act = hopper_fused.activation_matmul(
      rows, weights, tiles.tile_group, None, activation, num_sms=3,
      config=hopper.TileConfig(chain_tiles=chain_tiles), **_tables(tiles))
  want_hidden = _grouped_product(rows64, weights64, group_of_row)
  gate = want_hidden[:, :ffn]
  if activation == "swiglu":
    f = gate / (1 + np.exp(-gate))
  else:
    f = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
  want_act = f * want_hidden[:, ffn:] if n == 2 else f
  hidden, act = (np.asarray(v.astype(jnp.float32), np.float64) for v in (hidden, act))
  np.testing.assert_allclose(hidden, want_hidden, rtol=2 ** -8, atol=1e-5)
  # act from the float32 accumulators, its function in float32: 2^-8 of the
  # value once rounded, and the gate's float32 rounding through f (|f'| < 1.2).
  np.testing.assert_allclose(act, want_act, rtol=2 ** -7, atol=1e-4)
  assert not hidden[group_of_row < 0].any() and not act[group_of_row < 0].any()


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_weight_gradient_ring_interpreted_equals_tile_by_tile(interpreted, stages, monkeypatch):
  """The weight gradient's chained ring (one ring of stages for all of a
  CTA's tiles, groups of 0 to 3 blocks: the stages are whole rounds of no
  tile's blocks) against float64 and bit for bit against JAX's pipeline per
  tile. The interpreter knows no transposed operand, so both run the
  product untransposed, on square ``[128, 128]`` row blocks: each block
  ``j`` adds ``lhs[rows_j, k_tile] @ rhs[rows_j]`` to its group's tile, the
  same blocks in the same stages and order as ``lhs[rows_j, k_tile].T``."""
  monkeypatch.setattr(hopper, "transposed", lambda ref: ref)
  block, sizes, contraction, columns = 128, [256, 0, 128, 384, 128], 256, 512
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
  rng = np.random.default_rng(stages)
  num_rows = sum(sizes) + block  # and a block of no group
  lhs = jnp.asarray(rng.normal(size=(num_rows, contraction)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(num_rows, columns)), jnp.bfloat16)
  outs = []
  for chain_tiles in (True, False):
    config = hopper.TileConfig(tile_k=block, max_concurrent_steps=stages,
                               chain_tiles=chain_tiles)
    assert hopper_wgrad.chains(config, columns // 256) == chain_tiles
    out = hopper_wgrad.grouped_matmul_wgrad(
        lhs, rhs, jnp.asarray(starts), jnp.asarray(sizes, jnp.int32) // block, len(sizes),
        config=config, num_sms=3)
    outs.append(np.asarray(out.astype(jnp.float32), np.float64))
  np.testing.assert_array_equal(outs[0], outs[1])
  lhs64, rhs64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (lhs, rhs))
  want = np.zeros((len(sizes), contraction, columns))
  for g, (start, size) in enumerate(zip(starts, sizes)):
    for first in range(start, start + size, block):
      rows = slice(first, first + block)
      for k in range(0, contraction, block):
        want[g, k:k + block] += lhs64[rows, k:k + block] @ rhs64[rows]
  # float32 sums of at most 384 products rounded once to bf16 (2^-8), the
  # sums' own error far below it.
  np.testing.assert_allclose(outs[0], want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())
  assert not outs[0][1].any()  # the empty group: exactly zero
