"""Router math: scores, (group-limited) top-k, weights, aux losses, bias update.

Pure functions over one shard's tokens; the layer adds the cross-shard sums.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

# DeepSeek-V3 scores a group by the sum of its best two experts
# (MoEConfig.group_score "top2_sum"), DeepSeek-V2 by its best one ("max").
_EXPERTS_PER_GROUP_SCORE = {"top2_sum": 2, "max": 1}
# From this row width and up to this K the top-k takes K arg-max passes over
# [T, E] instead of lax.top_k, whose GPU TopK kernel serves only wide rows
# and sorts the others. One H100, 16k tokens, K=8, one router per call
# (docs/benchmarks.md, The router's top-k): lax.top_k 0.071 ms at E=128 and
# 0.155 ms at E=256, the passes at the host's dispatch floor (0.055-0.065 ms)
# on every width, as lax.top_k was on narrower rows.
_MIN_WIDTH_BY_PASSES, _MAX_K_BY_PASSES = 128, 16
_INT32_MIN = -2 ** 31


class Routing(NamedTuple):
  """One shard's routing decision.

  Attributes:
    scores: ``[T, E]`` float32 softmax or sigmoid scores (no bias).
    topk_idx: ``[T, K]`` int32 selected experts.
    topk_weights: ``[T, K]`` float32 routing weights (from ``scores``).
  """

  scores: jax.Array
  topk_idx: jax.Array
  topk_weights: jax.Array


def scores_from_logits(logits: jax.Array, score_function: str) -> jax.Array:
  """``[T, E]`` logits -> float32 scores."""
  logits = logits.astype(jnp.float32)
  if score_function == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if score_function == "sigmoid":
    return jax.nn.sigmoid(logits)
  raise ValueError(f"score_function={score_function!r} must be 'softmax' or 'sigmoid'")


def _order_keys(values: jax.Array) -> jax.Array:
  """int32 keys ordered as the float32 values (-0 < +0; every key above
  ``_INT32_MIN``, which marks a taken entry)."""
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
  keys = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
  return jnp.maximum(keys, _INT32_MIN + 1)


def top_k_indices(values: jax.Array, k: int) -> jax.Array:
  """``[..., N]`` -> ``[..., k]`` int32 indices of the ``k`` largest values,
  largest first, the lower index first among equals (``lax.top_k``'s order).

  Wide rows and small ``k`` take ``k`` arg-max passes (each one fused
  reduction, no sort), the others ``lax.top_k``; both give the same indices."""
  if k > _MAX_K_BY_PASSES or values.shape[-1] < _MIN_WIDTH_BY_PASSES:
    return jax.lax.top_k(values, k)[1].astype(jnp.int32)
  keys = _order_keys(values)
  columns = jnp.arange(values.shape[-1], dtype=jnp.int32)
  picked = []
  for _ in range(k):
    best = jnp.argmax(keys, axis=-1).astype(jnp.int32)
    picked.append(best)
    keys = jnp.where(columns == best[..., None], _INT32_MIN, keys)
  return jnp.stack(picked, axis=-1)


def group_limited_mask(selection: jax.Array, num_groups: int, group_top_k: int,
                       group_score: str = "top2_sum") -> jax.Array:
  """``[T, E]`` bool: experts inside each token's best ``group_top_k`` groups.

  A group's score is the sum of its two best selection scores (its best one
  when a group holds a single expert) with ``group_score="top2_sum"``, its
  best one with ``"max"``.
  """
  if group_score not in _EXPERTS_PER_GROUP_SCORE:
    raise ValueError(f"group_score={group_score!r} must be one of "
                     f"{tuple(_EXPERTS_PER_GROUP_SCORE)}")
  num_tokens, num_experts = selection.shape
  grouped = selection.reshape(num_tokens, num_groups, num_experts // num_groups)
  best = jax.lax.top_k(grouped, min(_EXPERTS_PER_GROUP_SCORE[group_score], grouped.shape[-1]))[0]
  _, top_groups = jax.lax.top_k(best.sum(axis=-1), group_top_k)  # [T, group_top_k]
  group_chosen = jnp.zeros((num_tokens, num_groups), bool).at[
      jnp.arange(num_tokens)[:, None], top_groups].set(True)
  return jnp.repeat(group_chosen, num_experts // num_groups, axis=1)


def _no_name(_: str, value):
  return value


def route(logits: jax.Array, *, top_k: int, score_function: str = "softmax",
          normalize_top_k: bool = True, routed_scaling: float = 1.0,
          num_groups: int | None = None, group_top_k: int | None = None,
          group_score: str = "top2_sum", expert_bias: jax.Array | None = None,
          name: Callable[[str, jax.Array], jax.Array] = _no_name) -> Routing:
  """Selects ``top_k`` experts per token.

  The expert bias only shifts *selection*; the weights always come from the
  unbiased scores, and the bias gets no gradient.

  Args:
    logits: ``[T, E]`` router logits.
    group_score: how a group is scored (see :func:`group_limited_mask`).
    expert_bias: ``[E]`` or None.
    name: attaches checkpoint names ``router.scores``, ``router.topk_idx``,
      ``router.topk_weights``.

  Returns:
    :class:`Routing`.
  """
  scores = name("router.scores", scores_from_logits(logits, score_function))
  selection = scores
  if expert_bias is not None:
    selection = selection + jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
  selection = jax.lax.stop_gradient(selection)
  if num_groups is not None:
    mask = group_limited_mask(selection, num_groups, group_top_k, group_score)
    selection = jnp.where(mask, selection, -jnp.inf)
  topk_idx = name("router.topk_idx", top_k_indices(selection, top_k))
  weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
  if normalize_top_k:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
  return Routing(scores, topk_idx, name("router.topk_weights", weights * routed_scaling))


def expert_histogram(topk_idx: jax.Array, num_experts: int) -> jax.Array:
  """``[E]`` int32: routes per expert (ids outside range are not counted)."""
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  ids = jnp.where(valid, topk_idx, num_experts).reshape(-1)
  return jnp.zeros(num_experts + 1, jnp.int32).at[ids].add(1)[:num_experts]


def load_balancing_loss(tokens_per_expert: jax.Array, mean_scores: jax.Array) -> jax.Array:
  """Switch-style ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

  Args:
    tokens_per_expert: ``[E]`` routes per expert over the batch (``f_e`` is
      its share of all ``T * K`` routes; no gradient flows through it).
    mean_scores: ``[E]`` batch mean of the per-token score distribution
      (``P_e``; carries the gradient).
  """
  num_experts = tokens_per_expert.shape[0]
  routes = tokens_per_expert.astype(jnp.float32)
  fraction = routes / jnp.maximum(routes.sum(), 1.0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_scores)


def score_distribution(scores: jax.Array, score_function: str) -> jax.Array:
  """``[T, E]`` per-token distribution used for ``P_e``: softmax scores as
  they are; sigmoid scores normalised to sum to one per token."""
  if score_function == "sigmoid":
    return scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
  return scores


def z_loss_terms(logits: jax.Array) -> jax.Array:
  """``[T]`` per-token ``logsumexp(logits)**2`` (the z-loss is their mean)."""
  return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2


def expert_bias_step(expert_bias: jax.Array, tokens_per_expert: jax.Array,
                     rate: float) -> jax.Array:
  """Auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of
  under-loaded experts and lower it for over-loaded ones by ``rate``.

  ``expert_bias`` and ``tokens_per_expert`` are ``[..., E]``: stacked layers
  (``[L, E]``) are balanced each against its own mean load."""
  load = tokens_per_expert.astype(jnp.float32)
  mean_load = load.mean(axis=-1, keepdims=True)
  return expert_bias + rate * jnp.sign(mean_load - load).astype(expert_bias.dtype)
