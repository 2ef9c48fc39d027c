"""moe_ep.row_groups: each buffer row's group against a loop over the groups."""

import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep.row_groups import ROW_TILE, group_of_rows, group_starts


def reference_groups(counts, num_rows, align):
  """A loop in numpy: groups laid out one after another, each rounded up to
  ``align`` and cut at ``num_rows``; -1 on rows of no group."""
  group = np.full(num_rows, -1)
  start = 0
  for g, count in enumerate(counts):
    rows = -(-count // align) * align
    group[start:min(start + rows, num_rows)] = g
    start = min(start + rows, num_rows)
  return group


@pytest.mark.parametrize("counts, num_rows", [
    ([300, 0, 1, 129, 128, 64], 12 * ROW_TILE),  # empty, one-row, exact and spare tiles
    ([0, 0, 517, 0], 6 * ROW_TILE),  # empty groups first and last
    ([700, 700], 9 * ROW_TILE),  # the buffer ends inside the second group
    ([37] * 64, 64 * ROW_TILE),  # many groups of one tile
    ([0] * 5, 2 * ROW_TILE),  # no rows at all
])
def test_each_row_and_tile_gets_the_group_that_holds_it(counts, num_rows, group_align):
  starts, rows = group_starts(jnp.asarray(counts, jnp.int32), num_rows, group_align)
  want = reference_groups(counts, num_rows, group_align)
  got_rows = group_of_rows(starts, rows, jnp.arange(num_rows, dtype=jnp.int32))
  np.testing.assert_array_equal(np.asarray(got_rows), want)
  tiles = jnp.arange(0, num_rows, ROW_TILE, dtype=jnp.int32)  # as the bank asks, a tile's first row
  np.testing.assert_array_equal(np.asarray(group_of_rows(starts, rows, tiles)),
                                want[::ROW_TILE])


@pytest.mark.parametrize("seed", range(40))
def test_the_half_tile_list_covers_each_group_in_whole_tiles_and_one_half(seed):
  """``group_tiles(..., align=ROW_TILE // 2)`` against the rows' groups: each
  row of the buffer in exactly one entry, of its group (-1 where none);
  entries of a whole or half tile, a group's half tile its last; spare
  entries (0 rows) only after the others, within the list's static length."""
  from moe_ep.experts.grouped import group_tiles
  rng = np.random.default_rng(seed)
  half = ROW_TILE // 2
  counts = rng.integers(0, 300, rng.integers(1, 10)) * (rng.random() < 0.9)
  num_rows = ROW_TILE * int(rng.integers(1, 14))
  tiles = group_tiles(jnp.asarray(counts, jnp.int32), num_rows, align=half)
  group, start, rows = map(np.asarray, (tiles.tile_group, tiles.tile_start, tiles.tile_rows))
  assert group.shape == (num_rows // ROW_TILE + (len(counts) + 1) // 2,)
  want = np.full(num_rows, -1)
  begin = 0
  for g, count in enumerate(counts):  # the layout: groups on multiples of half a tile
    end = min(begin + -(-count // half) * half, num_rows)
    want[begin:end] = g
    begin = end
  seen = np.full(num_rows, -2)
  for g, s, r in zip(group, start, rows):
    if r == 0:
      continue
    assert r in (ROW_TILE, half) and s % half == 0 and s + r <= num_rows
    assert (seen[s:s + r] == -2).all()
    seen[s:s + r] = g
  np.testing.assert_array_equal(seen, want)
  spare = np.flatnonzero(rows == 0)
  assert (spare.size == 0) or (spare.min() == (rows > 0).sum())
  for g in range(len(counts)):
    mine = np.flatnonzero((group == g) & (rows > 0))
    assert (rows[mine[:-1]] == ROW_TILE).all()
