"""The grouped weight gradient on Hopper tensor cores: ``out[g] =
lhs[rows_g].T @ rhs[rows_g]``, contracting over group ``g``'s rows only.

Its output tiles are ``[128, 2 * tile_n]`` pieces of each group's
``[K, N]`` gradient, and each contracts over as many ``tile_k``-row blocks
as its group holds, a count known only on the device: with fine-grained
experts a few (256 rows of an expert are four blocks), so each tile's own
pipeline would begin with a full load latency and end with its stages
drained. Two implementations behind :func:`grouped_matmul_wgrad`:

* chained (``config.chain_tiles``, no clusters): one ring
  of shared-memory stages for all of a CTA's tiles, written directly on
  barriers and TMA; the memory warpgroup counts blocks across tiles, so it
  loads the next tile's first blocks while the compute warpgroups multiply
  this tile's last ones and store it. JAX's pipeline of pipelines cannot
  chain here: its step counts must be static and whole rounds of the stages.
* tile by tile: JAX's warp-specialized pipeline per tile, in clusters of
  CTAs sharing the rows by TMA multicast where ``config`` forms them.

Both sum every tile's blocks in the same order: the same bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_ep.experts import hopper
from moe_ep.experts.hopper import TileConfig
from moe_ep.row_groups import ROW_TILE


def grouped_matmul_wgrad(lhs: jax.Array, rhs: jax.Array, group_start: jax.Array,
                         group_steps: jax.Array, num_groups: int, *,
                         config: TileConfig = TileConfig(),
                         num_sms: int | None = None) -> jax.Array:
  """``out[g] = lhs[rows_g].T @ rhs[rows_g]``: the weight gradient.

  Args:
    lhs: ``[M, K]`` (the layer's input rows).
    rhs: ``[M, N]`` (the output gradient rows).
    group_start: ``[G]`` int32 first row of each group, a multiple of
      ``config.tile_k``.
    group_steps: ``[G]`` int32 ``tile_k``-row blocks of each group (0: empty).
    num_groups: ``G``.
    config: tiles and schedule; chained where :func:`chains`.
    num_sms: persistent CTAs (default: the device's multiprocessor count).

  Returns:
    ``[G, K, N]`` in ``lhs.dtype``, zero for an empty group.
  """
  unpadded_k, unpadded_n = lhs.shape[1], rhs.shape[1]
  lhs, rhs = hopper.pad_minor(lhs, 1), hopper.pad_minor(rhs, 1)
  n_iters = pl.cdiv(rhs.shape[1], 2 * config.tile_n)
  kernel = _chained if chains(config, n_iters) else _tile_by_tile
  out = kernel(lhs, rhs, group_start, group_steps, num_groups, config,
               num_sms or hopper.num_sms_here())
  return out[:, :unpadded_k, :unpadded_n]


def chains(config: TileConfig, column_tiles: int) -> bool:
  """Whether the kernel of ``column_tiles`` column tiles runs its tiles as
  one chain: ``config.chain_tiles``, without clusters (their shared row
  blocks need cluster-wide barriers) or delayed release. On one H200 the
  chain made the bank 3-5% faster in three of four runs and no slower in the
  fourth (docs/grouped.md)."""
  return config.chain_tiles and config.cluster(column_tiles) == 1 and config.delay_release == 0


def _operands(lhs, rhs, config: TileConfig):
  """The sizes and shared-memory transforms both implementations share."""
  k, n = lhs.shape[1], rhs.shape[1]
  cta_tile_n = 2 * config.tile_n
  k_iters, n_iters = pl.cdiv(k, ROW_TILE), pl.cdiv(n, cta_tile_n)
  # One swizzle for both wgmma operands, whose minor sizes are K and N.
  transforms = hopper.smem_transforms(lhs.dtype, ROW_TILE, k, cta_tile_n, n)
  out_transforms = hopper.smem_transforms(lhs.dtype, config.epi_tile, n)
  return k, n, k_iters, n_iters, transforms, out_transforms


def _chained(lhs, rhs, group_start, group_steps, num_groups, config, num_sms):
  k, n, k_iters, n_iters, transforms, out_transforms = _operands(lhs, rhs, config)
  tile_n, tile_c, epi, stages = (config.tile_n, config.tile_k, config.epi_tile,
                                 config.max_concurrent_steps)
  cta_tile_n, dtype = 2 * tile_n, lhs.dtype
  tiles = (num_groups, k_iters * n_iters)

  def body(group_start_gmem, group_steps_gmem, lhs_gmem, rhs_gmem, out_gmem):
    def scoped(lhs_smem, rhs_smem, out_smem, loaded, consumed):
      wg_idx = lax.axis_index("wg")

      def tile_of(loop_info):
        """The step's group, its blocks, the first of them, and its output
        tile's rows (of K) and columns (of N)."""
        group, index = loop_info.index
        k_idx, n_idx = hopper.snake_tile(index, k_iters, n_iters, config)
        return (group, group_steps_gmem[group], group_start_gmem[group] // tile_c,
                pl.ds(k_idx * ROW_TILE, ROW_TILE), pl.ds(n_idx * cta_tile_n, cta_tile_n))

      @pl.when(wg_idx == 2)
      def _memory():
        plgpu.set_max_registers(hopper.MEMORY_REGISTERS, action="decrease")

        def load_block(first_block, k_slice, n_slice, step, slot):
          rows = pl.ds(pl.multiple_of((first_block + step) * tile_c, tile_c), tile_c)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, k_slice], lhs_smem.at[slot],
                                  loaded.at[slot])
          plgpu.copy_gmem_to_smem(rhs_gmem.at[rows, n_slice], rhs_smem.at[slot],
                                  loaded.at[slot])

        hopper.ring_loads(tiles, tile_of, load_block, stages, consumed)

      @pl.when(wg_idx < 2)
      def _compute():
        plgpu.set_max_registers(hopper.COMPUTE_REGISTERS, action="increase")
        wg_n_slice = pl.ds(wg_idx * tile_n, tile_n)

        @plgpu.nd_loop(tiles, collective_axes="sm", init_carry=jnp.int32(0))
        def _(loop_info, carry):  # the blocks this CTA has read
          group, steps, _, k_slice, n_slice = tile_of(loop_info)

          def accumulate(acc_ref):
            @pl.loop(0, steps)
            def _(step):
              slot = lax.rem(carry + step, stages)
              plgpu.barrier_wait(loaded.at[slot])
              plgpu.wgmma(acc_ref, hopper.transposed(lhs_smem.at[slot]),
                          rhs_smem.at[slot].at[:, wg_n_slice])
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(consumed.at[slot])
            return acc_ref[...]

          acc = pl.run_scoped(accumulate, plgpu.ACC((ROW_TILE, tile_n), jnp.float32))
          out_view = out_gmem.at[group].at[k_slice, n_slice].at[:, wg_n_slice]
          hopper.store_tile(acc, out_smem, out_view, wg_idx, epi)
          return carry + steps

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, tile_c, ROW_TILE), dtype, transforms=transforms),
        plgpu.SMEM((stages, tile_c, cta_tile_n), dtype, transforms=transforms),
        plgpu.SMEM((2, 2, epi, epi), dtype, transforms=out_transforms),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # a stage's two copies landed
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups read it
        collective_axes="wg")
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = hopper.kernel_call(body, jax.ShapeDtypeStruct((num_groups, k, n), dtype), num_sms,
                            name="grouped_matmul_wgrad")
  return call(group_start, group_steps, lhs, rhs)


def _tile_by_tile(lhs, rhs, group_start, group_steps, num_groups, config, num_sms):
  k, n, k_iters, n_iters, transforms, out_transforms = _operands(lhs, rhs, config)
  tile_n, tile_c, epi = config.tile_n, config.tile_k, config.epi_tile
  cta_tile_n, dtype = 2 * tile_n, lhs.dtype
  cluster = config.cluster(n_iters)

  def pipeline(body, compute_context, steps, first_block):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=hopper.MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((tile_c, ROW_TILE), lambda ci: (first_block + ci, 0),
                            transforms=transforms, memory_space=plgpu.SMEM,
                            delay_release=config.delay_release,
                            collective_axes=hopper.rows_collective(cluster)),
            plgpu.BlockSpec((tile_c, cta_tile_n), lambda ci: (first_block + ci, 0),
                            transforms=transforms, memory_space=plgpu.SMEM,
                            delay_release=config.delay_release)],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context)

  def body(group_start_gmem, group_steps_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ignore = lambda *_, **__: None
    # A traced step count, as in the loop: a static one would shrink the stages.
    dynamic_one = jnp.int32(1)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore, dynamic_one, dynamic_one).get_allocations(lhs_gmem,
                                                                                rhs_gmem),
        out_smem=plgpu.SMEM((2, 2, epi, epi), dtype, transforms=out_transforms),
        collective_axes="wg")
    def scope(allocs, out_smem):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((num_groups, k_iters * n_iters // cluster), collective_axes="sm")
      def tile_loop(loop_info):
        group, index = loop_info.index
        # A cluster's CTAs share the lhs block (the contraction's rows).
        k_idx, n_idx = hopper.snake_tile(index, k_iters, n_iters, config)
        steps = group_steps_gmem[group]
        first_block = group_start_gmem[group] // tile_c
        k_slice = pl.ds(k_idx * ROW_TILE, ROW_TILE)
        n_slice = pl.ds(n_idx * cta_tile_n, cta_tile_n)
        wg_n_slice = pl.ds(wg_idx * tile_n, tile_n)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROW_TILE, tile_n), jnp.float32))
          def _(acc_ref):
            eval_pipeline(acc_ref)
            hopper.store_tile(acc_ref[...], out_smem,
                              out_gmem.at[group].at[k_slice, n_slice].at[:, wg_n_slice],
                              wg_idx, epi)

        def mma(_, lhs_smem, rhs_smem, acc_ref):
          plgpu.wgmma(acc_ref, hopper.transposed(lhs_smem), rhs_smem.at[:, wg_n_slice])
          plgpu.wgmma_wait(config.delay_release)
          return acc_ref

        pipeline(mma, compute_context, steps, first_block)(
            lhs_gmem.at[:, k_slice], rhs_gmem.at[:, n_slice], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = hopper.kernel_call(body, jax.ShapeDtypeStruct((num_groups, k, n), dtype), num_sms,
                            cluster, name="grouped_matmul_wgrad")
  return call(group_start, group_steps, lhs, rhs)
