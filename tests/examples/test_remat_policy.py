"""The ``save_dots_attention`` remat policy keeps cuDNN flash attention's
forward out of the backward pass, which ``save_dots`` runs again.

cuDNN needs a GPU to run, not to trace: with JAX's cuDNN version and
compute-capability checks patched, the gradient's jaxpr shows on any machine
how often the fused forward runs (the reference: the jaxpr's own equations).
"""

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from conftest import nested_jaxprs
from tiny_run import TINY_YAML
from examples.model import block_remat_policy
from examples.train_config import load_config


def count_equations(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and every jaxpr inside it."""
  return sum(eqn.primitive.name == name for inner in nested_jaxprs(jaxpr) for eqn in inner.eqns)


@pytest.mark.parametrize("policy, forwards", [("save_dots", 2), ("save_dots_attention", 1)])
def test_the_attention_forward_runs_again_in_backward_only_under_save_dots(
    monkeypatch, policy, forwards):
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda *_, **__: 91900)
  monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability",
                      lambda *_, **__: True)
  config = load_config(TINY_YAML, ["model.remat_blocks=true", f"model.remat_policy={policy}"])

  def block(query, key, value):  # a projection, as the model's blocks have, and attention
    attended = jax.nn.dot_product_attention(query @ jnp.eye(64, dtype=query.dtype), key, value,
                                            is_causal=True, implementation="cudnn")
    return attended.astype(jnp.float32).sum()

  rows = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(block, policy=block_remat_policy(config)),
                                  argnums=(0, 1, 2)))(rows, rows, rows).jaxpr
  assert count_equations(jaxpr, "dot_product_attention_fwd_wrapper") == forwards
  assert count_equations(jaxpr, "dot_product_attention_bwd_wrapper") == 1
