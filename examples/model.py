"""A decoder-only transformer language model whose FFNs are
:class:`moe_ep.ExpertParallelMoE` layers (all of them, or every
``moe_every``-th with dense MLPs between).

The MoE layers are used as drop-ins: built under ``jax.set_mesh`` without a
``mesh=`` argument, called as ``y = moe(x)``, their aux losses and loads read
back with :func:`moe_ep.total_aux_loss` / :func:`moe_ep.collect_aux` and their
biases stepped with :func:`moe_ep.update_expert_biases` (see
``examples/pretrain.py``).

The depth is a repeat of one :class:`BlockGroup` (``moe_every - 1`` dense
blocks, then one MoE block). With ``scan_layers`` the groups are created
stacked by ``nnx.vmap`` and run by ``nnx.scan``; otherwise they are a list
run by a Python loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from examples.train_config import Config, ModelConfig
from moe_ep import ExpertParallelMoE, MoEConfig


def rotary(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of ``x [B, S, heads, head_dim]`` (positions 0..S-1)."""
  seq, head_dim = x.shape[1], x.shape[-1]
  inverse_frequency = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inverse_frequency  # [S, head_dim/2]
  cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
  return rotated.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
  """Pre-norm causal multi-head self-attention with rotary positions:
  ``x [B, S, D]`` -> ``x + attention(norm(x)) [B, S, D]``."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d_model, dtype = config.d_model, config.dtype
    self.num_heads, self.rope_base = config.num_heads, config.rope_base
    self.implementation = config.attention_implementation
    self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
    self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

  @jax.named_scope("attention")  # profiles attribute time by scope
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, seq, d_model = x.shape
    qkv = self.qkv(self.norm(x)).reshape(batch, seq, 3, self.num_heads, -1)
    query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    query, key = rotary(query, self.rope_base), rotary(key, self.rope_base)
    if self.implementation == "cudnn" and jax.default_backend() != "gpu":
      raise ValueError(f"ModelConfig.attention='cudnn' needs a CUDA GPU, but JAX's backend "
                       f"is {jax.default_backend()!r}: use attention 'auto' or 'xla'")
    attended = jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                            implementation=self.implementation)
    return x + self.out(attended.reshape(batch, seq, d_model))


class DenseBlock(nnx.Module):
  """Attention, then a pre-norm SwiGLU MLP: ``[B, S, D]`` -> ``[B, S, D]``."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d_model, dtype = config.d_model, config.dtype
    self.attention = CausalSelfAttention(config, rngs=rngs)
    self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
    self.w_in = nnx.Linear(d_model, 2 * config.mlp_size, use_bias=False, dtype=dtype, rngs=rngs)
    self.w_out = nnx.Linear(config.mlp_size, d_model, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.attention(x)
    with jax.named_scope("dense_mlp"):
      gate, up = jnp.split(self.w_in(self.norm(x)), 2, axis=-1)
      return x + self.w_out(jax.nn.silu(gate) * up)


class MoEBlock(nnx.Module):
  """Attention, then a pre-norm expert-parallel MoE: ``[B, S, D]`` -> ``[B, S, D]``."""

  def __init__(self, config: ModelConfig, moe: MoEConfig, *, rngs: nnx.Rngs):
    self.attention = CausalSelfAttention(config, rngs=rngs)
    self.norm = nnx.RMSNorm(config.d_model, dtype=config.dtype, rngs=rngs)
    # The layer keeps its aux (return_aux=False) for the model-wide helpers.
    self.moe = ExpertParallelMoE(dataclasses.replace(moe, return_aux=False), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.attention(x)
    return x + self.moe(self.norm(x))


class BlockGroup(nnx.Module):
  """``moe_every - 1`` dense blocks and one MoE block: the unit the depth repeats."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.dense_blocks = nnx.List([DenseBlock(config.model, rngs=rngs)
                                  for _ in range(config.model.moe_every - 1)])
    self.moe_block = MoEBlock(config.model, config.moe, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    for block in self.dense_blocks:
      x = block(x)
    return self.moe_block(x)


def fused_attention_forward(primitive, *_, **__) -> bool:
  """A ``jax.checkpoint`` policy: saves cuDNN flash attention's forward
  outputs (JAX's ``dot_product_attention_fwd_wrapper``)."""
  return primitive.name == "dot_product_attention_fwd_wrapper"


def block_remat_policy(config: Config):
  """The ``jax.checkpoint`` policy of each repeating unit as
  ``model.remat_policy`` names it (see :class:`ModelConfig`); None without
  ``model.remat_blocks``."""
  if not config.model.remat_blocks:
    return None
  moe_names = config.moe.remat.policy()
  policies = jax.checkpoint_policies
  save_dots = policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                               moe_names)
  return {
      "moe": moe_names,
      "save_dots": save_dots,
      "save_dots_attention": policies.save_from_both_policies(save_dots,
                                                              fused_attention_forward),
      "full": policies.nothing_saveable,
  }[config.model.remat_policy]


class TransformerLM(nnx.Module):
  """Token embedding, ``num_layers`` blocks, final RMSNorm, unembedding:
  ``model(tokens [B, S] int32)`` -> ``logits [B, S, vocab] float32``.

  Build it under ``jax.set_mesh(mesh)`` with a ``("dp", "ep")`` mesh: the MoE
  layers shard their experts over ``"ep"``.

  Args:
    config: the run's :class:`~examples.train_config.Config` (``model`` and ``moe``).
    rngs: parameter initialisation keys.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    model = config.model
    self.scan_layers = model.scan_layers
    self.remat_policy = block_remat_policy(config)
    # Unit-scale embeddings: with the default 1/sqrt(d_model) the token signal
    # is lost under the blocks' unit-scale outputs in deep stacks, and a
    # 12-layer model stayed at log(vocab) for hundreds of steps.
    self.embed = nnx.Embed(model.vocab_size, model.d_model, dtype=model.dtype,
                           embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
    if model.scan_layers:
      @nnx.split_rngs(splits=model.num_moe_layers)
      # The layer's partition metadata gains an unnamed leading axis: P(None, "ep", ...).
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def create_stack(rngs):
        return BlockGroup(config, rngs=rngs)
      self.groups = create_stack(rngs)
    else:
      self.groups = nnx.List([BlockGroup(config, rngs=rngs)
                              for _ in range(model.num_moe_layers)])
    self.norm = nnx.RMSNorm(model.d_model, dtype=model.dtype, rngs=rngs)
    self.unembed = nnx.Linear(model.d_model, model.vocab_size, use_bias=False,
                              dtype=model.dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    def run_group(group: BlockGroup, x):
      return group(x)
    if self.remat_policy is not None:
      run_group = nnx.remat(run_group, policy=self.remat_policy)

    x = self.embed(tokens)
    if self.scan_layers:
      x = nnx.scan(run_group, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.groups, x)
    else:
      for group in self.groups:
        x = run_group(group, x)
    with jax.named_scope("unembed"):
      return self.unembed(self.norm(x)).astype(jnp.float32)
