"""The expert MLP's activation inside the grouped GEMMs' epilogues (Hopper).

The bank's first GEMM produces ``hidden = rows @ w_in[g]`` (``[M, n*F]``,
gate | up for the gated activations, ``n = 2``; ``n = 1`` for GELU) and the
activation ``act = f(gate) * up * w`` (``[M, F]``, ``w`` the row's routing
weight, optional). Unfused, that is a GEMM writing ``hidden``, then XLA
passes reading it to write ``act``; backward, the second GEMM's input
gradient ``d_act`` is written, read again with ``hidden``, and
``d_hidden = [d_gate | d_up]`` concatenated. Here:

* :func:`activation_matmul`: the first GEMM's epilogue writes both
  ``hidden`` (what backward needs) and ``act`` from the float32 accumulators.
  Each compute warpgroup accumulates the gate and the up columns of the same
  outputs, so the activation needs no exchange between warpgroups.
* :func:`activation_grad_matmul`: the second GEMM's input gradient
  ``d_act = d_out @ w_out[g].T`` never leaves registers: its epilogue reads
  the matching ``hidden`` pieces by TMA and writes ``d_hidden`` and each
  column tile's share of the weights' gradient ``sum_f d_act * f(gate) * up``.

Rows of tiles of no group get zeros in every output. Both kernels are the
persistent, warp-specialized pipeline of :mod:`moe_ep.experts.hopper`, with
its sizes rule (:func:`moe_ep.experts.hopper.supports`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_ep.experts import hopper
from moe_ep.row_groups import ROW_TILE

ACTIVATIONS = ("swiglu", "geglu", "gelu")
_EPI = 64  # side of the epilogue's square pieces
_GELU_C = math.sqrt(2 / math.pi)


def gate_count(activation: str) -> int:
  """``n``: 2 for the gated activations (gate | up), 1 for GELU."""
  return 1 if activation == "gelu" else 2


def _function_and_derivative(activation: str, x):
  """``(f(x), f'(x))`` in float32 for the gate's function: SiLU, or GELU's
  tanh form (``jax.nn.gelu``'s default), written with what the kernels
  lower (logistic, tanh, products)."""
  if activation == "swiglu":
    sigmoid = jax.nn.sigmoid(x)
    value = x * sigmoid
    return value, sigmoid + value * (1 - sigmoid)
  inner = _GELU_C * (x + 0.044715 * x * x * x)
  t = jnp.tanh(inner)
  derivative = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * x * x)
  return 0.5 * x * (1 + t), derivative


def _row_weights(w_smem, wg_idx, rows: slice, columns: int):
  """The ``[rows, columns]`` broadcast of a warpgroup's row weights in shared memory."""
  ref = w_smem.at[wg_idx, pl.ds(rows.start, rows.stop - rows.start)]
  weights = hopper.load(ref, plgpu.Layout.WGMMA.reduce(1))
  return lax.broadcast_in_dim(weights, (rows.stop - rows.start, columns), (0,))


def activation_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array,
                      row_weights: jax.Array | None, activation: str, *,
                      config: hopper.TileConfig = hopper.TileConfig(),
                      num_sms: int | None = None, tile_start: jax.Array | None = None,
                      tile_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``hidden = lhs[rows_g] @ rhs[g]`` and its activation, in one pass.

  Args:
    lhs: ``[M, K]``, ``M % ROW_TILE == 0``.
    rhs: ``[G, K, n*F]``, gate then up columns for the gated activations.
    tile_group: ``[M // ROW_TILE]`` int32 group of each row tile, -1 for none.
    row_weights: ``[M]`` float32 weight of each row, or None (1).
    activation: ``"swiglu"``, ``"geglu"`` or ``"gelu"``.
    tile_start, tile_rows: None, or a tile list with half tiles, as
      :func:`moe_ep.experts.hopper.grouped_matmul`.

  Returns:
    ``(hidden [M, n*F], act [M, F])`` in ``lhs.dtype``; ``act`` is computed
    from the float32 accumulators; both zero on tiles of no group.
  """
  n = gate_count(activation)
  groups, _, width = rhs.shape
  ffn = width // n
  lhs = hopper.pad_minor(lhs, 1)
  rhs = hopper.pad_minor(rhs.reshape(groups, rhs.shape[1], n, ffn), 3)
  m, k = lhs.shape
  padded_f = rhs.shape[3]
  tile_m, tile_k = ROW_TILE, config.tile_k
  wg_cols = config.tile_n // n  # each of its n accumulators
  cta_cols = 2 * wg_cols
  m_iters, n_iters, k_iters = tile_group.shape[0], pl.cdiv(padded_f, cta_cols), pl.cdiv(k, tile_k)
  dtype = lhs.dtype
  transforms = hopper.smem_transforms(dtype, tile_k, k, padded_f, cta_cols)
  out_transforms = hopper.smem_transforms(dtype, _EPI, padded_f)
  weighted = row_weights is not None
  tables = () if tile_rows is None else (tile_start, tile_rows)

  def pipeline(body, compute_context, state=None):
    spec = lambda shape, index, collective=(): plgpu.BlockSpec(
        shape, index, transforms=transforms, memory_space=plgpu.SMEM,
        delay_release=config.delay_release, collective_axes=collective)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=hopper.MEMORY_REGISTERS,
        in_specs=[spec((tile_m, tile_k), lambda ki: (0, ki),
                       hopper.rows_collective(config.cluster(n_iters)))]
        + [spec((tile_k, cta_cols), lambda ki: (ki, 0))] * n,
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context, pipeline_state=state)

  def body(tile_group_gmem, *refs):
    table_gmems, (lhs_gmem, rhs_gmem, *refs) = refs[:len(tables)], refs[len(tables):]
    w_gmem, hidden_gmem, act_gmem = refs if weighted else (None, *refs)
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(
            lhs_gmem, *[rhs_gmem.at[0].at[:, h, :] for h in range(n)]),
        out_smem=plgpu.SMEM((2, 2, _EPI, _EPI), dtype, transforms=out_transforms),
        w_smem=plgpu.SMEM((2, tile_m), jnp.float32) if weighted else None,
        w_barrier=plgpu.Barrier(num_barriers=2) if weighted else None,
        collective_axes="wg")
    def scope(allocs, out_smem, w_smem, w_barrier):
      wg_idx = lax.axis_index("wg")

      def tile_body(tile, height, state):
        group, n_slice, wg_slice = tile.group, tile.columns, tile.wg_columns
        # [height, wg_cols] views of this warpgroup's outputs: hidden's n parts, act.
        outputs = [tile.row_view(hidden_gmem, height).at[:, h, n_slice].at[:, wg_slice]
                   for h in range(n)]
        outputs.append(tile.row_view(act_gmem, height).at[:, n_slice].at[:, wg_slice])

        def store(values):  # values: n + 1 float32 [height, wg_cols] arrays
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          piece = 0
          for i in range(height // _EPI):
            for j in range(wg_cols // _EPI):
              rows, cols = slice(i * _EPI, (i + 1) * _EPI), slice(j * _EPI, (j + 1) * _EPI)
              for value, out_ref in zip(values(rows, cols), outputs):
                hopper.store_piece(value, out_smem, wg_idx, piece % 2, out_ref.at[rows, cols])
                piece += 1

        @pl.when((group < 0) & (wg_idx < 2) & hopper.of_height(tile, height))
        def _():
          zeros = jnp.zeros((_EPI, _EPI), jnp.float32)
          store(lambda rows, cols: [zeros] * (n + 1))

        @pl.when((group >= 0) & hopper.of_height(tile, height))
        def _():
          def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped,
                               accs=[plgpu.ACC((height, wg_cols), jnp.float32)] * n)
            def _(accs):
              if weighted:  # fetched under the main loop (the last tile's epilogue has read it)
                plgpu.copy_gmem_to_smem(w_gmem.at[tile.rows], w_smem.at[wg_idx],
                                        w_barrier.at[wg_idx])
              eval_pipeline(accs)
              if weighted:
                plgpu.barrier_wait(w_barrier.at[wg_idx])
              parts = [acc[...] for acc in accs]

              def values(rows, cols):
                pieces = [part[rows, cols] for part in parts]
                act, _ = _function_and_derivative(activation, pieces[0])
                if n == 2:
                  act = act * pieces[1]
                if weighted:
                  act = act * _row_weights(w_smem, wg_idx, rows, _EPI)
                return [*pieces, act]

              store(values)

          def mma(_, lhs_smem, *rest):
            *rhs_smems, accs = rest
            # A half tile's block holds the next rows too: only its own enter.
            lhs_block = lhs_smem if height == tile_m else lhs_smem.at[:height]
            for rhs_smem, acc in zip(rhs_smems, accs):
              plgpu.wgmma(acc, lhs_block, rhs_smem.at[:, wg_slice])
            plgpu.wgmma_wait(config.delay_release)
            return accs

          pipeline(mma, compute_context, state)(
              lhs_gmem.at[tile.rows, :],
              *[rhs_gmem.at[group].at[:, h, n_slice] for h in range(n)], allocations=allocs)

      hopper.for_each_tile(tile_body, tile_group_gmem, wg_idx, m_iters=m_iters,
                           n_iters=n_iters, wg_columns=wg_cols, config=config,
                           tables=table_gmems, tile_rows=tile_rows,
                           chain=hopper.chain(allocs, config, k_iters))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = (jax.ShapeDtypeStruct((m, n, padded_f), dtype),
              jax.ShapeDtypeStruct((m, padded_f), dtype))
  call = hopper.kernel_call(body, out_type, num_sms or hopper.num_sms_here(),
                            config.cluster(n_iters), name="activation_matmul")
  hidden, act = call(tile_group, *tables, lhs, rhs, *([row_weights] if weighted else []))
  return hidden[:, :, :ffn].reshape(m, n * ffn), act[:, :ffn]


# The input gradient's epilogue holds two slots of hidden pieces besides the
# pipeline: three stages keep it within shared memory (212 of 227 KiB).
GRAD_CONFIG = hopper.TileConfig(max_concurrent_steps=3)


def activation_grad_matmul(out_grad: jax.Array, w_out: jax.Array, hidden: jax.Array,
                           tile_group: jax.Array, row_weights: jax.Array | None,
                           activation: str, *, config: hopper.TileConfig = GRAD_CONFIG,
                           num_sms: int | None = None, tile_start: jax.Array | None = None,
                           tile_rows: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array | None]:
  """``d_hidden`` of ``out = act(hidden) @ w_out[g]``, ``d_act`` kept in registers.

  Args:
    out_grad: ``[M, H]`` the output's gradient, ``M % ROW_TILE == 0``.
    w_out: ``[G, F, H]``.
    hidden: ``[M, n*F]`` as :func:`activation_matmul` wrote it.
    tile_group, row_weights, activation, tile_start, tile_rows: as
      :func:`activation_matmul`.

  Returns:
    ``(d_hidden [M, n*F] in out_grad.dtype, d_weights [M] float32 or None)``,
    both zero on tiles of no group.
  """
  n = gate_count(activation)
  groups, ffn, _ = w_out.shape
  out_grad = hopper.pad_minor(out_grad, 1)
  w_out = hopper.pad_minor(w_out, 2)
  m, k = out_grad.shape
  hidden = hopper.pad_minor(hidden.reshape(m, n, ffn), 2)
  padded_f = hidden.shape[2]
  tile_m, tile_k, wg_cols = ROW_TILE, config.tile_k, config.tile_n
  cta_cols = 2 * wg_cols
  m_iters, n_iters, k_iters = tile_group.shape[0], pl.cdiv(padded_f, cta_cols), pl.cdiv(k, tile_k)
  dtype = out_grad.dtype
  transforms = hopper.smem_transforms(dtype, tile_k, k)  # both read along H
  io_transforms = hopper.smem_transforms(dtype, _EPI, padded_f)
  weighted = row_weights is not None
  tables = () if tile_rows is None else (tile_start, tile_rows)

  def pipeline(body, compute_context, state=None):
    spec = lambda shape, collective=(): plgpu.BlockSpec(
        shape, lambda ki: (0, ki), transforms=transforms, memory_space=plgpu.SMEM,
        delay_release=config.delay_release, collective_axes=collective)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=hopper.MEMORY_REGISTERS,
        in_specs=[spec((tile_m, tile_k), hopper.rows_collective(config.cluster(n_iters))),
                  spec((cta_cols, tile_k))],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context, pipeline_state=state)

  def body(tile_group_gmem, *refs):
    table_gmems, (grad_gmem, w_out_gmem, hidden_gmem, *refs) = (refs[:len(tables)],
                                                                refs[len(tables):])
    w_gmem, d_hidden_gmem, d_w_gmem = refs if weighted else (None, *refs, None)
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(grad_gmem, w_out_gmem.at[0]),
        io_smem=plgpu.SMEM((2, 2, 2, _EPI, _EPI), dtype, transforms=io_transforms),
        w_smem=plgpu.SMEM((2, tile_m), jnp.float32) if weighted else None,
        d_w_smem=plgpu.SMEM((2, tile_m), jnp.float32) if weighted else None,
        barriers=plgpu.Barrier(num_barriers=10),
        collective_axes="wg")
    def scope(allocs, io_smem, w_smem, d_w_smem, barriers):
      # io_smem[warpgroup, slot, gate]: piece p's hidden parts arrive in slot
      # p % 2 and leave it as d_hidden; barriers 0-7 are the slots' loads,
      # 8 and 9 the warpgroups' row weights.
      wg_idx = lax.axis_index("wg")
      loaded = lambda slot, h: barriers.at[(2 * wg_idx + slot) * 2 + h]

      def tile_body(tile, height, state):
        group, n_slice, wg_slice = tile.group, tile.columns, tile.wg_columns
        pieces = [(slice(i * _EPI, (i + 1) * _EPI), slice(j * _EPI, (j + 1) * _EPI))
                  for i in range(height // _EPI) for j in range(wg_cols // _EPI)]
        hidden_views = [tile.row_view(hidden_gmem, height).at[:, h, n_slice].at[:, wg_slice]
                        for h in range(n)]
        d_hidden_views = [tile.row_view(d_hidden_gmem, height).at[:, h, n_slice].at[:, wg_slice]
                          for h in range(n)]
        # This warpgroup's column tile's share of the weights' gradient.
        d_w_view = (tile.row_view(d_w_gmem.at[tile.column_tile * 2 + wg_idx], height)
                    if weighted else None)

        def fetch(p):  # piece p's hidden parts into slot p % 2, once its last store read it
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          rows, cols = pieces[p]
          for h in range(n):
            plgpu.copy_gmem_to_smem(hidden_views[h].at[rows, cols], io_smem.at[wg_idx, p % 2, h],
                                    loaded(p % 2, h))

        def store(p, d_parts):
          rows, cols = pieces[p]
          for h in range(n):
            io_smem[wg_idx, p % 2, h] = d_parts[h].astype(dtype)
          plgpu.commit_smem()
          for h in range(n):
            plgpu.copy_smem_to_gmem(io_smem.at[wg_idx, p % 2, h],
                                    d_hidden_views[h].at[rows, cols])

        def store_d_w():
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(d_w_smem.at[wg_idx, pl.ds(0, height)], d_w_view)

        def epilogue(d_act):  # d_act: float32 [height, wg_cols]; its first pieces are in flight
          if weighted:
            plgpu.barrier_wait(barriers.at[8 + wg_idx])
          d_w_rows = jnp.zeros((_EPI,), jnp.float32)
          for p, (rows, cols) in enumerate(pieces):
            for h in range(n):
              plgpu.barrier_wait(loaded(p % 2, h))
            parts = [io_smem[wg_idx, p % 2, h].astype(jnp.float32) for h in range(n)]
            value, derivative = _function_and_derivative(activation, parts[0])
            d_piece = d_act[rows, cols]
            if weighted:
              product = value * parts[1] if n == 2 else value
              d_w_rows = d_w_rows + jnp.sum(d_piece * product, axis=1)
              d_piece = d_piece * _row_weights(w_smem, wg_idx, rows, _EPI)
            store(p, [d_piece * parts[1] * derivative, d_piece * value] if n == 2
                  else [d_piece * derivative])
            if p + 2 < len(pieces):  # under the next piece's arithmetic
              fetch(p + 2)
            if weighted and (p + 1 == len(pieces) or pieces[p + 1][0] != rows):
              d_w_smem[wg_idx, pl.ds(rows.start, _EPI)] = d_w_rows
              d_w_rows = jnp.zeros((_EPI,), jnp.float32)
          if weighted:
            store_d_w()

        @pl.when((group < 0) & (wg_idx < 2) & hopper.of_height(tile, height))
        def _():
          for p in range(len(pieces)):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            store(p, [jnp.zeros((_EPI, _EPI), jnp.float32)] * n)
          if weighted:  # a splat of zeros takes the whole row of 128 elements at once
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            d_w_smem[wg_idx] = jnp.zeros((tile_m,), jnp.float32)
            store_d_w()

        @pl.when((group >= 0) & hopper.of_height(tile, height))
        def _():
          def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc=plgpu.ACC((height, wg_cols), jnp.float32))
            def _(acc):
              # The epilogue's reads start before the main loop and run under it.
              for p in range(min(2, len(pieces))):
                fetch(p)
              if weighted:
                plgpu.copy_gmem_to_smem(w_gmem.at[tile.rows], w_smem.at[wg_idx],
                                        barriers.at[8 + wg_idx])
              eval_pipeline(acc)
              epilogue(acc[...])

          def mma(_, grad_smem, w_out_smem, acc):
            # A half tile's block holds the next rows too: only its own enter.
            plgpu.wgmma(acc, grad_smem if height == tile_m else grad_smem.at[:height],
                        hopper.transposed(w_out_smem.at[wg_slice, :]))
            plgpu.wgmma_wait(config.delay_release)
            return acc

          pipeline(mma, compute_context, state)(grad_gmem.at[tile.rows, :],
                                                w_out_gmem.at[group].at[n_slice, :],
                                                allocations=allocs)

      hopper.for_each_tile(tile_body, tile_group_gmem, wg_idx, m_iters=m_iters,
                           n_iters=n_iters, wg_columns=wg_cols, config=config,
                           tables=table_gmems, tile_rows=tile_rows,
                           chain=hopper.chain(allocs, config, k_iters))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = [jax.ShapeDtypeStruct((m, n, padded_f), dtype)]
  if weighted:
    out_type.append(jax.ShapeDtypeStruct((2 * n_iters, m), jnp.float32))
  call = hopper.kernel_call(body, tuple(out_type), num_sms or hopper.num_sms_here(),
                            config.cluster(n_iters), name="activation_grad_matmul")
  outs = call(tile_group, *tables, out_grad, w_out, hidden,
              *([row_weights] if weighted else []))
  d_hidden = outs[0][:, :, :ffn].reshape(m, n * ffn)
  return d_hidden, (outs[1].sum(axis=0) if weighted else None)
