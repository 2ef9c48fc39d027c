"""The wire format of the routing metadata that travels with the token rows.

One int32 row per destination rank, ``width(S, K, L) = 2*S*K + L`` words::

  [0, S*K)        local expert id of member k of slot s (row-major s, k), -1 if none
  [S*K, 2*S*K)    its routing weight, float32 bit pattern
  [2*S*K, +L)     routes this rank sends to each of the destination's L experts,
                  counted before any drop (the receiver sums them into demand)

Both backends read and write exactly this layout; ``kernels/layout.cu``
documents the same offsets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def width(send_capacity: int, top_k: int, num_local_experts: int) -> int:
  return 2 * send_capacity * top_k + num_local_experts


def demand_offset(send_capacity: int, top_k: int) -> int:
  """Where the demand counts start in a row."""
  return 2 * send_capacity * top_k


def send_capacity(meta_width: int, top_k: int, num_local_experts: int) -> int:
  """``S`` of a row ``meta_width`` words wide (the inverse of :func:`width`);
  ValueError unless ``meta_width = 2 * S * K + L`` with ``S >= 1``."""
  capacity, rest = divmod(meta_width - num_local_experts, 2 * top_k)
  if rest or capacity < 1:
    raise ValueError(f"meta width {meta_width} must be 2 * S * K + L with S >= 1, K={top_k}, "
                     f"L={num_local_experts}")
  return capacity


def pack(local_ids: jax.Array, weights: jax.Array, demand: jax.Array) -> jax.Array:
  """``local_ids [R, S, K]`` int32, ``weights [R, S, K]`` float32, ``demand [R, L]`` int32
  -> ``[R, width]`` int32."""
  ep_size = local_ids.shape[0]
  return jnp.concatenate([
      local_ids.reshape(ep_size, -1).astype(jnp.int32),
      jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32).reshape(ep_size, -1),
      demand.astype(jnp.int32),
  ], axis=1)


def unpack(meta: jax.Array, *, top_k: int, num_local_experts: int):
  """Inverse of :func:`pack`: ``[R, width]`` -> ``local_ids [R, S, K]``,
  ``weights [R, S, K]`` float32, ``demand [R, L]``."""
  ep_size, meta_width = meta.shape
  capacity = send_capacity(meta_width, top_k, num_local_experts)
  members = capacity * top_k
  local_ids = meta[:, :members].reshape(ep_size, capacity, top_k)
  weights = jax.lax.bitcast_convert_type(meta[:, members:2 * members], jnp.float32)
  demand = meta[:, demand_offset(capacity, top_k):]
  return local_ids, weights.reshape(ep_size, capacity, top_k), demand
