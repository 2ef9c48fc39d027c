"""The dispatch plan (moe_ep/transport/plan.py): which exchange, metadata path
and row paths a dispatch or combine takes, resolved once. The expected
table was read off the predicates the row paths used to call themselves
(``exchange.fused_rows``, ``fused_slab_layout``, ``one_launch_dispatch``),
with the peer path's reachability and the one-launch switch patched, as
a GPU would answer them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from benchmarks import ep_inputs
from moe_ep.transport import dispatch, ops, row_paths
from moe_ep.transport.handle import RoutingHandle
from moe_ep.transport.peer import reachability
from moe_ep.transport.peer import runtime as peer_runtime
from moe_ep.transport.plan import (COMBINE_ROW_PATHS, DISPATCH_ROW_PATHS, META_PATHS,
                                   DispatchPlan, plan_combine, plan_dispatch)

FP8 = "float8_e4m3fn"
# (E, K, S, C, H) of bf16 rows. decode: the fused layout and the one-launch
# dispatch fit (2 tiles of members); prefill: neither (128 tiles); odd_rows:
# 14-byte rows, which no fused row launch takes (its FP8 wire rows it does);
# fp8_bytes: H % 16 != 0, so FP8 is quantized before the fused byte-row
# launch; wide_top_k: K = 40, above the fused launches' 32 lanes.
SIZES = {
    "decode": (256, 8, 128, 16, 7168),
    "prefill": (64, 8, 8192, 2560, 7168),
    "odd_rows": (256, 8, 128, 16, 7),
    "fp8_bytes": (256, 8, 128, 16, 200),
    "wide_top_k": (64, 40, 16, 16, 7168),
}

# backend, exchange, R, sizes, rows ("bf16"; "fp8": dequantized as they land;
# "fp8_slabs": FP8 slabs, a checkpoint name), grouped, one launch enabled,
# peer reachable -> exchange, meta_path, dispatch_row_path, combine_row_path
TABLE = [
    ("xla", "auto", 2, "decode", "bf16", False, False, True,
     ("all_to_all", "exchange", "exchange", "exchange")),
    ("cupy", "all_to_all", 2, "decode", "bf16", False, True, True,
     ("all_to_all", "exchange", "exchange", "exchange")),
    ("cupy", "auto", 2, "decode", "bf16", False, False, False,
     ("all_to_all", "exchange", "exchange", "exchange")),
    ("cupy", "auto", 1, "decode", "bf16", False, True, True,
     ("all_to_all", "local", "local", "local")),
    ("cupy", "peer", 1, "decode", "fp8_slabs", False, False, True,
     ("all_to_all", "local", "local", "local")),
    ("xla", "all_to_all", 1, "prefill", "fp8", True, False, True,
     ("all_to_all", "local", "local", "local")),
    ("xla", "peer", 2, "decode", "bf16", False, False, True,
     ("peer", "fused_layout", "fused", "fused")),
    ("cupy", "auto", 2, "decode", "bf16", False, False, True,
     ("peer", "fused_layout", "fused", "fused")),
    ("cupy", "auto", 2, "decode", "bf16", False, True, True,
     ("peer", "fused_layout", "one_launch", "fused")),
    ("auto", "peer", 2, "decode", "bf16", True, True, True,
     ("peer", "fused_layout", "fused", "fused")),
    ("cupy", "auto", 2, "decode", "fp8", False, True, True,
     ("peer", "fused_layout", "exchange", "fused")),
    ("cupy", "auto", 2, "decode", "fp8_slabs", False, True, True,
     ("peer", "fused_layout", "fused", "fused")),
    ("cupy", "all_to_all", 2, "decode", "fp8_slabs", False, False, True,
     ("all_to_all", "exchange", "exchange", "exchange")),
    ("cupy", "auto", 2, "prefill", "bf16", False, True, True,
     ("peer", "exchange", "fused", "fused")),
    ("cupy", "auto", 2, "prefill", "fp8_slabs", True, False, True,
     ("peer", "exchange", "fused", "fused")),
    ("cupy", "auto", 2, "prefill", "fp8", False, False, True,
     ("peer", "exchange", "exchange", "fused")),
    ("cupy", "auto", 2, "odd_rows", "bf16", False, True, True,
     ("peer", "fused_layout", "exchange", "exchange")),
    ("cupy", "auto", 2, "odd_rows", "fp8_slabs", False, False, True,
     ("peer", "fused_layout", "fused_wire", "exchange")),
    ("cupy", "auto", 2, "fp8_bytes", "fp8_slabs", False, False, True,
     ("peer", "fused_layout", "fused_wire", "fused")),
    ("cupy", "auto", 2, "fp8_bytes", "bf16", False, True, True,
     ("peer", "fused_layout", "one_launch", "fused")),
    ("cupy", "peer", 2, "wide_top_k", "fp8_slabs", False, True, True,
     ("peer", "fused_layout", "exchange", "exchange")),
    ("cupy", "peer", 2, "wide_top_k", "bf16", False, True, True,
     ("peer", "fused_layout", "exchange", "exchange")),
]


@pytest.fixture
def peer_switches(monkeypatch, pretend_cupy):
  """Sets whether the peer path reaches every GPU and whether the one-launch
  dispatch is enabled, as a GPU machine would answer."""
  def set_switches(reachable: bool, one_launch: bool):
    monkeypatch.setattr(reachability, "unsupported_reason",
                        lambda mesh, axis: None if reachable else "no peer access")
    monkeypatch.setattr(peer_runtime, "dispatch_layout_enabled", lambda: one_launch)
  return set_switches


def _plan(backend, exchange, ep_size, sizes, rows, grouped, **extra) -> DispatchPlan:
  num_experts, top_k, send_capacity, capacity, hidden = SIZES[sizes]
  return plan_dispatch(num_experts=num_experts, ep_size=ep_size, expert_capacity=capacity,
                       send_capacity=send_capacity, top_k=top_k, hidden=hidden,
                       row_dtype=jnp.bfloat16, axis_name="ep", transport=backend,
                       exchange=exchange, mesh=make_mesh((ep_size,), ("ep",)),
                       wire_dtype=None if rows == "bf16" else FP8,
                       checkpoint_name="moe.dispatch" if rows == "fp8_slabs" else None,
                       grouped_rows=256 if grouped else None, **extra)


@pytest.mark.parametrize("backend, exchange, ep_size, sizes, rows, grouped, one_launch, "
                         "reachable, want", TABLE)
def test_the_plan_takes_the_paths_the_kernels_take_at_these_sizes(
    peer_switches, backend, exchange, ep_size, sizes, rows, grouped, one_launch, reachable, want):
  peer_switches(reachable, one_launch)
  plan = _plan(backend, exchange, ep_size, sizes, rows, grouped)
  assert (plan.exchange, plan.meta_path, plan.dispatch_row_path, plan.combine_row_path) == want
  assert plan.fp8_slabs == (rows == "fp8_slabs")


@pytest.mark.parametrize("backend", ["xla", "cupy", "auto"])
@pytest.mark.parametrize("exchange", ["auto", "all_to_all", "peer"])
@pytest.mark.parametrize("ep_size", [1, 2])
@pytest.mark.parametrize("rows", ["bf16", "fp8", "fp8_slabs"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("one_launch", [False, True])
def test_every_plan_on_one_rank_or_all_to_all_moves_rows_by_the_drop_in_passes(
    peer_switches, backend, exchange, ep_size, rows, grouped, one_launch):
  """Across the grid: one rank runs only local passes; XLA's all_to_all only
  the drop-in passes; fused launches only on the peer path; the one-launch
  dispatch only for bf16 slabs with the switch on; a dequantizing FP8
  dispatch never fused."""
  peer_switches(True, one_launch)
  plan = _plan(backend, exchange, ep_size, "decode", rows, grouped)
  paths = (plan.meta_path, plan.dispatch_row_path, plan.combine_row_path)
  want_exchange = "all_to_all" if ep_size == 1 or exchange == "all_to_all" or (
      exchange == "auto" and backend == "xla") else "peer"
  assert plan.exchange == want_exchange
  if ep_size == 1:
    assert paths == ("local",) * 3
  elif plan.exchange == "all_to_all":
    assert paths == ("exchange",) * 3
  else:
    one = one_launch and rows == "bf16" and not grouped
    assert plan.dispatch_row_path == ("one_launch" if one else
                                      "exchange" if rows == "fp8" else "fused")
    assert (plan.meta_path, plan.combine_row_path) == ("fused_layout", "fused")


def test_a_plan_off_cuda_is_the_all_to_all_plan(peer_switches):
  """A fused launch's other branch runs ``on_all_to_all``: the plan that
  ``exchange="all_to_all"`` resolves to (but for the mesh it drops)."""
  peer_switches(True, True)
  for sizes in SIZES:
    for rows in ("bf16", "fp8", "fp8_slabs"):
      on_peer = _plan("cupy", "peer", 2, sizes, rows, False)
      want = dataclasses.replace(_plan("cupy", "all_to_all", 2, sizes, rows, False), mesh=None)
      assert on_peer.on_all_to_all() == want, (sizes, rows)


def test_a_plan_names_a_path_outside_its_set():
  base = DispatchPlan(num_experts=8, ep_size=2, expert_capacity=8, send_capacity=4, top_k=2,
                      hidden=16, row_dtype="bfloat16", axis_name="ep", transport="xla",
                      exchange="all_to_all", meta_path="exchange", dispatch_row_path="exchange",
                      combine_row_path="exchange")
  for field, value in (("exchange", "auto"), ("meta_path", "one_launch"),
                       ("dispatch_row_path", "drop_in"), ("combine_row_path", "fused_wire"),
                       ("local_passes", "auto")):
    with pytest.raises(ValueError, match=rf"DispatchPlan.{field}='{value}' must be one of"):
      dataclasses.replace(base, **{field: value})
  assert "fused_wire" in DISPATCH_ROW_PATHS and "fused_wire" not in COMBINE_ROW_PATHS
  assert "one_launch" not in META_PATHS


def _handle(ep_size: int, tokens: int, top_k: int, send_capacity: int, slab_rows: tuple):
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
  return RoutingHandle(send_slot=i32(tokens, ep_size), send_token=i32(ep_size, send_capacity),
                       route_slot=i32(tokens, top_k),
                       recv_pos=i32(ep_size, send_capacity, top_k), slab_row=i32(*slab_rows))


@pytest.mark.parametrize("grouped", [False, True])
def test_a_combine_plan_routes_nothing_and_reads_its_sizes_off_the_handle(
    monkeypatch, peer_switches, grouped):
  peer_switches(True, True)

  def not_asked():
    raise AssertionError("a combine's plan asked whether the one-launch dispatch is on")

  monkeypatch.setattr(peer_runtime, "dispatch_layout_enabled", not_asked)
  handle = _handle(2, 128, 8, 128, (256,) if grouped else (128, 16))
  plan = plan_combine(handle, hidden=7168, row_dtype=jnp.bfloat16, axis_name="ep",
                      transport="cupy", exchange="auto", mesh=make_mesh((2,), ("ep",)))
  local, capacity = (1, 256) if grouped else (128, 16)
  assert (plan.num_experts, plan.expert_capacity, plan.send_capacity, plan.top_k) == (
      2 * local, capacity, 128, 8)
  # combine's backward moves rows by the fused launch, never the one-launch dispatch
  assert (plan.exchange, plan.meta_path, plan.dispatch_row_path, plan.combine_row_path) == (
      "peer", None, "fused", "fused")
  assert plan.wire_dtype is None and plan.checkpoint_name is None
  with pytest.raises(ValueError, match="a combine's routes nothing"):
    row_paths.routing(plan, jnp.zeros((4, 8), jnp.int32), jnp.ones((4, 8)))


def test_row_paths_refuse_a_plan_for_other_rows(peer_switches):
  peer_switches(True, False)
  bf16, fp8, fp8_slabs = (_plan("xla", "all_to_all", 2, "decode", rows, False)
                          for rows in ("bf16", "fp8", "fp8_slabs"))
  handle, rows = _handle(2, 128, 8, 128, (128, 16)), jnp.zeros((128, 7168), jnp.bfloat16)
  with pytest.raises(ValueError, match="not on a float8_e4m3fn wire; use rows_to_slabs_fp8"):
    row_paths.rows_to_slabs(fp8_slabs, rows, handle)
  with pytest.raises(ValueError, match="needs a plan with wire_dtype="):
    row_paths.rows_to_slabs_fp8(bf16, rows, handle)
  with pytest.raises(ValueError, match="lands FP8 slabs: wire_dtype='float8_e4m3fn' and a "
                                       "checkpoint_name"):
    row_paths.rows_to_fp8_slabs(fp8, rows, handle)


@pytest.mark.parametrize("exchange", ["all_to_all", "peer"])
def test_a_bench_plan_is_the_plan_dispatch_resolves(monkeypatch, peer_switches, exchange):
  """The benchmarks time row paths with :meth:`EPInputs.plan`: the plan
  dispatch itself resolves at that shape."""
  peer_switches(True, False)
  resolved = []

  def recording(**arguments):
    resolved.append(plan_dispatch(**arguments))
    return resolved[-1]

  monkeypatch.setattr(ops, "plan_dispatch", recording)
  mesh = make_mesh((4,), ("ep",))
  inputs = ep_inputs.ep_inputs(mesh, 16, 32, 8, 2, 1.25, seed=0)
  options = inputs.dispatch_options("xla", exchange)
  fn = jax.shard_map(lambda x, i, w: dispatch(x, i, w, **options).tokens, mesh=mesh,
                     in_specs=P("ep"), out_specs=P("ep"))
  jax.jit(fn).trace(*inputs.dispatch_args)
  assert resolved == [inputs.plan("xla", exchange)]
  assert resolved[0].exchange == exchange


def test_routing_only_is_dispatchs_handle():
  mesh = make_mesh((4,), ("ep",))
  inputs = ep_inputs.ep_inputs(mesh, 16, 32, 8, 2, 1.25, seed=3)
  plan = inputs.plan("xla", "auto")
  handle = jax.jit(ep_inputs.per_rank(mesh, ep_inputs.routing_only(plan)))(inputs.idx,
                                                                          inputs.weights)
  want = jax.jit(ep_inputs.per_rank(mesh, lambda *a: dispatch(
      *a, **inputs.dispatch_options("xla", "auto")).handle))(*inputs.dispatch_args)
  for got, expected in zip(handle, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
