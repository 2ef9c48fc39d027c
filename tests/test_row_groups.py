"""moe_ep.row_groups: each buffer row's group against a loop over the groups."""

import jax.numpy as jnp
import numpy as np
import pytest

from moe_ep.row_groups import ROW_TILE, group_of_rows, group_starts


def reference_groups(counts, num_rows):
  """A loop in numpy: groups laid out one after another, each rounded up to
  ``ROW_TILE`` and cut at ``num_rows``; -1 on rows of no group."""
  group = np.full(num_rows, -1)
  start = 0
  for g, count in enumerate(counts):
    rows = -(-count // ROW_TILE) * ROW_TILE
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
def test_each_row_and_tile_gets_the_group_that_holds_it(counts, num_rows):
  starts, rows = group_starts(jnp.asarray(counts, jnp.int32), num_rows)
  want = reference_groups(counts, num_rows)
  got_rows = group_of_rows(starts, rows, jnp.arange(num_rows, dtype=jnp.int32))
  np.testing.assert_array_equal(np.asarray(got_rows), want)
  tiles = jnp.arange(0, num_rows, ROW_TILE, dtype=jnp.int32)  # as the bank asks, a tile's first row
  np.testing.assert_array_equal(np.asarray(group_of_rows(starts, rows, tiles)),
                                want[::ROW_TILE])
