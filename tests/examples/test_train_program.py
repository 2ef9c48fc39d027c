"""examples/train_program.py's optimizer: the bf16 first-moment option
against the float32 AdamW it stands in for."""

import jax
import jax.numpy as jnp
import numpy as np

from examples.train_config import TrainConfig
from examples.train_program import make_optimizer


def test_a_bfloat16_first_moment_gives_the_float32_updates_to_its_rounding():
  """``adam_mu_dtype="bfloat16"`` keeps AdamW's first moment in bf16 (and
  the second in float32), and its updates are float32 AdamW's within the
  moment's roundings: gradients of one sign per coordinate (no cancellation
  in the moment), each step's bf16 rounding off by at most 2**-9 of it, so
  after ``t`` steps within ``t * 2**-8`` of each update (weight decay off:
  it adds the same term to both)."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(24,)), jnp.float32)}
  signs = jax.tree.map(lambda p: np.sign(rng.normal(size=p.shape)), params)
  train = dict(steps=10, warmup_steps=0, weight_decay=0.0, grad_clip_norm=None)
  optimizers = {dtype: make_optimizer(TrainConfig(adam_mu_dtype=dtype, **train))
                for dtype in (None, "bfloat16")}
  states = {dtype: opt.init(params) for dtype, opt in optimizers.items()}
  moments = lambda state: [leaf for leaf in jax.tree.leaves(state)
                           if getattr(leaf, "shape", ()) == (16, 24)]
  assert [m.dtype for m in moments(states["bfloat16"])] == [jnp.bfloat16, jnp.float32]
  assert [m.dtype for m in moments(states[None])] == [jnp.float32, jnp.float32]
  changed = False
  for step in range(1, 5):
    grads = jax.tree.map(lambda s: jnp.asarray(s * rng.uniform(0.5, 2.0, s.shape), jnp.float32),
                         signs)
    updates = {}
    for dtype, opt in optimizers.items():
      updates[dtype], states[dtype] = opt.update(grads, states[dtype], params)
    for got, want in zip(jax.tree.leaves(updates["bfloat16"]), jax.tree.leaves(updates[None])):
      got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
      assert np.all(np.abs(got - want) <= step * 2.0 ** -8 * np.abs(want)), step
      changed |= bool(np.any(got != want))
  assert changed  # the option is not a no-op
