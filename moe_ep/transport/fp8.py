"""FP8 rows for the dispatch: float8_e4m3fn codes with per-128-channel scales.

The format (DeepSeek-V3 / DeepEP blocks, with TransformerEngine's blockwise
``power_2_scale`` / DeepGEMM's UE8M0 rule for the scale):

* Each row of ``H`` channels is cut into ``B = ceil(H / 128)`` blocks of 128
  channels (the last one shorter when ``H % 128 != 0``).
* ``scale = 2**ceil(log2(amax / 448))``, the smallest power of two with
  ``amax / scale <= 448`` (``amax`` = max |x| of the block, 448 = the largest
  e4m3fn value), floored at ``2**-116``, stored as float32. The block's amax
  lands in (224, 448]: the relative precision of e4m3 is unchanged, only the
  subnormal zone is up to 2x wider. Why a power of two: ``x / scale`` and
  ``code * scale`` are then exact, so every platform gives the same bits. A
  plain float32 scale cannot: XLA rewrites ``x / broadcast(s)`` into
  ``x * broadcast(1 / s)`` and lowers float32 division on GPUs to the
  approximate ``div.full.f32``. The floor keeps every scale and every
  ``code * scale`` a normal float32, so all-zero blocks (scale 2**-116) and
  float32 subnormal inputs (always code ±0) also agree where XLA on CPU
  flushes subnormals and GPUs do not.
* ``code = e4m3fn(clip(x / scale, -448, 448))``, rounded to nearest even (the
  clip never binds with this scale; it keeps a cast from ever making NaN).
  Exact zeros (and their signs) round-trip.
* A block holding a NaN or ±inf is poisoned: scale NaN, every code 0x7f (NaN),
  so it dequantizes to NaN ("non-finite in, NaN out"; e4m3fn has no inf, and
  saturating an inf would pass a wrong finite value on silently). The row's
  other blocks and other rows are untouched.
* ``dequantize = float32(code) * scale`` (exact) then one rounding to the
  output dtype. Error bound: ``|x - deq| <= 2**-4 |x| + 2**-10 scale`` before
  that rounding (3 mantissa bits: half an ulp is at most 2**-4 of the value in
  e4m3's normal range, and ``2**-10 * scale`` in its subnormal one). Finite
  values of magnitude ``>= 1.9375 * 2**127`` (~3.3e38, float32/bfloat16 only)
  round to a code whose product overflows: they dequantize to ±inf.

Wire row (one ``[W]`` uint8 row per token, so one exchange carries both)::

  [0, H)            e4m3fn codes, channel order
  [H, Hc)           zeros, Hc = round_up(H, 16)
  [Hc, Hc + 4B)     float32 scales, little-endian, block order
  [Hc + 4B, W)      zeros, W = round_up(Hc + 4B, 128) where that adds less
                    than 1/16 of the row, else round_up(Hc + 4B, 16)

Whole 128-byte lines let rows laid end to end in a slab each start a line:
the GPU kernels store a row a warp (512 bytes) at a time, and a row starting
mid-line spreads each of those stores over one more line. Where the lines
cost many bytes (small H) the bytes cost more than the alignment gains (the
peer FP8 dispatch at four H, including the one shape where the rule does not
pick the faster: ``docs/benchmarks.md``, "Tuning"). The kernels take W from
:func:`wire_bytes`, the one place this rule lives.

An all-zero wire row dequantizes to an all-zero row (codes 0, scales 0), so
``expand_rows`` zero fill on the wire is a zero row after unpacking.

The scale rule and the quantization in blocks live in :mod:`moe_ep.fp8_blocks`,
shared with the FP8 expert bank (:mod:`moe_ep.experts.fp8`), which reads the
codes and scales of the grouped rows straight from the wire rows
(:func:`unpack_filled_wire`). These pure-JAX functions run on every platform
and are the reference. The
CUDA kernels of the same format (``kernels/fp8.cu``, launched by
:mod:`moe_ep.transport.cupy_backend`, and the peer dispatch that quantizes as it
sends, ``peer_dispatch_fp8_*``) give the same bytes and values and need
compute capability 8.9+ (the e4m3 conversion instructions;
:func:`moe_ep.transport.cupy_backend.check_compute_capability`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_ep import fp8_blocks
from moe_ep.capacity import round_up
from moe_ep.fp8_blocks import BLOCK, E4M3_MAX, MIN_SCALE_EXPONENT, NAN_CODE  # noqa: F401

INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_CODE_ALIGN = 16
_WIRE_ALIGN = 128  # whole cache lines (see the wire row above)
_WIRE_LINES_COST = 16  # ... where the padding is under 1/16 of the row


def num_blocks(hidden: int) -> int:
  """``B = ceil(H / 128)`` scale blocks per row."""
  return fp8_blocks.num_blocks(hidden)


def code_bytes(hidden: int) -> int:
  """``Hc``: bytes of a wire row's code region (``H`` rounded up to 16)."""
  return round_up(hidden, _CODE_ALIGN)


def wire_bytes(hidden: int) -> int:
  """``W``: bytes of one wire row: codes and scales, padded to whole 128-byte
  lines where that adds less than 1/16 of the row, else to 16 bytes (the
  rule and its measurements: the module docstring)."""
  packed = round_up(code_bytes(hidden) + 4 * num_blocks(hidden), _CODE_ALIGN)
  lines = round_up(packed, _WIRE_ALIGN)
  return lines if _WIRE_LINES_COST * (lines - packed) < packed else packed


def check_rows(name: str, x: jax.Array) -> None:
  if x.ndim != 2:
    raise ValueError(f"{name} must be [N, H] (rank 2); got shape {x.shape}")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise ValueError(f"{name} dtype {x.dtype} must be one of "
                     f"{[d.name for d in INPUT_DTYPES]}")
  if x.shape[1] < 1:
    raise ValueError(f"{name} must have H >= 1 channels; got shape {x.shape}")


def check_dtype(dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in INPUT_DTYPES:
    raise ValueError(f"dtype={dtype} must be one of {[d.name for d in INPUT_DTYPES]}")
  return dtype


def check_wire(wire: jax.Array, hidden: int) -> None:
  if hidden < 1:
    raise ValueError(f"hidden={hidden} must be >= 1")
  if wire.ndim != 2 or wire.dtype != jnp.uint8 or wire.shape[1] != wire_bytes(hidden):
    raise ValueError(f"wire must be [N, {wire_bytes(hidden)}] uint8 for hidden={hidden} "
                     f"(wire_bytes); got {wire.dtype} {wire.shape}")


def check_filled(filled: jax.Array, wire: jax.Array) -> None:
  if filled.shape != wire.shape[:1] or filled.dtype != jnp.bool_:
    raise ValueError(f"filled must be [{wire.shape[0]}] bool for wire rows {wire.shape}; "
                     f"got {filled.dtype} {filled.shape}")


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-row, per-128-channel FP8 quantization (see the module docstring).

  Args:
    x: ``[N, H]`` float32, bfloat16 or float16.

  Returns:
    ``(codes [N, H] float8_e4m3fn, scales [N, B] float32)``.
  """
  check_rows("x", x)
  return fp8_blocks.quantize_rows(x)


def dequantize_rows(codes: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """``[N, H]`` rows ``float32(code) * scale`` rounded once to ``dtype``.

  Args:
    codes: ``[N, H]`` float8_e4m3fn.
    scales: ``[N, ceil(H / 128)]`` float32.
    dtype: float32, bfloat16 or float16.
  """
  dtype = check_dtype(dtype)
  if codes.ndim != 2 or codes.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"codes must be [N, H] float8_e4m3fn; got {codes.dtype} {codes.shape}")
  rows, hidden = codes.shape
  blocks = num_blocks(hidden)
  if scales.shape != (rows, blocks) or scales.dtype != jnp.float32:
    raise ValueError(f"scales must be [{rows}, {blocks}] float32 for codes {codes.shape}; "
                     f"got {scales.dtype} {scales.shape}")
  return fp8_blocks.dequantize_rows(codes, scales, dtype)


def pack_wire(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """``[N, W]`` uint8 wire rows holding each row's codes and scales."""
  rows, hidden = codes.shape
  code_region = jnp.pad(jax.lax.bitcast_convert_type(codes, jnp.uint8),
                        ((0, 0), (0, code_bytes(hidden) - hidden)))
  scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(rows, -1)
  wire = jnp.concatenate([code_region, scale_bytes], axis=1)
  return jnp.pad(wire, ((0, 0), (0, wire_bytes(hidden) - wire.shape[1])))


def unpack_wire(wire: jax.Array, hidden: int) -> tuple[jax.Array, jax.Array]:
  """``(codes [N, H] float8_e4m3fn, scales [N, B] float32)`` of wire rows."""
  check_wire(wire, hidden)
  rows = wire.shape[0]
  blocks = num_blocks(hidden)
  codes = jax.lax.bitcast_convert_type(wire[:, :hidden], jnp.float8_e4m3fn)
  start = code_bytes(hidden)
  scale_bytes = wire[:, start:start + 4 * blocks].reshape(rows, blocks, 4)
  return codes, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)


def dequantize_wire_rows(wire: jax.Array, hidden: int, dtype, filled: jax.Array) -> jax.Array:
  """``[N, W]`` uint8 wire rows -> ``[N, H]`` rows of ``dtype``
  (:func:`dequantize_rows` of :func:`unpack_wire`), zero wherever ``filled
  [N]`` (bool) is False whatever those rows' bytes hold: the FP8 slabs'
  padding rows, which the peer kernel leaves unwritten. One fused pass, as
  without the mask."""
  check_filled(filled, wire)
  rows = dequantize_rows(*unpack_wire(wire, hidden), dtype)
  return jnp.where(filled[:, None], rows, jnp.zeros((), rows.dtype))


def unpack_filled_wire(wire: jax.Array, hidden: int,
                       filled: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(codes [N, H] float8_e4m3fn, scales [N, B] float32)`` of wire rows
  (:func:`unpack_wire`), both zero wherever ``filled [N]`` (bool) is False
  whatever those rows' bytes hold (as :func:`dequantize_wire_rows`): a byte
  copy, no dequantize, for the FP8 expert bank's first GEMM."""
  check_filled(filled, wire)
  codes, scales = unpack_wire(wire, hidden)
  zero_code = jnp.zeros((), codes.dtype)
  return (jnp.where(filled[:, None], codes, zero_code),
          jnp.where(filled[:, None], scales, jnp.zeros((), scales.dtype)))


def quantize_pack(x: jax.Array) -> jax.Array:
  """``x [N, H]`` -> ``[N, W]`` uint8 wire rows."""
  return pack_wire(*quantize_rows(x))
