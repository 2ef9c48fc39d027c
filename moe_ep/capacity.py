"""Capacity math: the sizes of the transport's static buffers, pure Python.

Notation used throughout the transport (per rank of the EP axis):

* ``R`` ranks on the EP axis, ``T`` local tokens, ``K`` routes per token,
  ``E`` experts, ``L = E // R`` local experts, ``C`` rows per expert slab
  (``expert_capacity``), ``S`` rows per destination send chunk
  (``send_capacity``), ``H`` hidden size.
* Rank ``r`` owns global experts ``[r*L, (r+1)*L)``; route ``(t, k)`` with id
  ``e`` goes to rank ``e // L``, local expert ``e % L``.
* A token is sent at most once to each destination rank (one wire row per
  distinct ``(token, rank)`` pair); the receiver expands it into one slab row
  per local expert it was routed to.
"""

from __future__ import annotations

import math
import operator

import numpy as np

# Slabs are the M dimension of the expert GEMMs: large ones are rounded to a
# whole number of 128-row tiles, small ones (tests, tiny models) to 8 rows.
_LARGE_SLAB_ROWS = 1024
_LARGE_SLAB_MULTIPLE = 128
_SMALL_SLAB_MULTIPLE = 8


def round_up(value, multiple: int):
  """``value`` (a Python int or an integer array) rounded up to ``multiple``."""
  return -(-value // multiple) * multiple


def positive_int(name: str, value) -> int:
  """``value`` as a Python int, or ValueError naming ``name``: a positive
  integer (NumPy integer scalars included; bools refused)."""
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r} must be a positive integer, not a bool")
  try:
    number = operator.index(value)
  except TypeError:
    raise ValueError(f"{name}={value!r} must be a positive integer") from None
  if number < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer")
  return number


def check_num_tokens(num_tokens, caller: str) -> int:
  """``T`` as a Python int; ValueError naming the shape rule for ``T < 1``."""
  try:
    empty = not isinstance(num_tokens, (bool, np.bool_)) and operator.index(num_tokens) == 0
  except TypeError:
    empty = False
  if empty:
    raise ValueError(f"num_tokens=0: {caller} needs T >= 1 tokens per rank")
  return positive_int("num_tokens", num_tokens)


def check_capacity_factor(capacity_factor, name: str = "capacity_factor") -> None:
  """ValueError naming ``name`` unless ``capacity_factor`` is None or a
  finite number > 0 (also the grouped layout's ``receive_factor``)."""
  if capacity_factor is None:
    return
  ok = (isinstance(capacity_factor, (int, float, np.integer, np.floating))
        and not isinstance(capacity_factor, (bool, np.bool_))
        and math.isfinite(capacity_factor) and capacity_factor > 0)
  if not ok:
    raise ValueError(f"{name}={capacity_factor!r} must be a finite number > 0 or None")


def check_experts(num_experts: int, top_k: int, ep_size: int) -> tuple[int, int, int]:
  """ValueError naming the argument unless sizes are positive, K <= E and E % R == 0.

  Returns ``(num_experts, top_k, ep_size)`` as Python ints."""
  num_experts = positive_int("num_experts", num_experts)
  top_k = positive_int("top_k", top_k)
  ep_size = positive_int("ep_size", ep_size)
  if top_k > num_experts:
    raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
  if num_experts % ep_size:
    raise ValueError(
        f"num_experts={num_experts} is not divisible by the ep axis size {ep_size}")
  return num_experts, top_k, ep_size


def expert_capacity_for(num_tokens: int, top_k: int, num_experts: int,
                        ep_size: int, capacity_factor: float | None = None) -> int:
  """Rows per expert slab ``C``.

  Args:
    num_tokens: tokens per rank ``T``.
    top_k: routes per token ``K``.
    num_experts: total experts ``E``.
    ep_size: ranks on the EP axis ``R``.
    capacity_factor: ``None`` gives the dropless bound ``R * T`` (every token
      of every source rank routed to one expert; assumes a token's K expert ids
      are distinct, as any top-k router gives). A float scales the balanced
      load ``R * T * K / E``.

  Returns:
    ``C``, rounded up to a GEMM-friendly multiple and never above the rounded
    dropless bound.
  """
  num_tokens = check_num_tokens(num_tokens, "expert_capacity_for")
  num_experts, top_k, ep_size = check_experts(num_experts, top_k, ep_size)
  check_capacity_factor(capacity_factor)
  dropless = round_up(ep_size * num_tokens, _SMALL_SLAB_MULTIPLE)
  if capacity_factor is None:
    rows = ep_size * num_tokens
  else:
    rows = math.ceil(capacity_factor * ep_size * num_tokens * top_k / num_experts)
  multiple = _LARGE_SLAB_MULTIPLE if rows >= _LARGE_SLAB_ROWS else _SMALL_SLAB_MULTIPLE
  return max(1, min(round_up(rows, multiple), dropless))


def send_capacity_for(num_tokens: int, top_k: int, num_experts: int,
                      ep_size: int, capacity_factor: float | None = None) -> int:
  """Rows per destination send chunk ``S``.

  ``None`` gives ``T`` (a token is sent at most once per rank, so this never
  drops). A float scales the balanced number of routes one rank sends to one
  destination, ``T * K / R``; rows are deduplicated routes, so this drops on
  the wire only what the slabs' balanced budget would also exceed.
  """
  num_tokens = check_num_tokens(num_tokens, "send_capacity_for")
  num_experts, top_k, ep_size = check_experts(num_experts, top_k, ep_size)
  check_capacity_factor(capacity_factor)
  if capacity_factor is None:
    return num_tokens
  rows = math.ceil(capacity_factor * num_tokens * top_k / ep_size)
  return max(1, min(round_up(rows, _SMALL_SLAB_MULTIPLE), num_tokens))
