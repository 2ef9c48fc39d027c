"""The experts' activations, in one place: which there are, which are
gated, the activation itself, and the ``F < 2H`` rule for where work goes
through it.

Below the configuration and the expert bank (JAX only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_ep.precision import exact_float32

ACTIVATIONS = ("swiglu", "geglu", "gelu")
# Gated activations read two input projections, gate | up, each F wide.
GATED_ACTIVATIONS = ("swiglu", "geglu")


def input_projections(activation: str) -> int:
  """``n`` of ``w_in [L, H, n*F]``: 2 for gated activations (gate and up), 1
  otherwise."""
  return 2 if activation in GATED_ACTIVATIONS else 1


def activate(hidden: jax.Array, activation: str, row_weights: jax.Array | None = None
             ) -> jax.Array:
  """``[..., n*F]`` -> ``[..., F]`` in ``hidden``'s dtype: gated activations
  split gate | up.

  Computed in float32 from ``hidden``'s exact values and rounded once, as
  the Hopper kernels' epilogues compute it: in ``hidden``'s dtype the
  intermediate roundings would be XLA's to keep or drop per fusion
  (:mod:`moe_ep.precision`), so two programs of one layer could differ.
  ``row_weights [...]`` (float32), if given, scales each row before that
  rounding: ``(w * a) @ W_out`` is the weighted output ``w * (a @ W_out)``
  without a pass over ``[..., H]``, forward or backward (the weights'
  gradient then sums over ``F``, in the pass that already reads the
  activation's)."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r} must be 'swiglu', 'geglu' or 'gelu'")
  wide = exact_float32(hidden)
  if activation == "gelu":
    act = jax.nn.gelu(wide)
  else:
    gate, up = jnp.split(wide, 2, axis=-1)
    act = (jax.nn.silu(gate) if activation == "swiglu" else jax.nn.gelu(gate)) * up
  if row_weights is not None:
    act = act * row_weights[..., None]
  return act.astype(hidden.dtype)


def small_activation(hidden: int, ffn: int) -> bool:
  """``F < 2H``: the activation ``[M, F]`` is small beside a pass over the
  output ``[M, H]``. There the layer's routing weights scale the activation
  rather than the output, and the grouped bank fuses the activation into its
  GEMMs' epilogues by default.

  Per row, weighting the output costs a pass over ``[M, H]`` forward and two
  backward (about ``6H`` elements read or written); weighting the activation
  costs nothing forward (its pass exists) and, backward, the weights'
  gradient reads the activation's input and gradient (``3F``, ``2F + F``
  gated or not). Fused, the epilogues read and write pieces of the hidden
  rows serially, which costs less than the XLA passes it removes where the
  activation is small and more where it is large (docs/grouped.md has the
  measurements)."""
  return ffn < 2 * hidden
