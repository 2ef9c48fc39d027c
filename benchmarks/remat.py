"""Remat variants of a stack of layers' value_and_grad (``nnx.scan`` over
stacked layers, the policy applied per layer): forward dispatch exchanges in
the compiled program, its memory (``compiled.memory_analysis()``: ``temp`` is
the activations and residuals) and its time, side by side, with no
checkpoint (everything saved), with the dispatch saved (bf16 and FP8
dispatch, whose saved tokens are the FP8 slabs), and with nothing saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from benchmarks import common, hlo
from moe_ep.transport import NAMED_SCOPES

_MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "generated_code_size_in_bytes")


def run(hidden=1024, ffn=2048, num_experts=16, top_k=2, batch=16, seq=512, num_layers=8,
        dp=None, backend="auto", dtype="bfloat16", iters=5, fp8=True) -> dict:
  devices = jax.devices()
  ep = min(len(devices), num_experts)
  dp = dp or len(devices) // ep
  mesh = jax.sharding.Mesh(np.array(devices[:dp * ep]).reshape(dp, ep), ("dp", "ep"))
  x = jax.random.normal(jax.random.key(1), (batch, seq, hidden), jnp.dtype(dtype))

  def stack(dispatch_dtype):
    config = MoEConfig(hidden_size=hidden, ffn_size=ffn, num_experts=num_experts, top_k=top_k,
                       dtype=dtype, transport=backend, capacity_factor=1.25,
                       dispatch_dtype=dispatch_dtype)

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def create(rngs):
      return ExpertParallelMoE(config, mesh=mesh, rngs=rngs)
    return nnx.split(create(nnx.Rngs(0)), nnx.Param, ...)

  def stack_loss(policy, graphdef, rest):
    def step(layer, h):
      y, aux = layer(h)
      return h + y, aux.aux_loss
    if policy is not None:
      step = nnx.remat(step, policy=policy)

    def loss(params, x):
      layers = nnx.merge(graphdef, params, rest)
      h, aux_losses = nnx.scan(step, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))(layers, x)
      return jnp.mean(h.astype(jnp.float32) ** 2) + aux_losses.sum()
    return loss

  save_dispatch = RematConfig(save=("dispatch",)).policy()
  policies = {"no_checkpoint": (None, None),
              "save_dispatch": (save_dispatch, None),
              "save_dispatch_tokens_and_weights_only": (
                  jax.checkpoint_policies.save_only_these_names(
                      "moe.dispatch.tokens", "moe.dispatch.weights"), None),
              "nothing_saveable": (jax.checkpoint_policies.nothing_saveable, None)}
  if fp8:
    policies["save_dispatch_fp8"] = (save_dispatch, "float8_e4m3fn")
  variants = {}
  stacks = {}
  for name, (policy, dispatch_dtype) in policies.items():
    if dispatch_dtype not in stacks:
      stacks[dispatch_dtype] = stack(dispatch_dtype)
    graphdef, params, rest = stacks[dispatch_dtype]
    step = jax.jit(jax.value_and_grad(stack_loss(policy, graphdef, rest), argnums=(0, 1)))
    compiled = step.lower(params, x).compile()
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    variants[name] = {
        "dispatch_dtype": dispatch_dtype,
        **common.time_ms(compiled, params, x, iters=iters),
        "forward_row_exchanges": hlo.count(text, scope=f"{NAMED_SCOPES['dispatch']}/exchange_rows"),
        "forward_dispatch_exchanges": hlo.count(text, scope=NAMED_SCOPES["dispatch"] + "/"),
        "all_collectives": len(hlo.collectives(text)),
        **{field: getattr(memory, field, None) for field in _MEMORY_FIELDS},
    }
  return {"shapes": dict(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k,
                         batch=batch, seq=seq, num_layers=num_layers, dtype=dtype,
                         mesh=dict(mesh.shape),
                         capacity_factor=1.25, transport=backend),
          "variants": variants}


def summary(result: dict) -> str:
  lines = [f"remat variants {result['shapes']}"]
  for name, v in result["variants"].items():
    lines.append(f"  {name:40s} row exchanges {v['forward_row_exchanges']}, dispatch exchanges "
                 f"{v['forward_dispatch_exchanges']}, collectives {v['all_collectives']}, temp "
                 f"{(v['temp_size_in_bytes'] or 0) / 2**20:.1f} MiB, {v['median_ms']:.2f} ms")
  return "\n".join(lines)
