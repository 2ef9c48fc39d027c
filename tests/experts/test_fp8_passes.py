"""The FP8 bank's passes outside its GEMMs: kernels/fp8_bank.cu against the
pure-JAX passes (the weights' quantization bit for bit; the activation or its
autodiff, then both quantizations, within a bf16 ulp of the activation), and
the pure-JAX activation passes against float64 NumPy. Lowering on any
machine; the kernels' values on a CUDA GPU."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_ep import fp8_blocks
from moe_ep.activations import ACTIVATIONS, input_projections
from moe_ep.experts import fp8_passes, grouped, hopper
from moe_ep.transport import kernel_launch

# F: whole blocks, a partial last block (176 = 128 + 48; gated, the
# gradient's blocks straddle gate and up), one partial block.
FFNS = (256, 176, 48)
ROWS = 384


def _inputs(activation, ffn, seed=0, weighted=True):
  rng = np.random.default_rng(seed)
  width = input_projections(activation) * ffn
  hidden = rng.normal(size=(ROWS, width)) * 2.0
  hidden[:128] *= 2.0 ** -20  # a tile of tiny values: small scales
  hidden[-128:] = 0.0  # a tile of no group: zero rows
  act_grad = rng.normal(size=(ROWS, ffn))
  weights = rng.uniform(0.1, 1.0, size=ROWS) if weighted else None
  as_jax = lambda v, dtype: None if v is None else jnp.asarray(v, dtype)
  return (as_jax(hidden, jnp.bfloat16), as_jax(act_grad, jnp.bfloat16),
          as_jax(weights, jnp.float32))


def _deq(quantized, transposed=False):
  codes, scales = quantized
  values = np.asarray(fp8_blocks.dequantize_rows(codes, scales), np.float64)
  return values.T if transposed else values


def _gate64(g, activation):
  if activation == "swiglu":
    return g / (1.0 + np.exp(-g))
  return 0.5 * g * (1.0 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def _activation64(hidden, activation, weights):
  h = np.asarray(hidden.astype(jnp.float32), np.float64)
  if activation == "gelu":
    act = _gate64(h, "gelu")
  else:
    gate, up = np.split(h, 2, axis=1)
    act = _gate64(gate, activation) * up
  return act if weights is None else act * np.asarray(weights, np.float64)[:, None]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("ffn", FFNS)
def test_reference_passes_match_float64(activation, ffn):
  """Both quantizations of the pure-JAX activation dequantize to the float64
  activation within the format's bound (``2**-4`` of a value plus
  ``2**-10`` of its block's scale, plus the bf16 rounding before it,
  ``2**-8``; 1% for float32's own error); zero rows stay zero."""
  hidden, _, weights = _inputs(activation, ffn)
  rows, columns = jax.jit(fp8_passes.activate_quantized_xla, static_argnums=1)(
      hidden, activation, weights)
  want = _activation64(hidden, activation, weights)
  row_scales = np.repeat(np.asarray(rows[1]), 128, axis=1)[:, :ffn]
  column_scales = np.repeat(np.asarray(columns[1]), 128, axis=1)[:, :ROWS].T
  for got, scales in ((_deq(rows), row_scales), (_deq(columns, True), column_scales)):
    bound = 1.01 * (2.0 ** -4 + 2.0 ** -8) * np.abs(want) + 2.0 ** -10 * scales
    assert np.all(np.abs(got - want) <= bound)
  assert np.all(_deq(rows)[-128:] == 0) and np.all(_deq(columns, True)[-128:] == 0)


def _bf16_ulp(values):
  """One bf16 ulp of each value (of the smallest normal for zeros)."""
  magnitude = np.maximum(np.abs(values), 2.0 ** -126)
  return 2.0 ** (np.floor(np.log2(magnitude)) - 7)


def _one_code_apart(got, want):
  """Kernel and reference quantizations of the same bf16 values, up to the
  values themselves moving by one bf16 ulp where float32 activations round
  to the other side (expf/tanhf against XLA's): scales equal but where such
  a move crosses a power of two at a block's amax, codes equal but on at
  most 2% of elements, each at most one e4m3 step apart (``2**-3`` of the
  value, or of the block's subnormal step)."""
  (got_codes, got_scales), (want_codes, want_scales) = got, want
  got_scales, want_scales = np.asarray(got_scales), np.asarray(want_scales)
  assert np.mean(got_scales == want_scales) >= 0.99
  np.testing.assert_array_equal(np.isnan(got_scales), np.isnan(want_scales))
  got_deq, want_deq = _deq(got), _deq(want)
  step = np.maximum(2.0 ** -3 * np.abs(want_deq),
                    2.0 ** -9 * np.repeat(want_scales, 128, axis=1)[:, :want_deq.shape[1]])
  finite = np.isfinite(want_deq)
  assert np.all(np.abs(got_deq - want_deq)[finite] <= 2 * step[finite])
  codes_apart = (np.asarray(got_codes.astype(jnp.float32)) !=
                 np.asarray(want_codes.astype(jnp.float32)))
  assert np.mean(codes_apart[finite]) <= 0.02


needs_kernels = pytest.mark.skipif(not grouped.hopper_available(),
                                   reason="the FP8 bank's kernels run with its Hopper GEMMs")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("ffn", FFNS)
@pytest.mark.parametrize("weighted", (True, False))
def test_kernels_match_the_reference_passes(activation, ffn, weighted):
  hidden, act_grad, weights = _inputs(activation, ffn, weighted=weighted)
  forward = jax.jit(fp8_passes.activate_quantized_cuda, static_argnums=1)
  reference = jax.jit(fp8_passes.activate_quantized_xla, static_argnums=1)
  got, want = forward(hidden, activation, weights), reference(hidden, activation, weights)
  for got_q, want_q in zip(got, want):
    _one_code_apart(got_q, want_q)
  backward = jax.jit(fp8_passes.activation_grad_quantized_cuda, static_argnums=2)
  reference = jax.jit(fp8_passes.activation_grad_quantized_xla, static_argnums=2)
  got, want = (backward(hidden, act_grad, activation, weights),
               reference(hidden, act_grad, activation, weights))
  for got_q, want_q in zip(got[:2], want[:2]):
    _one_code_apart(got_q, want_q)
  if weighted:  # float32 sums of ~F products in another order
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-4,
                               atol=1e-4 * np.abs(np.asarray(want[2])).max())
  else:
    assert got[2] is None and want[2] is None
  again = backward(hidden, act_grad, activation, weights)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.gpu
@needs_kernels
def test_kernels_poison_a_non_finite_block_both_ways():
  """A NaN or an inf poisons its row block and its column block (scale NaN,
  codes NaN), as the reference does, and no other block."""
  hidden, act_grad, weights = _inputs("swiglu", 256)
  hidden = hidden.at[5, 7].set(jnp.nan).at[200, 256 + 130].set(jnp.inf)
  got = jax.jit(fp8_passes.activate_quantized_cuda, static_argnums=1)(
      hidden, "swiglu", weights)
  want = jax.jit(fp8_passes.activate_quantized_xla, static_argnums=1)(
      hidden, "swiglu", weights)
  for (_, got_scales), (_, want_scales) in zip(got, want):
    np.testing.assert_array_equal(np.isnan(got_scales), np.isnan(want_scales))
    assert np.isnan(np.asarray(want_scales)).sum() == 2


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("shape", [(3, 256, 512), (2, 2880, 176), (1, 48, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weight_kernel_gives_the_reference_bytes(shape, dtype):
  """Every code (both layouts) and scale of the kernel's weight quantization
  is the pure-JAX one's: no rounding but the e4m3 one on either side. A NaN
  poisons its block alone; a block of zeros gets the floor scale."""
  rng = np.random.default_rng(3)
  weights = rng.normal(size=shape) * 2.0 ** rng.integers(-30, 10, size=(shape[0], 1, 1))
  weights[0, :16, :16] = 0.0
  weights[-1, -1, -1] = np.nan
  weights = jnp.asarray(weights, dtype)
  got = jax.jit(fp8_passes.quantize_weights_cuda)(weights)
  want = jax.jit(fp8_passes.quantize_weights_xla)(weights)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_kernels_lower_for_cuda_as_one_callback_each(monkeypatch, pretend_cupy):
  """On a machine without a GPU the bank's passes lower for CUDA to one
  buffer callback each: the activation, its gradient, the weights."""
  monkeypatch.setattr(grouped, "hopper_available", lambda: True)
  monkeypatch.setattr(hopper, "num_sms_here", lambda: 132)
  hidden, act_grad, weights = _inputs("swiglu", 176)

  def passes(h, g, w, master):
    return (fp8_passes.activate_quantized(h, "swiglu", w, kernels=True),
            fp8_passes.activation_grad_quantized(h, g, "swiglu", w, kernels=True),
            fp8_passes.quantize_weights(master, kernels=True))

  master = jnp.zeros((2, 64, 352), jnp.float32)
  text = jax.jit(passes).trace(hidden, act_grad, weights, master).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "xla_buffer_python_gpu_callback" in line]
  assert len(calls) == 3, calls
  assert "tensor<2x64x352xui8>" in calls[2] and "tensor<2x352x64xui8>" in calls[2]
  # Outputs: the codes both ways, [M, F] and [F, M]; backward [M, 2F] and [2F, M].
  assert f"tensor<{ROWS}x176xui8>" in calls[0] and f"tensor<176x{ROWS}xui8>" in calls[0]
  assert f"tensor<{ROWS}x352xui8>" in calls[1] and f"tensor<352x{ROWS}xui8>" in calls[1]


def test_shapes_are_checked_at_trace_time():
  hidden = jnp.zeros((100, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    fp8_passes.activate_quantized(hidden, "swiglu", None, kernels=False)
  with pytest.raises(ValueError, match="bfloat16"):
    fp8_passes.activate_quantized(jnp.zeros((128, 64)), "swiglu", None, kernels=False)
  with pytest.raises(ValueError, match="act_grad"):
    fp8_passes.activation_grad_quantized(jnp.zeros((128, 64), jnp.bfloat16),
                                             jnp.zeros((128, 64), jnp.bfloat16), "swiglu",
                                             None, kernels=False)


def test_without_cupy_the_kernels_path_says_so_once_and_runs_the_reference(monkeypatch):
  """Asked for the kernels where CuPy is missing, the passes warn once
  (naming the install) and give the pure-JAX passes' values."""
  monkeypatch.setattr(kernel_launch, "cupy_available", lambda: False)
  fp8_passes._warn_no_cupy.cache_clear()
  hidden, act_grad, weights = _inputs("geglu", 176)
  with pytest.warns(UserWarning, match="CuPy is not installed"):
    got = fp8_passes.activate_quantized(hidden, "geglu", weights, kernels=True)
  want = fp8_passes.activate_quantized(hidden, "geglu", weights, kernels=False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fp8_passes.activation_grad_quantized(hidden, act_grad, "geglu", weights, kernels=True)
