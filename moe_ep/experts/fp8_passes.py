"""The FP8 bank's passes outside its GEMMs, each one read of its input that
writes every quantization of its output the GEMMs read:

* :func:`quantize_weights`: the master weights ``[G, K, N]`` per 128x128
  block, their codes as they are (the input gradient's operand) and
  transposed (the forward's), once per step;
* :func:`activate_quantized`: ``hidden [M, n*F]`` -> the activation ``[M, F]``
  (:func:`moe_ep.activations.activate`: float32 from the exact inputs, times
  the routing weights, rounded to bf16 once), quantized per row (the second
  GEMM's operand) and per channel and 128 rows, transposed (its weight
  gradient's);
* :func:`activation_grad_quantized`: ``hidden`` and the activation's
  cotangent ``[M, F]`` -> the hidden rows' gradient ``[M, n*F]`` (float32,
  rounded to bf16 once), quantized both ways, and the routing weights'
  gradient.

Where the bank's GEMMs run on the Hopper kernels, these run
``kernels/fp8_bank.cu`` (through CuPy, on XLA's stream); elsewhere, and as the
reference, the pure-JAX functions below: the same math as XLA passes
(:func:`moe_ep.fp8_blocks.quantize`, the activation or its autodiff).
Without CuPy on such a GPU they say so once and run as XLA passes.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep import fp8_blocks
from moe_ep.activations import ACTIVATIONS, activate, input_projections
from moe_ep.row_groups import ROW_TILE
from moe_ep.transport import kernel_launch as kl
from moe_ep.transport.kernel_launch import KernelFile, i32, pointer

WEIGHT_DTYPES = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}
KERNELS = KernelFile("fp8_bank.cu", (
    *(f"fp8_quantize_weights_{suffix}" for suffix in WEIGHT_DTYPES.values()),
    *(f"{op}_{activation}" for op in ("fp8_act_quantize", "fp8_act_grad_quantize")
      for activation in ACTIVATIONS)))
WEIGHT_BLOCKS = (1, fp8_blocks.BLOCK, fp8_blocks.BLOCK)  # per group, 128x128
_THREADS = 256  # kernels/fp8_bank.cu's BANK_THREADS
_NULL = np.uint64(0)

Quantized = tuple[jax.Array, jax.Array]  # (codes, scales)


# --- the reference (pure JAX) ---------------------------------------------------


def quantize_weights_xla(weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`quantize_weights` as XLA passes."""
  codes, scales = fp8_blocks.quantize(weights, WEIGHT_BLOCKS)
  return codes, jnp.swapaxes(codes, 1, 2), scales


def activate_quantized_xla(hidden: jax.Array, activation: str,
                           row_weights: jax.Array | None) -> tuple[Quantized, Quantized]:
  """:func:`activate_quantized` as XLA passes."""
  act = activate(hidden, activation, row_weights)
  return fp8_blocks.quantize_rows(act), fp8_blocks.quantize_columns(act)


def activation_grad_quantized_xla(hidden: jax.Array, act_grad: jax.Array, activation: str,
                                  row_weights: jax.Array | None
                                  ) -> tuple[Quantized, Quantized, jax.Array | None]:
  """:func:`activation_grad_quantized` as XLA passes (the activation's autodiff)."""
  if row_weights is None:
    _, vjp = jax.vjp(lambda h: activate(h, activation), hidden)
    (hidden_grad,), weights_grad = vjp(act_grad), None
  else:
    _, vjp = jax.vjp(lambda h, w: activate(h, activation, w), hidden, row_weights)
    hidden_grad, weights_grad = vjp(act_grad)
  return (fp8_blocks.quantize_rows(hidden_grad), fp8_blocks.quantize_columns(hidden_grad),
          weights_grad)


# --- the kernels ----------------------------------------------------------------


def _kernels(ordinal: int) -> dict[str, object]:
  return kl.functions(ordinal, (KERNELS,))


def _code_shapes(rows: int, width: int) -> list[jax.ShapeDtypeStruct]:
  """Row codes and scales, then column codes and scales, of ``[rows, width]``
  (codes as uint8: the callback's buffers; bitcast to e4m3 after)."""
  return [jax.ShapeDtypeStruct((rows, width), jnp.uint8),
          jax.ShapeDtypeStruct((rows, fp8_blocks.num_blocks(width)), jnp.float32),
          jax.ShapeDtypeStruct((width, rows), jnp.uint8),
          jax.ShapeDtypeStruct((width, rows // ROW_TILE), jnp.float32)]


def _as_codes(row_codes, row_scales, column_codes, column_scales) -> tuple[Quantized, Quantized]:
  e4m3 = lambda codes: jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
  return (e4m3(row_codes), row_scales), (e4m3(column_codes), column_scales)


def quantize_weights_cuda(weights):
  """:func:`quantize_weights` by kernel ``fp8_quantize_weights_<dtype>`` (the same bytes)."""
  groups, k_size, n_size = weights.shape
  blocks = (fp8_blocks.num_blocks(k_size), fp8_blocks.num_blocks(n_size))
  kernel = f"fp8_quantize_weights_{WEIGHT_DTYPES[jnp.dtype(weights.dtype)]}"
  shapes = [jax.ShapeDtypeStruct((groups, k_size, n_size), jnp.uint8),
            jax.ShapeDtypeStruct((groups, n_size, k_size), jnp.uint8),
            jax.ShapeDtypeStruct((groups, *blocks), jnp.float32)]

  def callback(ctx, outs, weights_buffer):
    with kl.on_xla_stream(ctx, weights_buffer, _kernels) as launch:
      launch(kernel, groups * blocks[0] * blocks[1], _THREADS, pointer(weights_buffer),
             *i32(groups, k_size, n_size), *(pointer(out) for out in outs))

  codes, codes_t, scales = kl.call("moe_fp8_quantize_weights", callback, shapes, weights,
                                   kernels=_kernels)
  e4m3 = lambda c: jax.lax.bitcast_convert_type(c, jnp.float8_e4m3fn)
  return e4m3(codes), e4m3(codes_t), scales


def activate_quantized_cuda(hidden, activation, row_weights):
  """:func:`activate_quantized` by kernel ``fp8_act_quantize_<activation>``."""
  rows, width = hidden.shape
  ffn = width // input_projections(activation)
  grid = rows // ROW_TILE * fp8_blocks.num_blocks(ffn)
  weights = () if row_weights is None else (row_weights.astype(jnp.float32),)

  def callback(ctx, outs, hidden_buffer, *weights_buffer):
    weights_pointer = pointer(weights_buffer[0]) if weights_buffer else _NULL
    with kl.on_xla_stream(ctx, hidden_buffer, _kernels) as launch:
      launch(f"fp8_act_quantize_{activation}", grid, _THREADS, pointer(hidden_buffer),
             weights_pointer, *i32(rows, ffn), *(pointer(out) for out in outs))

  outs = kl.call("moe_fp8_act_quantize", callback, _code_shapes(rows, ffn), hidden, *weights,
                 kernels=_kernels)
  return _as_codes(*outs)


def activation_grad_quantized_cuda(hidden, act_grad, activation, row_weights):
  """:func:`activation_grad_quantized` by kernel ``fp8_act_grad_quantize_<activation>``;
  the routing weights' gradient sums the kernel's per-block partial sums in
  a fixed order."""
  rows, width = hidden.shape
  ffn = width // input_projections(activation)
  blocks = fp8_blocks.num_blocks(width)
  shapes = _code_shapes(rows, width)
  weights = () if row_weights is None else (row_weights.astype(jnp.float32),)
  if weights:
    shapes.append(jax.ShapeDtypeStruct((rows, blocks), jnp.float32))

  def callback(ctx, outs, hidden_buffer, grad_buffer, *weights_buffer):
    weights_pointer = pointer(weights_buffer[0]) if weights_buffer else _NULL
    partials_pointer = pointer(outs[4]) if weights_buffer else _NULL
    with kl.on_xla_stream(ctx, hidden_buffer, _kernels) as launch:
      launch(f"fp8_act_grad_quantize_{activation}", rows // ROW_TILE * blocks, _THREADS,
             pointer(hidden_buffer), pointer(grad_buffer), weights_pointer, *i32(rows, ffn),
             *(pointer(out) for out in outs[:4]), partials_pointer)

  outs = kl.call("moe_fp8_act_grad_quantize", callback, shapes, hidden,
                 act_grad.astype(jnp.bfloat16), *weights, kernels=_kernels)
  weights_grad = (jnp.sum(outs[4], axis=1).astype(row_weights.dtype) if weights else None)
  return (*_as_codes(*outs[:4]), weights_grad)


# --- which runs -----------------------------------------------------------------


@functools.cache
def _warn_no_cupy() -> None:
  warnings.warn(
      "expert_precision='fp8': the activation and its quantizations run as XLA passes, not "
      "as kernels/fp8_bank.cu's single passes, because CuPy is not installed (pip install "
      "'moe_ep[cuda13]' or '[cuda12]')", stacklevel=4)


def _check(hidden, activation, row_weights, act_grad=None):
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
  if hidden.ndim != 2 or jnp.dtype(hidden.dtype) != jnp.bfloat16:
    raise ValueError(f"hidden must be [M, n*F] bfloat16; got {hidden.dtype} {hidden.shape}")
  rows, width = hidden.shape
  n = input_projections(activation)
  if rows % ROW_TILE or width % (n * 16):
    raise ValueError(f"hidden {hidden.shape}: M must be a multiple of {ROW_TILE} and F of 16 "
                     f"(the grouped FP8 layout)")
  if row_weights is not None and row_weights.shape != (rows,):
    raise ValueError(f"row_weights must be [{rows}]; got {row_weights.shape}")
  if act_grad is not None and act_grad.shape != (rows, width // n):
    raise ValueError(f"act_grad must be [{rows}, {width // n}]; got {act_grad.shape}")


def _given(optional: tuple):
  return optional[0] if optional else None


def _on_kernels(kernels: bool) -> bool:
  if kernels and not kl.cupy_available():
    _warn_no_cupy()
    return False
  return kernels


def quantize_weights(weights: jax.Array, kernels: bool
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``weights [G, K, N]`` (the master weights, no gradient through this)
  quantized per 128x128 block: ``(codes [G, K, N], codes_t [G, N, K],
  scales [G, ceil(K / 128), ceil(N / 128)])``; ``kernels``: run
  ``kernels/fp8_bank.cu`` on a CUDA device for float32 and bfloat16 weights
  with K and N multiples of 16 (the pure-JAX passes otherwise)."""
  if weights.ndim != 3:
    raise ValueError(f"weights must be [G, K, N]; got shape {weights.shape}")
  weights = jax.lax.stop_gradient(weights)
  fits = (jnp.dtype(weights.dtype) in WEIGHT_DTYPES and weights.shape[1] % 16 == 0
          and weights.shape[2] % 16 == 0)
  if not (fits and _on_kernels(kernels)):
    return quantize_weights_xla(weights)
  return jax.lax.platform_dependent(weights, cuda=quantize_weights_cuda,
                                    default=quantize_weights_xla)


def activate_quantized(hidden: jax.Array, activation: str, row_weights: jax.Array | None,
                       kernels: bool) -> tuple[Quantized, Quantized]:
  """The activation of ``hidden [M, n*F]`` bf16, quantized per row and 128
  channels (``codes [M, F]``, ``scales [M, ceil(F / 128)]``) and per channel
  and 128 rows (``codes [F, M]``, ``scales [F, M / 128]``).

  ``row_weights [M]`` (float32) or None scales each row before the rounding
  (:func:`moe_ep.activations.activate`); ``kernels``: run
  ``kernels/fp8_bank.cu`` on a CUDA device (the pure-JAX passes elsewhere).
  """
  _check(hidden, activation, row_weights)
  if not _on_kernels(kernels):
    return activate_quantized_xla(hidden, activation, row_weights)
  weights = () if row_weights is None else (row_weights,)
  return jax.lax.platform_dependent(
      hidden, *weights,
      cuda=lambda h, *w: activate_quantized_cuda(h, activation, _given(w)),
      default=lambda h, *w: activate_quantized_xla(h, activation, _given(w)))


def activation_grad_quantized(hidden: jax.Array, act_grad: jax.Array, activation: str,
                              row_weights: jax.Array | None, kernels: bool
                              ) -> tuple[Quantized, Quantized, jax.Array | None]:
  """The gradient of :func:`activate_quantized`'s activation for its
  cotangent ``act_grad [M, F]``: the hidden rows' ``[M, n*F]`` rounded to
  bf16 once, quantized per row (``codes [M, n*F]``) and per channel
  (``codes [n*F, M]``), and ``row_weights``' ``[M]`` (None without them)."""
  _check(hidden, activation, row_weights, act_grad)
  if not _on_kernels(kernels):
    return activation_grad_quantized_xla(hidden, act_grad, activation, row_weights)
  weights = () if row_weights is None else (row_weights,)
  return jax.lax.platform_dependent(
      hidden, act_grad, *weights,
      cuda=lambda h, g, *w: activation_grad_quantized_cuda(h, g, activation, _given(w)),
      default=lambda h, g, *w: activation_grad_quantized_xla(h, g, activation, _given(w)))
