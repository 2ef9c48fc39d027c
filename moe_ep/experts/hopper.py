"""Grouped GEMMs on Hopper tensor cores (Pallas Mosaic GPU: TMA + wgmma).

Rows come in groups: group ``g`` owns rows ``[start_g, start_g + size_g)``
with ``start_g`` a multiple of ``ROW_TILE`` and its padding rows (up to the
next multiple) zero, so every tile of rows belongs to one group or to none;
or, with a tile list, ``start_g`` a multiple of half a tile and each group's
rows whole tiles and at most one half tile, whose product runs on half the
rows (:class:`moe_ep.experts.grouped.GroupTiles`). Two kernels cover the
three products of a linear layer's forward and backward:

* :func:`grouped_matmul`: ``out[rows_g] = lhs[rows_g] @ rhs[g]`` (or
  ``@ rhs[g].T``), the forward and the input gradient; ``tile_group [M /
  ROW_TILE]`` names each tile's group, -1 for a tile of no group, whose
  output rows are stored as zeros.
* :func:`moe_ep.experts.hopper_wgrad.grouped_matmul_wgrad`: ``out[g] =
  lhs[rows_g].T @ rhs[rows_g]``, the weight gradient, contracting over the
  group's rows only (zero for an empty group).

Both are persistent, warp-specialized kernels after JAX's Hopper matmul
(``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``): one memory
warpgroup streams ``[128, tile_k]`` and ``[tile_k, 2 * tile_n]`` blocks by TMA
through ``max_concurrent_steps`` shared-memory stages, two compute warpgroups
each accumulate a ``[128, tile_n]`` float32 tile with wgmma, and the
epilogue stores ``[64, 64]`` pieces by TMA. They run inside XLA's program as
custom calls, on its stream, and need 16-bit inputs (bfloat16, float16) and
sizes that are multiples of ``SIZE_MULTIPLE`` (:func:`supports`); tiles past
a size are TMA's to fill with zeros and clip (a half tile's block of
``ROW_TILE`` rows too, where it ends the buffer).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_ep.capacity import round_up
from moe_ep.row_groups import ROW_TILE  # a group's rows start at a multiple of it

DTYPES = ("bfloat16", "float16")
# Sizes (contraction and columns) the kernels take: a 16-byte row, what a TMA
# descriptor's strides need. Edge tiles past a size are read as zeros and
# clipped on store by TMA itself.
SIZE_MULTIPLE = 8
# wgmma reads shared memory swizzled by 32, 64 or 128 bytes, and the swizzle
# tiles the global arrays too: sizes of 16-bit elements must be multiples of
# 16 (a 32-byte swizzle; 64: the full 128-byte one). Sizes of only 8 | size are
# padded to it, a copy of at most 8 columns.
_SWIZZLED_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tile sizes and scheduling of one kernel.

  Attributes:
    tile_n: output columns per compute warpgroup (the CTA's are ``2 * tile_n``).
    tile_k: contraction depth of one pipeline stage.
    max_concurrent_steps: shared-memory pipeline stages.
    grid_tile_width: width of the snake order over output tiles (L2 reuse).
    grid_minor_dim: 0: the snake walks along rows; 1: along columns.
    epi_tile: side of the square pieces the epilogue stores.
    delay_release: wgmma groups a compute warpgroup keeps in flight before it
      releases their stage (0: each product completes before the next).
    cluster_columns: CTAs of a cluster, computing neighbouring column tiles of
      one row tile, which load its rows once for all by TMA multicast (1, the
      default: no clusters; a kernel whose column tiles it does not divide
      runs without). 2 shares each row block between two CTAs, a sixth less
      traffic from L2 at ``[128, 256]`` CTA tiles.
    chain_tiles: the memory warpgroup loads a tile's first blocks while the
      compute warpgroups finish the tile before and store it, where
      :func:`chain` allows (the weight gradient: on one ring of stages,
      :func:`moe_ep.experts.hopper_wgrad.chains`). On by default: 1-3% faster
      on the Qwen3 bank's GEMMs and 3-5% on its weight gradient, the same
      bits (docs/grouped.md).
  """

  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  grid_tile_width: int = 8
  grid_minor_dim: int = 0
  epi_tile: int = 64
  delay_release: int = 0
  cluster_columns: int = 1
  chain_tiles: bool = True

  def __post_init__(self):
    if isinstance(self.cluster_columns, bool) or not (isinstance(self.cluster_columns, int)
                                                      and self.cluster_columns >= 1):
      raise ValueError(f"TileConfig.cluster_columns={self.cluster_columns!r} must be an int >= 1")
    if not isinstance(self.chain_tiles, bool):
      raise ValueError(f"TileConfig.chain_tiles={self.chain_tiles!r} must be a bool")

  def cluster(self, column_tiles: int) -> int:
    """CTAs per cluster of a kernel of ``column_tiles`` column tiles."""
    columns = self.cluster_columns
    return columns if column_tiles % columns == 0 else 1


def supports(dtype, *, rows: int, contraction: int, columns: int) -> bool:
  """Whether the kernels take these operands: 16-bit floats, ``rows`` a
  multiple of ``ROW_TILE``, ``contraction`` and ``columns`` of
  ``SIZE_MULTIPLE`` (any multiple: tiles past the edge are TMA's to fill and
  clip)."""
  return (jnp.dtype(dtype).name in DTYPES and rows % ROW_TILE == 0
          and contraction % SIZE_MULTIPLE == 0 and columns % SIZE_MULTIPLE == 0
          and contraction > 0 and columns > 0)


def smem_transforms(dtype, *minor_sizes: int):
  """Tiling and swizzle of shared-memory blocks whose minor dimension, in the
  blocks and in the global arrays they are copied from or to, has each of
  ``minor_sizes`` elements: the widest swizzle that tiles them all."""
  swizzle = plgpu.find_swizzle(math.gcd(*minor_sizes) * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def pad_minor(x: jax.Array, axis: int, multiple: int = _SWIZZLED_MULTIPLE) -> jax.Array:
  """``x`` with zeros appended on ``axis`` up to a multiple of ``multiple``
  (default ``_SWIZZLED_MULTIPLE``)."""
  extra = round_up(x.shape[axis], multiple) - x.shape[axis]
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def transposed(ref):
  """``ref`` viewed transposed, for a wgmma operand read the other way round."""
  with warnings.catch_warnings():  # renamed in newer JAX; the same view in both
    warnings.simplefilter("ignore", DeprecationWarning)
    return plgpu.transpose_ref(ref, (1, 0))


def load(ref, layout):
  """``ref`` (shared memory) read into registers in ``layout``."""
  try:  # newer JAX takes the reference indexed already (a separate index is deprecated)
    return plgpu.load(ref, layout=layout)
  except TypeError:  # older JAX needs the index argument
    return plgpu.load(ref, (), layout=layout)


def num_sms_here() -> int:
  return jax.devices()[0].core_count


def store_piece(value, out_smem, wg_idx, slot: int, out_ref):
  """Stores one ``[epi_tile, epi_tile]`` piece through shared-memory ``slot``
  of warpgroup ``wg_idx`` by TMA, once the slot's previous store has read it."""
  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  out_smem[wg_idx, slot] = value.astype(out_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot], out_ref)


def store_tile(acc, out_smem, out_ref, wg_idx, epi_tile: int):
  """Stores one warpgroup's ``[128, tile_n]`` float32 accumulator into
  ``out_ref`` (a ``[128, tile_n]`` view of the output) by TMA, in
  ``[epi_tile, epi_tile]`` pieces through two shared-memory slots."""
  acc = acc.astype(out_smem.dtype)
  rows, cols = acc.shape
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for i in range(rows // epi_tile):
    for j in range(cols // epi_tile):
      piece = (slice(i * epi_tile, (i + 1) * epi_tile), slice(j * epi_tile, (j + 1) * epi_tile))
      store_piece(acc[piece], out_smem, wg_idx, (i * (cols // epi_tile) + j) % 2,
                  out_ref.at[piece])


@dataclasses.dataclass(frozen=True)
class OutputTile:
  """Where one step of a persistent kernel's loop over output tiles writes:
  its row tile's group (-1: none) and rows (``ROW_TILE`` of them from its
  start; ``height`` of them are the tile's), the CTA's columns, this compute
  warpgroup's share of them, and the column tile's index."""

  group: jax.Array
  rows: object  # pl.ds of ROW_TILE rows
  height: object  # ROW_TILE, or with a tile list int32 ROW_TILE, half of it or 0
  columns: object  # pl.ds of 2 * wg_columns columns
  wg_columns: object  # pl.ds within ``columns``
  column_tile: jax.Array

  def row_view(self, ref, height: int):
    """``ref``'s first ``height`` rows of this tile."""
    return ref.at[pl.ds(self.rows.start, height)]


def snake_tile(index, row_iters: int, n_iters: int, config: TileConfig):
  """``(row tile, column tile)`` of step ``index`` of a loop over
  ``row_iters * n_iters`` tiles in the snake order of ``config``: a cluster
  of ``config.cluster(n_iters)`` CTAs takes one step, each CTA one of its
  neighbouring column tiles."""
  cluster = config.cluster(n_iters)
  row_idx, n_idx = plgpu.planar_snake(index, (row_iters, n_iters // cluster),
                                      config.grid_minor_dim, config.grid_tile_width)
  if cluster > 1:
    n_idx = n_idx * cluster + lax.axis_index("cluster")
  return row_idx, n_idx


def output_tile(loop_info, tile_group_gmem, wg_idx, *, m_iters: int, n_iters: int,
                wg_columns: int, config: TileConfig, tables=()) -> OutputTile:
  """The :class:`OutputTile` of step ``loop_info`` of an ``nd_loop`` over
  ``m_iters * n_iters`` tiles (``n_iters`` column tiles of clusters of
  ``config.cluster(n_iters)`` CTAs, each of which takes one), visited in the
  snake order of ``config``; row tile ``i`` is rows ``i * ROW_TILE`` on, or
  with a tile list (``tables``: the ``tile_start`` and ``tile_rows`` of
  :class:`moe_ep.experts.grouped.GroupTiles`) the list's entry ``i``."""
  (index,) = loop_info.index
  m_idx, n_idx = snake_tile(index, m_iters, n_iters, config)
  if tables:  # TMA needs the rows' alignment proven: half tiles start at multiples of 64
    start = pl.multiple_of(tables[0][m_idx], ROW_TILE // 2)
    height = tables[1][m_idx]
  else:
    start, height = m_idx * ROW_TILE, ROW_TILE
  return OutputTile(tile_group_gmem[m_idx], pl.ds(start, ROW_TILE), height,
                    pl.ds(n_idx * (2 * wg_columns), 2 * wg_columns),
                    pl.ds(wg_idx * wg_columns, wg_columns), n_idx)


def tile_heights(tile_rows) -> tuple[int, ...]:
  """The row tile heights a kernel over ``tile_rows`` (None: whole tiles)
  traces a body for."""
  return (ROW_TILE,) if tile_rows is None else (ROW_TILE, ROW_TILE // 2)


def of_height(tile: OutputTile, height: int):
  """Whether ``tile`` has ``height`` rows (a traced bool, or True)."""
  return True if isinstance(tile.height, int) else tile.height == height


def chain(allocs: dict, config: TileConfig, k_iters: int) -> tuple[dict, int] | None:
  """The ``chain`` of :func:`for_each_tile` for a kernel of ``k_iters``
  pipeline steps per tile whose pipelines' allocations are ``allocs``: they
  and the stages, or None where the tiles' pipelines do not run as one chain
  (``config``'s choice, and JAX's pipeline of pipelines needs whole rounds of
  the stages and no delayed release)."""
  stages = min(config.max_concurrent_steps, k_iters)
  if config.chain_tiles and config.delay_release == 0 and k_iters % stages == 0:
    return allocs, stages
  return None


def for_each_tile(tile_body, tile_group_gmem, wg_idx, *, m_iters: int, n_iters: int,
                  wg_columns: int, config: TileConfig, tables, tile_rows,
                  chain: tuple[dict, int] | None = None) -> None:
  """The persistent loop over ``m_iters * n_iters`` output tiles
  (:func:`output_tile`): ``tile_body(tile, height, pipeline_state)`` for each
  of :func:`tile_heights`, the body's pipeline guarded by ``tile.group >= 0``
  and :func:`of_height`.

  ``pipeline_state`` is None: each tile's pipeline fills the stages and
  drains them. With a ``chain`` (:func:`chain`) it is JAX's
  ``PipelinePipeline`` state, traced: START for a CTA's first pipeline,
  STEADY after it (the loop carries whether one has run), so that the memory
  warpgroup loads a tile's first blocks while the compute warpgroups finish
  the tile before and store it. After the loop the memory warpgroup waits
  for the last pipeline's stages, as STOP would: which pipeline is a CTA's
  last is known only then."""
  start, steady = (int(state) for state in (plgpu.PipelinePipeline.START,
                                           plgpu.PipelinePipeline.STEADY))

  @plgpu.nd_loop((m_iters * n_iters // config.cluster(n_iters),), collective_axes="sm",
                 init_carry=jnp.int32(0))
  def started(loop_info, carry):
    tile = output_tile(loop_info, tile_group_gmem, wg_idx, m_iters=m_iters, n_iters=n_iters,
                       wg_columns=wg_columns, config=config, tables=tables)
    for height in tile_heights(tile_rows):
      tile_body(tile, height, None if chain is None else jnp.where(carry > 0, steady, start))
      carry = carry | ((tile.group >= 0) & of_height(tile, height)).astype(jnp.int32)
    return carry

  if chain is not None:
    allocs, stages = chain

    @pl.when((started > 0) & (wg_idx == 2))  # the memory warpgroup
    def _():
      for barrier in allocs["flat_consumed_barrier_refs"]:
        for slot in range(stages):
          plgpu.barrier_wait(barrier.at[slot])


# Registers per thread of a warp-specialized kernel's memory warpgroup (as
# JAX's pipelines set them); its compute warpgroups share the rest of the
# 64K-register file.
MEMORY_REGISTERS, COMPUTE_REGISTERS = 40, 232


def ring_loads(tiles: tuple[int, int], tile_of, load_block, stages: int, consumed) -> None:
  """The memory warpgroup of a kernel whose tiles share one ring of
  ``stages`` shared-memory stages (the chained weight gradients): for each
  of this CTA's tiles of the grid ``tiles`` (``tile_of(loop_info) -> (group,
  steps, first_block, rows, columns)``), ``load_block(first_block, rows,
  columns, step, slot)`` issues its block ``step``'s copies into stage
  ``slot``. The carry counts the CTA's blocks;
  block ``b`` goes to stage ``b % stages`` once the compute warpgroups
  released block ``b - stages`` (``consumed``), and the last stages'
  releases are waited for so no barrier is left mid-phase."""
  @plgpu.nd_loop(tiles, collective_axes="sm", init_carry=jnp.int32(0))
  def blocks(loop_info, carry):
    _, steps, *tile = tile_of(loop_info)

    @pl.loop(0, steps)
    def _(step):
      block, slot = carry + step, lax.rem(carry + step, stages)

      @pl.when(block >= stages)
      def _():
        plgpu.barrier_wait(consumed.at[slot])
      load_block(*tile, step, slot)
    return carry + steps

  @pl.loop(jnp.maximum(blocks - stages, 0), blocks)
  def _(block):
    plgpu.barrier_wait(consumed.at[lax.rem(block, stages)])


def rows_collective(cluster: int) -> tuple[str, ...]:
  """The ``collective_axes`` of the rows' ``BlockSpec``: a cluster's CTAs
  share them."""
  return ("cluster",) if cluster > 1 else ()


def kernel_call(body, out_type, num_sms, cluster: int = 1, *, name: str):
  """The persistent kernel of ``body``: one CTA per multiprocessor, in
  clusters of ``cluster``; its GPU kernel is ``{name}_mosaic_gpu_kernel`` in
  profiles."""
  body.__name__ = body.__qualname__ = name
  clusters = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
  return plgpu.kernel(
      body, out_type=out_type, grid=(num_sms // cluster,), grid_names=("sm",), num_threads=3,
      thread_name="wg", **clusters,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array, *,
                   transpose_rhs: bool = False, config: TileConfig = TileConfig(),
                   num_sms: int | None = None, tile_start: jax.Array | None = None,
                   tile_rows: jax.Array | None = None) -> jax.Array:
  """``out[rows_g] = lhs[rows_g] @ rhs[g]`` over the row tiles of each group.

  Args:
    lhs: ``[M, K]``, ``M % ROW_TILE == 0``.
    rhs: ``[G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``).
    tile_group: ``[M // ROW_TILE]`` int32 group of each row tile, -1 for none
      (with a tile list: ``[W]``, each entry's).
    transpose_rhs: multiply by ``rhs[g].T`` (the input gradient).
    config: tiles and schedule.
    num_sms: persistent CTAs (default: the device's multiprocessor count).
    tile_start, tile_rows: None, or the ``[W]`` tile list of groups on half
      tiles (:class:`moe_ep.experts.grouped.GroupTiles`): a half tile's
      product runs on half the rows.

  Returns:
    ``[M, N]`` in ``lhs.dtype``, zero on rows of tiles of no group.
  """
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  lhs = pad_minor(lhs, 1)
  rhs = pad_minor(pad_minor(rhs, 1), 2)
  m, k = lhs.shape
  padded_n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tile_m, tile_n, tile_k = ROW_TILE, config.tile_n, config.tile_k
  cta_tile_n = 2 * tile_n
  m_iters, n_iters, k_iters = tile_group.shape[0], pl.cdiv(padded_n, cta_tile_n), pl.cdiv(k, tile_k)
  dtype = lhs.dtype
  # Both operands share one swizzle (wgmma's rule); the arrays' minor sizes
  # are K, and N where the weights are not read transposed.
  transforms = smem_transforms(dtype, tile_k, k, *(() if transpose_rhs else (padded_n,)))
  epi = config.epi_tile
  out_transforms = smem_transforms(dtype, epi, padded_n)
  tables = () if tile_rows is None else (tile_start, tile_rows)

  def pipeline(body, compute_context, state=None):
    rhs_spec = (plgpu.BlockSpec((cta_tile_n, tile_k), lambda ki: (0, ki), transforms=transforms,
                                memory_space=plgpu.SMEM, delay_release=config.delay_release)
                if transpose_rhs else
                plgpu.BlockSpec((tile_k, cta_tile_n), lambda ki: (ki, 0), transforms=transforms,
                                memory_space=plgpu.SMEM, delay_release=config.delay_release))
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=MEMORY_REGISTERS,
        in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda ki: (0, ki), transforms=transforms,
                                  memory_space=plgpu.SMEM, delay_release=config.delay_release,
                                  collective_axes=rows_collective(config.cluster(n_iters))),
                  rhs_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context, pipeline_state=state)

  def body(tile_group_gmem, *refs):
    *table_gmems, lhs_gmem, rhs_gmem, out_gmem = refs
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
        out_smem=plgpu.SMEM((2, 2, epi, epi), dtype, transforms=out_transforms),
        collective_axes="wg")
    def scope(allocs, out_smem):
      wg_idx = lax.axis_index("wg")

      def tile_body(tile, height, state):
        group, n_slice, wg_n_slice = tile.group, tile.columns, tile.wg_columns
        out_view = tile.row_view(out_gmem, height).at[:, n_slice].at[:, wg_n_slice]

        # A tile of no group is stored as zeros by the compute warpgroups (so
        # the input gradient there is zero, not what memory held).
        @pl.when((group < 0) & (wg_idx < 2) & of_height(tile, height))
        def _():
          store_tile(jnp.zeros((height, tile_n), jnp.float32), out_smem, out_view, wg_idx, epi)

        @pl.when((group >= 0) & of_height(tile, height))
        def _():
          def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((height, tile_n), jnp.float32))
            def _(acc_ref):
              eval_pipeline(acc_ref)
              store_tile(acc_ref[...], out_smem, out_view, wg_idx, epi)

          def mma(_, lhs_smem, rhs_smem, acc_ref):
            if transpose_rhs:
              rhs_block = transposed(rhs_smem.at[wg_n_slice, :])
            else:
              rhs_block = rhs_smem.at[:, wg_n_slice]
            # A half tile's block holds the next tile's rows too (or TMA's
            # zeros past the end): only its own enter the product.
            plgpu.wgmma(acc_ref, lhs_smem if height == tile_m else lhs_smem.at[:height],
                        rhs_block)
            plgpu.wgmma_wait(config.delay_release)
            return acc_ref

          rhs_view = (rhs_gmem.at[group].at[n_slice, :] if transpose_rhs
                      else rhs_gmem.at[group].at[:, n_slice])
          pipeline(mma, compute_context, state)(lhs_gmem.at[tile.rows, :], rhs_view,
                                                allocations=allocs)

      for_each_tile(tile_body, tile_group_gmem, wg_idx, m_iters=m_iters, n_iters=n_iters,
                    wg_columns=tile_n, config=config, tables=table_gmems, tile_rows=tile_rows,
                    chain=chain(allocs, config, k_iters))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = kernel_call(body, jax.ShapeDtypeStruct((m, padded_n), dtype), num_sms or num_sms_here(),
                     config.cluster(n_iters),
                     name="grouped_matmul_t" if transpose_rhs else "grouped_matmul")
  return call(tile_group, *tables, lhs, rhs)[:, :n]
