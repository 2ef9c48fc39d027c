"""Which exchange carries the rows (XLA's all_to_all or direct peer stores),
and that the layer's results do not depend on it: the peer exchange moves the
same bytes, so every value and gradient downstream is bitwise equal."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import custom_call_scopes, devices_for, gpu_devices, make_mesh
from moe_ep.transport.launch_geometry import SlabSizes
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from benchmarks import hlo
from moe_ep.transport import NAMED_SCOPES, combine, dispatch, expert_capacity_for, peer
from moe_ep.transport.plan import resolve_exchange
from moe_ep.transport.peer import dispatch_layout, fused_layout, reachability
from moe_ep.transport.peer import runtime as peer_runtime

ROWS = f"{NAMED_SCOPES['dispatch']}/exchange_rows"


def test_auto_takes_all_to_all_where_peer_cannot_run():
  cpu = make_mesh((2, 4), ("dp", "ep"))
  assert resolve_exchange("auto", "auto", "ep", 4, cpu) == "all_to_all"  # CPU devices
  assert resolve_exchange("auto", "cupy", "ep", 4, None) == "all_to_all"  # no mesh
  assert resolve_exchange("peer", "cupy", "ep", 1, cpu) == "all_to_all"  # one rank
  if gpu_devices() and len(gpu_devices()) >= 2:
    gpus = jax.sharding.Mesh(np.array(gpu_devices()[:2]), ("ep",))
    assert resolve_exchange("auto", "xla", "ep", 2, gpus) == "all_to_all"  # pure JAX asked


def test_peer_where_it_cannot_run_is_an_error_naming_why():
  cpu = make_mesh((2, 4), ("dp", "ep"))
  with pytest.raises(ValueError, match="exchange='peer' cannot run on this mesh: the mesh "
                                       "has non-GPU devices"):
    resolve_exchange("peer", "auto", "ep", 4, cpu)
  with pytest.raises(ValueError, match="exchange='peer' needs mesh="):
    resolve_exchange("peer", "cupy", "ep", 4, None)
  with pytest.raises(ValueError, match="exchange='ring' is not one of"):
    resolve_exchange("ring", "cupy", "ep", 4, cpu)
  with pytest.raises(ValueError, match=r"MoEConfig.exchange='ring' must be one of"):
    MoEConfig(hidden_size=8, ffn_size=8, num_experts=4, top_k=2, exchange="ring")


def _value_and_grad(exchange: str, mesh, policy=None):
  config = MoEConfig(hidden_size=64, ffn_size=96, num_experts=8, top_k=2, dtype="bfloat16",
                     score_function="sigmoid", aux_loss_coeff=1e-2, capacity_factor=1.0,
                     transport="cupy", exchange=exchange)
  layer = ExpertParallelMoE(config, mesh=mesh, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y.astype(jnp.float32) ** 2) + aux.aux_loss, (y, aux)

  if policy is not None:
    loss = jax.checkpoint(loss, policy=policy)
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64, 64)), jnp.bfloat16)
  return step.lower(params, x).compile().as_text(), step(params, x)


@pytest.mark.gpu
def test_layer_on_the_peer_exchange_is_bitwise_the_all_to_all_layer():
  """Forward, aux, drops (capacity 1.0) and every gradient, bitwise; the
  compiled peer program issues no all_to_all of rows, one forward row
  exchange, and saving "dispatch" still spares the backward re-dispatch."""
  devices = devices_for("cupy", 2)
  mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
  text_peer, peer = _value_and_grad("peer", mesh)
  text_a2a, a2a = _value_and_grad("all_to_all", mesh)
  for got, want in zip(jax.tree.leaves(peer), jax.tree.leaves(a2a)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert "moe_peer_exchange" in text_peer and "moe_peer_exchange" not in text_a2a
  assert not any("all-to-all" in line for *_, line in hlo.collectives(text_peer)
                 if "moe_peer_exchange" not in line)
  assert hlo.count(text_peer, scope=ROWS) == hlo.count(text_a2a, scope=ROWS) == 1
  saved = RematConfig(save=("dispatch",)).policy()
  text_saved, _ = _value_and_grad("peer", mesh, saved)
  text_nothing, _ = _value_and_grad("peer", mesh, jax.checkpoint_policies.nothing_saveable)
  assert hlo.count(text_saved, scope=ROWS) == 1
  assert hlo.count(text_nothing, scope=ROWS) == 2


# --- the fused peer row paths ----------------------------------------------------------------

E, K = 8, 3


def routing(rng, tokens: int, skew: bool = True):
  """``[tokens, K]`` ids with invalid ones (-1) and, if ``skew``, a third of
  the routes on experts 0 and 1 (drops at capacity factor 1.0); float32 weights."""
  idx = rng.integers(-1, E, size=(tokens, K))
  if skew:
    idx = np.where(rng.random((tokens, K)) < 0.33, rng.integers(0, 2, size=(tokens, K)), idx)
  return idx.astype(np.int32), rng.random((tokens, K)).astype(np.float32)


def round_trip_fn(exchange: str, mesh, backend: str, tokens: int, expert_capacity: int,
                  send_capacity):
  """Per rank: dispatch, expert outputs sin(slabs + row index) * weights,
  combine, and the vjp of y (through all four row paths and the weight
  exchange)."""
  def per_rank(x, idx, w, y_grad):
    def forward(x, w):
      d = dispatch(x, idx, w, num_experts=E, expert_capacity=expert_capacity, axis_name="ep",
                   send_capacity=send_capacity, transport=backend, exchange=exchange, mesh=mesh)
      # Each expert row its own values, so the combine sums depend on their order.
      slab_index = jnp.arange(d.weights.size, dtype=jnp.float32).reshape(d.weights.shape)
      out = (jnp.sin(d.tokens.astype(jnp.float32) + slab_index[..., None])
             * d.weights[..., None]).astype(x.dtype)
      y = combine(out, d.handle, num_tokens=tokens, axis_name="ep", transport=backend,
                  exchange=exchange, mesh=mesh)
      return y, d
    y, vjp, d = jax.vjp(forward, x, w, has_aux=True)
    x_grad, w_grad = vjp(y_grad)
    return dict(y=y, slabs=d.tokens, weights=d.weights, handle=d.handle, counts=d.counts,
                demand=d.demand, x_grad=x_grad, w_grad=w_grad)
  return per_rank


@pytest.mark.parametrize("path", ["dispatch_with_layout", "slab_layout", "unfused"])
def test_peer_row_paths_lower_to_one_fused_callback_each_and_no_row_passes(monkeypatch,
                                                                          pretend_cupy, path):
  """With the peer path taken (its checks stubbed on CPU devices), every row
  path of the forward and backward passes lowers for CUDA to one fused
  callback under .../exchange_rows/, with no expand_rows or gather_sum_rows
  pass and no all_to_all; the weights use the drop-in exchange. The
  metadata: where its rows are whole 16-byte vectors (S=5: 2*S*K + L = 32
  words) inside the dispatch's fused callback (with configure's
  dispatch_layout) or in the exchange fused with the slab layout (without);
  else (S=6: 38 words) the drop-in exchange and the layout's own callback."""
  monkeypatch.setattr(reachability, "unsupported_reason", lambda mesh, axis: None)
  monkeypatch.setattr(peer_runtime, "dispatch_layout_enabled",
                      lambda: path == "dispatch_with_layout")
  mesh = make_mesh((4,), ("ep",))
  send_capacity = 6 if path == "unfused" else 5
  sizes = SlabSizes(4, send_capacity, K, E // 4, 12)
  assert fused_layout.fused_layout_fits(sizes) == (path != "unfused")
  assert dispatch_layout.dispatch_layout_fits(jnp.bfloat16, 32, sizes) == (path != "unfused")
  fn = round_trip_fn("peer", mesh, "auto", 16, 12, send_capacity)
  args = (jnp.ones((64, 32), jnp.bfloat16), jnp.zeros((64, K), jnp.int32),
          jnp.ones((64, K)), jnp.ones((64, 32), jnp.bfloat16))
  traced = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).trace(
      *args)
  text = traced.lower(lowering_platforms=("cuda",)).as_text(debug_info=True)
  scopes = [name for _, name in custom_call_scopes(text)]
  fused = [s for s in scopes if "/exchange_rows/" in s]
  passes = [[name for name in NAMED_SCOPES.values() if name in s] for s in fused]
  assert sorted(passes) == sorted([name] for name in NAMED_SCOPES.values())
  assert all("moe_peer_exchange" in s for s in fused)
  assert not any("expand_rows" in s or "gather_sum_rows" in s for s in scopes)
  meta = [s for s in scopes if "/exchange_meta/" in s]
  assert len(meta) == (0 if path == "dispatch_with_layout" else 1)
  assert all("moe_peer_exchange" in s for s in meta)
  assert any("moe_cupy_slab_layout" in s for s in scopes) == (path == "unfused")
  assert sum("/exchange_weights/" in s for s in scopes) == 1
  assert "all_to_all" not in text



@pytest.mark.parametrize("send_capacity", [5, 6])
def test_peer_row_paths_off_cuda_run_the_all_to_all_path_bitwise(monkeypatch, send_capacity):
  """On CPU devices the fused paths' other branch runs: the same values,
  handle and gradients as exchange='all_to_all', bitwise (S=5: the dispatch
  with its layout fused; S=6: the row paths alone)."""
  monkeypatch.setattr(reachability, "unsupported_reason", lambda mesh, axis: None)
  monkeypatch.setattr(peer_runtime, "dispatch_layout_enabled", lambda: True)
  assert dispatch_layout.dispatch_layout_fits(
      jnp.bfloat16, 32, SlabSizes(4, send_capacity, K, E // 4, 8)) == (send_capacity == 5)
  mesh = make_mesh((4,), ("ep",))
  rng = np.random.default_rng(1)
  idx, w = routing(rng, 64)
  x = rng.normal(size=(64, 32)).astype(jnp.bfloat16)
  y_grad = rng.normal(size=(64, 32)).astype(jnp.bfloat16)
  results = []
  for exchange in ("peer", "all_to_all"):
    fn = round_trip_fn(exchange, mesh, "xla", 16, 8, send_capacity)
    results.append(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"),
                                         out_specs=P("ep")))(x, idx, w, y_grad))
  for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def fused_model(rows, out, handles, dtype):
  """kernels/peer_dispatch.cu's and peer_combine.cu's fused row kernels, step
  by step in NumPy, per rank r: rows [R][T, H], expert outputs out [R][L*C,
  H], handles [R] (NumPy fields).

  Dispatch (peer_dispatch): senders copy the token send_token[d, s] into
  row s of r's slot on every other rank d; receivers zero the padding rows,
  copy r's own token send_token[r, s] into the members recv_pos[r, s], and
  each received slot row into its members. Combine (peer_combine): senders
  put, per row from src, the float32 member sum in member order, rounded,
  into src's slot; receivers, per token, the float32 sum over ranks in
  order, r's own member sum rounded as if it had travelled, rounded once."""
  ranks = len(rows)
  tokens, hidden = rows[0].shape
  send_capacity, top_k = handles[0].recv_pos.shape[1:]
  num_slab_rows = handles[0].slab_row.size
  f32 = np.float32
  slots = [[np.full((send_capacity, hidden), np.nan, dtype) for _ in range(ranks)]
           for _ in range(ranks)]  # slots[dst][src]
  slabs = [np.full((num_slab_rows, hidden), np.nan, dtype) for _ in range(ranks)]

  def wire_slot(h, t, d):
    s = h.send_slot[t, d]
    return s if 0 <= s < send_capacity else -1

  def members(h, src, s):
    return [n for n in h.recv_pos[src, s] if 0 <= n < num_slab_rows]

  def token(h, d, s):
    t = h.send_token[d, s]
    return t if 0 <= t < tokens else -1

  for r, h in enumerate(handles):
    for d in range(ranks):
      for s in range(send_capacity):
        t = token(h, d, s)
        if t < 0:
          continue
        if d != r:
          slots[d][r][s] = rows[r][t]
        else:
          for n in members(h, r, s):
            slabs[r][n] = rows[r][t]
    for n, m in enumerate(h.slab_row.reshape(-1)):
      if not 0 <= m < ranks * send_capacity:
        slabs[r][n] = 0
  for r, h in enumerate(handles):
    for src in range(ranks):
      if src != r:
        for s in range(send_capacity):
          for n in members(h, src, s):
            slabs[r][n] = slots[r][src][s]

  def member_sum(r, src, s):
    acc = np.zeros(hidden, f32)
    for n in members(handles[r], src, s):
      acc = acc + out[r][n].astype(f32)
    return acc.astype(dtype)

  for r in range(ranks):
    for dest in range(ranks):
      if dest != r:
        for s in range(send_capacity):
          slots[dest][r][s] = member_sum(r, dest, s)
  ys = []
  for r, h in enumerate(handles):
    y = np.zeros((tokens, hidden), dtype)
    for t in range(tokens):
      acc = np.zeros(hidden, f32)
      for d in range(ranks):
        s = wire_slot(h, t, d)
        if s >= 0:
          part = member_sum(r, r, s) if d == r else slots[r][d][s]
          acc = acc + part.astype(f32)
      y[t] = acc.astype(dtype)
    ys.append(y)
  return slabs, ys


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_fused_row_algorithm_is_the_all_to_all_path_bitwise(dtype):
  """The fused kernels' data flow (fused_model), run on the handles of an
  all_to_all dispatch with drops, gives its slabs and combine output bit for
  bit: every slab row is written, the sums keep their order and roundings."""
  ranks, tokens, hidden = 4, 32, 16
  mesh = make_mesh((ranks,), ("ep",))
  rng = np.random.default_rng(2)
  idx, w = routing(rng, ranks * tokens)
  x = rng.normal(size=(ranks * tokens, hidden)).astype(dtype)

  def per_rank(x, idx, w):
    d = dispatch(x, idx, w, num_experts=E, expert_capacity=24, axis_name="ep", send_capacity=20,
                 transport="xla")
    # Each expert row its own values: the sums then depend on their order.
    slab_index = jnp.arange(d.tokens.shape[0] * d.tokens.shape[1], dtype=jnp.float32)
    out = jnp.sin(7 * d.tokens.astype(jnp.float32)
                  + slab_index.reshape(d.tokens.shape[:2] + (1,))).astype(x.dtype)
    y = combine(out, d.handle, num_tokens=tokens, axis_name="ep", transport="xla")
    return d.tokens, d.handle, out, y, d.counts, d.demand

  slabs, handle, expert_out, y, counts, demand = jax.jit(jax.shard_map(
      per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)
  split = lambda a: np.split(np.asarray(a), ranks)  # noqa: E731
  handles = [type(handle)(*fields) for fields in zip(*(split(f) for f in handle))]
  rows = split(x)
  outs = [o.reshape(-1, hidden) for o in split(expert_out)]
  got_slabs, got_y = fused_model(rows, outs, handles, np.dtype(dtype))
  assert any((h.slab_row < 0).any() for h in handles)  # padding rows
  assert int(np.asarray(counts).sum()) < int(np.asarray(demand).sum())  # drops
  for r in range(ranks):
    want_slabs = split(slabs)[r].reshape(-1, hidden)
    np.testing.assert_array_equal(got_slabs[r].view(np.uint8), want_slabs.view(np.uint8))
    np.testing.assert_array_equal(got_y[r].view(np.uint8), split(y)[r].view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, hidden, fused", [(jnp.bfloat16, 2056, True),
                                                  (jnp.float32, 1028, True),
                                                  (jnp.bfloat16, 12, False)])
def test_peer_rows_are_bitwise_the_all_to_all_rows_over_many_steps(dtype, hidden, fused):
  """Two GPUs, one process, backend "cupy": slabs, weights, handle, counts,
  demand, y and the gradients of tokens and weights, bitwise equal between
  exchange="peer" and "all_to_all", over 16 scan steps of fresh tokens and
  routes, each step with drops (capacity 1.0, send capacity 24 of 64 tokens
  binding) and dropless. Rows of 257 16-byte vectors: with this few rows the
  kernels split them into segments, the last one partial. 24-byte rows
  (hidden=12 bf16) take the drop-in exchange instead, also bitwise."""
  devices = devices_for("cupy", 2)
  mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
  steps, tokens = 16, 64
  capacity = expert_capacity_for(tokens, K, E, 2, 1.0)
  dropless = expert_capacity_for(tokens, K, E, 2)
  rng = np.random.default_rng(hidden)
  idx, w = zip(*(routing(rng, 2 * tokens) for _ in range(steps)))
  x = rng.normal(size=(steps, 2 * tokens, hidden)).astype(dtype)
  y_grad = rng.normal(size=(steps, 2 * tokens, hidden)).astype(dtype)
  spec = P(None, "ep")

  def program(exchange):
    drops = round_trip_fn(exchange, mesh, "cupy", tokens, capacity, 24)
    no_drops = round_trip_fn(exchange, mesh, "cupy", tokens, dropless, None)

    def body(carry, step):
      return carry, (drops(*step), no_drops(*step))

    fn = jax.jit(jax.shard_map(lambda *xs: jax.lax.scan(body, None, xs)[1], mesh=mesh,
                               in_specs=spec, out_specs=spec))
    args = (x, np.stack(idx), np.stack(w), y_grad)
    return fn.lower(*args).compile().as_text(), fn(*args)

  text_peer, got = program("peer")
  text_a2a, want = program("all_to_all")
  peer.raise_if_failed()
  assert int(np.asarray(got[0]["counts"]).sum()) < int(np.asarray(got[0]["demand"]).sum())
  for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, h = np.asarray(g), np.asarray(h)
    np.testing.assert_array_equal(g.view(np.dtype(f"u{g.dtype.itemsize}")),
                                  h.view(np.dtype(f"u{h.dtype.itemsize}")))
  assert not any("all-to-all" in line for *_, line in hlo.collectives(text_peer)
                 if "moe_peer_exchange" not in line)
  row_passes = "moe_cupy_expand_rows" in text_peer or "moe_cupy_gather_sum_rows" in text_peer
  assert row_passes != fused
  assert "moe_cupy_expand_rows" in text_a2a
