"""Bad static arguments fail at trace time, naming the argument and the rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh, x64_enabled
from moe_ep.transport import combine, dispatch, expert_capacity_for, send_capacity_for
from moe_ep.transport import cupy_backend
from moe_ep.transport import kernel_launch, launch_geometry

TOKENS = jnp.zeros((6, 4), jnp.float32)
IDX = jnp.zeros((6, 2), jnp.int32)
WEIGHTS = jnp.ones((6, 2), jnp.float32)


def call(**overrides):
  args = dict(tokens=TOKENS, topk_idx=IDX, topk_weights=WEIGHTS)
  kwargs = dict(num_experts=4, expert_capacity=8, transport="xla")
  for key, value in overrides.items():
    (args if key in args else kwargs)[key] = value
  return dispatch(args.pop("tokens"), args.pop("topk_idx"), args.pop("topk_weights"), **kwargs)


@pytest.mark.parametrize("overrides, message", [
    (dict(tokens=jnp.zeros((6,))), r"tokens must be \[T, H\]"),
    (dict(topk_idx=jnp.zeros((6,), jnp.int32)), r"topk_idx must be \[T, K\]"),
    (dict(topk_idx=jnp.zeros((6, 2), jnp.float32)), "topk_idx must hold integer"),
    (dict(topk_weights=jnp.ones((6, 3))), "topk_weights shape"),
    (dict(topk_idx=jnp.zeros((5, 2), jnp.int32), topk_weights=jnp.ones((5, 2))),
     r"topk_idx has 5 rows but tokens has 6"),
    (dict(num_experts=1), "top_k=2 must be <= num_experts=1"),
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(expert_capacity=0), "expert_capacity=0 must be a positive integer"),
    (dict(send_capacity=0), "send_capacity=0 must be a positive integer"),
    (dict(transport="triton"), "transport='triton' is not one of"),
    (dict(tokens=jnp.zeros((0, 4)), topk_idx=jnp.zeros((0, 2), jnp.int32),
          topk_weights=jnp.ones((0, 2))),
     r"tokens has 0 rows: dispatch needs T >= 1 \(got shape \(0, 4\)\)"),
    (dict(topk_weights=jnp.ones((6, 2), jnp.int32)), "topk_weights must be floating"),
    (dict(expert_capacity=True), "expert_capacity=True must be a positive integer, not a bool"),
    (dict(send_capacity=np.bool_(True)), "send_capacity=.*True.* must be a positive integer"),
    (dict(num_experts=4.0), r"num_experts=4.0 must be a positive integer"),
    (dict(expert_capacity=8.5), r"expert_capacity=8.5 must be a positive integer"),
    (dict(checkpoint_name=3), "checkpoint_name=3 must be a string or None"),
])
def test_bad_dispatch_arguments(overrides, message):
  with pytest.raises(ValueError, match=message):
    call(**overrides)


def test_bad_combine_arguments():
  d = call()
  slabs = d.tokens
  with pytest.raises(ValueError, match=r"expert_outputs must be \[L, C, H\]"):
    combine(slabs[0], d.handle, num_tokens=6, transport="xla")
  with pytest.raises(ValueError, match="must be \\[L, C, H\\] with \\[L, C\\]"):
    combine(slabs[:, :4], d.handle, num_tokens=6, transport="xla")
  with pytest.raises(ValueError, match="num_tokens=5 does not match the handle's 6"):
    combine(slabs, d.handle, num_tokens=5, transport="xla")
  with pytest.raises(ValueError, match="handle must be the RoutingHandle"):
    combine(slabs, tuple(d.handle), num_tokens=6, transport="xla")


def test_numpy_integer_sizes_are_accepted():
  idx = jnp.asarray(np.arange(12).reshape(6, 2) % 4, jnp.int32)
  plain = call(topk_idx=idx, num_experts=4, expert_capacity=8, send_capacity=6)
  numpy = call(topk_idx=idx, num_experts=np.int64(4), expert_capacity=np.int32(8),
               send_capacity=np.int64(6))
  for got, want in zip(jax.tree.leaves(numpy), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  y = combine(numpy.tokens, numpy.handle, num_tokens=np.int64(6), transport="xla")
  assert y.shape == (6, 4)
  assert expert_capacity_for(np.int64(13), np.int32(3), np.int64(16), np.int64(4)) == 56


def test_zero_tokens_and_bad_capacity_factors_are_named():
  with pytest.raises(ValueError, match="num_tokens=0: expert_capacity_for needs T >= 1"):
    expert_capacity_for(0, 2, 8, 1)
  with pytest.raises(ValueError, match="num_tokens=0: send_capacity_for needs T >= 1"):
    send_capacity_for(np.int64(0), 2, 8, 1, 1.0)
  for factor in (float("inf"), float("nan"), 0.0, True):
    with pytest.raises(ValueError, match=r"capacity_factor=.* must be a finite number > 0"):
      expert_capacity_for(8, 2, 8, 1, factor)
    with pytest.raises(ValueError, match=r"capacity_factor=.* must be a finite number > 0"):
      send_capacity_for(8, 2, 8, 1, factor)
  d = call()
  with pytest.raises(ValueError, match="num_tokens=0: combine needs T >= 1"):
    combine(d.tokens, d.handle, num_tokens=0, transport="xla")
  with pytest.raises(ValueError, match="num_tokens=True must be a positive integer, not a bool"):
    combine(d.tokens, d.handle, num_tokens=True, transport="xla")


def test_axis_name_outside_shard_map_is_named():
  message = (r"dispatch\(axis_name='ep'\): no mapped axis of that name here; call dispatch "
             r"inside jax.shard_map over the 'ep' mesh axis \(or pass axis_name=None for one "
             r"rank\)")
  with pytest.raises(ValueError, match=message):
    call(axis_name="ep")
  with pytest.raises(ValueError, match=message):  # under jit, still outside shard_map
    jax.jit(lambda x: call(tokens=x, axis_name="ep").tokens)(TOKENS)
  d = call()
  with pytest.raises(ValueError, match=message.replace("dispatch", "combine")):
    combine(d.tokens, d.handle, num_tokens=6, axis_name="ep", transport="xla")


def test_experts_not_divisible_by_ep_size_is_named():
  mesh = make_mesh((4,), ("ep",))
  fn = lambda x, i, w: dispatch(x, i, w, num_experts=6, expert_capacity=8, axis_name="ep",
                                transport="xla").tokens
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by the ep axis size 4"):
    jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(
        np.zeros((8, 4), np.float32), np.zeros((8, 2), np.int32), np.ones((8, 2), np.float32))


def test_cupy_transport_without_cupy_names_the_extra(monkeypatch):
  monkeypatch.setattr(kernel_launch, "cupy_available", lambda: False)
  with pytest.raises(ImportError, match=r"moe_ep\[cuda13\]"):
    call(transport="cupy")


@pytest.mark.parametrize("tokens", [1, 100, 4096, 8192, 100_000])
@pytest.mark.parametrize("ep_size, num_experts, top_k", [(1, 8, 2), (8, 256, 8), (64, 4096, 16)])
def test_routing_tiles_fit_shared_memory_and_spread(tokens, ep_size, num_experts, top_k):
  """The CuPy routing kernels' token tiles: whole warps, at most 8, both
  kernels' dynamic shared memory within the 48 KiB default; up to 256
  tokens one tile of 8 warps, beyond that ``ROUTE_WARPS`` warps (fewer
  only where one more warp would not fit)."""
  sizes = launch_geometry.RouteSizes(tokens, ep_size, num_experts, top_k)

  def fits(threads):
    count_ints = launch_geometry.route_count_shared_ints(threads, sizes)
    rank_ints = launch_geometry.route_rank_shared_ints(threads, sizes, counted=tokens > threads)
    return max(count_ints, rank_ints) <= kernel_launch.SHARED_INTS

  threads = launch_geometry.route_threads(sizes)
  assert threads % 32 == 0 and 32 <= threads <= 256 and fits(threads)
  wanted = 256 if tokens <= 256 else 32 * launch_geometry.ROUTE_WARPS
  assert threads == wanted or (threads < wanted and not fits(threads + 32))


def test_routing_that_cannot_fit_shared_memory_is_named():
  with pytest.raises(ValueError, match="ep_size=512, num_experts=512 and top_k=8 do not fit"):
    launch_geometry.route_threads(launch_geometry.RouteSizes(1024, 512, 512, 8))


def test_slab_layout_beyond_int32_positions_is_named():
  """R * S * K received members are indexed in int32 by the kernels (as the
  handle stores them): larger fails at trace time, before any kernel."""
  ep_size, top_k, local_experts, send_capacity = 2, 8, 4, 2**27
  meta = jax.ShapeDtypeStruct((ep_size, 2 * send_capacity * top_k + local_experts), jnp.int32)
  with pytest.raises(ValueError, match=r"R \* S \* K received members = 2147483648 must be"):
    jax.eval_shape(lambda m: cupy_backend.slab_layout(
        m, top_k=top_k, num_local_experts=local_experts, expert_capacity=8), meta)


def test_fp8_wire_rows_the_fused_kernel_cannot_pad_are_refused(monkeypatch):
  """The fused FP8 dispatch writes 0 to 31 zero vectors after a row's codes
  and scales (lanes of its last quantize step): a wire width outside that
  sends the rows through the drop-in exchange, with the reason named."""
  from moe_ep.transport import fp8
  from moe_ep.transport.peer import rows as peer_rows
  assert peer_rows.fused_rows_problem(jnp.bfloat16, 1024, 2, 8, sums=False,
                                      wire_dtype="float8_e4m3fn") is None
  rule = fp8.wire_bytes
  for width, zeros in ((rule(1024) + 32 * 16, 32), (1024, -2)):
    monkeypatch.setattr(fp8, "wire_bytes", lambda h, w=width: w)
    assert f"not {zeros}" in peer_rows.fused_rows_problem(jnp.bfloat16, 1024, 2, 8, sums=False,
                                                          wire_dtype="float8_e4m3fn")


def test_float64_rows_and_rows_without_channels_are_refused_by_name():
  """The transport sums in float32: float64 rows are refused (as the layer
  refuses them), not silently rounded; rows need channels."""
  with x64_enabled():
    with pytest.raises(ValueError, match=r"tokens dtype float64 must be one of"):
      call(tokens=jnp.zeros((6, 4), jnp.float64))
    handle = call().handle
    with pytest.raises(ValueError, match=r"expert_outputs dtype float64 must be one of"):
      combine(jnp.zeros(handle.slab_row.shape + (4,), jnp.float64), handle, num_tokens=6,
              transport="xla")
  with pytest.raises(ValueError, match=r"tokens has shape \(6, 0\): rows need H >= 1"):
    call(tokens=jnp.zeros((6, 0), jnp.float32))
  with pytest.raises(ValueError, match=r"tokens dtype int32 must be one of"):
    call(tokens=jnp.zeros((6, 4), jnp.int32))
