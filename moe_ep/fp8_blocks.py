"""Block-scaled float8_e4m3fn: the scale rule and the quantization in blocks,
one implementation for the FP8 dispatch (:mod:`moe_ep.transport.fp8`, rows
in blocks of 128 channels) and the FP8 expert bank
(:mod:`moe_ep.experts.fp8`: rows likewise, weights in 128x128 blocks).

The rule, for each block (DeepSeek-V3's blocks, with TransformerEngine's
blockwise ``power_2_scale`` / DeepGEMM's UE8M0 rule for the scale):

* ``scale = 2**ceil(log2(amax / 448))``, the smallest power of two with
  ``amax / scale <= 448`` (``amax`` = max |x| of the block, 448 = the largest
  e4m3fn value), floored at ``2**-116``, float32. The block's amax lands in
  (224, 448]. A power of two makes ``x / scale`` and ``code * scale`` exact,
  so every platform gives the same bits; the floor keeps every scale and
  every ``code * scale`` a normal float32 (the reasons at length:
  :mod:`moe_ep.transport.fp8`).
* ``code = e4m3fn(clip(x / scale, -448, 448))``, rounded to nearest even in
  float32 arithmetic (the cast afterwards is exact); zeros and their signs
  round-trip.
* A block holding a NaN or ±inf is poisoned: scale NaN, every code NaN.
* ``dequantize = float32(code) * scale``, exact, then one rounding to the
  output dtype. ``|x - deq| <= 2**-4 |x| + 2**-10 scale`` before it.

A block is given per axis: ``blocks[i]`` elements of axis ``i`` share a
scale (1: each index its own), the last block of an axis shorter where its
size is not a multiple. Rows per 128 channels are ``(1, 128)``
(:func:`quantize_rows`; :func:`quantize_columns` for the transposed rows
the weight gradients read), weights ``[G, K, N]`` per 128x128 block
``(1, 128, 128)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep.precision import exact_float32

BLOCK = 128
E4M3_MAX = 448.0
MIN_SCALE_EXPONENT = -116  # scale floor 2**-116
NAN_CODE = 0x7F
_MANTISSA_BITS = 3
_MIN_NORMAL_EXPONENT = -6  # e4m3fn: smallest normal 2**-6, subnormal step 2**-9


def num_blocks(size: int, block: int = BLOCK) -> int:
  """``ceil(size / block)``: the scale blocks along an axis of ``size``."""
  return -(-size // block)


def _f32_bits(value: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(value, jnp.int32)


def _pow2(exponent: jax.Array) -> jax.Array:
  """``2.0 ** exponent`` in float32 for int32 exponents in [-126, 127], exactly."""
  return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def _scale_exponent(amax: jax.Array) -> jax.Array:
  """int32 ``max(ceil(log2(amax / 448)), -116)`` of finite ``amax >= 0``, from
  its bits: with ``amax = m * 2**E``, ``m`` in [1, 2), it is ``E - 8``, plus one
  where ``m > 1.75`` (448 = 1.75 * 2**8)."""
  bits = _f32_bits(amax)
  exponent = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
  return jnp.maximum(exponent, MIN_SCALE_EXPONENT)


def _round_to_e4m3_grid(y: jax.Array) -> jax.Array:
  """Rounds finite float32 ``|y| <= 448`` to the nearest e4m3fn value, ties to
  even, in float32 arithmetic; the cast to float8 afterwards is exact, so the
  bits do not depend on how a platform implements that conversion."""
  exponent = ((_f32_bits(y) >> 23) & 0xFF) - 127
  ulp_exponent = jnp.maximum(exponent, _MIN_NORMAL_EXPONENT) - _MANTISSA_BITS
  return jnp.round(y * _pow2(-ulp_exponent)) * _pow2(ulp_exponent)


def _check_blocks(shape: tuple, blocks: tuple) -> tuple[int, ...]:
  blocks = tuple(int(b) for b in blocks)
  if len(blocks) != len(shape) or min(blocks, default=1) < 1:
    raise ValueError(f"blocks={blocks} must give one block size >= 1 per axis of shape {shape}")
  return blocks


def _split(x: jax.Array, blocks: tuple[int, ...]) -> jax.Array:
  """``x`` padded to whole blocks and reshaped to ``[n_0, b_0, n_1, b_1, ...]``."""
  counts = [num_blocks(size, block) for size, block in zip(x.shape, blocks)]
  padded = jnp.pad(x, [(0, n * b - size) for n, b, size in zip(counts, blocks, x.shape)])
  return padded.reshape([d for pair in zip(counts, blocks) for d in pair])


def _per_block(values: jax.Array) -> jax.Array:
  """``[n_0, n_1, ...]`` per-block values as ``[n_0, 1, n_1, 1, ...]``."""
  return values.reshape([d for n in values.shape for d in (n, 1)])


def quantize(x: jax.Array, blocks: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """Block-scaled e4m3fn codes of ``x`` (the rule: the module docstring).

  Args:
    x: any shape, float32, bfloat16 or float16.
    blocks: one block size per axis of ``x``.

  Returns:
    ``(codes, scales)``: codes float8_e4m3fn shaped like ``x``; scales
    float32 ``[ceil(x.shape[i] / blocks[i]) for each axis i]``.
  """
  blocks = _check_blocks(x.shape, blocks)
  split = _split(exact_float32(x), blocks)
  inner = tuple(range(1, split.ndim, 2))
  finite = jnp.isfinite(split).all(axis=inner)
  amax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(split), split, 0.0)), axis=inner)
  exponent = _scale_exponent(amax)
  scales = jnp.where(finite, _pow2(exponent), np.float32(np.nan))
  y = jnp.clip(split * _per_block(_pow2(-exponent)), -E4M3_MAX, E4M3_MAX)  # exact
  grid = jnp.where(_per_block(finite), _round_to_e4m3_grid(y), np.float32(np.nan))
  padded_shape = [n * b for n, b in zip(scales.shape, blocks)]
  codes = grid.astype(jnp.float8_e4m3fn).reshape(padded_shape)
  return codes[tuple(slice(0, size) for size in x.shape)], scales


def dequantize(codes: jax.Array, scales: jax.Array, blocks: tuple[int, ...],
               dtype=jnp.float32) -> jax.Array:
  """``float32(code) * scale`` of every element (exact), rounded once to ``dtype``.

  Args:
    codes: float8_e4m3fn, any shape.
    scales: float32, as :func:`quantize` gives for ``codes.shape`` and ``blocks``.
    blocks: one block size per axis of ``codes``.
    dtype: the output dtype.
  """
  blocks = _check_blocks(codes.shape, blocks)
  if codes.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"codes must be float8_e4m3fn; got {codes.dtype}")
  expected = tuple(num_blocks(size, block) for size, block in zip(codes.shape, blocks))
  if scales.shape != expected or scales.dtype != jnp.float32:
    raise ValueError(f"scales must be {list(expected)} float32 for codes {codes.shape} in "
                     f"blocks {blocks}; got {scales.dtype} {scales.shape}")
  per_element = scales
  for axis, (size, block) in enumerate(zip(codes.shape, blocks)):
    per_element = jnp.repeat(per_element, block, axis=axis,
                             total_repeat_length=expected[axis] * block)
  per_element = per_element[tuple(slice(0, size) for size in codes.shape)]
  return (codes.astype(jnp.float32) * per_element).astype(dtype)


ROW_BLOCKS = (1, BLOCK)  # per row, 128 channels


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x [M, K]`` -> ``(codes [M, K], scales [M, ceil(K / 128)])``: per row and 128 channels."""
  return quantize(x, ROW_BLOCKS)


def quantize_columns(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x [M, K]`` -> ``(codes [K, M], scales [K, ceil(M / 128)])``: per channel
  and 128 rows, transposed (the operands of a weight gradient ``x^T @ dy``)."""
  return quantize(x.T, ROW_BLOCKS)


def dequantize_rows(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``[M, K]`` of row-quantized ``codes`` (:func:`quantize_rows`), exact, then
  rounded once to ``dtype``."""
  return dequantize(codes, scales, ROW_BLOCKS, dtype)
