"""The peer kernels at EP = 2, 4 and 8 on ONE GPU
(benchmarks/peer_loopback.py): every rank's output of the dispatch
(bf16 rows, and FP8 quantizing float32 and bf16 rows) and of the combine,
bit for bit against the pure-JAX path run on R CPU devices; and of the
drop-in exchange (every vector width) against all_to_all's definition. The maps carry
invalid ids, wire drops (send capacity) and slab drops (expert capacity);
at EP > 2 tokens go to several remote ranks, so the block that sends a
token's first remote row places its own row."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.transport import combine, dispatch, ops, row_paths
from moe_ep.transport import xla as xla_backend
from moe_ep.transport.launch_geometry import SlabSizes, slab_geometry
from moe_ep.transport.plan import plan_dispatch
from moe_ep.transport.peer import channel, dispatch_layout, fused_layout
from benchmarks import peer_loopback
from moe_ep.transport.peer import rows as peer_rows

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN, EXPERTS, TOP_K = 96, 1040, 16, 4  # FP8 wire rows of 1152 bytes: 4 zero vectors
FP8 = "float8_e4m3fn"


def _reference(ep_size: int, dtype, seed: int) -> list[dict]:
  """Per rank: its rows, handle, the pure-JAX dispatch's slabs (bf16 rows
  and FP8 wire rows), expert outputs and their combine, on R CPU devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:ep_size]), ("ep",))
  rng = np.random.default_rng(seed)
  rows = ep_size * TOKENS
  idx = np.argsort(rng.random((rows, EXPERTS)), axis=1)[:, :TOP_K].astype(np.int32)
  idx[rng.random(idx.shape) < 0.05] = -1  # invalid ids: not routed
  weights = rng.random((rows, TOP_K)).astype(np.float32)
  x = rng.standard_normal((rows, HIDDEN)).astype(dtype)
  # 0.9 of the mean routes per expert and of the mean tokens per rank: both kinds of drop
  local = EXPERTS // ep_size
  capacity = int(0.9 * ep_size * TOKENS * TOP_K / EXPERTS)
  send_capacity = int(0.9 * TOKENS * (1 - math.comb(EXPERTS - local, TOP_K)
                                      / math.comb(EXPERTS, TOP_K)))
  outputs = rng.standard_normal((EXPERTS * capacity, HIDDEN)).astype(dtype)
  fp8_slabs_plan = plan_dispatch(num_experts=EXPERTS, ep_size=ep_size, expert_capacity=capacity,
                                 send_capacity=send_capacity, top_k=TOP_K, hidden=HIDDEN,
                                 row_dtype=dtype, axis_name="ep", transport="xla",
                                 exchange="all_to_all", mesh=mesh, wire_dtype=FP8,
                                 checkpoint_name="moe.dispatch")

  def program(x, idx, weights, outputs):
    d = dispatch(x, idx, weights, num_experts=EXPERTS, expert_capacity=capacity,
                 axis_name="ep", send_capacity=send_capacity, transport="xla", mesh=mesh)
    fp8_slabs = row_paths.rows_to_fp8_slabs(fp8_slabs_plan, x, d.handle)
    expert_out = outputs.reshape(d.tokens.shape)
    y = combine(expert_out, d.handle, num_tokens=TOKENS, axis_name="ep", transport="xla",
                mesh=mesh)
    # route's metadata, before its exchange, from the ids dispatch routes by
    merged = ops.merge_duplicate_routes(ops.valid_ids(idx, EXPERTS), weights)
    meta = xla_backend.route(*merged, num_experts=EXPERTS, ep_size=ep_size,
                             send_capacity=send_capacity)[3]
    return d.tokens, fp8_slabs, d.handle, expert_out, y, meta, d.weights, d.counts, d.demand

  shard = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
  got = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
      *(shard(a) for a in (x, idx, weights, outputs)))
  slabs, fp8_slabs, handle, expert_out, y, meta, slab_weights, counts, demand = got
  part = lambda a, r: np.asarray(a.addressable_shards[r].data)  # noqa: E731
  return [dict(rows=part(shard(x), r), send_token=part(handle.send_token, r).reshape(-1),
               send_slot=part(handle.send_slot, r), recv_pos=part(handle.recv_pos, r),
               slab_row=part(handle.slab_row, r).reshape(-1),
               slabs=part(slabs, r), fp8_slabs=part(fp8_slabs, r),
               expert_out=part(expert_out, r), y=part(y, r), meta=part(meta, r),
               slab_weights=part(slab_weights, r).reshape(-1), counts=part(counts, r),
               demand=part(demand, r), capacity=capacity) for r in range(ep_size)]


def _filled(rank: dict) -> np.ndarray:
  """``[L * C]`` bool: the slab rows a member fills (slab_row in [0, R * S)),
  the rows on which FP8 slabs are defined."""
  return (rank["slab_row"] >= 0) & (rank["slab_row"] < rank["send_token"].size)


def _dispatch_inputs(rank: dict) -> tuple:
  return (rank["rows"], rank["send_token"], rank["send_slot"], rank["recv_pos"].reshape(-1),
          rank["slab_row"])


@pytest.mark.parametrize("ep_size", [2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_every_rank_matches_pure_jax(ep_size, dtype):
  ranks = _reference(ep_size, dtype, seed=ep_size)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  slab_rows = ranks[0]["slab_row"].shape[0]
  assert (ranks[0]["send_slot"] < 0).any() and (ranks[0]["slab_row"] < 0).any()
  # combine sends back zeros for a slot whose every route here was dropped
  # (-2), and nothing for a slot its source left empty (every member -1,
  # here only at EP > 2: at EP=2 these maps fill every slot)
  recv_pos = np.stack([r["recv_pos"] for r in ranks])
  held = (recv_pos != -1).any(-1)
  assert (held & ~(recv_pos >= 0).any(-1)).any() and ((~held).any() or ep_size == 2)
  if ep_size > 2:  # some token goes to two or more other ranks
    remote = (ranks[0]["send_slot"] >= 0).sum(1) - (ranks[0]["send_slot"][:, 0] >= 0)
    assert (remote >= 2).any()
  kernels = {
      "slabs": peer_rows.dispatch_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows),
      "fp8_slabs": peer_rows.dispatch_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k,
                                             slab_rows, wire_dtype=FP8),
  }
  for rank in range(ep_size):
    for name, kernel in kernels.items():
      want = ranks[rank][name].reshape(slab_rows, -1)
      got = peer_loopback.run_rank(kernel, [_dispatch_inputs(r) for r in ranks],
                                   want.shape, want.dtype, rank=rank)
      rows = _filled(ranks[rank]) if name == "fp8_slabs" else slice(None)  # FP8 padding: any
      np.testing.assert_array_equal(got.view(np.uint8)[rows], want.view(np.uint8)[rows],
                                    err_msg=f"{name}, rank {rank} of {ep_size}")
    kernel = peer_rows.combine_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows,
                                      ep_size=ep_size)
    inputs = [(r["expert_out"].reshape(slab_rows, HIDDEN), r["recv_pos"].reshape(-1, top_k),
               r["send_slot"]) for r in ranks]
    want = ranks[rank]["y"]
    got = peer_loopback.run_rank(kernel, inputs, want.shape, want.dtype, rank=rank)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                  err_msg=f"combine, rank {rank} of {ep_size}")


@pytest.mark.parametrize("ep_size", [2, 4])
def test_fused_slab_layout_is_the_exchange_then_the_layout(ep_size):
  """peer_slab_layout (decode's metadata exchange and slab layout in one
  launch), every rank: recv_pos, slab_row, the slab weights' bits, counts and
  demand equal the pure-JAX layout of the exchanged metadata, with invalid
  ids and both kinds of drop (one member tile)."""
  ranks = _reference(ep_size, jnp.bfloat16, seed=10 + ep_size)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  local, capacity = EXPERTS // ep_size, ranks[0]["capacity"]
  assert fused_layout.fused_layout_fits(SlabSizes(ep_size, send_capacity, top_k, local, capacity))
  assert (ranks[0]["recv_pos"] == -2).any() and (ranks[0]["slab_row"] < 0).any()
  for rank in range(ep_size):
    got = peer_loopback.slab_layout_rank([r["meta"] for r in ranks],
                                         (send_capacity, top_k, local, capacity), rank=rank)
    want = ranks[rank]
    for name, value in zip(("recv_pos", "slab_row", "slab_weights", "counts", "demand"), got):
      np.testing.assert_array_equal(value.view(np.int32), want[name].reshape(-1).view(np.int32),
                                    err_msg=f"{name}, rank {rank} of {ep_size}")


def test_fused_slab_layout_at_decode_counts_the_other_tile():
  """Decode's shape at EP=2 (T=128, E=256, K=8): 2048 members, two tiles of
  1024, so each layout block also counts the tile it does not rank; C=6
  drops routes. Against the pure-JAX layout of the exchanged metadata."""
  ranks, tokens, experts, top_k, capacity = 2, 128, 256, 8, 6
  rng = np.random.default_rng(5)
  metas = []
  for _ in range(ranks):
    idx = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    metas.append(np.asarray(xla_backend.route(idx, weights, num_experts=experts,
                                              ep_size=ranks, send_capacity=tokens)[3]))
  sizes = (tokens, top_k, experts // ranks, capacity)
  assert fused_layout.fused_layout_fits(SlabSizes(ranks, *sizes))
  assert slab_geometry(SlabSizes(ranks, *sizes)).tiles == 2
  for rank in range(ranks):
    got = peer_loopback.slab_layout_rank(metas, sizes, rank=rank)
    want = xla_backend.slab_layout(np.stack([m[rank] for m in metas]), top_k=top_k,
                                   num_local_experts=experts // ranks, expert_capacity=capacity)
    assert (np.asarray(want[0]) == -2).any()
    for name, value, expected in zip(("recv_pos", "slab_row", "slab_weights", "counts",
                                      "demand"), got, want):
      np.testing.assert_array_equal(value.view(np.int32),
                                    np.asarray(expected).reshape(-1).view(np.int32),
                                    err_msg=f"{name}, rank {rank}")


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("ep_size", [2, 4])
def test_dispatch_with_layout_is_the_pure_jax_dispatch(monkeypatch, ep_size, counted):
  """peer_dispatch_layout (the metadata exchange, the slab layout and the
  rows in one launch), every rank: its slabs and the handle's maps equal the
  pure-JAX dispatch's bit for bit, with invalid ids and both kinds of drop;
  two member tiles of 512, each counted by every receiver block, or
  (counted: as with more tiles than that path takes, or than receiver
  blocks) once each into scratch, ranked after a barrier."""
  if counted:
    monkeypatch.setattr(dispatch_layout, "dispatch_layout_counted",
                        lambda tiles, receivers=None: True)
  ranks = _reference(ep_size, jnp.bfloat16, seed=20 + ep_size)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  local, capacity = EXPERTS // ep_size, ranks[0]["capacity"]
  assert dispatch_layout.dispatch_layout_fits(
      jnp.bfloat16, HIDDEN, SlabSizes(ep_size, send_capacity, top_k, local, capacity))
  kernel = dispatch_layout.dispatch_layout_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity,
                                                  top_k, local, capacity)
  inputs = [(r["rows"], r["send_token"], r["send_slot"], r["meta"]) for r in ranks]
  for rank in range(ep_size):
    got = peer_loopback.dispatch_layout_rank(kernel, inputs, rank=rank)
    want = ranks[rank]
    np.testing.assert_array_equal(got[0], want["slabs"].view(np.uint8).reshape(got[0].shape),
                                  err_msg=f"slabs, rank {rank} of {ep_size}")
    for name, value in zip(("recv_pos", "slab_row", "slab_weights", "counts", "demand"),
                           got[1:]):
      np.testing.assert_array_equal(value.view(np.int32), want[name].reshape(-1).view(np.int32),
                                    err_msg=f"{name}, rank {rank} of {ep_size}")


def test_dispatch_with_layout_at_decode_is_the_two_launches():
  """Decode's shape at EP=2 (T=128, E=256, K=8, H=7168): 2048 members, four
  tiles of 512. Every rank's slabs and maps equal those of the metadata
  exchange fused with the layout followed by peer_dispatch (each checked
  against pure JAX above)."""
  ranks, tokens, experts, top_k, hidden, capacity = 2, 128, 256, 8, 7168, 12
  local = experts // ranks
  rng = np.random.default_rng(6)
  routes, rows = [], []
  for _ in range(ranks):
    idx = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    routes.append([np.asarray(a) for a in xla_backend.route(
        idx, weights, num_experts=experts, ep_size=ranks, send_capacity=tokens)])
    rows.append(rng.standard_normal((tokens, hidden)).astype(jnp.bfloat16))
  assert dispatch_layout.dispatch_layout_fits(
      jnp.bfloat16, hidden, SlabSizes(ranks, tokens, top_k, local, capacity))
  kernel = dispatch_layout.dispatch_layout_kernel(jnp.bfloat16, tokens, hidden, tokens, top_k,
                                                  local, capacity)
  inputs = [(rows[q], routes[q][1].reshape(-1), routes[q][0], routes[q][3])
            for q in range(ranks)]
  sizes = (tokens, top_k, local, capacity)
  maps = [peer_loopback.slab_layout_rank([r[3] for r in routes], sizes, rank=q)
          for q in range(ranks)]
  two = peer_rows.dispatch_kernel(jnp.bfloat16, tokens, hidden, tokens, top_k, local * capacity)
  for rank in range(ranks):
    got = peer_loopback.dispatch_layout_rank(kernel, inputs, rank=rank)
    slabs = peer_loopback.run_rank(
        two, [(rows[q], routes[q][1].reshape(-1), routes[q][0], maps[q][0], maps[q][1])
              for q in range(ranks)], (local * capacity, hidden), jnp.bfloat16, rank=rank)
    assert (maps[rank][0] == -2).any()
    np.testing.assert_array_equal(got[0], slabs.view(np.uint8), err_msg=f"slabs, rank {rank}")
    for name, value, expected in zip(("recv_pos", "slab_row", "slab_weights", "counts",
                                      "demand"), got[1:], maps[rank]):
      np.testing.assert_array_equal(value.view(np.int32), expected.view(np.int32),
                                    err_msg=f"{name}, rank {rank}")


def test_dispatch_with_layout_names_a_rank_that_never_sends():
  ranks = _reference(2, jnp.bfloat16, seed=4)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  kernel = dispatch_layout.dispatch_layout_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity,
                                                  top_k, EXPERTS // 2, ranks[0]["capacity"])
  with pytest.raises(RuntimeError, match="rank 0 waited in vain for rank 1"):
    peer_loopback.dispatch_layout_rank(
        kernel, [(r["rows"], r["send_token"], r["send_slot"], r["meta"]) for r in ranks],
        rank=0, absent=(1,), timeout_s=0.5)


def test_fused_slab_layout_names_a_rank_that_never_sends():
  ranks = _reference(2, jnp.bfloat16, seed=3)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  with pytest.raises(RuntimeError, match="rank 0 waited in vain for rank 1"):
    peer_loopback.slab_layout_rank([r["meta"] for r in ranks],
                                   (send_capacity, top_k, EXPERTS // 2, ranks[0]["capacity"]),
                                   rank=0, absent=(1,), timeout_s=0.5)


def test_a_rank_that_never_sends_is_named():
  """Rank 1's kernel never runs, so rank 0 waits for chunks that never
  come: the bounded wait ends in an error naming rank 1, not a hang."""
  ranks = _reference(2, jnp.bfloat16, seed=0)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  slab_rows = ranks[0]["slab_row"].shape[0]
  kernel = peer_rows.dispatch_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k, slab_rows)
  with pytest.raises(RuntimeError, match="rank 0 waited in vain for rank 1"):
    peer_loopback.run_rank(kernel, [_dispatch_inputs(r) for r in ranks], (slab_rows, HIDDEN),
                           ranks[0]["slabs"].dtype, rank=0, absent=(1,), timeout_s=0.5)


@pytest.mark.parametrize("ep_size", [2, 4, 8])
@pytest.mark.parametrize("shape, dtype", [((64, 16), np.int32), ((3, 2), np.int32),
                                          ((5,), np.int32), ((3,), np.int16), ((7,), np.uint8)])
def test_drop_in_exchange_is_all_to_all(ep_size, shape, dtype):
  """Chunks of 4096, 24, 20, 6 and 7 bytes: the 16-, 8-, 4-, 2- and 1-byte copies."""
  rng = np.random.default_rng(ep_size)
  chunks = [rng.integers(0, 100, (ep_size, *shape)).astype(dtype) for _ in range(ep_size)]
  assert channel.ChannelLayout(ep_size, chunks[0].nbytes // ep_size).vector_bytes == {
      4096: 16, 24: 8, 20: 4, 6: 2, 7: 1}[chunks[0].nbytes // ep_size]
  for rank in range(ep_size):
    got = peer_loopback.exchange_rank(chunks, rank=rank)
    np.testing.assert_array_equal(got, np.stack([c[rank] for c in chunks]),
                                  err_msg=f"rank {rank} of {ep_size}")


@pytest.mark.parametrize("zero_vectors", [0, 4, 28])
def test_fp8_dispatch_takes_the_wire_width_it_is_given(monkeypatch, zero_vectors):
  # The kernel takes W from its argument (fp8.wire_bytes, the one place the
  # rule lives): rows of 1088 bytes (codes and scales, no zero vector at this
  # H), 1152 (4: the rule's) or 1536 (28) match the pure-JAX rows of the same
  # width, every rank.
  from moe_ep.transport import fp8
  packed = -(-HIDDEN // 16) + -(-HIDDEN // 512)  # code vectors, then a scale vector per 512
  width = 16 * (packed + zero_vectors)
  rule = fp8.wire_bytes
  monkeypatch.setattr(fp8, "wire_bytes", lambda h: width if h == HIDDEN else rule(h))
  ranks = _reference(2, jnp.bfloat16, seed=zero_vectors)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  slab_rows = ranks[0]["slab_row"].shape[0]
  kernel = peer_rows.dispatch_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k, slab_rows,
                                     wire_dtype=FP8)
  assert kernel.row_vecs * 16 == fp8.wire_bytes(HIDDEN) == ranks[0]["fp8_slabs"].shape[-1]
  for rank in range(2):
    want = ranks[rank]["fp8_slabs"].reshape(slab_rows, -1)
    got = peer_loopback.run_rank(kernel, [_dispatch_inputs(r) for r in ranks], want.shape,
                                 want.dtype, rank=rank)
    filled = _filled(ranks[rank])
    np.testing.assert_array_equal(got[filled], want[filled],
                                  err_msg=f"W={want.shape[-1]}, rank {rank}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_fp8_padding_rows_are_left_unwritten_and_dequantize_to_zero(dtype):
  """The FP8 dispatch kernel leaves the slabs' padding rows as it found them
  (0xAB poison here, which dequantizes to small nonzero values), and both
  backends' dequantize_filled_rows, the FP8 slabs' reader, zero them: their
  slabs are bitwise the pure-JAX FP8 slabs' (all-zero padding) dequantized by
  pure JAX, every rank of EP=2."""
  from moe_ep.transport import cupy_backend
  from moe_ep.transport import fp8
  ranks = _reference(2, dtype, seed=31)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  slab_rows = ranks[0]["slab_row"].shape[0]
  kernel = peer_rows.dispatch_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows,
                                     wire_dtype=FP8)
  for rank in range(2):
    want = ranks[rank]["fp8_slabs"].reshape(slab_rows, -1)
    got = peer_loopback.run_rank(kernel, [_dispatch_inputs(r) for r in ranks], want.shape,
                                 want.dtype, rank=rank)
    filled = _filled(ranks[rank])
    assert (~filled).sum() > 0 and (got[~filled] == 0xAB).all()
    assert (want[~filled] == 0).all()
    raw = np.asarray(fp8.dequantize_rows(*fp8.unpack_wire(jnp.asarray(got), HIDDEN), dtype),
                     np.float32)
    assert (raw[~filled] != 0).all()  # the mask, not the bytes, zeroes the padding
    want_rows = np.asarray(xla_backend.dequantize_filled_rows(
        jnp.asarray(want), jnp.asarray(filled), hidden=HIDDEN, dtype=dtype))
    for reader in (xla_backend, cupy_backend):
      got_rows = np.asarray(reader.dequantize_filled_rows(
          jnp.asarray(got), jnp.asarray(filled), hidden=HIDDEN, dtype=dtype))
      np.testing.assert_array_equal(got_rows.view(np.uint8), want_rows.view(np.uint8),
                                    err_msg=f"rank {rank}, {reader.__name__}")
      assert (got_rows[~filled] == 0).all() and (got_rows[filled] != 0).any()


def _multiprocessors() -> int:
  import cupy
  return cupy.cuda.Device().attributes["MultiProcessorCount"]


def _on_device(ranks: list[dict], names: tuple) -> list[tuple]:
  import cupy
  return [tuple(cupy.asarray(np.ascontiguousarray(r[name])) for name in names) for r in ranks]


STEPS = 3  # the ranks' kernels alternate slot parity and wait for acknowledgements (step > 2)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_ranks_at_once_dispatch_then_combine_over_steps_match_pure_jax(ep_size):
  """Every rank's peer_dispatch then peer_combine, on one channel (as the
  layer's share one), three steps with fresh routing each, all ranks
  running at once on their own streams (each grid a 1/R share of the
  SMs): six exchanges on the channel, so the senders wait for the
  acknowledgements of step s - 2 and the slots alternate parity. Every
  rank's slabs and combined rows of every step equal the pure-JAX path's
  bit for bit."""
  refs = [_reference(ep_size, jnp.bfloat16, seed=40 + 10 * ep_size + s) for s in range(STEPS)]
  send_capacity, top_k = refs[0][0]["recv_pos"].shape[1:]
  slab_rows = refs[0][0]["slab_row"].shape[0]
  dispatch_kernel = peer_rows.dispatch_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k,
                                              slab_rows)
  combine_kernel = peer_rows.combine_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k,
                                            slab_rows, ep_size=ep_size)
  layout = dispatch_kernel.layout(ep_size)
  assert combine_kernel.layout(ep_size) == layout  # one channel, as in the layer
  share = _multiprocessors() // ep_size
  grids = [k.grid(ep_size, share) for k in (dispatch_kernel, combine_kernel)]
  assert max(g.blocks for g in grids) <= share
  for step_refs in refs:
    for r in step_refs:
      r["recv_pos_flat"] = r["recv_pos"].reshape(-1)
      r["recv_pos_rows"] = r["recv_pos"].reshape(-1, top_k)
      r["expert_rows"] = r["expert_out"].reshape(slab_rows, HIDDEN)
  inputs = [_on_device(step_refs, ("rows", "send_token", "send_slot", "recv_pos_flat",
                                   "slab_row", "expert_rows", "recv_pos_rows"))
            for step_refs in refs]

  def launches(step, q, peers, tail):
    rows, send_token, send_slot, recv_pos, slab_row, expert_rows, recv_pos_rows = inputs[step][q]
    return [peer_loopback.row_job(dispatch_kernel, grids[0], layout, peers[0], q, tail,
                                  (rows, send_token, send_slot, recv_pos, slab_row),
                                  (slab_rows, HIDDEN), jnp.bfloat16),
            peer_loopback.row_job(combine_kernel, grids[1], layout, peers[0], q, tail,
                                  (expert_rows, recv_pos_rows, send_slot),
                                  (TOKENS, HIDDEN), jnp.bfloat16)]

  got = peer_loopback.run_concurrently([layout], launches, STEPS)
  for step, step_refs in enumerate(refs):
    for q, want in enumerate(step_refs):
      slabs, y = got[step][q]
      np.testing.assert_array_equal(slabs.view(np.uint16),
                                    want["slabs"].view(np.uint16).reshape(slabs.shape),
                                    err_msg=f"slabs, step {step}, rank {q} of {ep_size}")
      np.testing.assert_array_equal(y.view(np.uint16), want["y"].view(np.uint16),
                                    err_msg=f"combine, step {step}, rank {q} of {ep_size}")


@pytest.mark.parametrize("ep_size", [2, 4])
def test_ranks_at_once_fused_layouts_then_combine_over_steps_match_pure_jax(ep_size):
  """Decode's fused launches with every rank running at once, three steps:
  the metadata exchange fused with the slab layout (peer_slab_layout), then
  the whole dispatch in one launch (peer_dispatch_layout: metadata, layout,
  receivers' barrier, rows) on the same metadata channel, then the combine
  on the rows channel. Each kernel's maps, slabs and combined rows of every
  step, every rank, equal the pure-JAX path's bit for bit."""
  refs = [_reference(ep_size, jnp.bfloat16, seed=70 + 10 * ep_size + s) for s in range(STEPS)]
  send_capacity, top_k = refs[0][0]["recv_pos"].shape[1:]
  local, capacity = EXPERTS // ep_size, refs[0][0]["capacity"]
  slab_rows = local * capacity
  sizes = (send_capacity, top_k, local, capacity)
  assert fused_layout.fused_layout_fits(SlabSizes(ep_size, *sizes))
  assert dispatch_layout.dispatch_layout_fits(jnp.bfloat16, HIDDEN, SlabSizes(ep_size, *sizes))
  kernel = dispatch_layout.dispatch_layout_kernel(jnp.bfloat16, TOKENS, HIDDEN, *sizes)
  combine_kernel = peer_rows.combine_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k,
                                            slab_rows, ep_size=ep_size)
  layout = kernel.layout(ep_size)
  meta_layout = channel.meta_channel_layout(ep_size, refs[0][0]["meta"].shape[1])
  share = _multiprocessors() // ep_size
  grid, combine_grid = kernel.grid(ep_size, share), combine_kernel.grid(ep_size, share)
  shapes = dispatch_layout.dispatch_layout_shapes(kernel, ep_size, jnp.bfloat16, HIDDEN)
  layout_shapes = shapes[1:6]
  for step_refs in refs:
    for r in step_refs:
      r["expert_rows"] = r["expert_out"].reshape(slab_rows, HIDDEN)
      r["recv_pos_rows"] = r["recv_pos"].reshape(-1, top_k)
  inputs = [_on_device(step_refs, ("rows", "send_token", "send_slot", "meta", "expert_rows",
                                   "recv_pos_rows")) for step_refs in refs]

  def launches(step, q, peers, tail):
    import cupy
    rows, send_token, send_slot, meta, expert_rows, recv_pos_rows = inputs[step][q]
    maps = [peer_loopback._unwritten(cupy, s.shape, s.dtype) for s in layout_shapes]
    fused = fused_layout.slab_layout_kernel(meta_layout, 0, peers[1], q, sizes, tail)
    outs = [peer_loopback._unwritten(cupy, s.shape, s.dtype) for s in shapes]
    one = dispatch_layout.dispatch_layout_launch(kernel, grid, layout, meta_layout, 0, peers[0],
                                                 peers[1], q, tail)
    return [(fused, (meta, *maps), maps),
            (one, (rows, send_token, send_slot, meta, *outs), outs[:6]),
            peer_loopback.row_job(combine_kernel, combine_grid, layout, peers[0], q, tail,
                                  (expert_rows, recv_pos_rows, send_slot), (TOKENS, HIDDEN),
                                  jnp.bfloat16)]

  got = peer_loopback.run_concurrently([layout, meta_layout], launches, STEPS)
  names = ("recv_pos", "slab_row", "slab_weights", "counts", "demand")
  for step, step_refs in enumerate(refs):
    for q, want in enumerate(step_refs):
      fused_maps, (slabs, *maps), (y,) = got[step][q][:5], got[step][q][5:11], got[step][q][11:]
      where = f"step {step}, rank {q} of {ep_size}"
      for label, values in (("fused layout", fused_maps), ("one-launch dispatch", maps)):
        for name, value in zip(names, values):
          np.testing.assert_array_equal(value.view(np.int32).reshape(-1),
                                        want[name].reshape(-1).view(np.int32),
                                        err_msg=f"{label} {name}, {where}")
      np.testing.assert_array_equal(slabs.view(np.uint16),
                                    want["slabs"].view(np.uint16).reshape(slabs.shape),
                                    err_msg=f"slabs, {where}")
      np.testing.assert_array_equal(y.view(np.uint16), want["y"].view(np.uint16),
                                    err_msg=f"combine, {where}")


def test_ranks_at_once_name_the_rank_that_skips_a_step():
  """Rank 1 runs two of three steps: rank 0's third dispatch waits for its
  chunks in vain, and the bounded wait ends in an error naming rank 1."""
  refs = _reference(2, jnp.bfloat16, seed=99)
  send_capacity, top_k = refs[0]["recv_pos"].shape[1:]
  slab_rows = refs[0]["slab_row"].shape[0]
  kernel = peer_rows.dispatch_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k, slab_rows)
  layout = kernel.layout(2)
  grid = kernel.grid(2, _multiprocessors() // 2)
  for r in refs:
    r["recv_pos_flat"] = r["recv_pos"].reshape(-1)
  inputs = _on_device(refs, ("rows", "send_token", "send_slot", "recv_pos_flat", "slab_row"))

  def launches(step, q, peers, tail):
    if q == 1 and step == 2:
      return []
    return [peer_loopback.row_job(kernel, grid, layout, peers[0], q, tail, inputs[q],
                                  (slab_rows, HIDDEN), jnp.bfloat16)]

  with pytest.raises(RuntimeError, match="rank 0 waited in vain for rank 1"):
    peer_loopback.run_concurrently([layout], launches, 3, timeout_s=0.5)


@pytest.mark.parametrize("ep_size", [2, 4, 8])
@pytest.mark.parametrize("own_first", [0, 1])
def test_combine_own_members_first_or_after_the_wait_give_the_pure_jax_bits(ep_size, own_first):
  """The combine's receivers either sum each token's own members before
  waiting for the other ranks (own_first, which these decode-sized shapes
  pick) or in rank order after it (larger sizes): every rank's rows equal
  the pure-JAX combine's bit for bit either way, float32 and bf16."""
  assert peer_rows.combine_own_first(TOKENS, HIDDEN, np.float32, ep_size)
  assert not peer_rows.combine_own_first(8192, 7168, jnp.bfloat16, 2)
  for dtype in (np.float32, jnp.bfloat16):
    ranks = _reference(ep_size, dtype, seed=50 + ep_size)
    send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
    slab_rows = ranks[0]["slab_row"].shape[0]
    kernel = peer_rows.combine_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows,
                                      ep_size=ep_size)
    assert "own_first_" in kernel.function
    kernel = peer_rows.combine_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows,
                                      ep_size=ep_size, own_first=bool(own_first))
    inputs = [(r["expert_out"].reshape(slab_rows, HIDDEN), r["recv_pos"].reshape(-1, top_k),
               r["send_slot"]) for r in ranks]
    for rank in range(ep_size):
      want = ranks[rank]["y"]
      got = peer_loopback.run_rank(kernel, inputs, want.shape, want.dtype, rank=rank)
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                    err_msg=f"{np.dtype(dtype).name}, rank {rank} of {ep_size}")
