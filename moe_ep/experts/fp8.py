"""The FP8 expert bank: the grouped bank's three GEMMs in block-scaled
float8_e4m3fn (``MoEConfig.expert_precision="fp8"``), as DeepSeek-V3 trains
its experts.

The format is the FP8 dispatch's (:mod:`moe_ep.fp8_blocks`: one
power-of-two float32 scale per block, so every dequantization is exact):
activations per row and 128 channels along the contraction (``[M, K]``
codes, ``[M, ceil(K / 128)]`` scales), weights ``[G, K, N]`` per 128x128
block (``[G, ceil(K / 128), ceil(N / 128)]`` scales), partial last blocks
where a size is not a multiple of 128. Each product accumulates in float32
and rounds once.

For ``y = x @ W`` per group (``x [M, K]`` bf16 rows in the grouped layout,
``W [G, K, N]``):

* forward: ``x`` row-quantized times ``W`` transposed (codes ``[G, N, K]``,
  contraction last): :func:`grouped_matmul_fp8`;
* input gradient ``dx = dy @ W^T``: ``dy`` row-quantized times ``W``'s codes
  as they are (``[G, K, N]``: contraction ``N`` last), the same scales
  transposed, so each step quantizes the weights once
  (:func:`quantize_weights`) for both products;
* weight gradient ``dW = x^T @ dy`` per group: both quantized column-wise,
  per channel and 128 rows (``x`` as ``[K, M]``, ``dy`` as ``[N, M]``):
  :func:`grouped_matmul_fp8_wgrad`.

The forward quantizes ``x`` both ways; the column-wise codes are the
weight gradient's residual (FP8 bytes, half of bf16 ``x``). Outputs and the
input gradient are bf16; the weight gradient reaches the master weights in
their own dtype, straight through the quantization. Rows of no group are
zero in ``y`` and in ``dx``.

:func:`grouped_matmul_fp8` and :func:`grouped_matmul_fp8_wgrad` here are the
pure-JAX implementations ("xla": exact dequantization, float32 contraction
at ``Precision.HIGHEST``), the reference and the CPU path; the Hopper kernels
of :mod:`moe_ep.experts.hopper_fp8` take the same arguments and run under
``implementation="auto"`` (on a GPU of compute capability 9.0) or
``"hopper"``, as in :mod:`moe_ep.experts.grouped`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_ep import fp8_blocks, sharding
from moe_ep.activations import input_projections
from moe_ep.experts import fp8_passes, grouped, hopper_fp8
from moe_ep.experts.grouped import GroupTiles, check_implementation, group_tiles
from moe_ep.experts.slabs import Namer, _no_name
from moe_ep.fp8_blocks import BLOCK
from moe_ep.row_groups import ROW_TILE

# FP8 rows must start on 16 bytes for the kernels' bulk copies (TMA).
SIZE_MULTIPLE = 16
# The weight gradient's dtypes the Hopper kernel stores (others: float32, then cast).
_KERNEL_OUT_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)))
# Checkpoint names of the weight gradients' column-wise codes (RematConfig).
INPUT_CODES = "expert_fp8.input"
HIDDEN_CODES = "expert_fp8.hidden"


class FP8Weights(NamedTuple):
  """One step's quantized expert weights ``W [G, K, N]`` (:func:`quantize_weights`).

  Attributes:
    codes: ``[G, K, N]`` float8_e4m3fn (the input gradient's operand).
    codes_t: ``[G, N, K]`` the same codes transposed (the forward's).
    scales: ``[G, ceil(K / 128), ceil(N / 128)]`` float32, one per 128x128
      block, shared by both (transposed for ``codes_t``).
  """

  codes: jax.Array
  codes_t: jax.Array
  scales: jax.Array


def quantize_weights(weights: jax.Array, implementation: str = "auto") -> FP8Weights:
  """``weights [G, K, N]`` (any float dtype: the master weights) quantized per
  128x128 block, with the transposed codes, in one pass where the bank's
  kernels run (:func:`moe_ep.experts.fp8_passes.quantize_weights`);
  ``implementation`` as :func:`fp8_grouped_matmul`."""
  return FP8Weights(*fp8_passes.quantize_weights(weights, _uses_kernels(implementation)))


def dequantize_weights(weights: FP8Weights) -> jax.Array:
  """``[G, K, N]`` float32: the values the FP8 GEMMs multiply by (exact)."""
  return fp8_blocks.dequantize(weights.codes, weights.scales, fp8_passes.WEIGHT_BLOCKS)


# --- the two products, pure JAX ("xla") ---------------------------------------


def _tile_groups_to_sizes(tile_group: jax.Array, num_groups: int) -> jax.Array:
  """``[G]`` rows of each group: its tiles times ``ROW_TILE``. The tiles of a
  group are contiguous and in group order, the tiles of no group last (as
  :func:`~moe_ep.experts.grouped.group_tiles` lays them out)."""
  groups = jnp.arange(num_groups, dtype=jnp.int32)
  return ROW_TILE * jnp.sum(tile_group[None, :] == groups[:, None], axis=1, dtype=jnp.int32)


def grouped_matmul_fp8(a_codes: jax.Array, a_scales: jax.Array, b_codes: jax.Array,
                       b_scales: jax.Array, tile_group: jax.Array) -> jax.Array:
  """``out[rows of tile t] = (a * a_scales) @ (b[g] * b_scales[g]).T`` for
  ``g = tile_group[t]``, zero rows where ``g == -1``; pure JAX.

  Args:
    a_codes: ``[M, K]`` float8_e4m3fn, ``M = ROW_TILE * W``.
    a_scales: ``[M, ceil(K / 128)]`` float32, per row and 128 channels.
    b_codes: ``[G, N, K]`` float8_e4m3fn (contraction last).
    b_scales: ``[G, ceil(N / 128), ceil(K / 128)]`` float32, per 128x128 block.
    tile_group: ``[W]`` int32 group of each ``ROW_TILE``-row tile, or -1.

  Returns:
    ``[M, N]`` bfloat16: the float32 sums of the exact products, rounded once.
  """
  lhs = fp8_blocks.dequantize_rows(a_codes, a_scales)
  rhs = fp8_blocks.dequantize(b_codes, b_scales, fp8_passes.WEIGHT_BLOCKS)
  sizes = _tile_groups_to_sizes(tile_group, rhs.shape[0])
  out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes,
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return out.astype(jnp.bfloat16)


def grouped_matmul_fp8_wgrad(a_codes: jax.Array, a_scales: jax.Array, b_codes: jax.Array,
                             b_scales: jax.Array, group_start: jax.Array,
                             group_blocks: jax.Array, num_groups: int) -> jax.Array:
  """``out[g] = a[:, rows_g] @ b[:, rows_g].T`` over each group's rows: the
  weight gradient from column-wise operands; pure JAX.

  Args:
    a_codes: ``[P, M]`` float8_e4m3fn; a_scales: ``[P, M // 128]`` float32,
      per channel and 128 rows.
    b_codes: ``[Q, M]``; b_scales: ``[Q, M // 128]``, likewise.
    group_start: ``[G]`` int32 first row of each group (a multiple of 128).
    group_blocks: ``[G]`` int32 128-row blocks of each group, which follow
      one another from row 0 (as the grouped layout lays them out).
    num_groups: ``G``.

  Returns:
    ``[G, P, Q]`` float32, zero for an empty group.
  """
  del group_start  # the groups follow one another: their sizes place them
  lhs = fp8_blocks.dequantize_rows(a_codes, a_scales)
  rhs = fp8_blocks.dequantize_rows(b_codes, b_scales)
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  sizes = BLOCK * group_blocks[:num_groups].astype(jnp.int32)
  return jax.lax.ragged_dot_general(lhs.T, rhs.T, sizes, numbers,
                                    precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32)


# --- which implementation runs ------------------------------------------------


def check_device() -> None:
  """ValueError on a GPU that is not of compute capability 9.0: the FP8
  bank never falls back to bf16 there. CPUs run the pure-JAX path."""
  device = grouped._default_device()
  if device is not None and device.platform == "gpu" and not grouped.hopper_available():
    capability = getattr(device, "compute_capability", "unknown")
    raise ValueError(
        f"expert_precision='fp8' needs a CUDA GPU of compute capability 9.0 (H100, H200) for "
        f"its block-scaled FP8 GEMMs; this {device.device_kind} has compute capability "
        f"{capability}: set expert_precision=None (bf16 GEMMs) on this GPU")


def _uses_kernels(implementation: str) -> bool:
  check_implementation(implementation)
  if implementation == "xla":
    return False
  if implementation == "hopper":
    if not grouped.hopper_available():
      raise ValueError("implementation='hopper' needs a CUDA GPU of compute capability 9.0 "
                       "(H100, H200); use 'auto' or 'xla'")
    return True
  check_device()
  return grouped.hopper_available()


def _forward(implementation, config, a_codes, a_scales, b_codes, b_scales, tile_group):
  if _uses_kernels(implementation):
    return jax.lax.platform_dependent(
        a_codes, a_scales, b_codes, b_scales, tile_group,
        cuda=lambda a, sa, b, sb, t: sharding.vary_like(
            hopper_fp8.grouped_matmul_fp8(a, sa, b, sb, t, config=config), a, b),
        default=grouped_matmul_fp8)
  return grouped_matmul_fp8(a_codes, a_scales, b_codes, b_scales, tile_group)


def _wgrad(implementation, config, a_codes, a_scales, b_codes, b_scales, tiles: GroupTiles,
           out_dtype):
  """The weight gradient in ``out_dtype`` (the master weights'), rounded once
  from the float32 sums: the kernel stores it directly, so bf16 master
  weights cost no float32 ``[G, K, N]`` pass."""
  # With groups on whole tiles their rows are whole 128-row blocks.
  group_blocks = tiles.group_rows // BLOCK
  num_groups = tiles.group_start.shape[0]
  reference = lambda *args: grouped_matmul_fp8_wgrad(*args, num_groups).astype(out_dtype)
  if _uses_kernels(implementation):
    stored = out_dtype if out_dtype in _KERNEL_OUT_DTYPES else jnp.dtype(jnp.float32)
    return jax.lax.platform_dependent(
        a_codes, a_scales, b_codes, b_scales, tiles.group_start, group_blocks,
        cuda=lambda a, sa, b, sb, start, blocks: sharding.vary_like(
            hopper_fp8.grouped_matmul_fp8_wgrad(a, sa, b, sb, start, blocks, num_groups,
                                                config=config, out_dtype=stored), a, b
            ).astype(out_dtype),
        default=reference)
  return reference(a_codes, a_scales, b_codes, b_scales, tiles.group_start, group_blocks)


# --- the differentiable product ----------------------------------------------


def _no_gradient(tiles: GroupTiles) -> GroupTiles:
  return jax.tree.map(lambda t: jnp.zeros(t.shape, jax.dtypes.float0), tiles)


def _input_codes(rows, rows_fp8):
  """The forward's row-wise codes and the weight gradient's column-wise ones."""
  if rows_fp8 is None:
    return fp8_blocks.quantize_rows(rows), fp8_blocks.quantize_columns(rows)
  # Rows fed as FP8 (the dispatch's codes): used as they are; the column-wise
  # codes come from them dequantized exactly (code * power of two) and
  # requantized per channel and 128 rows.
  return rows_fp8, fp8_blocks.quantize_columns(fp8_blocks.dequantize_rows(*rows_fp8))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _fp8_matmul(implementation, config, weight_dtype, name, residual, rows, rows_fp8, weights,
                weights_fp8, tiles):
  del weight_dtype, name, residual, weights
  codes, scales = fp8_blocks.quantize_rows(rows) if rows_fp8 is None else rows_fp8
  return _forward(implementation, config, codes, scales, weights_fp8.codes_t,
                  jnp.swapaxes(weights_fp8.scales, 1, 2), tiles.tile_group)


def _fp8_matmul_fwd(implementation, config, weight_dtype, name, residual, rows, rows_fp8,
                    weights, weights_fp8, tiles):
  del weights  # its gradient comes from the residuals alone
  (codes, scales), columns = _input_codes(rows, rows_fp8)
  # Named inside the forward rule, so the residual itself carries the name.
  columns = name(residual, columns)
  out = _forward(implementation, config, codes, scales, weights_fp8.codes_t,
                 jnp.swapaxes(weights_fp8.scales, 1, 2), tiles.tile_group)
  return out, (columns, weights_fp8.codes, weights_fp8.scales, tiles)


def _fp8_matmul_bwd(implementation, config, weight_dtype, name, residual, residuals, out_grad):
  (column_codes, column_scales), weight_codes, weight_scales, tiles = residuals
  out_grad = out_grad.astype(jnp.bfloat16)
  rows_grad = _forward(implementation, config, *fp8_blocks.quantize_rows(out_grad),
                       weight_codes, weight_scales, tiles.tile_group)
  weights_grad = _wgrad(implementation, config, column_codes, column_scales,
                        *fp8_blocks.quantize_columns(out_grad), tiles, jnp.dtype(weight_dtype))
  return (rows_grad, None, weights_grad, None, _no_gradient(tiles))


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _check_product(rows, weights, weights_fp8, tiles, rows_fp8):
  if rows.ndim != 2 or weights.ndim != 3 or rows.shape[1] != weights.shape[1]:
    raise ValueError(f"the FP8 grouped product needs rows [M, K] and weights [G, K, N]; got "
                     f"{rows.shape} and {weights.shape}")
  if jnp.dtype(rows.dtype) != jnp.bfloat16:
    raise ValueError(f"the FP8 expert bank takes bfloat16 rows; got {rows.dtype}")
  num_rows, contraction = rows.shape
  columns = weights.shape[2]
  if contraction % SIZE_MULTIPLE or columns % SIZE_MULTIPLE:
    raise ValueError(f"the FP8 expert bank needs sizes that are multiples of {SIZE_MULTIPLE} "
                     f"(16-byte FP8 rows); got K={contraction}, N={columns}")
  if num_rows % ROW_TILE or tiles.tile_group.shape[0] * ROW_TILE != num_rows:
    raise ValueError(f"rows has {num_rows} rows: the grouped layout needs a multiple of "
                     f"{ROW_TILE} matching tiles.tile_group {tiles.tile_group.shape}")
  expected = FP8Weights(weights.shape, weights.shape[:1] + weights.shape[:0:-1],
                        (weights.shape[0],) + tuple(fp8_blocks.num_blocks(n)
                                                    for n in weights.shape[1:]))
  if tuple(v.shape for v in weights_fp8) != tuple(expected):
    raise ValueError(f"weights_fp8 must be quantize_weights(weights) of {weights.shape}")
  if rows_fp8 is not None:
    codes, scales = rows_fp8
    blocks = fp8_blocks.num_blocks(contraction)
    if (codes.shape != rows.shape or codes.dtype != jnp.float8_e4m3fn
        or scales.shape != (num_rows, blocks) or scales.dtype != jnp.float32):
      raise ValueError(f"rows_fp8 must be (codes [{num_rows}, {contraction}] float8_e4m3fn, "
                       f"scales [{num_rows}, {blocks}] float32); got "
                       f"{codes.dtype} {codes.shape}, {scales.dtype} {scales.shape}")


def fp8_grouped_matmul(rows: jax.Array, weights: jax.Array, weights_fp8: FP8Weights,
                       tiles: GroupTiles, implementation: str = "auto",
                       rows_fp8: tuple[jax.Array, jax.Array] | None = None,
                       name: Namer = _no_name, residual: str = INPUT_CODES,
                       tile_config: hopper_fp8.FP8TileConfig = hopper_fp8.FP8TileConfig()
                       ) -> jax.Array:
  """``out[rows_g] = rows[rows_g] @ weights[g]`` in block-scaled FP8,
  differentiable in ``rows`` and ``weights``.

  Args:
    rows: ``[M, K]`` bfloat16 in the grouped layout (groups on whole tiles).
    weights: ``[G, K, N]`` the master weights (any float dtype): they receive
      the weight gradient, in their dtype; the product reads only
      ``weights_fp8``.
    weights_fp8: :func:`quantize_weights` of ``weights`` (once per step).
    tiles: the :class:`~moe_ep.experts.grouped.GroupTiles` of the layout.
    implementation: ``"auto"``, ``"hopper"`` or ``"xla"``.
    rows_fp8: None, or ``(codes [M, K], scales [M, ceil(K / 128)])``: the
      rows already row-quantized (the FP8 dispatch's), read in their place;
      ``rows`` then only receives the input gradient.
    name, residual: the weight gradient's column-wise codes of ``rows``
      (the residual) are named ``name(residual, ...)``.
    tile_config: the Hopper kernels' tiles and schedule.

  Returns:
    ``[M, N]`` bfloat16, zero on rows of no group (as is the gradient of ``rows``).
  """
  _check_product(rows, weights, weights_fp8, tiles, rows_fp8)
  weights = sharding.vary_like(weights, rows)
  weights_fp8 = jax.tree.map(lambda v: sharding.vary_like(jax.lax.stop_gradient(v), rows),
                             weights_fp8)
  return _fp8_matmul(implementation, tile_config, jnp.dtype(weights.dtype).name, name,
                     residual, rows,
                     rows_fp8, weights, weights_fp8, tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _fp8_mlp(implementation, config, activation, weight_dtypes, name, rows, rows_fp8, w_in,
             w_out, w_in_fp8, w_out_fp8, row_weights, tiles):
  return _fp8_mlp_fwd(implementation, config, activation, weight_dtypes, name, rows, rows_fp8,
                      w_in, w_out, w_in_fp8, w_out_fp8, row_weights, tiles)[0]


def _fp8_mlp_fwd(implementation, config, activation, weight_dtypes, name, rows, rows_fp8, w_in,
                 w_out, w_in_fp8, w_out_fp8, row_weights, tiles):
  del weight_dtypes, w_in, w_out  # their gradients come from the residuals alone
  kernels = _uses_kernels(implementation)
  (codes, scales), input_columns = _input_codes(rows, rows_fp8)
  # Named inside the forward rule, so the residuals themselves carry the names.
  input_columns = name(INPUT_CODES, input_columns)
  hidden = _forward(implementation, config, codes, scales, w_in_fp8.codes_t,
                    jnp.swapaxes(w_in_fp8.scales, 1, 2), tiles.tile_group)
  hidden = name("expert_hidden", hidden)
  (act_codes, act_scales), act_columns = fp8_passes.activate_quantized(
      hidden, activation, row_weights, kernels)
  act_columns = name(HIDDEN_CODES, act_columns)
  out = _forward(implementation, config, act_codes, act_scales, w_out_fp8.codes_t,
                 jnp.swapaxes(w_out_fp8.scales, 1, 2), tiles.tile_group)
  return out, (input_columns, hidden, act_columns, row_weights, w_in_fp8.codes, w_in_fp8.scales,
               w_out_fp8.codes, w_out_fp8.scales, tiles)


def _fp8_mlp_bwd(implementation, config, activation, weight_dtypes, name, residuals, out_grad):
  del name
  (input_columns, hidden, act_columns, row_weights, w_in_codes, w_in_scales, w_out_codes,
   w_out_scales, tiles) = residuals
  kernels = _uses_kernels(implementation)
  out_grad = out_grad.astype(jnp.bfloat16)
  act_grad = _forward(implementation, config, *fp8_blocks.quantize_rows(out_grad), w_out_codes,
                      w_out_scales, tiles.tile_group)
  w_out_grad = _wgrad(implementation, config, *act_columns,
                      *fp8_blocks.quantize_columns(out_grad), tiles, jnp.dtype(weight_dtypes[1]))
  hidden_rows, hidden_columns, row_weights_grad = fp8_passes.activation_grad_quantized(
      hidden, act_grad, activation, row_weights, kernels)
  rows_grad = _forward(implementation, config, *hidden_rows, w_in_codes, w_in_scales,
                       tiles.tile_group)
  w_in_grad = _wgrad(implementation, config, *input_columns, *hidden_columns, tiles,
                     jnp.dtype(weight_dtypes[0]))
  return (rows_grad, None, w_in_grad, w_out_grad, None, None, row_weights_grad,
          _no_gradient(tiles))


_fp8_mlp.defvjp(_fp8_mlp_fwd, _fp8_mlp_bwd)


def fp8_grouped_expert_mlp(rows: jax.Array, counts: jax.Array, w_in: jax.Array,
                           w_out: jax.Array, w_in_fp8: FP8Weights, w_out_fp8: FP8Weights,
                           activation: str, name: Namer = _no_name,
                           implementation: str = "auto",
                           row_weights: jax.Array | None = None,
                           rows_fp8: tuple[jax.Array, jax.Array] | None = None,
                           tile_config: hopper_fp8.FP8TileConfig = hopper_fp8.FP8TileConfig()
                           ) -> jax.Array:
  """Expert ``l``'s MLP on the rows of group ``l``, both GEMMs in FP8 (the
  FP8 sibling of :func:`~moe_ep.experts.grouped.grouped_expert_mlp`).

  One differentiable step: the first GEMM, the activation with both of its
  quantizations in one pass (:mod:`~moe_ep.experts.fp8_passes`), the
  second GEMM; backward, the activation's gradient and both of its
  quantizations likewise in one pass between the GEMMs.

  Args:
    rows: ``[M, H]`` bfloat16 in the grouped layout.
    counts: ``[L]`` int32 rows of each group.
    w_in, w_out: ``[L, H, n*F]``, ``[L, F, H]`` master weights.
    w_in_fp8, w_out_fp8: their :func:`quantize_weights`.
    activation, name: as :func:`moe_ep.experts.expert_mlp`; ``name`` also
      marks the weight gradients' column-wise codes of the rows
      (``"expert_fp8.input"``) and of the activation (``"expert_fp8.hidden"``).
    implementation: as :func:`fp8_grouped_matmul`.
    row_weights: ``[M]`` float32 routing weight of each row, or None
      (:func:`moe_ep.experts.activate`).
    rows_fp8: None, or the rows as the FP8 dispatch's codes and scales
      (:func:`fp8_grouped_matmul`): the first GEMM reads them directly.
    tile_config: the Hopper kernels' tiles and schedule (both GEMMs).

  Returns:
    ``[M, H]`` bfloat16, zero on rows of no group, where the gradient of
    ``rows`` is zero too.
  """
  tiles = group_tiles(counts, rows.shape[0], ROW_TILE)
  _check_product(rows, w_in, w_in_fp8, tiles, rows_fp8)
  if w_out.ndim != 3 or w_in.shape[2] != input_projections(activation) * w_out.shape[1]:
    raise ValueError(f"w_out must be [L, F, H] with w_in [L, H, n*F] (n=2 for gated "
                     f"activations); got w_in {w_in.shape}, w_out {w_out.shape} for "
                     f"activation={activation!r}")
  activations = jax.ShapeDtypeStruct((rows.shape[0], w_out.shape[1]), jnp.bfloat16)
  _check_product(activations, w_out, w_out_fp8, tiles, None)
  w_in, w_out = (sharding.vary_like(w, rows) for w in (w_in, w_out))
  w_in_fp8, w_out_fp8 = (jax.tree.map(lambda v: sharding.vary_like(jax.lax.stop_gradient(v),
                                                                     rows), w)
                         for w in (w_in_fp8, w_out_fp8))
  dtypes = (jnp.dtype(w_in.dtype).name, jnp.dtype(w_out.dtype).name)
  out = _fp8_mlp(implementation, tile_config, activation, dtypes, name, rows, rows_fp8, w_in,
                 w_out, w_in_fp8, w_out_fp8, row_weights, tiles)
  return name("expert_output", out)
