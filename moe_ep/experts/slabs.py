"""The expert bank: batched GEMMs over ``[L, C, H]`` slabs.

Every expert's rows sit in a fixed-size slab, so the bank is two einsums
batched over the expert axis (never ``jax.lax.ragged_dot``, far slower:
docs/grouped.md). The same function serves the shared experts with ``L = 1``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from moe_ep.activations import activate

Namer = Callable[[str, jax.Array], jax.Array]


def _no_name(_: str, value: jax.Array) -> jax.Array:
  return value


def expert_mlp(tokens: jax.Array, w_in: jax.Array, w_out: jax.Array, activation: str,
               name: Namer = _no_name, row_weights: jax.Array | None = None) -> jax.Array:
  """Applies expert ``l``'s MLP to slab ``l``.

  Args:
    tokens: ``[L, C, H]`` slab rows, compute dtype.
    w_in: ``[L, H, n*F]`` input projection (``n = 2`` for gated activations,
      gate then up).
    w_out: ``[L, F, H]`` output projection.
    activation: ``"swiglu"``, ``"geglu"`` or ``"gelu"``.
    name: attaches checkpoint names (``"expert_hidden"``, the activation
      input, and ``"expert_output"``).
    row_weights: ``[L, C]`` float32, each row's routing weight, or None: the
      output is then weighted (see :func:`activate`).

  Returns:
    ``[L, C, H]`` in ``tokens.dtype``.
  """
  hidden = jnp.einsum("lch,lhf->lcf", tokens, w_in.astype(tokens.dtype))
  hidden = name("expert_hidden", hidden)
  out = jnp.einsum("lcf,lfh->lch", activate(hidden, activation, row_weights),
                   w_out.astype(tokens.dtype))
  return name("expert_output", out)
