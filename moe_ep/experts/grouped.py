"""The expert bank over the grouped layout: one ``[M, H]`` buffer of rows in
which each local expert's rows are contiguous.

Group ``l`` holds ``counts[l]`` rows from row ``start[l]`` on, where the
starts are the exclusive running sum of the counts rounded up to the
layout's ``group_align`` (:mod:`moe_ep.row_groups`; its padding rows are
zero); rows past the last group belong to none. So every GEMM costs the
routed rows plus at most ``group_align - 1`` rows per expert, whatever the
worst case the static ``M`` must hold.

:func:`grouped_matmul` is a ``custom_vjp`` product with two implementations
of the same three passes (forward, input gradient, weight gradient over the
ragged rows): the Hopper kernels of :mod:`moe_ep.experts.hopper` where they
apply (a CUDA device of compute capability 9.0, 16-bit operands, sizes that
are multiples of 8), ``jax.lax.ragged_dot`` elsewhere. Both
accumulate in float32 and round once. The Hopper kernels' tile
configurations are the caller's (:class:`BankKernels`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_ep import sharding
from moe_ep.capacity import round_up
from moe_ep.experts import hopper, hopper_fused, hopper_wgrad
from moe_ep.activations import activate, small_activation
from moe_ep.experts.slabs import Namer, _no_name
from moe_ep.row_groups import GROUP_ALIGN, ROW_TILE, check_group_align, group_of_rows, group_starts

IMPLEMENTATIONS = ("auto", "hopper", "xla")


@dataclasses.dataclass(frozen=True)
class BankKernels:
  """The tile configurations of the grouped bank's Hopper kernels (hashable:
  the products' custom rules take it as a static argument).

  Attributes:
    matmul: :func:`moe_ep.experts.hopper.grouped_matmul` (the forward and the
      input gradients) and the fused forward
      (:func:`moe_ep.experts.hopper_fused.activation_matmul`).
    activation_grad: the fused input gradient through the activation
      (:func:`moe_ep.experts.hopper_fused.activation_grad_matmul`).
    wgrad: the weight gradient
      (:func:`moe_ep.experts.hopper_wgrad.grouped_matmul_wgrad`); its
      ``chain_tiles`` is its ring's.
  """

  matmul: hopper.TileConfig = hopper.TileConfig()
  activation_grad: hopper.TileConfig = hopper_fused.GRAD_CONFIG
  wgrad: hopper.TileConfig = hopper.TileConfig()

  def scheduled(self, *, cluster_columns: int | None = None, chain_tiles: bool | None = None,
                chain_wgrad: bool | None = None) -> BankKernels:
    """These configurations with every kernel in clusters of
    ``cluster_columns``, the row-tile kernels' tiles chained or not
    (``chain_tiles``) and the weight gradient's (``chain_wgrad``); None keeps
    a field as it is."""
    def set_fields(config, chain):
      fields = {"cluster_columns": cluster_columns, "chain_tiles": chain}
      return dataclasses.replace(config, **{k: v for k, v in fields.items() if v is not None})
    return BankKernels(set_fields(self.matmul, chain_tiles),
                       set_fields(self.activation_grad, chain_tiles),
                       set_fields(self.wgrad, chain_wgrad))


# Rows of a step of the Hopper weight gradient (its tile_k): it divides
# every group alignment, so a group's blocks start and end within its rows.
WGRAD_BLOCK = BankKernels().wgrad.tile_k


class GroupTiles(NamedTuple):
  """Where each group sits in the row buffer: int32 data derived from the counts.

  The GEMMs walk row tiles. With groups on whole tiles (``group_align ==
  ROW_TILE``) tile ``i`` is rows ``[i * ROW_TILE, (i + 1) * ROW_TILE)``;
  with groups on half tiles each group's rows are whole tiles and at most
  one half tile, listed in row order with the rows of no group after them
  (``tile_start`` and ``tile_rows``).

  Attributes:
    group_start: ``[G]`` first row of each group (a multiple of ``group_align``).
    group_rows: ``[G]`` the group's rows rounded up to ``group_align`` (its
      padding rows are zero); a group that would run past the buffer is cut
      at its end.
    group_blocks: ``[G]`` the ``WGRAD_BLOCK``-row blocks that hold each
      group's rows (within ``group_rows``): all that the weight gradient
      contracts over, the rest of ``group_rows`` being zeros.
    tile_group: ``[W]`` the group of each row tile, -1 for none.
    tile_start: None (whole tiles: ``W = M // ROW_TILE``), or ``[W]`` each
      tile's first row.
    tile_rows: None, or ``[W]`` each tile's rows: ``ROW_TILE``, half of it,
      or 0 for the spare entries at the end of the list.
  """

  group_start: jax.Array
  group_rows: jax.Array
  group_blocks: jax.Array
  tile_group: jax.Array
  tile_start: jax.Array | None = None
  tile_rows: jax.Array | None = None


def group_tiles(counts: jax.Array, num_rows: int, align: int = GROUP_ALIGN) -> GroupTiles:
  """The :class:`GroupTiles` of groups of ``counts [G]`` rows in ``num_rows``
  (a multiple of ``ROW_TILE``) rows, starting at multiples of ``align``
  (``ROW_TILE``, the default, or half of it: the layout's ``group_align``)."""
  align = check_group_align(align, "align")
  starts, rows = group_starts(counts, num_rows, align)
  blocks = jnp.minimum(round_up(counts.astype(jnp.int32), WGRAD_BLOCK), rows) // WGRAD_BLOCK
  if align == ROW_TILE:
    tile_firsts = jnp.arange(num_rows // ROW_TILE, dtype=jnp.int32) * ROW_TILE
    return GroupTiles(starts, rows, blocks, group_of_rows(starts, rows, tile_firsts))
  return GroupTiles(starts, rows, blocks, *_half_tile_list(starts, rows, num_rows))


def _half_tile_list(starts, rows, num_rows: int):
  """``(tile_group, tile_start, tile_rows)``, each ``[M // ROW_TILE + (G + 1) // 2]``:
  every group's rows as whole tiles then at most one half tile, then the rows
  of no group the same way, then spare entries of 0 rows. Every run of rows
  is a multiple of half a tile long, so each half tile adds half an entry to
  ``M // ROW_TILE``: at most ``G + 1`` of them."""
  num_groups = starts.shape[0]
  entries = num_rows // ROW_TILE + (num_groups + 1) // 2
  group_entries = -(-rows // ROW_TILE)
  ends = jnp.cumsum(group_entries)
  firsts = ends - group_entries
  grouped_entries, grouped_rows = ends[-1], starts[-1] + rows[-1]
  entry = jnp.arange(entries, dtype=jnp.int32)
  # Unrolled: the default scan is a while loop, read back on the host each step.
  group = jnp.searchsorted(ends, entry, side="right", method="scan_unrolled").astype(jnp.int32)
  in_group = group < num_groups
  g = jnp.minimum(group, num_groups - 1)
  offset = (entry - firsts[g]) * ROW_TILE
  start = jnp.where(in_group, starts[g] + offset,
                    grouped_rows + (entry - grouped_entries) * ROW_TILE)
  height = jnp.where(in_group, jnp.minimum(rows[g] - offset, ROW_TILE),
                     jnp.clip(num_rows - start, 0, ROW_TILE))
  return (jnp.where(in_group, group, -1), jnp.where(height > 0, start, 0),
          height.astype(jnp.int32))


def check_implementation(implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")


def _default_device():
  """The default backend's first device, or None where there is none."""
  try:
    return jax.devices()[0]
  except RuntimeError:
    return None


@functools.cache
def hopper_available() -> bool:
  """Whether the default backend is a CUDA GPU of compute capability 9.0."""
  device = _default_device()
  return (device is not None and device.platform == "gpu"
          and getattr(device, "compute_capability", None) == "9.0")


def kernels_apply(dtype, hidden: int, ffn: int) -> bool:
  """Whether every GEMM of a bank of ``hidden`` and ``ffn`` sizes in
  ``dtype`` runs on the Hopper kernels here (what ``expert_layout="auto"``
  asks)."""
  # The bank's GEMMs contract over H into F columns and over F into H
  # columns (the gradients too, transposed).
  return hopper_available() and all(
      hopper.supports(dtype, rows=ROW_TILE, contraction=inner, columns=outer)
      for inner, outer in ((hidden, ffn), (ffn, hidden)))


def bank_layout(expert_layout: str, dtype, hidden: int, ffn: int) -> str:
  """``"grouped"`` or ``"slabs"``: the layout a bank of ``expert_layout``
  (``"auto"``: grouped wherever :func:`kernels_apply`) runs on here. On a
  GPU where "auto" cannot be grouped it says so, once per bank shape."""
  if expert_layout != "auto":
    return expert_layout
  if kernels_apply(dtype, hidden, ffn):
    return "grouped"
  if _on_gpu():
    _warn_slabs(jnp.dtype(dtype).name, hidden, ffn)
  return "slabs"


def _on_gpu() -> bool:
  device = _default_device()
  return device is not None and device.platform == "gpu"


@functools.cache
def _warn_slabs(dtype: str, hidden: int, ffn: int) -> None:
  reason = ("this GPU is not of compute capability 9.0" if not hopper_available() else
            f"the kernels take bfloat16/float16 with H and F multiples of "
            f"{hopper.SIZE_MULTIPLE}")
  warnings.warn(
      f"expert_layout='auto' runs the expert bank (dtype={dtype}, H={hidden}, F={ffn}) on "
      f"slabs, not the grouped layout: {reason}. Dropless slabs hold every expert's worst case "
      f"(measured several times the grouped bank's time); a capacity_factor bounds them, or "
      f"set dtype='bfloat16' where the sizes allow.", stacklevel=3)


def _uses_hopper(implementation: str, dtype, rows: int, contraction: int, columns: int) -> bool:
  if implementation == "xla":
    return False
  fits = hopper.supports(dtype, rows=rows, contraction=contraction, columns=columns)
  if implementation == "hopper":
    if not hopper_available():
      raise ValueError("implementation='hopper' needs a CUDA GPU of compute capability 9.0 "
                       "(H100, H200); use 'auto' or 'xla'")
    if not fits:
      raise ValueError(
          f"implementation='hopper' needs bfloat16/float16 operands, rows a multiple of "
          f"{ROW_TILE} and sizes of {hopper.SIZE_MULTIPLE}; got {jnp.dtype(dtype).name} "
          f"rows={rows} contraction={contraction} columns={columns}: use 'auto' or 'xla'")
    return True
  return fits and hopper_available()


# --- the three passes, per implementation -----------------------------------


def _forward_xla(lhs, rhs, tiles: GroupTiles, transpose_rhs: bool):
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  out = jax.lax.ragged_dot(lhs, rhs, tiles.group_rows, preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def _wgrad_xla(lhs, rhs, tiles: GroupTiles):
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  out = jax.lax.ragged_dot_general(lhs, rhs, tiles.group_rows, numbers,
                                   preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def _forward(implementation, kernels: BankKernels, lhs, rhs, tiles, transpose_rhs):
  columns = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if _uses_hopper(implementation, lhs.dtype, lhs.shape[0], lhs.shape[1], columns):
    return jax.lax.platform_dependent(
        lhs, rhs, tiles,
        cuda=lambda a, b, t: sharding.vary_like(
            hopper.grouped_matmul(a, b, t.tile_group, transpose_rhs=transpose_rhs,
                                  config=kernels.matmul, tile_start=t.tile_start,
                                  tile_rows=t.tile_rows), a, b),
        default=lambda a, b, t: _forward_xla(a, b, t, transpose_rhs))
  return _forward_xla(lhs, rhs, tiles, transpose_rhs)


def _wgrad(implementation, kernels: BankKernels, lhs, rhs, tiles):
  if _uses_hopper(implementation, lhs.dtype, lhs.shape[0], lhs.shape[1], rhs.shape[1]):
    return jax.lax.platform_dependent(
        lhs, rhs, tiles,
        cuda=lambda a, b, t: sharding.vary_like(hopper_wgrad.grouped_matmul_wgrad(
            a, b, t.group_start, t.group_blocks, t.group_start.shape[0],
            config=kernels.wgrad), a, b),
        default=_wgrad_xla)
  return _wgrad_xla(lhs, rhs, tiles)


def _no_gradient(tiles: GroupTiles) -> GroupTiles:
  """The cotangent of int32 layout data: float0 zeros."""
  return jax.tree.map(lambda t: jnp.zeros(t.shape, jax.dtypes.float0), tiles)


def _weights_like(weights: jax.Array, rows: jax.Array) -> jax.Array:
  """``weights`` in the rows' dtype, varying like them: the custom rules'
  weight gradients vary like the rows (over the batch axes too), and the
  transpose of this cast sums them over those axes."""
  return sharding.vary_like(weights.astype(rows.dtype), rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped_matmul(implementation, kernels, lhs, rhs, tiles):
  return _forward(implementation, kernels, lhs, rhs, tiles, False)


def _grouped_matmul_fwd(implementation, kernels, lhs, rhs, tiles):
  return _forward(implementation, kernels, lhs, rhs, tiles, False), (lhs, rhs, tiles)


def _grouped_matmul_bwd(implementation, kernels, residuals, out_grad):
  lhs, rhs, tiles = residuals
  out_grad = out_grad.astype(lhs.dtype)
  lhs_grad = _forward(implementation, kernels, out_grad, rhs, tiles, True)
  rhs_grad = _wgrad(implementation, kernels, lhs, out_grad, tiles)
  tiles_grad = _no_gradient(tiles)
  return lhs_grad, rhs_grad, tiles_grad


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, tiles: GroupTiles,
                   implementation: str = "auto",
                   kernels: BankKernels = BankKernels()) -> jax.Array:
  """``out[rows_g] = lhs[rows_g] @ rhs[g]`` for every group ``g``, differentiable
  in ``lhs`` and ``rhs``.

  Args:
    lhs: ``[M, K]`` rows in the grouped layout (``M % ROW_TILE == 0``).
    rhs: ``[G, K, N]``, cast to ``lhs.dtype``.
    tiles: the :class:`GroupTiles` of the layout (:func:`group_tiles`).
    implementation: ``"auto"`` (the Hopper kernels where they apply),
      ``"hopper"`` or ``"xla"``.
    kernels: the Hopper kernels' tile configurations.

  Returns:
    ``[M, N]`` in ``lhs.dtype``, zero on rows of no group (and so is the
    gradient of ``lhs`` there); padding rows of a group, zero in ``lhs``, are
    zero.
  """
  check_implementation(implementation)
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"grouped_matmul needs lhs [M, K] and rhs [G, K, N]; got {lhs.shape} "
                     f"and {rhs.shape}")
  whole_tiles = tiles.tile_rows is None
  if lhs.shape[0] % ROW_TILE or (whole_tiles and
                                 tiles.tile_group.shape[0] * ROW_TILE != lhs.shape[0]):
    raise ValueError(f"lhs has {lhs.shape[0]} rows: the grouped layout needs a multiple of "
                     f"{ROW_TILE} matching tiles.tile_group {tiles.tile_group.shape}")
  rhs = _weights_like(rhs, lhs)
  return _grouped_matmul(implementation, kernels, lhs, rhs, tiles)


# --- the activation fused into the two GEMMs (Hopper) ------------------------
#
# Two custom rules whose product is the MLP: the first returns ``hidden`` and
# ``act``; the second multiplies ``act`` by ``w_out`` and, backward, returns
# the whole gradient through the activation as ``hidden``'s (the derivative
# in its input gradient's epilogue), none as ``act``'s. Apart they would not
# be each other's derivative; composed, as only :func:`grouped_expert_mlp`
# composes them, ``act`` is always the activation of ``hidden``.


def _fuses_activation(implementation, dtype, rows, hidden, ffn, activation) -> bool:
  return (activation in hopper_fused.ACTIVATIONS
          and _uses_hopper(implementation, dtype, rows, hidden, ffn)
          and _uses_hopper(implementation, dtype, rows, ffn, hidden))


def _activation_xla(lhs, rhs, tiles, row_weights, activation):
  hidden = _forward_xla(lhs, rhs, tiles, False)
  return hidden, activate(hidden, activation, row_weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _activation_matmul(implementation, kernels, activation, lhs, rhs, row_weights, tiles):
  return jax.lax.platform_dependent(
      lhs, rhs, row_weights, tiles,
      cuda=lambda a, b, w, t: tuple(
          sharding.vary_like(v, a, b) for v in hopper_fused.activation_matmul(
              a, b, t.tile_group, w, activation, config=kernels.matmul,
              tile_start=t.tile_start, tile_rows=t.tile_rows)),
      default=lambda a, b, w, t: _activation_xla(a, b, t, w, activation))


def _activation_matmul_fwd(implementation, kernels, activation, lhs, rhs, row_weights, tiles):
  out = _activation_matmul(implementation, kernels, activation, lhs, rhs, row_weights, tiles)
  return out, (lhs, rhs, row_weights, tiles)


def _activation_matmul_bwd(implementation, kernels, activation, residuals, grads):
  lhs, rhs, row_weights, tiles = residuals
  hidden_grad = grads[0].astype(lhs.dtype)  # act's is taken through hidden: zero here
  lhs_grad = _forward(implementation, kernels, hidden_grad, rhs, tiles, True)
  rhs_grad = _wgrad(implementation, kernels, lhs, hidden_grad, tiles)
  weights_grad = (None if row_weights is None else
                  sharding.vary_like(jnp.zeros_like(row_weights), row_weights))
  tiles_grad = _no_gradient(tiles)
  return lhs_grad, rhs_grad, weights_grad, tiles_grad


_activation_matmul.defvjp(_activation_matmul_fwd, _activation_matmul_bwd)


def _activation_grad_xla(out_grad, w_out, hidden, tiles, row_weights, activation):
  act_grad = _forward_xla(out_grad, w_out, tiles, True)
  # row_weights None is an empty argument: its gradient comes back None.
  _, vjp = jax.vjp(lambda h, w: activate(h, activation, w), hidden, row_weights)
  return vjp(act_grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _activated_matmul(implementation, kernels, activation, act, hidden, w_out, row_weights,
                      tiles):
  return _forward(implementation, kernels, act, w_out, tiles, False)


def _activated_matmul_fwd(implementation, kernels, activation, act, hidden, w_out, row_weights,
                          tiles):
  out = _forward(implementation, kernels, act, w_out, tiles, False)
  return out, (act, hidden, w_out, row_weights, tiles)


def _activated_matmul_bwd(implementation, kernels, activation, residuals, out_grad):
  act, hidden, w_out, row_weights, tiles = residuals
  out_grad = out_grad.astype(act.dtype)
  hidden_grad, weights_grad = jax.lax.platform_dependent(
      out_grad, w_out, hidden, row_weights, tiles,
      cuda=lambda g, b, h, w, t: jax.tree.map(
          lambda v: sharding.vary_like(v, g, b, h),
          hopper_fused.activation_grad_matmul(g, b, h, t.tile_group, w, activation,
                                              config=kernels.activation_grad,
                                              tile_start=t.tile_start, tile_rows=t.tile_rows)),
      default=lambda g, b, h, w, t: _activation_grad_xla(g, b, h, t, w, activation))
  w_out_grad = _wgrad(implementation, kernels, act, out_grad, tiles)
  tiles_grad = _no_gradient(tiles)
  act_grad = sharding.vary_like(jnp.zeros_like(act), act)  # all of it went through hidden
  return act_grad, hidden_grad, w_out_grad, weights_grad, tiles_grad


_activated_matmul.defvjp(_activated_matmul_fwd, _activated_matmul_bwd)


def grouped_expert_mlp(rows: jax.Array, counts: jax.Array, w_in: jax.Array, w_out: jax.Array,
                       activation: str, name: Namer = _no_name,
                       implementation: str = "auto",
                       row_weights: jax.Array | None = None,
                       fuse_activation: bool | None = None,
                       group_align: int = GROUP_ALIGN,
                       kernels: BankKernels = BankKernels()) -> jax.Array:
  """Applies expert ``l``'s MLP to the rows of group ``l``.

  Args:
    rows: ``[M, H]`` in the grouped layout, compute dtype.
    counts: ``[L]`` int32 rows of each group.
    w_in: ``[L, H, n*F]``; w_out: ``[L, F, H]`` (as :func:`moe_ep.experts.expert_mlp`).
    activation, name: as :func:`moe_ep.experts.expert_mlp`. Where the
      activation is fused, ``"expert_hidden"`` names both the activation's
      input ``[M, n*F]`` and its output ``[M, F]``: saving it keeps every
      expert GEMM out of backward's recomputation.
    implementation: as :func:`grouped_matmul`.
    row_weights: ``[M]`` float32 routing weight of each row, or None: the
      output is then weighted (:func:`moe_ep.experts.activate`).
    fuse_activation: on the Hopper kernels, compute the activation in the
      first GEMM's epilogue and its derivative in the epilogue of the
      second's input gradient (:mod:`moe_ep.experts.hopper_fused`); False
      runs them as XLA passes between the GEMMs; None: where
      :func:`moe_ep.activations.small_activation`.
    group_align: where the groups of ``rows`` start, as dispatch filled them
      (:func:`group_tiles`): multiples of ``ROW_TILE`` (the default) or half
      of it.
    kernels: the Hopper kernels' tile configurations.

  Returns:
    ``[M, H]`` in ``rows.dtype``, zero on rows of no group, where the
    gradient of ``rows`` is zero too.
  """
  tiles = group_tiles(counts, rows.shape[0], group_align)
  ffn = w_out.shape[1]
  if fuse_activation is None:
    fuse_activation = small_activation(rows.shape[1], ffn)
  if fuse_activation and _fuses_activation(implementation, rows.dtype, rows.shape[0],
                                           rows.shape[1], ffn, activation):
    w_in, w_out = _weights_like(w_in, rows), _weights_like(w_out, rows)
    hidden, act = _activation_matmul(implementation, kernels, activation, rows, w_in,
                                     row_weights, tiles)
    hidden, act = name("expert_hidden", hidden), name("expert_hidden", act)
    out = _activated_matmul(implementation, kernels, activation, act, hidden, w_out,
                            row_weights, tiles)
    return name("expert_output", out)
  hidden = name("expert_hidden", grouped_matmul(rows, w_in, tiles, implementation, kernels))
  out = grouped_matmul(activate(hidden, activation, row_weights), w_out, tiles, implementation,
                       kernels)
  return name("expert_output", out)
