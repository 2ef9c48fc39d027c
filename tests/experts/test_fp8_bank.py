"""The FP8 expert bank (moe_ep/experts/fp8.py): its block quantization and its
three products against float64 NumPy computations of the same quantized
math, the custom rule's gradients, the bank against the bf16 bank, rows fed
as FP8, remat and the refusals."""

import itertools
import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from moe_ep import fp8_blocks
from moe_ep.experts import fp8, grouped, hopper
from moe_ep.row_groups import ROW_TILE

# Empty groups, a group of one row, sizes off and on the row tile.
SIZE_CASES = {"mixed": [130, 0, 1, 128, 60], "one_row": [1], "first_empty": [0, 200, 0]}
# K and N multiples of 16 with partial 128-blocks (144 = 128 + 16, 208 = 128 + 80)
# and one size below a block.
SHAPES = [(144, 208), (208, 144), (32, 48)]


# --- the NumPy reference ------------------------------------------------------


def reference_quantize(x, blocks):
  """Block scaling written out with NumPy loops over the blocks, independently
  of moe_ep.fp8_blocks: the scale from float64 log2 (exact: see
  tests/transport/test_fp8.py), the codes from ml_dtypes' float32 -> e4m3fn
  cast (round to nearest even). Returns float64 ``(codes as values, scales)``."""
  x = np.asarray(x, np.float32)
  counts = [-(-n // b) for n, b in zip(x.shape, blocks)]
  codes = np.zeros(x.shape, np.float64)
  scales = np.zeros(counts, np.float64)
  for index in itertools.product(*(range(c) for c in counts)):
    where = tuple(slice(i * b, (i + 1) * b) for i, b in zip(index, blocks))
    block = x[where]
    amax = float(np.abs(block).max())
    scale = 2.0 ** max(np.ceil(np.log2(amax / 448)) if amax > 0 else -np.inf, -116)
    scales[index] = scale
    codes[where] = (block / np.float32(scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return codes, scales


def reference_dequantize(x, blocks):
  """The values the FP8 GEMMs multiply by: float64 ``code * scale``."""
  codes, scales = reference_quantize(x, blocks)
  per_element = scales
  for axis, block in enumerate(blocks):
    per_element = np.repeat(per_element, block, axis=axis)
  return codes * per_element[tuple(slice(0, n) for n in x.shape)]


def rows_of(x):
  return reference_dequantize(x, (1, 128))


def columns_of(x):
  """``x [M, K]`` quantized per channel and 128 rows, as ``[M, K]`` values."""
  return reference_dequantize(np.asarray(x, np.float32).T, (1, 128)).T


def weights_of(w):
  return reference_dequantize(w, (1, 128, 128))


def assert_within(got, want, bound, what):
  got = np.asarray(got, np.float64)
  excess = np.abs(got - want) - bound
  assert excess.max() <= 0, f"{what}: off by {excess.max():.3g} beyond the bound"


def product_bound(want, magnitude, terms, rounded_to_bf16=True):
  """Float32 accumulation over ``terms`` exactly representable products
  (e4m3 codes times powers of two: 4 x 4 significant bits) errs by at most
  ``terms * 2**-24 * sum |a_k b_k|`` (``magnitude``); a bf16 output adds
  half an ulp, at most ``2**-8 |out|``. Both doubled for margin."""
  accumulation = 2 * terms * 2.0 ** -24 * magnitude
  return accumulation + (2.0 ** -7 * np.abs(want) if rounded_to_bf16 else 0)


# --- a grouped problem --------------------------------------------------------


def layout(sizes, rng, hidden, decades=(-3, 2)):
  """``(rows [M, H] bf16, group of each row or -1, tiles)``: groups on whole
  tiles, two spare tiles of no group, rows past each group's count zero,
  each row scaled by a power of ten drawn from ``decades``."""
  padded = [-(-s // ROW_TILE) * ROW_TILE for s in sizes]
  num_rows = sum(padded) + 2 * ROW_TILE
  starts = np.concatenate([[0], np.cumsum(padded)])[:-1]
  rows = np.zeros((num_rows, hidden), np.float32)
  group = np.full(num_rows, -1)
  for g, size in enumerate(sizes):
    rows[starts[g]:starts[g] + size] = rng.normal(size=(size, hidden)) * 10.0 ** rng.uniform(
        *decades, (size, 1))
    group[starts[g]:starts[g] + size] = g
  tiles = grouped.group_tiles(jnp.asarray(sizes, jnp.int32), num_rows, ROW_TILE)
  return jnp.asarray(rows, jnp.bfloat16), group, tiles


def group_rows(tiles, num_rows):
  """``[G, M]`` bool: the rows of each group's whole tiles."""
  starts, rows = np.asarray(tiles.group_start), np.asarray(tiles.group_rows)
  row = np.arange(num_rows)
  return (row >= starts[:, None]) & (row < (starts + rows)[:, None])


def per_group(x_values, w_values, member):
  """``out[m] = x[m] @ w[g(m)]`` (zero for no group), and the matching
  ``|x| @ |w|`` for the bound."""
  out = np.zeros((x_values.shape[0], w_values.shape[2]))
  magnitude = np.zeros_like(out)
  for g, rows in enumerate(member):
    out[rows] = x_values[rows] @ w_values[g]
    magnitude[rows] = np.abs(x_values[rows]) @ np.abs(w_values[g])
  return out, magnitude


def f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("hidden, columns", SHAPES)
def test_weight_blocks_match_the_numpy_reference(hidden, columns):
  """Codes and 128x128 scales as the reference quantizes them (partial
  blocks included), the transposed codes the same bits, and the
  dequantization within e4m3's bound of the weights."""
  rng = np.random.default_rng(0)
  w = rng.normal(size=(3, hidden, columns)).astype(np.float32) * [[[1e-3]], [[1.0]], [[50.0]]]
  quantized = fp8.quantize_weights(jnp.asarray(w))
  codes, scales = reference_quantize(w, (1, 128, 128))
  np.testing.assert_array_equal(f64(quantized.codes), codes)
  np.testing.assert_array_equal(np.asarray(quantized.scales, np.float64), scales)
  np.testing.assert_array_equal(np.asarray(quantized.codes_t).view(np.uint8),
                                np.swapaxes(np.asarray(quantized.codes).view(np.uint8), 1, 2))
  values = np.asarray(fp8.dequantize_weights(quantized), np.float64)
  np.testing.assert_array_equal(values, weights_of(w))
  # |x - deq| <= 2**-4 |x| + 2**-10 scale (moe_ep/fp8_blocks.py)
  per_element = np.repeat(np.repeat(scales, 128, 1), 128, 2)[:, :hidden, :columns]
  assert np.all(np.abs(values - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * per_element)


@pytest.mark.parametrize("case", list(SIZE_CASES))
@pytest.mark.parametrize("hidden, columns", SHAPES)
def test_forward_product_matches_float64(case, hidden, columns):
  """grouped_matmul_fp8 (pure JAX) against float64 NumPy of the same codes
  and scales (tolerance: product_bound); rows of no group exactly zero."""
  rng = np.random.default_rng(1)
  rows, group, tiles = layout(SIZE_CASES[case], rng, hidden)
  w = rng.normal(size=(len(SIZE_CASES[case]), hidden, columns)) / hidden ** 0.5
  quantized = fp8.quantize_weights(jnp.asarray(w, jnp.float32))
  codes, scales = fp8_blocks.quantize_rows(rows)
  out = jax.jit(fp8.grouped_matmul_fp8)(codes, scales, quantized.codes_t,
                                        jnp.swapaxes(quantized.scales, 1, 2), tiles.tile_group)
  assert out.dtype == jnp.bfloat16 and out.shape == (rows.shape[0], columns)
  member = group_rows(tiles, rows.shape[0])
  want, magnitude = per_group(rows_of(f64(rows)), weights_of(np.float32(w)), member)
  assert_within(out, want, product_bound(want, magnitude, hidden), "forward")
  assert not np.any(np.asarray(out, np.float32)[~member.any(0)])


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_weight_gradient_product_matches_float64(case):
  """grouped_matmul_fp8_wgrad (pure JAX) against float64 NumPy over each
  group's rows, from operands quantized per channel and 128 rows; an empty
  group's gradient exactly zero."""
  rng = np.random.default_rng(2)
  hidden, columns = 144, 208
  sizes = SIZE_CASES[case]
  x, _, tiles = layout(sizes, rng, hidden)
  dy, _, _ = layout(sizes, rng, columns)
  x_codes, dy_codes = fp8_blocks.quantize_columns(x), fp8_blocks.quantize_columns(dy)
  out = jax.jit(fp8.grouped_matmul_fp8_wgrad, static_argnums=6)(
      *x_codes, *dy_codes, tiles.group_start, tiles.group_rows // 128, len(sizes))
  assert out.dtype == jnp.float32 and out.shape == (len(sizes), hidden, columns)
  member = group_rows(tiles, x.shape[0])
  a, b = columns_of(f64(x)), columns_of(f64(dy))
  for g, rows in enumerate(member):
    want = a[rows].T @ b[rows]
    bound = product_bound(want, np.abs(a[rows]).T @ np.abs(b[rows]), rows.sum(), False)
    assert_within(out[g], want, bound, f"group {g}")
    if sizes[g] == 0:
      assert not np.any(np.asarray(out[g]))


def _product_and_vjp(rows, w, tiles, rows_fp8=None):
  quantized = fp8.quantize_weights(w)
  fn = lambda r, v: fp8.fp8_grouped_matmul(r, v, quantized, tiles, "xla", rows_fp8)
  return jax.vjp(jax.jit(fn), rows, w)


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_product_gradients_are_the_fp8_products_of_the_cotangent(case):
  """The custom rule's input gradient is ``Q_rows(dy) @ Q(W)^T`` and its
  weight gradient ``Q_columns(x)^T @ Q_columns(dy)`` per group (float64
  NumPy of the reference quantization; tolerance product_bound), in the master
  weights' float32; rows of no group get exactly zero input gradient even
  where the cotangent is not zero there."""
  rng = np.random.default_rng(3)
  hidden, columns = 144, 208
  rows, _, tiles = layout(SIZE_CASES[case], rng, hidden)
  w = jnp.asarray(rng.normal(size=(len(SIZE_CASES[case]), hidden, columns)) / 12, jnp.float32)
  out, vjp = _product_and_vjp(rows, w, tiles)
  dy = jnp.asarray(rng.normal(size=out.shape), jnp.bfloat16)
  rows_grad, w_grad = vjp(dy)
  assert rows_grad.dtype == jnp.bfloat16 and w_grad.dtype == jnp.float32
  member = group_rows(tiles, rows.shape[0])
  w_values = weights_of(np.asarray(w))
  want, magnitude = per_group(rows_of(f64(dy)), np.swapaxes(w_values, 1, 2), member)
  assert_within(rows_grad, want, product_bound(want, magnitude, columns), "input gradient")
  assert not np.any(np.asarray(rows_grad, np.float32)[~member.any(0)])
  a, b = columns_of(f64(rows)), columns_of(f64(dy))
  for g, group in enumerate(member):
    want = a[group].T @ b[group]
    bound = product_bound(want, np.abs(a[group]).T @ np.abs(b[group]), group.sum(), False)
    assert_within(w_grad[g], want, bound, f"weight gradient {g}")


def test_rows_fed_as_fp8_equal_their_dequantized_rows_bit_for_bit():
  """Rows given as codes and scales (the FP8 dispatch's) give the output and
  both gradients of the rows they dequantize to: the forward reads the codes
  as they are, the weight gradient requantizes them column-wise."""
  rng = np.random.default_rng(4)
  rows, _, tiles = layout([300, 1, 0, 77], rng, 144)
  codes, scales = fp8_blocks.quantize_rows(rows)
  on_grid = fp8_blocks.dequantize_rows(codes, scales).astype(jnp.bfloat16)  # exact in bf16
  w = jnp.asarray(rng.normal(size=(4, 144, 48)) / 12, jnp.float32)
  fed, fed_vjp = _product_and_vjp(on_grid, w, tiles, (codes, scales))
  plain, plain_vjp = _product_and_vjp(on_grid, w, tiles)
  dy = jnp.asarray(rng.normal(size=fed.shape), jnp.bfloat16)
  for got, want in zip((fed, *fed_vjp(dy)), (plain, *plain_vjp(dy))):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _bank(rng, sizes, hidden, ffn, activation="swiglu", decades=(-3, 2)):
  rows, _, tiles = layout(sizes, rng, hidden, decades)
  n = 2 if activation != "gelu" else 1
  counts = jnp.asarray(sizes, jnp.int32)
  w_in = jnp.asarray(rng.normal(size=(len(sizes), hidden, n * ffn)) / hidden ** 0.5, jnp.float32)
  w_out = jnp.asarray(rng.normal(size=(len(sizes), ffn, hidden)) / ffn ** 0.5, jnp.float32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, rows.shape[0]), jnp.float32)
  return rows, counts, w_in, w_out, weights


def _fp8_mlp(rows, counts, w_in, w_out, weights, activation="swiglu", name=fp8._no_name):
  return fp8.fp8_grouped_expert_mlp(rows, counts, w_in, w_out, fp8.quantize_weights(w_in),
                                    fp8.quantize_weights(w_out), activation, name, "xla",
                                    row_weights=weights)


def normwise_error(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fp8_bank_is_near_the_bf16_bank(activation):
  """Output and gradients against the bf16 grouped bank on the same rows and
  weights. Loose: rounding to e4m3's 3 mantissa bits errs by at most 2**-4
  of a value, about 2**-4 / sqrt(3) = 0.036 RMS; a GEMM of two quantized
  operands about sqrt(2) times that (0.05), the output through two GEMMs
  about 0.07 and a gradient, whose cotangent is quantized too, about 0.09
  normwise (measured: 0.054-0.066): the bound is 0.1. Rows of one
  magnitude: mixing rows of 1e-3 and 1e2 in one 128-row column block sends
  the small ones into e4m3's subnormals in the weight gradient (exact
  there, tested above, but farther from bf16)."""
  rng = np.random.default_rng(5)
  rows, counts, w_in, w_out, weights = _bank(rng, [200, 1, 0, 90], 144, 80, activation,
                                             decades=(0, 0))

  def loss(mlp):
    def value(r, a, b):
      out = mlp(r, counts, a, b, weights)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
    return jax.jit(jax.value_and_grad(value, (0, 1, 2)))

  bf16 = lambda r, c, a, b, w: grouped.grouped_expert_mlp(
      r, c, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), activation, implementation="xla",
      row_weights=w)
  fp8_out = _fp8_mlp(rows, counts, w_in, w_out, weights, activation)
  bf16_out = bf16(rows, counts, w_in, w_out, weights)
  assert normwise_error(fp8_out.astype(jnp.float32), bf16_out.astype(jnp.float32)) < 0.1
  (_, fp8_grads), (_, bf16_grads) = (
      loss(lambda *a: _fp8_mlp(*a, activation=activation))(rows, w_in, w_out),
      loss(bf16)(rows, w_in, w_out))
  for got, want in zip(fp8_grads, bf16_grads):
    assert normwise_error(got.astype(jnp.float32), want.astype(jnp.float32)) < 0.1
  no_group = np.arange(rows.shape[0]) >= int(np.asarray(grouped.group_tiles(
      counts, rows.shape[0]).group_rows).sum())
  assert not np.any(np.asarray(fp8_out, np.float32)[no_group])
  assert not np.any(np.asarray(fp8_grads[0], np.float32)[no_group])


def test_bank_is_bitwise_deterministic():
  """Two compilations and runs of the bank's value and gradients agree bit for bit."""
  rng = np.random.default_rng(6)
  rows, counts, w_in, w_out, weights = _bank(rng, [129, 3], 32, 48)
  value = lambda r, a, b: jnp.sum(_fp8_mlp(r, counts, a, b, weights).astype(jnp.float32) ** 2)
  runs = [jax.jit(jax.value_and_grad(value, (0, 1, 2)))(rows, w_in, w_out) for _ in range(2)]
  for got, want in zip(*map(jax.tree.leaves, runs)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_saving_the_fp8_names_recomputes_no_gemm_and_keeps_fp8_bytes():
  """Under remat saving "expert_hidden", "expert_fp8" and "expert_weights",
  backward runs the four gradient GEMMs alone, and what it keeps of the
  expert input and the activation is FP8 codes (with float32 scales), not
  bf16 rows; saving nothing recomputes the first GEMM."""
  rng = np.random.default_rng(7)
  rows, counts, w_in, w_out, weights = _bank(rng, [130, 7], 32, 48)
  names = ("expert_hidden", "expert_fp8.input", "expert_fp8.hidden", "expert_weights")

  def body(r, a, b):
    named = lambda name, v: checkpoint_name(v, name)
    quantized = [named("expert_weights", fp8.quantize_weights(v)) for v in (a, b)]
    return fp8.fp8_grouped_expert_mlp(r, counts, a, b, *quantized, "swiglu", named, "xla",
                                      row_weights=weights)

  def loss(policy):
    return lambda *a: jnp.sum(jax.checkpoint(body, policy=policy)(*a).astype(jnp.float32))

  def gemms(policy):
    text = str(jax.make_jaxpr(jax.grad(loss(policy), (0, 1, 2)))(rows, w_in, w_out))
    return text.count("ragged_dot_general")

  saving = jax.checkpoint_policies.save_only_these_names(*names)
  assert gemms(saving) == 2 + 4
  assert gemms(jax.checkpoint_policies.nothing_saveable) == 2 + 1 + 4
  from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415 - no public equivalent
  saved = [aval for aval, _ in saved_residuals(loss(saving), rows, w_in, w_out)]
  num_rows = rows.shape[0]
  codes = [a for a in saved if a.dtype == jnp.float8_e4m3fn]
  assert any(a.shape == (32, num_rows) for a in codes)  # the input, column-wise
  assert any(a.shape == (48, num_rows) for a in codes)  # the activation, column-wise
  assert not any(a.dtype == jnp.bfloat16 and a.shape == rows.shape for a in saved)


def test_refusals_name_the_rule(monkeypatch):
  rng = np.random.default_rng(8)
  rows, counts, w_in, w_out, weights = _bank(rng, [5], 32, 48)
  with pytest.raises(ValueError, match="multiples of 16"):
    _fp8_mlp(rows[:, :24], counts, w_in[:, :24], w_out[..., :24], weights)
  with pytest.raises(ValueError, match="bfloat16 rows"):
    _fp8_mlp(rows.astype(jnp.float32), counts, w_in, w_out, weights)
  # "hopper" where there is no Hopper GPU (on an H100 it would run).
  monkeypatch.setattr(fp8.grouped, "hopper_available", lambda: False)
  with pytest.raises(ValueError, match="compute capability 9.0"):
    fp8.fp8_grouped_expert_mlp(rows, counts, w_in, w_out, fp8.quantize_weights(w_in),
                               fp8.quantize_weights(w_out), "swiglu", implementation="hopper")


def test_a_gpu_other_than_hopper_is_refused_not_run_in_bf16(monkeypatch):
  """"auto" on a GPU of another compute capability: a one-line ValueError
  naming the requirement (the CPU runs the pure-JAX path)."""
  rng = np.random.default_rng(9)
  rows, counts, w_in, w_out, weights = _bank(rng, [5], 32, 48)
  ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0",
                                 device_kind="NVIDIA A100")
  monkeypatch.setattr(grouped, "_default_device", lambda: ampere)
  monkeypatch.setattr(grouped, "hopper_available", lambda: False)
  with pytest.raises(ValueError, match=r"compute capability 9\.0.*8\.0") as error:
    fp8.fp8_grouped_expert_mlp(rows, counts, w_in, w_out, fp8.quantize_weights(w_in),
                               fp8.quantize_weights(w_out), "swiglu", row_weights=weights)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("hidden, ffn", [(144, 208), (2880, 1408)])
def test_bank_and_its_gradients_lower_to_the_hopper_kernels(hidden, ffn, monkeypatch):
  """Lowered for CUDA where the kernels apply ("auto" on a GPU of compute
  capability 9.0), the bank's two forward GEMMs, two input gradients and
  two weight gradients are Mosaic GPU kernels (partial 128-blocks
  included); none runs as a ragged dot."""
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  monkeypatch.setattr(hopper, "num_sms_here", lambda: 132)
  rows, groups = 4 * ROW_TILE, 3
  S = jax.ShapeDtypeStruct
  counts = jnp.asarray([130, 0, 200], jnp.int32)

  def loss(r, a, b):
    out = fp8.fp8_grouped_expert_mlp(r, counts, a, b, fp8.quantize_weights(a),
                                     fp8.quantize_weights(b), "swiglu")
    return jnp.sum(out.astype(jnp.float32))

  args = (S((rows, hidden), jnp.bfloat16), S((groups, hidden, 2 * ffn), jnp.float32),
          S((groups, ffn, hidden), jnp.float32))
  text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 6 and "ragged_dot" not in text
