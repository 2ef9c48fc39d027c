"""The timeline benchmark's split of a trace into calls (the GPU case, where
only the gaps between kernels tell calls apart), on synthetic events."""

import pytest

from moe_ep.bench.timeline import split_calls


def events(*calls, gap=500.0):
  """Kernels (start, duration, name) of consecutive calls, each call's
  kernels ``(offset, duration)`` from its start, calls ``gap`` apart."""
  out, t = [], 0.0
  for number, kernels in enumerate(calls):
    for k, (offset, duration) in enumerate(kernels):
      out.append((t + offset, duration, f"call{number}.k{k}"))
    t = max(start + duration for start, duration, _ in out) + gap
  return sorted(out)


def test_calls_split_at_the_widest_gaps_even_where_kernels_overlap():
  # call 1's second kernel starts inside its first (two streams) and its
  # third starts after a 20-unit gap, narrower than the 500 between calls
  trace = events([(0, 10), (12, 3)], [(0, 100), (50, 10), (120, 5)], [(0, 1)])
  groups = split_calls(trace, 3)
  assert [[name.split(".")[0] for _, _, name in g] for g in groups] == [
      ["call0"] * 2, ["call1"] * 3, ["call2"]]
  assert split_calls(trace, 1) == [trace]


def test_a_gap_is_measured_from_the_latest_end_not_the_last_start():
  # the long first kernel covers the others: no gap inside call 0, though
  # 889 units pass between the second kernel's end and the third's start,
  # more than the 300 between the calls
  trace = events([(0, 1000), (10, 1), (900, 1)], [(0, 1)], gap=300)
  assert [len(g) for g in split_calls(trace, 2)] == [3, 1]


def test_more_calls_than_events_is_an_error():
  with pytest.raises(ValueError, match="2 events cannot make 3 calls"):
    split_calls(events([(0, 1)], [(0, 1)]), 3)
  with pytest.raises(ValueError, match="calls=0 must be >= 1"):
    split_calls(events([(0, 1)]), 0)
