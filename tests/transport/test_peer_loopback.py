"""The peer kernels at EP = 2, 4 and 8 on ONE GPU
(moe_ep/transport/peer_loopback.py): every rank's output of the dispatch
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

from moe_ep import transport
from moe_ep.transport import combine, dispatch, peer, peer_loopback
from moe_ep.transport import xla as xla_backend
from moe_ep.transport.cupy import slab_plan

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
  spec = transport._Spec(num_experts=EXPERTS, ep_size=ep_size, expert_capacity=capacity,
                         send_capacity=send_capacity, axis_name="ep", backend="xla",
                         exchange="all_to_all", mesh=mesh, wire_dtype=FP8)

  def program(x, idx, weights, outputs):
    d = dispatch(x, idx, weights, num_experts=EXPERTS, expert_capacity=capacity,
                 axis_name="ep", send_capacity=send_capacity, backend="xla", mesh=mesh)
    fp8_slabs = transport._rows_to_fp8_slabs(spec, x, d.handle)
    expert_out = outputs.reshape(d.tokens.shape)
    y = combine(expert_out, d.handle, num_tokens=TOKENS, axis_name="ep", backend="xla",
                mesh=mesh)
    # route's metadata, before its exchange, from the ids dispatch routes by
    merged = transport._merge_duplicate_routes(transport._valid_ids(idx, EXPERTS), weights)
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
      "slabs": peer.dispatch_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows),
      "fp8_slabs": peer.dispatch_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k,
                                        slab_rows, wire_dtype=FP8),
  }
  for rank in range(ep_size):
    for name, kernel in kernels.items():
      want = ranks[rank][name].reshape(slab_rows, -1)
      got = peer_loopback.run_rank(kernel, [_dispatch_inputs(r) for r in ranks],
                                   want.shape, want.dtype, rank=rank)
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                    err_msg=f"{name}, rank {rank} of {ep_size}")
    kernel = peer.combine_kernel(dtype, TOKENS, HIDDEN, send_capacity, top_k, slab_rows)
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
  assert peer.fused_layout_fits(ep_size, send_capacity, top_k, local, capacity)
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
  assert peer.fused_layout_fits(ranks, *sizes)
  assert slab_plan(ranks, *sizes).tiles == 2
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
    monkeypatch.setattr(peer, "_dispatch_layout_counted", lambda tiles, receivers=None: True)
  ranks = _reference(ep_size, jnp.bfloat16, seed=20 + ep_size)
  send_capacity, top_k = ranks[0]["recv_pos"].shape[1:]
  local, capacity = EXPERTS // ep_size, ranks[0]["capacity"]
  assert peer.dispatch_layout_fits(jnp.bfloat16, HIDDEN, ep_size, send_capacity, top_k, local,
                                   capacity)
  kernel = peer.dispatch_layout_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k,
                                       local, capacity)
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
  assert peer.dispatch_layout_fits(jnp.bfloat16, hidden, ranks, tokens, top_k, local, capacity)
  kernel = peer.dispatch_layout_kernel(jnp.bfloat16, tokens, hidden, tokens, top_k, local,
                                       capacity)
  inputs = [(rows[q], routes[q][1].reshape(-1), routes[q][0], routes[q][3])
            for q in range(ranks)]
  sizes = (tokens, top_k, local, capacity)
  maps = [peer_loopback.slab_layout_rank([r[3] for r in routes], sizes, rank=q)
          for q in range(ranks)]
  two = peer.dispatch_kernel(jnp.bfloat16, tokens, hidden, tokens, top_k, local * capacity)
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
  kernel = peer.dispatch_layout_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k,
                                       EXPERTS // 2, ranks[0]["capacity"])
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
  kernel = peer.dispatch_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k, slab_rows)
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
  assert peer.ChannelLayout(ep_size, chunks[0].nbytes // ep_size).vector_bytes == {
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
  kernel = peer.dispatch_kernel(jnp.bfloat16, TOKENS, HIDDEN, send_capacity, top_k, slab_rows,
                                wire_dtype=FP8)
  assert kernel.row_vecs * 16 == fp8.wire_bytes(HIDDEN) == ranks[0]["fp8_slabs"].shape[-1]
  for rank in range(2):
    want = ranks[rank]["fp8_slabs"].reshape(slab_rows, -1)
    got = peer_loopback.run_rank(kernel, [_dispatch_inputs(r) for r in ranks], want.shape,
                                 want.dtype, rank=rank)
    np.testing.assert_array_equal(got, want, err_msg=f"W={want.shape[-1]}, rank {rank}")
