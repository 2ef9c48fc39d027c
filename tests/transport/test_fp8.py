"""FP8 rows (moe_ep/transport/fp8.py, kernels/fp8.cu): the pure-JAX quantizer
against a NumPy/ml_dtypes reference on CPU, the wire layout, and on a GPU the
CuPy kernels against the pure-JAX path bit for bit."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import gpu_devices
from reference import permutation_maps
from moe_ep.transport import cupy_backend
from moe_ep.transport import fp8, xla

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
HIDDENS = [1, 7, 128, 200, 384]

quantize_rows = jax.jit(fp8.quantize_rows)
dequantize_rows = jax.jit(fp8.dequantize_rows, static_argnums=2)


# --- the NumPy reference ------------------------------------------------------


def reference_quantize(x):
  """The rules written out independently of fp8.py: the scale from float64
  log2 (exact here: amax / 448 is a power of two only when amax = 448 * 2**k,
  and otherwise at least 2**-24 away from one), the codes from ml_dtypes'
  float32 -> float8_e4m3fn cast (round to nearest even)."""
  x = np.asarray(x, np.float32)
  rows, hidden = x.shape
  blocks = -(-hidden // 128)
  padded = np.zeros((rows, blocks * 128), np.float32)
  padded[:, :hidden] = x
  padded = padded.reshape(rows, blocks, 128)
  finite = np.isfinite(padded).all(axis=2)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    amax = np.abs(np.where(np.isfinite(padded), padded, 0)).max(axis=2).astype(np.float64)
    exponent = np.maximum(np.ceil(np.log2(amax / 448)), -116)
    scales = np.where(finite, np.exp2(exponent), np.nan).astype(np.float32)
    y = np.clip(padded / np.where(finite, scales, 1)[:, :, None], -448, 448).astype(np.float32)
  codes = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  codes[~finite] = 0x7F
  return codes.reshape(rows, -1)[:, :hidden], scales


def reference_dequantize(codes, scales, dtype):
  hidden = codes.shape[1]
  per_channel = np.repeat(scales, 128, axis=1)[:, :hidden]
  values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * per_channel
  return values.astype(jnp.dtype(dtype))


def code_bytes(codes):
  return np.asarray(codes).view(np.uint8)


def assert_same_values(got, want):
  """Bit for bit, except that any NaN equals any NaN (payloads may differ)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape
  nan = np.isnan(got.astype(np.float32))
  np.testing.assert_array_equal(nan, np.isnan(want.astype(np.float32)))
  bits = np.dtype(f"u{got.dtype.itemsize}")
  np.testing.assert_array_equal(np.where(nan, 0, got.view(bits)), np.where(nan, 0, want.view(bits)))


def sample_rows(rng, rows, hidden, dtype):
  """Rows of very different magnitudes, with zero blocks, isolated zeros and -0."""
  low, high = (-2, 3) if dtype == jnp.float16 else (-6, 4)
  magnitude = 10.0 ** rng.uniform(low, high, (rows, 1))
  x = (rng.standard_normal((rows, hidden)) * magnitude).astype(np.float32)
  x[rng.random(x.shape) < 0.05] = 0.0
  x[rng.random(x.shape) < 0.05] = -0.0
  x[0] = 0.0
  if hidden > 128:
    x[1, 128:256] = 0.0
  return np.asarray(jnp.asarray(x, dtype))


# --- quantization against the reference ---------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_codes_and_scales_equal_numpy_reference(dtype, hidden):
  x = sample_rows(np.random.default_rng(hidden), 40, hidden, dtype)
  codes, scales = quantize_rows(x)
  want_codes, want_scales = reference_quantize(x)
  assert codes.dtype == jnp.float8_e4m3fn and codes.shape == (40, hidden)
  assert scales.dtype == jnp.float32 and scales.shape == (40, -(-hidden // 128))
  np.testing.assert_array_equal(code_bytes(codes), want_codes)
  np.testing.assert_array_equal(np.asarray(scales).view(np.uint32), want_scales.view(np.uint32))


def e4m3_midpoints_and_neighbours():
  """Every point halfway between adjacent non-negative e4m3fn values, and the
  float32 values one ulp either side: where a double rounding or a wrong tie
  rule shows."""
  grid = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
  values = np.concatenate([mids, np.nextafter(mids, np.float32(0)),
                           np.nextafter(mids, np.float32(np.inf)), grid])
  return np.concatenate([values, -values])


def test_ties_round_to_even_at_every_midpoint():
  values = e4m3_midpoints_and_neighbours()
  # amax 448 in every block makes the scale exactly 1, so x / scale == x.
  body = np.full(-(-values.size // 127) * 127, 448.0, np.float32)
  body[:values.size] = values
  rows = np.concatenate([np.full((body.size // 127, 1), 448.0, np.float32),
                         body.reshape(-1, 127)], axis=1)
  codes, scales = quantize_rows(rows)
  np.testing.assert_array_equal(np.asarray(scales), 1.0)
  np.testing.assert_array_equal(code_bytes(codes),
                                rows.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 200])
def test_dequantize_equals_numpy_reference(dtype, hidden):
  x = sample_rows(np.random.default_rng(hidden + 1), 40, hidden, dtype)
  codes, scales = reference_quantize(x)
  got = dequantize_rows(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)),
                            jnp.asarray(scales), dtype)
  assert got.dtype == dtype
  assert_same_values(got, reference_dequantize(codes, scales, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 200, 1024])
def test_round_trip_error_is_within_the_e4m3_bound(dtype, hidden):
  """With y = x / s (exact: s is a power of two) and 3 mantissa bits,
  |q - y| <= 2**-4 |y| where y is in e4m3's normal range (|y| >= 2**-6) and
  <= 2**-10 below (half the subnormal step 2**-9); q * s is exact, so
  |x - q * s| <= 2**-4 |x| + 2**-10 s. The output dtype adds half an ulp of
  its own: 2**-9 |deq| for bfloat16, 2**-11 |deq| for float16 (inputs are in
  float16's normal range)."""
  x = sample_rows(np.random.default_rng(hidden + 2), 64, hidden, dtype)
  codes, scales = quantize_rows(x)
  deq = np.asarray(dequantize_rows(codes, scales, dtype), np.float64)
  exact = np.asarray(x, np.float64)
  scale = np.repeat(np.asarray(scales, np.float64), 128, axis=1)[:, :hidden]
  output_rounding = {jnp.float32: 0.0, jnp.bfloat16: 2.0 ** -9, jnp.float16: 2.0 ** -11}[dtype]
  bound = 2.0 ** -4 * np.abs(exact) + 2.0 ** -10 * scale + output_rounding * np.abs(deq)
  error = np.abs(deq - exact)
  assert (error <= bound).all(), np.max(error / bound)
  if hidden > 1:  # with one channel each value is its block's amax: exact up to float32
    # Not vacuous: some values lose close to the full 2**-4 (3 mantissa bits).
    relative = error[exact != 0] / np.abs(exact[exact != 0])
    assert relative.max() > 2.0 ** -5


def test_scale_is_the_smallest_power_of_two_that_fits_448():
  """amax / scale lands in (224, 448], so no code saturates or overflows; the
  amax's code is that value rounded to e4m3."""
  rng = np.random.default_rng(3)
  x = (rng.standard_normal((50, 256)) * 10.0 ** rng.uniform(-30, 30, (50, 1))).astype(np.float32)
  x[0, :128] *= 448.0 / np.abs(x[0, :128]).max()  # amax exactly 448: scale 1
  x[1, 5] = 3.0e38
  codes, scales = quantize_rows(x)
  scales = np.asarray(scales)
  assert scales[0, 0] == 1.0
  np.testing.assert_array_equal(scales.view(np.uint32) & 0x7FFFFF, 0)  # powers of two
  amax = np.abs(x.reshape(50, 2, 128)).max(axis=2)
  assert ((amax / scales > 224) & (amax / scales <= 448)).all()
  values = np.asarray(codes, np.float32).reshape(50, 2, 128)
  peak = np.abs(x.reshape(50, 2, 128)).argmax(axis=2)[:, :, None]
  at_peak = np.take_along_axis(values, peak, axis=2)[:, :, 0]
  peak_x = np.take_along_axis(x.reshape(50, 2, 128), peak, axis=2)[:, :, 0]
  np.testing.assert_array_equal(at_peak, (peak_x / scales).astype(ml_dtypes.float8_e4m3fn))
  assert np.isfinite(values).all() and np.abs(values).max() <= 448.0


def test_values_beyond_the_last_power_of_two_scale_dequantize_to_inf():
  """The documented overflow: from 1.9375 * 2**127 up (248 * 2**120, a tie
  that rounds to the even code 256) the code times 2**120 exceeds float32;
  below it the round trip is finite."""
  x = np.full((1, 128), 1.0, np.float32)
  x[0, :3] = [np.finfo(np.float32).max, -1.9375 * 2.0 ** 127, 1.9 * 2.0 ** 127]
  codes, scales = quantize_rows(x)
  deq = np.asarray(dequantize_rows(codes, scales, jnp.float32))[0, :3]
  np.testing.assert_array_equal(deq[:2], [np.inf, -np.inf])
  assert np.isfinite(deq[2])


def test_exact_zeros_round_trip_with_their_sign():
  x = np.zeros((3, 200), np.float32)
  x[0, 10] = -0.0                    # zero row but for a negative zero
  x[1, :] = np.linspace(-5, 5, 200)  # zeros inside non-zero blocks
  x[1, ::7] = 0.0
  x[1, 3] = -0.0
  x[2, 150] = 2.5                    # zero first block, non-zero short last block
  codes, scales = quantize_rows(x)
  np.testing.assert_array_equal(np.asarray(scales)[0], 2.0 ** -116)
  assert np.asarray(scales)[2, 0] == 2.0 ** -116
  deq = np.asarray(dequantize_rows(codes, scales, jnp.float32))
  zeros = x == 0
  np.testing.assert_array_equal(deq[zeros].view(np.uint32), x[zeros].view(np.uint32))


def test_subnormal_inputs_quantize_to_signed_zero():
  x = np.full((1, 128), 1.0, np.float32)
  x[0, 1:4] = [1e-40, -1e-40, np.finfo(np.float32).tiny / 2]
  codes, _ = quantize_rows(x)
  np.testing.assert_array_equal(code_bytes(codes)[0, 1:4], [0x00, 0x80, 0x00])
  tiny = np.full((1, 128), -3e-39, np.float32)  # a whole block below the float32 normals
  codes, scales = quantize_rows(tiny)
  assert np.asarray(scales)[0, 0] == 2.0 ** -116
  np.testing.assert_array_equal(code_bytes(codes), 0x80)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_value_poisons_only_its_block(bad):
  rng = np.random.default_rng(4)
  x = rng.standard_normal((3, 200)).astype(np.float32)
  x[1, 150] = bad  # in the short last block of row 1
  codes, scales = quantize_rows(x)
  scales = np.asarray(scales)
  assert np.isnan(scales[1, 1]) and np.isfinite(np.delete(scales.ravel(), 3)).all()
  np.testing.assert_array_equal(code_bytes(codes)[1, 128:], fp8.NAN_CODE)
  deq = np.asarray(dequantize_rows(codes, jnp.asarray(scales), jnp.bfloat16), np.float32)
  poisoned = np.zeros(deq.shape, bool)
  poisoned[1, 128:] = True
  assert np.isnan(deq[poisoned]).all() and not np.isnan(deq[~poisoned]).any()
  clean = x.copy()
  clean[1, 128:] = 0.0
  clean_codes, _ = quantize_rows(clean)
  np.testing.assert_array_equal(code_bytes(codes)[:, :128], code_bytes(clean_codes)[:, :128])
  np.testing.assert_array_equal(code_bytes(codes)[[0, 2]], code_bytes(clean_codes)[[0, 2]])


# --- the wire row --------------------------------------------------------------


# Whole 128-byte lines where they add under 1/16 of the row (7168: 7392 ->
# 7424, 2048: 2112 -> 2176), else 16-byte multiples (1024: 1056, not 1152).
@pytest.mark.parametrize("hidden, width", [(1, 32), (16, 32), (128, 144), (200, 224),
                                           (1024, 1056), (2048, 2176), (4096, 4224),
                                           (4608, 4864), (7168, 7424)])
def test_wire_row_layout(hidden, width):
  x = sample_rows(np.random.default_rng(hidden), 5, hidden, jnp.bfloat16)
  codes, scales = quantize_rows(x)
  wire = np.asarray(fp8.pack_wire(codes, scales))
  blocks = -(-hidden // 128)
  codes_end = -(-hidden // 16) * 16
  assert fp8.wire_bytes(hidden) == width and wire.shape == (5, width) and wire.dtype == np.uint8
  np.testing.assert_array_equal(wire[:, :hidden], code_bytes(codes))
  np.testing.assert_array_equal(wire[:, hidden:codes_end], 0)
  scale_bytes = np.asarray(scales).astype("<f4").view(np.uint8)
  np.testing.assert_array_equal(wire[:, codes_end:codes_end + 4 * blocks], scale_bytes)
  np.testing.assert_array_equal(wire[:, codes_end + 4 * blocks:], 0)
  back_codes, back_scales = fp8.unpack_wire(jnp.asarray(wire), hidden)
  np.testing.assert_array_equal(code_bytes(back_codes), code_bytes(codes))
  np.testing.assert_array_equal(np.asarray(back_scales), np.asarray(scales))


def test_all_zero_wire_row_dequantizes_to_zeros():
  wire = jnp.zeros((2, fp8.wire_bytes(200)), jnp.uint8)
  out = dequantize_rows(*fp8.unpack_wire(wire, 200), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_wire_rows_zeroes_unfilled_rows_whatever_their_bytes(dtype):
  """Rows not ``filled`` come out zero even when their bytes are NaN codes
  and NaN scales (0xff), as the peer kernel's unwritten padding may be; the
  filled rows are dequantize_rows' bits."""
  rng = np.random.default_rng(6)
  x = sample_rows(rng, 6, 200, dtype)
  wire = np.asarray(fp8.quantize_pack(x)).copy()
  filled = np.array([True, False, True, True, False, True])
  wire[~filled] = 0xFF
  got = jax.jit(fp8.dequantize_wire_rows, static_argnums=(1, 2))(
      jnp.asarray(wire), 200, dtype, jnp.asarray(filled))
  assert np.isnan(np.asarray(dequantize_rows(*fp8.unpack_wire(jnp.asarray(wire), 200), dtype),
                             np.float32)[~filled]).all()
  want = np.asarray(dequantize_rows(*fp8.unpack_wire(jnp.asarray(wire), 200), dtype))
  np.testing.assert_array_equal(np.asarray(got)[filled].view(np.uint8),
                                want[filled].view(np.uint8))
  np.testing.assert_array_equal(np.asarray(got, np.float32)[~filled], 0.0)
  assert not np.signbit(np.asarray(got, np.float32)[~filled]).any()  # +0, as a zero wire row
  with pytest.raises(ValueError, match=r"filled must be \[6\] bool"):
    fp8.dequantize_wire_rows(jnp.asarray(wire), 200, dtype, jnp.ones((5,), bool))


def test_fused_ops_equal_quantize_then_expand():
  rng = np.random.default_rng(5)
  x = sample_rows(rng, 30, 200, jnp.bfloat16)
  targets, sources = permutation_maps(rng, 30, 3, 70)
  wire = xla.quantize_pack_expand(x, targets, sources)
  want = np.zeros((70, fp8.wire_bytes(200)), np.uint8)
  valid = (sources >= 0) & (sources < 30)
  want[valid] = np.asarray(fp8.quantize_pack(x))[sources[valid]]
  np.testing.assert_array_equal(np.asarray(wire), want)
  back_targets, back_sources = permutation_maps(rng, 70, 2, 90)
  out = xla.unpack_dequantize_expand(wire, back_targets, back_sources, hidden=200,
                                     dtype=jnp.float32)
  rows = np.asarray(dequantize_rows(*fp8.unpack_wire(wire, 200), jnp.float32))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(xla.expand_rows(
      rows, back_targets, back_sources)))


def test_bad_inputs_name_the_argument():
  with pytest.raises(ValueError, match=r"x must be \[N, H\]"):
    fp8.quantize_rows(jnp.zeros((4,)))
  with pytest.raises(ValueError, match="x dtype int32"):
    fp8.quantize_rows(jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"wire must be \[N, 224\] uint8 for hidden=200"):
    fp8.unpack_wire(jnp.zeros((2, 208), jnp.uint8), 200)
  with pytest.raises(ValueError, match="dtype=int8"):
    fp8.dequantize_rows(jnp.zeros((2, 4), jnp.float8_e4m3fn), jnp.ones((2, 1)), jnp.int8)
  with pytest.raises(ValueError, match=r"scales must be \[2, 2\] float32"):
    fp8.dequantize_rows(jnp.zeros((2, 200), jnp.float8_e4m3fn), jnp.ones((2, 1)))


def test_cuda_lowering_is_command_buffer_callbacks(pretend_cupy):
  """Lowered for CUDA on any machine (CuPy never runs): one buffer_callback
  per fused op, under its own scope, and no host callbacks."""

  def round_trip(x, targets, sources, back_targets, back_sources):
    wire = cupy_backend.quantize_pack_expand(x, targets, sources)
    return cupy_backend.unpack_dequantize_expand(wire, back_targets, back_sources, hidden=200)

  rng = np.random.default_rng(6)
  maps = permutation_maps(rng, 8, 2, 12) + permutation_maps(rng, 12, 3, 20)
  text = jax.jit(round_trip).trace(np.zeros((8, 200), jnp.bfloat16), *maps).lower(
      lowering_platforms=("cuda",)).as_text(debug_info=True)
  assert text.count("custom_call @xla_buffer_python_gpu_callback_cmd_buffer") == 2
  assert "moe_cupy_fp8_quantize_pack" in text
  assert "moe_cupy_fp8_unpack_dequantize_expand" in text
  assert "xla_python_gpu_callback" not in text and "xla_ffi_python" not in text


# --- CuPy kernels against the pure-JAX path (GPU) ------------------------------


def on_gpu(fn, *args):
  device = gpu_devices()[0]
  return jax.jit(fn)(*(jax.device_put(a, device) for a in args))


def with_non_finite_rows(x):
  x = np.array(x)
  hidden = x.shape[1]
  x[2, hidden // 2] = np.nan
  x[3, hidden - 1] = np.inf
  x[4, 0] = -np.inf
  x[5, :] = np.asarray(jnp.asarray(np.full(hidden, -3e-39, np.float32), x.dtype))
  return x


GPU_HIDDENS = [1, 7, 200, 4096, 7168]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", GPU_HIDDENS)
def test_cuda_quantize_pack_equals_jax_and_numpy_bitwise(dtype, hidden):
  x = with_non_finite_rows(sample_rows(np.random.default_rng(hidden), 300, hidden, dtype))
  got = np.asarray(on_gpu(cupy_backend.quantize_pack_expand, x))
  np.testing.assert_array_equal(got, np.asarray(on_gpu(fp8.quantize_pack, x)))
  codes, scales = reference_quantize(x)
  want = np.asarray(fp8.pack_wire(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)),
                                  jnp.asarray(scales)))
  np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 200, 4096])
def test_cuda_quantize_pack_expand_equals_jax_bitwise(dtype, hidden):
  rng = np.random.default_rng(hidden + 7)
  x = with_non_finite_rows(sample_rows(rng, 300, hidden, dtype))
  targets, sources = permutation_maps(rng, 300, 3, 700)
  got = on_gpu(cupy_backend.quantize_pack_expand, x, targets, sources)
  want = on_gpu(xla.quantize_pack_expand, x, targets, sources)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", GPU_HIDDENS)
def test_cuda_unpack_dequantize_expand_equals_dequantize_then_expand(dtype, hidden):
  """Same float32 product, same single rounding to the output dtype: equal
  values (NaN where the block was non-finite)."""
  rng = np.random.default_rng(hidden + 8)
  x = with_non_finite_rows(sample_rows(rng, 300, hidden, dtype))
  wire = np.asarray(fp8.quantize_pack(x))
  targets, sources = permutation_maps(rng, 300, 3, 700)
  fused = functools.partial(cupy_backend.unpack_dequantize_expand, hidden=hidden, dtype=dtype)
  got = np.asarray(on_gpu(fused, wire, targets, sources))

  def unfused(wire, targets, sources):
    rows = dequantize_rows(*fp8.unpack_wire(wire, hidden), dtype)
    return xla.expand_rows(rows, targets, sources)

  assert_same_values(got, on_gpu(unfused, wire, targets, sources))
  plain = functools.partial(cupy_backend.unpack_dequantize_expand, hidden=hidden, dtype=dtype)
  codes, scales = reference_quantize(x)
  assert_same_values(on_gpu(plain, wire), reference_dequantize(codes, scales, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", GPU_HIDDENS)
def test_cuda_dequantize_filled_rows_equals_pure_jax(dtype, hidden):
  """The named FP8 slabs' dequantize on the CuPy backend: filled rows the
  same values as the pure-JAX one (NaN where the block was non-finite), the
  others +0 whatever their bytes (here NaN codes and scales, 0xff)."""
  rng = np.random.default_rng(hidden + 9)
  x = with_non_finite_rows(sample_rows(rng, 300, hidden, dtype))
  wire = np.asarray(fp8.quantize_pack(x)).copy()
  filled = rng.random(300) < 0.8
  filled[2:5] = True  # the non-finite rows
  wire[~filled] = 0xFF
  ops = {name: functools.partial(backend.dequantize_filled_rows, hidden=hidden, dtype=dtype)
         for name, backend in (("cupy", cupy_backend), ("xla", xla))}
  got, want = (np.asarray(on_gpu(ops[name], wire, filled)) for name in ("cupy", "xla"))
  assert_same_values(got[filled], want[filled])
  assert np.isnan(np.asarray(got[2], np.float32)).any()
  np.testing.assert_array_equal(got[~filled].view(f"u{got.itemsize}"), 0)
