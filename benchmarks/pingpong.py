"""A prototype of the grouped GEMM on a ping-pong schedule (docs/grouped.md):
each compute warpgroup owns alternate ``[128, tile_n]`` output tiles of its
CTA and its own ring of ``stages`` shared-memory stages, so that one stores
a tile while the other multiplies. The operands and the result are
:func:`moe_ep.experts.hopper.grouped_matmul`'s (whole row tiles only, no
clusters); timed by benchmarks/pingpong_probe.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from moe_ep.experts import hopper
from moe_ep.row_groups import ROW_TILE


def pingpong_matmul(lhs, rhs, tile_group, *, transpose_rhs=False, stages=3, tile_n=128,
                    config=hopper.TileConfig(), num_sms=None):
  """``out [M, N]``: ``lhs [M, K]`` rows times ``rhs [G, K, N]`` (``[G, N, K]``
  with ``transpose_rhs``) of each row tile's group (``tile_group [M / 128]``,
  -1: zeros); ``config`` gives ``tile_k``, the snake order and the epilogue."""
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  lhs = hopper.pad_minor(lhs, 1)
  rhs = hopper.pad_minor(hopper.pad_minor(rhs, 1), 2)
  m, k = lhs.shape
  padded_n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tile_m, tile_k = ROW_TILE, config.tile_k
  m_iters, n_iters, k_iters = tile_group.shape[0], pl.cdiv(padded_n, tile_n), pl.cdiv(k, tile_k)
  dtype = lhs.dtype
  transforms = hopper.smem_transforms(dtype, tile_k, k, *(() if transpose_rhs else (padded_n, tile_n)))
  epi = config.epi_tile
  out_transforms = hopper.smem_transforms(dtype, epi, padded_n)
  num_sms = num_sms or hopper.num_sms_here()
  total = m_iters * n_iters
  rhs_block = (tile_n, tile_k) if transpose_rhs else (tile_k, tile_n)

  def body(tile_group_gmem, lhs_gmem, rhs_gmem, out_gmem):
    def scoped(lhs_smem, rhs_smem, out_smem, full, consumed):
      wg_idx = lax.axis_index("wg")
      cta = lax.axis_index("sm")
      my_tiles = (total - cta + num_sms - 1) // num_sms

      def tile_at(j):
        m_idx, n_idx = plgpu.planar_snake(cta + j * num_sms, (m_iters, n_iters),
                                          config.grid_minor_dim, config.grid_tile_width)
        return m_idx, n_idx, tile_group_gmem[m_idx]

      @pl.when(wg_idx == 2)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def tile_step(j, counts):
          m_idx, n_idx, group = tile_at(j)
          ring = j % 2
          count = jnp.where(ring == 0, counts[0], counts[1])

          @pl.when(group >= 0)
          def _():
            @pl.loop(0, k_iters)
            def _(ki):
              c = count + ki
              slot = ring * stages + c % stages

              @pl.when(c >= stages)
              def _():
                plgpu.barrier_wait(consumed.at[slot])
              ks = pl.ds(ki * tile_k, tile_k)
              ns = pl.ds(n_idx * tile_n, tile_n)
              plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(m_idx * tile_m, tile_m), ks],
                                      lhs_smem.at[slot], full.at[slot])
              src = rhs_gmem.at[group].at[ns, ks] if transpose_rhs else rhs_gmem.at[group].at[ks, ns]
              plgpu.copy_gmem_to_smem(src, rhs_smem.at[slot], full.at[slot])

          add = jnp.where(group >= 0, k_iters, 0)
          return (counts[0] + jnp.where(ring == 0, add, 0), counts[1] + jnp.where(ring == 1, add, 0))

        counts = lax.fori_loop(0, my_tiles, tile_step, (jnp.int32(0), jnp.int32(0)))
        for ring in (0, 1):
          @pl.loop(jnp.maximum(counts[ring] - stages, 0), counts[ring])
          def _(c):
            plgpu.barrier_wait(consumed.at[ring * stages + c % stages])

      @pl.when(wg_idx < 2)
      def _consumers():
        plgpu.set_max_registers(232, action="increase")

        def tile_step(j, count):
          m_idx, n_idx, group = tile_at(j)
          mine = (j % 2) == wg_idx
          out_view = out_gmem.at[pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)]

          @pl.when(mine & (group < 0))
          def _():
            hopper.store_tile(jnp.zeros((tile_m, tile_n), jnp.float32), out_smem, out_view,
                              wg_idx, epi)

          @pl.when(mine & (group >= 0))
          def _():
            def mainloop(acc_ref):
              @pl.loop(0, k_iters)
              def _(ki):
                slot = wg_idx * stages + (count + ki) % stages
                plgpu.barrier_wait(full.at[slot])
                b = hopper.transposed(rhs_smem.at[slot]) if transpose_rhs else rhs_smem.at[slot]
                plgpu.wgmma(acc_ref, lhs_smem.at[slot], b)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[slot])
              return acc_ref[...]
            acc = pl.run_scoped(mainloop, plgpu.ACC((tile_m, tile_n), jnp.float32))
            hopper.store_tile(acc, out_smem, out_view, wg_idx, epi)

          return count + jnp.where(mine & (group >= 0), k_iters, 0)

        lax.fori_loop(0, my_tiles, tile_step, jnp.int32(0))

    pl.run_scoped(
        scoped,
        plgpu.SMEM((2 * stages, tile_m, tile_k), dtype, transforms=transforms),
        plgpu.SMEM((2 * stages, *rhs_block), dtype, transforms=transforms),
        plgpu.SMEM((2, 2, epi, epi), dtype, transforms=out_transforms),
        plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
        collective_axes="wg")
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = hopper.kernel_call(body, jax.ShapeDtypeStruct((m, padded_n), dtype), num_sms,
                            name="pingpong_matmul")
  return call(tile_group, lhs, rhs)[:, :n]
