"""The GPU lowering, checked on any machine: with CuPy "present", backend
"auto" lowers every local pass for CUDA to a command-buffer buffer_callback
under its named scope, and lowers to plain XLA for CPU."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from conftest import custom_call_scopes, make_mesh
from moe_ep.transport import NAMED_SCOPES, combine, dispatch

EP, TOKENS, HIDDEN, EXPERTS, TOP_K = 4, 16, 8, 8, 2
BUFFER_CALLBACK = "xla_buffer_python_gpu_callback_cmd_buffer"
# Targets of jax.pure_callback / io_callback / debug.callback: none may appear.
HOST_CALLBACKS = ("xla_python_cpu_callback", "xla_python_gpu_callback",
                  "xla_ffi_python_cpu_callback", "xla_ffi_python_gpu_callback")


def value_and_grad_step():
  def body(x, idx, w):
    d = dispatch(x, idx, w, num_experts=EXPERTS, expert_capacity=16, axis_name="ep")
    out = jnp.sin(d.tokens) * d.weights[..., None].astype(x.dtype)
    return combine(out, d.handle, num_tokens=x.shape[0], axis_name="ep")

  fn = jax.shard_map(body, mesh=make_mesh((EP,), ("ep",)), in_specs=P("ep"), out_specs=P("ep"))
  idx = jnp.zeros((EP * TOKENS, TOP_K), jnp.int32)
  loss = lambda x, w: jnp.sum(fn(x, idx, w).astype(jnp.float32) ** 2)
  args = (jnp.ones((EP * TOKENS, HIDDEN), jnp.bfloat16), jnp.ones((EP * TOKENS, TOP_K)))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args)



def test_cuda_lowering_uses_named_buffer_callbacks(pretend_cupy):
  text = value_and_grad_step().lower(lowering_platforms=("cuda",)).as_text(debug_info=True)
  calls = custom_call_scopes(text)
  assert calls and all(target == BUFFER_CALLBACK for target, _ in calls)
  assert not any(host in text for host in HOST_CALLBACKS)
  passes = Counter()
  for _, name in calls:
    phase = next(scope for scope in NAMED_SCOPES.values() if name.startswith(scope + "/"))
    kernel = re.search(r"(moe_cupy_\w+)/buffer_callback", name).group(1)
    passes[phase, kernel] += 1
  assert passes == Counter({
      (NAMED_SCOPES["dispatch"], "moe_cupy_route"): 1,
      (NAMED_SCOPES["dispatch"], "moe_cupy_slab_layout"): 1,
      (NAMED_SCOPES["dispatch"], "moe_cupy_expand_rows"): 2,  # pack, unpack
      (NAMED_SCOPES["combine"], "moe_cupy_gather_sum_rows"): 2,  # partial sums, final sums
      (NAMED_SCOPES["combine_bwd"], "moe_cupy_expand_rows"): 2,
      (NAMED_SCOPES["dispatch_bwd"], "moe_cupy_gather_sum_rows"): 2,
  })


def test_cpu_lowering_of_auto_is_pure_xla(pretend_cupy):
  text = value_and_grad_step().lower(lowering_platforms=("cpu",)).as_text()
  assert "custom_call @xla_buffer_python" not in text
