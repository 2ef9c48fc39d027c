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
