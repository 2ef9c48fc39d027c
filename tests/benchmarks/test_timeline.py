"""The timeline benchmark's split of a trace into calls (the GPU case, where
only the gaps between kernels tell calls apart), on synthetic events; and
which events it reads, on synthetic traces."""

from types import SimpleNamespace as Obj

import pytest

from benchmarks import timeline
from benchmarks.timeline import split_calls


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


def trace(*planes):
  """A jax.profiler.ProfileData stand-in: planes of lines of (start, duration, name)."""
  return Obj(planes=[Obj(name=name, lines=[Obj(name=line, events=[
      Obj(start_ns=s, duration_ns=d, name=n) for s, d, n in events])
      for line, events in lines.items()]) for name, lines in planes])


def test_gpu_kernels_are_read_from_device_0_streams():
  profile = trace(("/device:GPU:0", {"Stream #1": [(0, 5, "route_count"), (900, 5, "route_rank")],
                                     "XLA Ops": [(0, 1, "ignored")]}),
                  ("/host:CPU", {"tf_XLA thread": [(0, 1, "fusion")]}))
  assert timeline._calls_of(profile, 2) == [[(0, 5, "route_count")], [(900, 5, "route_rank")]]


def test_a_gpu_plane_without_kernels_falls_back_to_the_cpu_ops():
  # the programs ran on CPU on a machine with a GPU (JAX_PLATFORMS=cpu): the
  # profiler still lists the GPU, with no kernels on it
  call = timeline._CALL
  profile = trace(("/device:GPU:0", {"Stream #1": []}),
                  ("/host:CPU", {"python": [(0, 50, call), (100, 50, call)],
                                 "tf_XLA client": [(10, 5, "all-to-all.1"), (110, 5, "fusion"),
                                                   (120, 1, "Handle inputs")]}))
  assert timeline._calls_of(profile, 2) == [[(10, 5, "all-to-all.1")], [(110, 5, "fusion")]]


@pytest.mark.parametrize("exchange", ["auto", "all_to_all"])
def test_the_fp8_program_runs_on_the_exchange_dispatch_resolves(exchange):
  # The FP8 program calls the transport with the case's plan directly; a
  # spec left at "auto" once took the all_to_all path even where dispatch
  # takes the peer path (seen on 2 GPUs: NCCL kernels in the FP8 timeline).
  import jax
  import numpy as np
  from moe_ep.transport.plan import resolve_exchange
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
  case = timeline._case(mesh, 16, 128, 8, 2, 1.25, "auto", exchange)
  ep_size = mesh.shape["ep"]  # 2 devices, or 1 on a one-GPU machine
  plan = case["fp8_slabs_plan"]
  assert plan.exchange == resolve_exchange(exchange, "auto", "ep", ep_size, mesh)
  assert plan.exchange in ("all_to_all", "peer")
  assert plan.fp8_slabs and case["options"]["exchange"] == exchange


def test_every_gpus_kernels_are_read_and_timed_from_device_0s_call():
  # One process driving three GPUs: GPU 1's and GPU 10's kernels of each call
  # start later than GPU 0's (their launches trail), and are listed per call
  # from GPU 0's first kernel; a plane named GPU:10 is not GPU 1's or 0's.
  profile = trace(
      ("/device:GPU:0", {"Stream #1": [(0, 5, "route"), (10, 50, "peer_dispatch"),
                                       (1000, 5, "route"), (1010, 50, "peer_dispatch")]}),
      ("/device:GPU:1", {"Stream #7": [(20, 5, "route"), (30, 40, "peer_dispatch"),
                                       (1025, 5, "route"), (1035, 40, "peer_dispatch")]}),
      ("/device:GPU:10", {"Stream #2": [(3, 1, "route"), (1003, 1, "route")]}))
  kernels = timeline._gpu_kernels(profile)
  assert sorted(kernels) == [0, 1, 10] and [len(k) for k in kernels.values()] == [4, 4, 2]
  groups = timeline._calls_of(profile, 2)
  others = timeline._other_gpus_calls(profile, 2)
  records = [timeline._call_record(g, o) for g, o in zip(groups, others)]
  assert [e["name"] for e in records[1]["events"]] == ["route", "peer_dispatch"]
  gpu1 = records[1]["other_gpus"]["1"]
  assert [(e["name"], e["start_us"], e["us"]) for e in gpu1] == [
      ("route", 0.025, 0.005), ("peer_dispatch", 0.035, 0.04)]
  assert [e["start_us"] for e in records[0]["other_gpus"]["10"]] == [0.003]
  assert "GPU 1, the same call" in timeline.summary({
      "ep_size": 2, "processes": 1, "tokens_per_rank": 8, "num_experts": 4,
      "decode_tokens_per_rank": 2, "decode_experts": 4,
      "programs": {"dispatch": [records[0], records[1]]}})
