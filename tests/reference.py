"""Independent references for the transport and the layer: plain loops and
dense per-token math, written from the documented policy, not from the code."""

import jax.numpy as jnp
import numpy as np


def kept_routes(topk_idx: np.ndarray, *, num_experts: int, ep_size: int,
                expert_capacity: int, send_capacity: int):
  """Which routes survive the drop policy, by unrolled loops.

  Args:
    topk_idx: ``[R, T, K]`` every rank's expert ids.

  Returns:
    ``keep [R, T, K]`` bool, ``demand [E]`` routes per expert before drops,
    ``counts [E]`` rows kept per expert, ``wire_rows [R]`` rows each rank
    puts into its send chunks.
  """
  ranks, tokens, top_k = topk_idx.shape
  local = num_experts // ep_size
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  arrived = np.zeros_like(valid)
  wire_rows = np.zeros(ranks, np.int64)
  for src in range(ranks):
    for dest in range(ep_size):
      slot = 0
      for t in range(tokens):
        members = [k for k in range(top_k)
                   if valid[src, t, k] and topk_idx[src, t, k] // local == dest]
        if not members:
          continue
        if slot < send_capacity:
          arrived[src, t, members] = True
          wire_rows[src] += 1
        slot += 1
  keep = np.zeros_like(valid)
  counts = np.zeros(num_experts, np.int64)
  demand = np.zeros(num_experts, np.int64)
  for src in range(ranks):  # slab order: (source rank, token, k)
    for t in range(tokens):
      for k in range(top_k):
        if not valid[src, t, k]:
          continue
        expert = topk_idx[src, t, k]
        demand[expert] += 1
        if arrived[src, t, k] and counts[expert] < expert_capacity:
          keep[src, t, k] = True
          counts[expert] += 1
  return keep, demand, counts, wire_rows


def dense_moe(tokens, topk_idx, topk_weights, keep, expert_fn):
  """``y[t] = sum_k keep[t,k] * w[t,k] * expert_fn(e_tk, x_t)``, per token.

  Args:
    tokens: ``[N, H]``; topk_idx, topk_weights, keep: ``[N, K]``.
    expert_fn: ``(expert_ids [N], tokens [N, H]) -> [N, H]``, any map that
      differs per expert.
  """
  total = jnp.zeros(tokens.shape, jnp.float32)
  for k in range(topk_idx.shape[1]):
    out = expert_fn(jnp.where(keep[:, k], topk_idx[:, k], 0), tokens).astype(jnp.float32)
    weight = jnp.where(keep[:, k], topk_weights[:, k].astype(jnp.float32), 0.0)
    total = total + weight[:, None] * out
  return total


def make_routing(kind: str, rng, ranks: int, tokens: int, top_k: int,
                 num_experts: int = 16) -> np.ndarray:
  """``[R, T, K]`` expert ids; distinct per token except where noted."""
  if kind == "balanced":
    probs = np.full(num_experts, 1.0 / num_experts)
  elif kind == "skewed":
    probs = np.exp(-0.6 * np.arange(num_experts))
    probs /= probs.sum()
  elif kind == "empty_experts":  # the upper half of the experts gets nothing
    probs = np.where(np.arange(num_experts) < num_experts // 2, 1.0, 0.0)
    probs /= probs.sum()
  else:
    raise ValueError(kind)
  ids = np.stack([
      np.stack([rng.choice(num_experts, size=top_k, replace=False, p=probs)
                for _ in range(tokens)]) for _ in range(ranks)])
  return ids.astype(np.int32)


def _activation(hidden, activation):
  import jax
  if activation == "gelu":
    return jax.nn.gelu(hidden)
  gate, up = jnp.split(hidden, 2, axis=-1)
  gate = gate * (1 / (1 + jnp.exp(-gate))) if activation == "swiglu" else jax.nn.gelu(gate)
  return gate * up


def reference_moe_layer(params, x, config):
  """Dense MoE: every expert applied to every token, then each token's top-k
  outputs picked and weighted. No slabs, no capacity, no exchange.

  Args:
    params: dict of global arrays ``router``, ``w_in``, ``w_out`` and
      optionally ``shared_w_in``, ``shared_w_out``.
    x: ``[B, S, H]``.

  Returns:
    ``(y [B, S, H] float32, aux_loss, z_loss, tokens_per_expert [E])``.
  """
  import jax
  assert config.num_groups is None and not config.use_expert_bias
  hidden = x.shape[-1]
  tokens = jnp.asarray(x, jnp.float32).reshape(-1, hidden)
  logits = tokens @ params["router"]
  if config.score_function == "softmax":
    exp = jnp.exp(logits - logits.max(-1, keepdims=True))
    scores = exp / exp.sum(-1, keepdims=True)
  else:
    scores = 1 / (1 + jnp.exp(-logits))
  idx = jnp.argsort(-jax.lax.stop_gradient(scores), axis=-1, stable=True)[:, :config.top_k]
  weights = jnp.take_along_axis(scores, idx, axis=-1)
  if config.normalize_top_k:
    weights = weights / weights.sum(-1, keepdims=True)
  weights = weights * config.routed_scaling

  every = jnp.einsum("nh,ehf->enf", tokens, params["w_in"])
  every = jnp.einsum("enf,efh->enh", _activation(every, config.activation), params["w_out"])
  rows = jnp.arange(tokens.shape[0])
  y = sum(weights[:, k, None] * every[idx[:, k], rows] for k in range(config.top_k))
  if "shared_w_in" in params:
    y = y + _activation(tokens @ params["shared_w_in"], config.activation) @ params["shared_w_out"]

  counts = jnp.zeros(config.num_experts, jnp.int32).at[idx.reshape(-1)].add(1)
  fraction = counts / counts.sum()
  distribution = scores if config.score_function == "softmax" else scores / scores.sum(
      -1, keepdims=True)
  aux_loss = config.aux_loss_coeff * config.num_experts * jnp.sum(
      fraction * distribution.mean(0))
  lse = jnp.log(jnp.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  z_loss = config.z_loss_coeff * jnp.mean(lse ** 2)
  return y.reshape(x.shape), aux_loss, z_loss, counts


def permutation_maps(rng, num_table_rows, fanout, num_out_rows):
  """A random partial one-to-one map (table row, copy) -> out row, in both
  directions, plus out-of-range entries on unmapped slots that must be
  ignored (targets) or read as "zero row" (sources)."""
  slots = rng.permutation(num_out_rows)[:min(num_out_rows, num_table_rows * fanout)]
  targets = np.full(num_table_rows * fanout, -1, np.int32)
  chosen = rng.choice(num_table_rows * fanout, len(slots), replace=False)
  keep = rng.random(len(slots)) < 0.8
  targets[chosen[keep]] = slots[keep]
  sources = np.full(num_out_rows, -1, np.int32)
  sources[targets[targets >= 0]] = np.nonzero(targets >= 0)[0] // fanout
  unmapped = np.nonzero(targets < 0)[0]
  targets[unmapped[::2]] = num_out_rows + 3
  targets[unmapped[1::4]] = -9
  empty = np.nonzero(sources < 0)[0]
  sources[empty[::2]] = num_table_rows + 11
  return targets.reshape(num_table_rows, fanout), sources
