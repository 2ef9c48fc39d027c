"""A dense float64 NumPy reference of the whole ``ExpertParallelMoE`` layer,
honouring every ``MoEConfig`` field, written from the documented policy (the
``MoEConfig`` docstring, ``expert_capacity_for`` / ``send_capacity_for``, the
drop order of ``kept_routes``), not from the layer's code.

Every expert is applied to every token in plain per-token float64 math; the
only place the mesh matters is the capacity drop, which the reference replays
with the layer's token split: the flattened tokens ``[N, H]`` are cut into
``num_shards`` contiguous blocks (the linear shard index of the batch axes,
EP axis last), and the blocks ``g * R .. g * R + R - 1`` form EP group ``g``,
ranks ``0 .. R - 1``, whose routes compete for the same slabs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from reference import kept_routes

# DeepSeek-V3: a group scores the sum of its best two experts' selection
# scores (MoEConfig.group_score "top2_sum"); DeepSeek-V2 its best one ("max").
GROUP_SCORE_EXPERTS = 2
GROUP_SCORE_EXPERTS_OF = {"top2_sum": 2, "max": 1}


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def expert_capacity(tokens_per_rank: int, top_k: int, num_experts: int, ep_size: int,
                    capacity_factor: float | None) -> int:
  """``C``: the dropless bound ``R * T``, or ``ceil(factor * R * T * K / E)``;
  rounded up to 8 rows (128 from 1024 rows on) and never above the dropless
  bound rounded up to 8."""
  dropless = _round_up(ep_size * tokens_per_rank, 8)
  if capacity_factor is None:
    rows = ep_size * tokens_per_rank
  else:
    rows = math.ceil(capacity_factor * ep_size * tokens_per_rank * top_k / num_experts)
  return max(1, min(_round_up(rows, 128 if rows >= 1024 else 8), dropless))


def send_capacity(tokens_per_rank: int, top_k: int, ep_size: int,
                  capacity_factor: float | None) -> int:
  """``S``: ``T`` (dropless), or ``ceil(factor * T * K / R)`` rounded up to 8
  rows and never above ``T``."""
  if capacity_factor is None:
    return tokens_per_rank
  rows = math.ceil(capacity_factor * tokens_per_rank * top_k / ep_size)
  return max(1, min(_round_up(rows, 8), tokens_per_rank))


def scores_of(logits: np.ndarray, score_function: str) -> np.ndarray:
  if score_function == "softmax":
    exp = np.exp(logits - logits.max(-1, keepdims=True))
    return exp / exp.sum(-1, keepdims=True)
  return 1.0 / (1.0 + np.exp(-logits))


def _best(values: np.ndarray, count: int) -> tuple[np.ndarray, float]:
  """Indices of the ``count`` largest of ``values [n]`` (lower index first on
  ties), and the gap between the last one taken and the best one left out."""
  order = np.argsort(-values, kind="stable")
  chosen = order[:count]
  rest = values[order[count:]]
  rest = rest[np.isfinite(rest)]
  gap = float(values[chosen[-1]] - rest.max()) if rest.size else np.inf
  return chosen, gap


def select_experts(selection: np.ndarray, top_k: int, num_groups: int | None = None,
                   group_top_k: int | None = None,
                   group_score_experts: int | None = GROUP_SCORE_EXPERTS,
                   group_selection: np.ndarray | None = None):
  """Per-token top-k of ``selection [N, E]``, optionally group-limited.

  A group's score is the sum of its best ``group_score_experts`` selection
  scores. The last two arguments exist to replay wrong rules, so tests can
  show their data tells them from the right one: ``group_score_experts=None``
  sums the whole group, ``group_selection [N, E]`` ranks the groups by other
  scores than ``selection``.

  Returns:
    ``(topk_idx [N, K], margin)``: ``margin`` is the smallest gap, over all
    tokens, between a chosen and a rejected expert (or group) score; decisions
    with a margin far above float32 rounding are the same in float32.
  """
  num_tokens, num_experts = selection.shape
  topk_idx = np.zeros((num_tokens, top_k), np.int64)
  margin = np.inf
  for t in range(num_tokens):
    allowed = selection[t].copy()
    if num_groups is not None:
      ranked = selection if group_selection is None else group_selection
      grouped = ranked[t].reshape(num_groups, num_experts // num_groups)
      size = grouped.shape[1] if group_score_experts is None else min(group_score_experts,
                                                                     grouped.shape[1])
      group_scores = np.sort(grouped, axis=1)[:, ::-1][:, :size].sum(axis=1)
      groups, gap = _best(group_scores, group_top_k)
      margin = min(margin, gap)
      in_group = np.zeros(num_groups, bool)
      in_group[groups] = True
      allowed = np.where(np.repeat(in_group, num_experts // num_groups), allowed, -np.inf)
    topk_idx[t], gap = _best(allowed, top_k)
    margin = min(margin, gap)
  return topk_idx, margin


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
  """jax.nn.gelu's default (approximate=True) form."""
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def activate(hidden: np.ndarray, activation: str) -> np.ndarray:
  """``[..., n*F] -> [..., F]``; gated activations split gate | up."""
  if activation == "gelu":
    return _gelu_tanh(hidden)
  gate, up = np.split(hidden, 2, axis=-1)
  if activation == "swiglu":
    return gate / (1.0 + np.exp(-gate)) * up
  if activation == "geglu":
    return _gelu_tanh(gate) * up
  raise ValueError(activation)


def _mlp(tokens: np.ndarray, w_in: np.ndarray, w_out: np.ndarray, activation: str):
  return activate(tokens @ w_in, activation) @ w_out


def _rounded(value, dtype) -> np.ndarray:
  """``value`` rounded to ``dtype``, then held in float64."""
  return np.asarray(value).astype(jnp.dtype(dtype)).astype(np.float64)


class LayerReference(NamedTuple):
  """What the reference computes for one call.

  Attributes:
    y: ``[..., H]`` float64, before the cast to the input's dtype.
    aux_loss, z_loss, dropped_fraction: floats; tokens_per_expert: ``[E]``.
    scores: ``[N, E]`` unbiased router scores.
    topk_idx, topk_weights, keep: ``[N, K]`` per route (padding rows: -1, 0,
      False).
    expert_capacity, send_capacity: ``C`` and ``S``.
    wire_dropped: routes dropped on the wire (before the slabs).
    margin: smallest selection gap (see :func:`select_experts`).
  """

  y: np.ndarray
  aux_loss: float
  z_loss: float
  tokens_per_expert: np.ndarray
  dropped_fraction: float
  scores: np.ndarray
  topk_idx: np.ndarray
  topk_weights: np.ndarray
  keep: np.ndarray
  expert_capacity: int
  send_capacity: int
  wire_dropped: int
  margin: float


def reference_layer(config, params: dict, x, *, num_shards: int, ep_size: int,
                    send_capacity_override: int | None = None) -> LayerReference:
  """The layer's output for ``x [..., H]`` under ``config``.

  Args:
    config: a ``MoEConfig`` (read field by field).
    params: global arrays ``router [H, E]``, ``w_in [E, H, n*F]`` (gate then
      up), ``w_out [E, F, H]``, and where configured ``expert_bias [E]``,
      ``shared_w_in [H, n*F_s]``, ``shared_w_out [F_s, H]``, ``shared_gate [H, 1]``.
    num_shards: shards of the batch (product of the batch axes' sizes and the
      EP axis size); ep_size: ``R``.
    send_capacity_override: replay the drop with another ``S`` (tests use it
      to show a case tells the right ``S`` from a wrong one).
  """
  x = np.asarray(x)
  hidden = x.shape[-1]
  num_experts, top_k = config.num_experts, config.top_k
  compute_dtype = jnp.dtype(config.dtype if config.dtype is not None else x.dtype)
  tokens = _rounded(x.reshape(-1, hidden), compute_dtype)
  num_valid = tokens.shape[0]
  tokens_per_rank = -(-num_valid // num_shards)
  num_rows = tokens_per_rank * num_shards

  # Route: float32 router weights, the compute-dtype tokens.
  logits = tokens @ _rounded(params["router"], np.float32)
  scores = scores_of(logits, config.score_function)
  selection = scores.copy()
  if config.use_expert_bias:
    selection = selection + _rounded(params["expert_bias"], np.float32)
  topk_idx, margin = select_experts(selection, top_k, config.num_groups, config.group_top_k,
                                    GROUP_SCORE_EXPERTS_OF[config.group_score])
  weights = np.take_along_axis(scores, topk_idx, axis=1)
  if config.normalize_top_k:
    weights = weights / weights.sum(axis=1, keepdims=True)
  weights = weights * config.routed_scaling

  # Drop: replay each EP group's slab order (source rank, token, k).
  slab_rows = config.expert_capacity or expert_capacity(
      tokens_per_rank, top_k, num_experts, ep_size, config.capacity_factor)
  wire_rows = send_capacity_override or send_capacity(
      tokens_per_rank, top_k, ep_size, config.capacity_factor)
  padded_idx = np.full((num_rows, top_k), -1, np.int64)
  padded_idx[:num_valid] = topk_idx
  by_group = padded_idx.reshape(num_shards // ep_size, ep_size, tokens_per_rank, top_k)
  keep = np.zeros(by_group.shape, bool)
  arrived = 0
  for group, group_idx in enumerate(by_group):
    keep[group], _, _, group_wire = kept_routes(
        group_idx, num_experts=num_experts, ep_size=ep_size, expert_capacity=slab_rows,
        send_capacity=wire_rows)
    unlimited, _, _, _ = kept_routes(
        group_idx, num_experts=num_experts, ep_size=ep_size, expert_capacity=10 ** 9,
        send_capacity=wire_rows)
    arrived += int(unlimited.sum())
  keep = keep.reshape(num_rows, top_k)[:num_valid]

  # Experts, weighted per kept route, plus the always-on shared experts.
  w_in = _rounded(params["w_in"], compute_dtype)
  w_out = _rounded(params["w_out"], compute_dtype)
  y = np.zeros_like(tokens)
  for t in range(num_valid):
    for k in range(top_k):
      if keep[t, k]:
        expert = topk_idx[t, k]
        y[t] += weights[t, k] * _mlp(tokens[t], w_in[expert], w_out[expert], config.activation)
  if config.num_shared_experts:
    shared = _mlp(tokens, _rounded(params["shared_w_in"], compute_dtype),
                  _rounded(params["shared_w_out"], compute_dtype), config.activation)
    if config.shared_expert_gate:  # Qwen2-MoE: sigmoid(x @ gate) scales each token's share
      shared = shared / (1.0 + np.exp(-(tokens @ _rounded(params["shared_gate"], compute_dtype))))
    y += shared

  # Batch-global statistics and losses (Switch style, over the real tokens).
  routes = num_valid * top_k
  tokens_per_expert = np.bincount(topk_idx.reshape(-1), minlength=num_experts)
  dropped_fraction = 1.0 - keep.sum() / max(routes, 1)
  distribution = scores
  if config.score_function == "sigmoid":
    distribution = scores / scores.sum(axis=1, keepdims=True)
  aux_loss = config.aux_loss_coeff * num_experts * float(
      np.sum(tokens_per_expert / routes * distribution.mean(axis=0)))
  peak = logits.max(axis=1)
  logsumexp = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1))
  z_loss = config.z_loss_coeff * float(np.mean(logsumexp ** 2))

  return LayerReference(
      y=y.reshape(x.shape), aux_loss=aux_loss, z_loss=z_loss,
      tokens_per_expert=tokens_per_expert, dropped_fraction=float(dropped_fraction),
      scores=scores, topk_idx=topk_idx, topk_weights=weights, keep=keep,
      expert_capacity=slab_rows, send_capacity=wire_rows,
      wire_dropped=routes - arrived, margin=margin)


def reference_bias_update(expert_bias: np.ndarray, tokens_per_expert: np.ndarray,
                          rate: float) -> np.ndarray:
  """One auxiliary-loss-free step: ``bias + rate * sign(mean_load - load)``."""
  load = np.asarray(tokens_per_expert, np.float64)
  return np.asarray(expert_bias, np.float64) + rate * np.sign(load.mean() - load)
