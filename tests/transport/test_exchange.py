"""What crosses the wire: one row exchange, deduplicated rows, and remat
policies that do or do not re-run it."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import moe_ep.transport as transport
from conftest import make_mesh
from benchmarks import hlo
from moe_ep.transport import combine, dispatch, expert_capacity_for, row_paths
from reference import kept_routes, make_routing
from test_transport import HIDDEN, NUM_EXPERTS, TOKENS

EP = 4
TOP_K = 4
CAPACITY = expert_capacity_for(TOKENS, TOP_K, NUM_EXPERTS, EP)
FIELD_NAMES = [f"moe.dispatch.{field}" for field in transport.CHECKPOINT_FIELDS]


def problem(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.normal(size=(EP * TOKENS, HIDDEN)).astype(np.float32)
  idx = make_routing("balanced", rng, EP, TOKENS, TOP_K)
  weights = rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32)
  return tokens, idx, weights


def layer_like(x, idx, w):
  d = dispatch(x, idx, w, num_experts=NUM_EXPERTS, expert_capacity=CAPACITY, axis_name="ep",
               checkpoint_name="moe.dispatch", transport="xla")
  out = jnp.tanh(d.tokens) * d.weights[..., None]
  return combine(out, d.handle, num_tokens=x.shape[0], axis_name="ep", transport="xla")


def sharded(fn):
  return jax.shard_map(fn, mesh=make_mesh((EP,), ("ep",)), in_specs=P("ep"), out_specs=P("ep"))


def test_forward_issues_one_row_exchange_and_one_metadata_exchange():
  tokens, idx, weights = problem()
  text = jax.jit(sharded(layer_like)).lower(
      tokens, idx.reshape(-1, TOP_K), weights.reshape(-1, TOP_K)).compile().as_text()
  dispatch_scope = transport.NAMED_SCOPES["dispatch"]
  assert hlo.count(text, scope=f"{dispatch_scope}/exchange_rows") == 1
  assert hlo.count(text, scope=f"{dispatch_scope}/exchange_meta") == 1
  assert hlo.count(text, scope=dispatch_scope) == 2
  assert hlo.count(text, scope=transport.NAMED_SCOPES["combine"]) == 1
  # No layout/count exchange beforehand, no gather of ids or tokens.
  assert [op for op, _, _ in hlo.collectives(text)] == ["all-to-all"] * 3


def test_each_token_is_sent_to_each_rank_at_most_once(monkeypatch):
  """The send chunks hold one row per distinct (token, destination rank)
  pair, fewer than the (token, k) pairs, in a buffer of S = T rows per rank."""
  tokens, idx, weights = problem(1)
  sent = []
  exchange = row_paths.exchange

  def recording_exchange(spec, x, what):
    if what == "exchange_rows":
      jax.debug.callback(lambda rows: sent.append(np.asarray(rows)), x)
    return exchange(spec, x, what)

  monkeypatch.setattr(row_paths, "exchange", recording_exchange)

  def dispatch_only(x, i, w):
    return dispatch(x, i, w, num_experts=NUM_EXPERTS, expert_capacity=CAPACITY,
                    axis_name="ep", transport="xla").tokens

  jax.block_until_ready(jax.jit(sharded(dispatch_only))(
      tokens, idx.reshape(-1, TOP_K), weights.reshape(-1, TOP_K)))
  assert len(sent) == EP
  local = NUM_EXPERTS // EP
  for chunk in sent:
    assert chunk.shape == (EP, TOKENS, HIDDEN)  # S = T: dropless without S = T*K
    first_row = chunk[chunk.any(axis=-1)][0]
    src = int(np.argwhere((tokens == first_row).all(axis=1))[0, 0]) // TOKENS
    for dest in range(EP):
      routed = [t for t in range(TOKENS) if (idx[src, t] // local == dest).any()]
      expected = np.zeros((TOKENS, HIDDEN), np.float32)
      expected[:len(routed)] = tokens[src * TOKENS + np.array(routed, int)]
      np.testing.assert_array_equal(chunk[dest], expected)
  _, _, _, wire_rows = kept_routes(idx, num_experts=NUM_EXPERTS, ep_size=EP,
                                   expert_capacity=CAPACITY, send_capacity=TOKENS)
  rows_sent = sum(int(chunk.any(axis=-1).sum()) for chunk in sent)
  assert rows_sent == wire_rows.sum()
  assert rows_sent < idx.size, "the routing must have several experts per rank per token"


def compiled_value_and_grad(policy):
  tokens, idx, weights = problem(2)
  body = layer_like if policy is None else jax.checkpoint(layer_like, policy=policy)
  fn = sharded(body)
  idx = idx.reshape(-1, TOP_K)
  loss = lambda x, w: jnp.sum(fn(x, idx, w) ** 2)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = (tokens, weights.reshape(-1, TOP_K))
  return step.lower(*args).compile().as_text(), step(*args)


def test_saving_the_named_dispatch_avoids_any_extra_collective():
  names = jax.checkpoint_policies.save_only_these_names
  text_plain, result_plain = compiled_value_and_grad(None)
  text_saved, result_saved = compiled_value_and_grad(names(*FIELD_NAMES))
  text_nothing, result_nothing = compiled_value_and_grad(jax.checkpoint_policies.nothing_saveable)
  text_no_handle, _ = compiled_value_and_grad(
      names(*(n for n in FIELD_NAMES if not n.endswith(".handle"))))
  rows = f"{transport.NAMED_SCOPES['dispatch']}/exchange_rows"
  total = lambda text: len(hlo.collectives(text))
  assert total(text_saved) == total(text_plain)
  assert hlo.count(text_saved, scope=rows) == 1
  assert hlo.count(text_nothing, scope=rows) == 2
  assert total(text_no_handle) > total(text_plain)
  # Remat changes what is kept, never the numbers.
  for other in (result_saved, result_nothing):
    for got, want in zip(jax.tree.leaves(other), jax.tree.leaves(result_plain)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
