"""Block-scaled FP8 grouped GEMMs on Hopper tensor cores (Pallas Mosaic GPU).

The scaling is DeepSeek-V3's: float8_e4m3fn codes with one float32 scale per
128 consecutive elements of the contraction for each row of an operand
(activations, ``[rows, ceil(K / 128)]`` scales) or per 128x128 block (weights,
``[ceil(N / 128), ceil(K / 128)]`` scales). FP8 wgmma accumulates with fewer
bits than float32, so each 128-deep step's products go into a fresh
accumulator that is then scaled and added to the tile's float32 sum (the
"promotion" of DeepSeek-V3's section 3.3.2): over any K the sum is float32.

wgmma reads 8-bit operands only K-major (the contraction contiguous in
shared memory), so both operands are ``[rows, K]``: the weights of the
forward product come transposed (``[G, N, K]``), those of the input gradient
as they are stored (``[G, K, N]`` is K-major for a contraction over ``N``),
and the weight gradient reads both of its operands quantized along the rows
(``[channels, M]``), the transposed quantization of the rows.

* :func:`grouped_matmul_fp8`: ``out[rows_g] = A[rows_g] @ B[g].T``, the
  forward and the input gradient; rows of tiles of no group are zeros.
* :func:`grouped_matmul_fp8_wgrad`: ``out[g] = A[:, rows_g] @ B[:, rows_g].T``
  over each group's 128-row blocks, the weight gradient; zero for an empty
  group.

Both are persistent, warp-specialized kernels like
:mod:`moe_ep.experts.hopper`'s (one memory warpgroup streaming 128-deep
blocks by TMA, two compute warpgroups of ``[128, tile_n]`` tiles), on groups
of whole 128-row tiles (``MoEConfig.group_align == ROW_TILE``). Scales
travel with the blocks: each stage also holds the step's ``[128]`` row scales
and the weights' scales for the CTA's columns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_ep.experts import hopper
from moe_ep.row_groups import ROW_TILE

BLOCK = 128  # elements of the contraction per scale (and per pipeline step)
CODE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
# A shared-memory row of codes must fill at least a 32-byte swizzle (wgmma
# has no unswizzled mode): minor sizes are padded to it, a copy of at most
# 31 columns.
_CODE_MULTIPLE = 32
# The column scales of a CTA (two warpgroups) padded to 128 bytes: each stage
# of them is a TMA destination, which must start at a multiple of 128 bytes
# (16-byte stages ran into CUDA_ERROR_MISALIGNED_ADDRESS).
_CTA_SCALES = 32
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
_COLUMN_LAYOUT = plgpu.Layout.WGMMA.reduce(0)  # one value per column


@dataclasses.dataclass(frozen=True)
class FP8TileConfig:
  """Tiles and schedule of the FP8 kernels.

  Each compute warpgroup holds two float32 accumulators of its tile (the sum
  and the step's fresh products), so its tile is half the bf16 kernels'
  register budget: ``[128, 128]`` (each accumulator 128 registers a thread)
  or, with ``split_rows``, ``[64, 128]``.

  Attributes:
    split_rows: the two compute warpgroups take the CTA's rows in halves
      (a ``[128, 128]`` CTA tile, one block of the weights' scales) rather
      than its columns (a ``[128, 256]`` CTA tile, two).
    max_concurrent_steps: shared-memory pipeline stages of 128-deep blocks.
    grid_tile_width, grid_minor_dim: the snake order over output tiles.
    epi_tile: side of the square pieces the epilogue stores.
    chain_tiles: the forward's tiles run as one chain of pipelines (the
      memory warpgroup loads a tile's first blocks while the compute
      warpgroups finish the tile before), where the contraction's blocks are
      whole rounds of the stages (:func:`moe_ep.experts.hopper.chain`).
    overlap_promotion: each step promotes the previous step's products
      while the tensor cores compute its own (a third ``[64, 128]`` float32
      array a thread's registers hold: with ``split_rows`` only), rather
      than after them.
    chain_wgrad: the weight gradient's tiles share one ring of stages
      (:func:`grouped_matmul_fp8_wgrad`), rather than each its own pipeline
      that starts with a full load latency and ends drained (its groups'
      blocks, hence its tiles' steps, are known only on the device). Its
      promotion follows each step's wgmma (not ``overlap_promotion``).
  """

  split_rows: bool = True
  max_concurrent_steps: int = 4
  grid_tile_width: int = 8
  grid_minor_dim: int = 0
  epi_tile: int = 64
  chain_tiles: bool = False
  overlap_promotion: bool = False
  chain_wgrad: bool = False

  def __post_init__(self):
    if self.overlap_promotion and not self.split_rows:
      raise ValueError("FP8TileConfig.overlap_promotion needs split_rows=True: a [128, 128] "
                       "warpgroup tile has no registers for a third accumulator")

  @property
  def wg_rows(self) -> int:
    return ROW_TILE // 2 if self.split_rows else ROW_TILE

  @property
  def cta_columns(self) -> int:
    return BLOCK if self.split_rows else 2 * BLOCK

  def wg_slices(self, wg_idx):
    """This warpgroup's rows and columns of the CTA's ``[128, cta_columns]`` tile."""
    if self.split_rows:
      return pl.ds(wg_idx * self.wg_rows, self.wg_rows), pl.ds(0, BLOCK)
    return pl.ds(0, ROW_TILE), pl.ds(wg_idx * BLOCK, BLOCK)

  def snake(self) -> hopper.TileConfig:
    """The bf16 kernels' config of the same snake order and stages (no clusters)."""
    return hopper.TileConfig(tile_n=self.cta_columns // 2, tile_k=BLOCK,
                             max_concurrent_steps=self.max_concurrent_steps,
                             grid_tile_width=self.grid_tile_width,
                             grid_minor_dim=self.grid_minor_dim, epi_tile=self.epi_tile,
                             cluster_columns=1, chain_tiles=self.chain_tiles)


# The promotion's carry through a tile's steps: ``(sum,)``, or with
# ``overlap_promotion`` ``(sum, pending products, their scale factors)``.
# A step's scale is the product of its factors, each a vector broadcast along
# a dimension of the tile (``dims``: the rows' scales along 0, columns' along 1).


def _promote(acc, part, factors, dims):
  """``acc + part * factor_0 * factor_1 ...``, each factor broadcast along its dim."""
  for factor, dim in zip(factors, dims):
    part = part * lax.broadcast_in_dim(factor, part.shape, (dim,))
  return acc + part


def _start_promotion(shape, dims, overlap: bool):
  acc = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
  if not overlap:
    return (acc,)
  layouts = (_ROW_LAYOUT, _COLUMN_LAYOUT)
  factors = tuple(plgpu.layout_cast(jnp.zeros((shape[dim],), jnp.float32), layouts[dim])
                  for dim in dims)
  return acc, acc, factors


def _scaled_step(carry, a_smem, b_smem, factors, dims, overlap: bool):
  """One 128-deep step: its wgmma into a fresh float32 accumulator, promoted
  into the tile's sum with the step's scale factors, now or (``overlap``) in
  the next step, while that step's wgmma runs."""
  def product(part_ref):
    plgpu.wgmma(part_ref, a_smem, hopper.transposed(b_smem))
    if not overlap:
      return part_ref[...]
    acc, pending, pending_factors = carry
    promoted = _promote(acc, pending, pending_factors, dims)  # beside the wgmma in flight
    return promoted, part_ref[...]

  shape = carry[0].shape
  if not overlap:
    part = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
    return (_promote(carry[0], part, factors, dims),)
  acc, part = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
  return acc, part, tuple(factors)


def _finish_promotion(carry, dims):
  if len(carry) == 1:
    return carry[0]
  acc, pending, pending_factors = carry
  return _promote(acc, pending, pending_factors, dims)


def _column_block_scales(b_scales: jax.Array, n_iters: int, per_cta: int) -> jax.Array:
  """``[G, Nb, Kb]`` -> ``[G, n_iters, Kb, 32]``: for each CTA column tile the
  ``per_cta`` block scales of its columns at each step, side by side (zeros
  past Nb and after them)."""
  groups, _, k_blocks = b_scales.shape
  scales = hopper.pad_minor(b_scales, 1, per_cta * n_iters)[:, :per_cta * n_iters]
  scales = scales.reshape(groups, n_iters, per_cta, k_blocks).transpose(0, 1, 3, 2)
  return hopper.pad_minor(scales, 3, _CTA_SCALES)


def grouped_matmul_fp8(a_codes: jax.Array, a_scales: jax.Array, b_codes: jax.Array,
                       b_scales: jax.Array, tile_group: jax.Array, *,
                       config: FP8TileConfig = FP8TileConfig(), num_sms: int | None = None,
                       out_dtype=jnp.bfloat16) -> jax.Array:
  """``out[rows of tile t] = (a * a_scales) @ (b[g] * b_scales[g]).T``, ``g = tile_group[t]``.

  Args:
    a_codes: ``[M, K]`` float8_e4m3fn, ``M % ROW_TILE == 0``.
    a_scales: ``[M, ceil(K / 128)]`` float32, each row's scale per 128 of K.
    b_codes: ``[G, N, K]`` float8_e4m3fn (K-major: the forward's weights transposed).
    b_scales: ``[G, ceil(N / 128), ceil(K / 128)]`` float32, per 128x128 block.
    tile_group: ``[M // ROW_TILE]`` int32 group of each row tile, -1 for none.
    config: tiles and schedule.
    num_sms: persistent CTAs (default: the device's multiprocessor count).
    out_dtype: of the output, rounded once from the float32 sums.

  Returns:
    ``[M, N]`` in ``out_dtype``, zero on rows of tiles of no group.
  """
  n = b_codes.shape[1]
  a_codes = hopper.pad_minor(a_codes, 1, _CODE_MULTIPLE)
  b_codes = hopper.pad_minor(hopper.pad_minor(b_codes, 2, _CODE_MULTIPLE), 1, 16)
  m, k = a_codes.shape
  padded_n = b_codes.shape[1]
  epi, wg_rows, cta_columns = config.epi_tile, config.wg_rows, config.cta_columns
  overlap = config.overlap_promotion
  m_iters, n_iters, k_iters = tile_group.shape[0], pl.cdiv(padded_n, cta_columns), pl.cdiv(k, BLOCK)
  if a_scales.shape != (m, k_iters) or b_scales.shape[2] != k_iters:
    raise ValueError(f"grouped_matmul_fp8: scales {a_scales.shape}, {b_scales.shape} do not "
                     f"match codes {a_codes.shape}, {b_codes.shape} in blocks of {BLOCK}")
  row_scales = a_scales.astype(jnp.float32).T  # [Kb, M]: a step's rows contiguous
  column_scales = _column_block_scales(b_scales.astype(jnp.float32), n_iters,
                                       cta_columns // BLOCK)
  transforms = hopper.smem_transforms(CODE_DTYPE, BLOCK, k)
  out_transforms = hopper.smem_transforms(out_dtype, epi, padded_n)
  snake = config.snake()

  def pipeline(body, compute_context, state=None):
    codes = lambda shape: plgpu.BlockSpec(shape, lambda ki: (0, ki), transforms=transforms,
                                          memory_space=plgpu.SMEM)
    scales = lambda shape: plgpu.BlockSpec(shape, lambda ki: (ki, 0), memory_space=plgpu.SMEM)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=hopper.MEMORY_REGISTERS,
        in_specs=[codes((ROW_TILE, BLOCK)), codes((cta_columns, BLOCK)),
                  scales((1, ROW_TILE)), scales((1, _CTA_SCALES))],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context, pipeline_state=state)

  def body(tile_group_gmem, a_gmem, b_gmem, row_scales_gmem, column_scales_gmem, out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(
            a_gmem, b_gmem.at[0], row_scales_gmem, column_scales_gmem.at[0, 0]),
        out_smem=plgpu.SMEM((2, 2, epi, epi), out_dtype, transforms=out_transforms),
        collective_axes="wg")
    def scope(allocs, out_smem):
      wg_idx = lax.axis_index("wg")
      wg_row_slice, wg_column_slice = config.wg_slices(wg_idx)

      def tile_body(tile, height, state):
        group = tile.group
        out_view = (tile.row_view(out_gmem, ROW_TILE).at[:, tile.columns]
                    .at[wg_row_slice, wg_column_slice])

        @pl.when((group < 0) & (wg_idx < 2))
        def _():
          hopper.store_tile(jnp.zeros((wg_rows, BLOCK), jnp.float32), out_smem, out_view,
                            wg_idx, epi)

        @pl.when(group >= 0)
        def _():
          def compute_context(eval_pipeline):
            carry = eval_pipeline(_start_promotion((wg_rows, BLOCK), (0,), overlap))
            hopper.store_tile(_finish_promotion(carry, (0,)), out_smem, out_view, wg_idx, epi)

          def mma(_, a_smem, b_smem, row_scale_smem, column_scale_smem, carry):
            column_scale = (column_scale_smem[0, 0] if config.split_rows else
                            jnp.where(wg_idx == 0, column_scale_smem[0, 0],
                                      column_scale_smem[0, 1]))
            scale = hopper.load(row_scale_smem.at[0, wg_row_slice], _ROW_LAYOUT) * column_scale
            return _scaled_step(carry, a_smem.at[wg_row_slice, :], b_smem.at[wg_column_slice, :],
                                (scale,), (0,), overlap)

          pipeline(mma, compute_context, state)(
              a_gmem.at[tile.rows, :], b_gmem.at[group].at[tile.columns, :],
              row_scales_gmem.at[:, tile.rows], column_scales_gmem.at[group, tile.column_tile],
              allocations=allocs)

      hopper.for_each_tile(tile_body, tile_group_gmem, wg_idx, m_iters=m_iters, n_iters=n_iters,
                           wg_columns=cta_columns // 2, config=snake, tables=(),
                           tile_rows=None, chain=hopper.chain(allocs, snake, k_iters))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = hopper.kernel_call(body, jax.ShapeDtypeStruct((m, padded_n), out_dtype),
                            num_sms or hopper.num_sms_here(), name="grouped_matmul_fp8")
  return call(tile_group, a_codes, b_codes, row_scales, column_scales)[:, :n]


def grouped_matmul_fp8_wgrad(a_codes: jax.Array, a_scales: jax.Array, b_codes: jax.Array,
                             b_scales: jax.Array, group_start: jax.Array,
                             group_blocks: jax.Array, num_groups: int, *,
                             config: FP8TileConfig = FP8TileConfig(),
                             num_sms: int | None = None, out_dtype=jnp.bfloat16) -> jax.Array:
  """``out[g] = (a * a_scales)[:, rows_g] @ ((b * b_scales)[:, rows_g]).T``.

  Args:
    a_codes: ``[P, M]`` float8_e4m3fn (the layer's input rows quantized along
      the rows, transposed), ``M % ROW_TILE == 0``.
    a_scales: ``[P, M // 128]`` float32, per channel and 128-row block.
    b_codes: ``[Q, M]`` float8_e4m3fn (the output gradient likewise).
    b_scales: ``[Q, M // 128]`` float32.
    group_start: ``[G]`` int32 first row of each group, a multiple of 128.
    group_blocks: ``[G]`` int32 128-row blocks of each group (0: empty).
    num_groups: ``G``.

  Returns:
    ``[G, P, Q]`` in ``out_dtype``, zero for an empty group.
  """
  p, q = a_codes.shape[0], b_codes.shape[0]
  a_codes, b_codes = hopper.pad_minor(a_codes, 0, 16), hopper.pad_minor(b_codes, 0, 16)
  padded_p, padded_q = a_codes.shape[0], b_codes.shape[0]
  epi, wg_rows, cta_columns = config.epi_tile, config.wg_rows, config.cta_columns
  overlap = config.overlap_promotion
  p_iters, q_iters = pl.cdiv(padded_p, ROW_TILE), pl.cdiv(padded_q, cta_columns)
  # [Mb, channels]: a step's scales of a tile's channels contiguous.
  row_scales = hopper.pad_minor(a_scales.astype(jnp.float32), 0, 16).T
  column_scales = hopper.pad_minor(b_scales.astype(jnp.float32), 0, 16).T
  transforms = hopper.smem_transforms(CODE_DTYPE, BLOCK, a_codes.shape[1])
  out_transforms = hopper.smem_transforms(out_dtype, epi, padded_q)
  snake = config.snake()
  out_shape = jax.ShapeDtypeStruct((num_groups, padded_p, padded_q), out_dtype)
  operands = (group_start, group_blocks, a_codes, b_codes, row_scales, column_scales)
  if config.chain_wgrad:
    call = _chained_wgrad(config, (p_iters, q_iters), num_groups, transforms, out_transforms,
                          out_shape, num_sms or hopper.num_sms_here())
    return call(*operands)[:, :p, :q]

  def pipeline(body, compute_context, steps, first_block):
    codes = lambda shape: plgpu.BlockSpec(shape, lambda ci: (0, first_block + ci),
                                          transforms=transforms, memory_space=plgpu.SMEM)
    scales = lambda shape: plgpu.BlockSpec(shape, lambda ci: (first_block + ci, 0),
                                           memory_space=plgpu.SMEM)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=hopper.MEMORY_REGISTERS,
        in_specs=[codes((ROW_TILE, BLOCK)), codes((cta_columns, BLOCK)),
                  scales((1, ROW_TILE)), scales((1, cta_columns))],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context)

  def body(group_start_gmem, group_blocks_gmem, a_gmem, b_gmem, row_scales_gmem,
           column_scales_gmem, out_gmem):
    ignore = lambda *_, **__: None
    dynamic_one = jnp.int32(1)  # a traced step count, as in the loop

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore, dynamic_one, dynamic_one).get_allocations(
            a_gmem, b_gmem, row_scales_gmem, column_scales_gmem),
        out_smem=plgpu.SMEM((2, 2, epi, epi), out_dtype, transforms=out_transforms),
        collective_axes="wg")
    def scope(allocs, out_smem):
      wg_idx = lax.axis_index("wg")
      wg_row_slice, wg_column_slice = config.wg_slices(wg_idx)

      @plgpu.nd_loop((num_groups, p_iters * q_iters), collective_axes="sm")
      def _(loop_info):
        group, index = loop_info.index
        p_idx, q_idx = hopper.snake_tile(index, p_iters, q_iters, snake)
        steps = group_blocks_gmem[group]
        first_block = group_start_gmem[group] // BLOCK
        p_slice = pl.ds(p_idx * ROW_TILE, ROW_TILE)
        q_slice = pl.ds(q_idx * cta_columns, cta_columns)
        out_view = out_gmem.at[group].at[p_slice, q_slice].at[wg_row_slice, wg_column_slice]

        def compute_context(eval_pipeline):
          carry = eval_pipeline(_start_promotion((wg_rows, BLOCK), (0, 1), overlap))
          hopper.store_tile(_finish_promotion(carry, (0, 1)), out_smem, out_view, wg_idx, epi)

        def mma(_, a_smem, b_smem, row_scale_smem, column_scale_smem, carry):
          rows = hopper.load(row_scale_smem.at[0, wg_row_slice], _ROW_LAYOUT)
          columns = hopper.load(column_scale_smem.at[0, wg_column_slice], _COLUMN_LAYOUT)
          return _scaled_step(carry, a_smem.at[wg_row_slice, :], b_smem.at[wg_column_slice, :],
                              (rows, columns), (0, 1), overlap)

        pipeline(mma, compute_context, steps, first_block)(
            a_gmem.at[p_slice, :], b_gmem.at[q_slice, :], row_scales_gmem.at[:, p_slice],
            column_scales_gmem.at[:, q_slice], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = hopper.kernel_call(body, out_shape, num_sms or hopper.num_sms_here(),
                            name="grouped_matmul_fp8_wgrad")
  return call(*operands)[:, :p, :q]



def _chained_wgrad(config: FP8TileConfig, iters: tuple[int, int], num_groups: int, transforms,
                   out_transforms, out_shape, num_sms: int):
  """The weight gradient's kernel with every tile of a CTA on one ring of
  ``max_concurrent_steps`` stages, written on barriers and TMA (as
  :mod:`moe_ep.experts.hopper_wgrad`'s chained kernel): the memory
  warpgroup counts blocks across tiles, so it loads the next tile's first
  blocks while the compute warpgroups finish this tile and store it. Each
  stage holds a 128-row block of both operands' codes and their scales; a
  compute warpgroup reads the scales, runs the step's wgmma, releases the
  stage and then promotes. The same sums in the same order as the tile by
  tile kernel: the same bits."""
  p_iters, q_iters = iters
  stages, epi = config.max_concurrent_steps, config.epi_tile
  wg_rows, cta_columns = config.wg_rows, config.cta_columns
  snake, tiles = config.snake(), (num_groups, p_iters * q_iters)

  def body(group_start_gmem, group_blocks_gmem, a_gmem, b_gmem, row_scales_gmem,
           column_scales_gmem, out_gmem):
    def scoped(a_smem, b_smem, row_scale_smem, column_scale_smem, out_smem, loaded, consumed):
      wg_idx = lax.axis_index("wg")
      wg_row_slice, wg_column_slice = config.wg_slices(wg_idx)

      def tile_of(loop_info):
        """The tile's group, its blocks, the first of them, and its output
        tile's rows (of P) and columns (of Q)."""
        group, index = loop_info.index
        p_idx, q_idx = hopper.snake_tile(index, p_iters, q_iters, snake)
        return (group, group_blocks_gmem[group], group_start_gmem[group] // BLOCK,
                pl.ds(p_idx * ROW_TILE, ROW_TILE), pl.ds(q_idx * cta_columns, cta_columns))

      @pl.when(wg_idx == 2)
      def _memory():
        plgpu.set_max_registers(hopper.MEMORY_REGISTERS, action="decrease")

        def load_block(first_block, p_slice, q_slice, step, slot):
          index = first_block + step
          columns = pl.ds(pl.multiple_of(index * BLOCK, BLOCK), BLOCK)
          plgpu.copy_gmem_to_smem(a_gmem.at[p_slice, columns], a_smem.at[slot],
                                  loaded.at[slot])
          plgpu.copy_gmem_to_smem(b_gmem.at[q_slice, columns], b_smem.at[slot],
                                  loaded.at[slot])
          plgpu.copy_gmem_to_smem(row_scales_gmem.at[pl.ds(index, 1), p_slice],
                                  row_scale_smem.at[slot], loaded.at[slot])
          plgpu.copy_gmem_to_smem(column_scales_gmem.at[pl.ds(index, 1), q_slice],
                                  column_scale_smem.at[slot], loaded.at[slot])

        hopper.ring_loads(tiles, tile_of, load_block, stages, consumed)

      @pl.when(wg_idx < 2)
      def _compute():
        plgpu.set_max_registers(hopper.COMPUTE_REGISTERS, action="increase")

        @plgpu.nd_loop(tiles, collective_axes="sm", init_carry=jnp.int32(0))
        def _(loop_info, carry):  # the blocks this CTA has read
          group, steps, _, p_slice, q_slice = tile_of(loop_info)

          def step(index, acc):
            slot = lax.rem(carry + index, stages)
            plgpu.barrier_wait(loaded.at[slot])
            rows = hopper.load(row_scale_smem.at[slot].at[0, wg_row_slice], _ROW_LAYOUT)
            columns = hopper.load(column_scale_smem.at[slot].at[0, wg_column_slice],
                                  _COLUMN_LAYOUT)

            def product(part_ref):
              plgpu.wgmma(part_ref, a_smem.at[slot].at[wg_row_slice, :],
                          hopper.transposed(b_smem.at[slot].at[wg_column_slice, :]))
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(consumed.at[slot])
              return part_ref[...]

            part = pl.run_scoped(product, plgpu.ACC((wg_rows, BLOCK), jnp.float32))
            return _promote(acc, part, (rows, columns), (0, 1))

          acc = lax.fori_loop(0, steps, step, _start_promotion((wg_rows, BLOCK), (0, 1),
                                                               False)[0])
          out_view = out_gmem.at[group].at[p_slice, q_slice].at[wg_row_slice, wg_column_slice]
          hopper.store_tile(acc, out_smem, out_view, wg_idx, epi)
          return carry + steps

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, ROW_TILE, BLOCK), CODE_DTYPE, transforms=transforms),
        plgpu.SMEM((stages, cta_columns, BLOCK), CODE_DTYPE, transforms=transforms),
        plgpu.SMEM((stages, 1, ROW_TILE), jnp.float32),
        plgpu.SMEM((stages, 1, cta_columns), jnp.float32),
        plgpu.SMEM((2, 2, epi, epi), out_shape.dtype, transforms=out_transforms),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # a stage's four copies landed
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups read it
        collective_axes="wg")
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return hopper.kernel_call(body, out_shape, num_sms, name="grouped_matmul_fp8_wgrad")
