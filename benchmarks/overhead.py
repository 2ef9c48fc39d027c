"""Host overhead per buffer_callback launch, with and without command buffers:
a chain of tiny kernel launches (one row copied by gather_sum_rows) in one
jitted function, time per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from benchmarks import common
from moe_ep.transport import cupy_backend
from moe_ep.transport import kernel_launch


def run(calls: int = 200) -> dict:
  width = 32
  results = {}
  for command_buffer in (True, False):
    def callback(ctx, outs, table, index):
      with kernel_launch.on_xla_stream(ctx, table, cupy_backend.kernels) as launch:
        launch("gather_sum_rows_f32", 1, 32, kernel_launch.pointer(table),
               kernel_launch.pointer(index), kernel_launch.pointer(outs[0]),
               *kernel_launch.i32(1, 1, 1, width))

    launch = buffer_callback(callback, [jax.ShapeDtypeStruct((1, width), jnp.float32)],
                             command_buffer_compatible=command_buffer)

    def chain(x, index):
      for _ in range(calls):
        x = launch(x, index)[0]
      return x

    kernel_launch.compile_for_local_gpus(cupy_backend.kernels)
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
