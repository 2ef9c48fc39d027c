"""Host overhead per buffer_callback launch, with and without command buffers:
a chain of tiny kernel launches (one row copied by gather_sum_rows) in one
jitted function, time per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from moe_ep.bench import common


def run(calls: int = 200) -> dict:
  from moe_ep.transport import cupy as cupy_backend  # the kernels and their launcher
  width = 32
  results = {}
  for command_buffer in (True, False):
    def callback(ctx, outs, table, index):
      with cupy_backend._on_xla_stream(ctx, table) as launch:
        launch("gather_sum_rows_f32", 1, 32, cupy_backend._pointer(table),
               cupy_backend._pointer(index), cupy_backend._pointer(outs[0]),
               *cupy_backend._i32(1, 1, 1, width))

    launch = buffer_callback(callback, [jax.ShapeDtypeStruct((1, width), jnp.float32)],
                             command_buffer_compatible=command_buffer)

    def chain(x, index):
      for _ in range(calls):
        x = launch(x, index)[0]
      return x

    cupy_backend._compile_at_trace_time()
    fn = jax.jit(chain)
    x = jnp.ones((1, width), jnp.float32)
    index = jnp.zeros((1, 1), jnp.int32)
    assert np.asarray(fn(x, index)).tolist() == np.asarray(x).tolist()
    timing = common.time_ms(fn, x, index, iters=5)
    results["command_buffer" if command_buffer else "no_command_buffer"] = {
        "us_per_call": 1e3 * timing["median_ms"] / calls, **timing}
  return {"calls_per_jit": calls, "variants": results}


def summary(result: dict) -> str:
  return "host overhead per callback: " + ", ".join(
      f"{name} {v['us_per_call']:.1f} us" for name, v in result["variants"].items())
