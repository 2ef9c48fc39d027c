"""A CuPy-transport workload for ``compute-sanitizer --tool memcheck``.

Not a pytest module: run it under the sanitizer on a GPU machine,

    compute-sanitizer --tool memcheck --target-processes application-only \\
        --error-exitcode 7 python tests/transport/cupy_sanitizer_workload.py

It drives every kernel through dispatch/combine forward and backward on the
edge cases (invalid ids, slab overflow, wire overflow, K=1, odd row widths
that take the 8/4/2-byte and scalar paths, many local experts), on one GPU
and, where there are two, with EP=2 across them on both exchanges: XLA's
all_to_all and the peer path (the fused row kernels where rows are whole
16-byte vectors, the drop-in exchange elsewhere); and the FP8 dispatch
(float8_e4m3fn wire rows: the quantize and dequantize kernels, and on the
peer path the dispatch that quantizes as it sends); and the grouped layout
(rows written to their grouped positions, in a buffer with room for every
row and in one too small, so that some are dropped). The peer kernels of two
GPUs wait for each other, so run it as one process per GPU, each under the
sanitizer (which serializes the kernels of its own process only):

    python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 -- \\
        compute-sanitizer --tool memcheck --target-processes application-only \\
        --error-exitcode 7 python tests/transport/cupy_sanitizer_workload.py

(``application-only``: following the workload's child processes, its
default, the sanitizer's front end segfaulted at start-up in a third of the
runs.)
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.distributed import initialize_from_env
from moe_ep.transport import combine, dispatch, grouped_rows_for
from moe_ep.row_groups import ROW_TILE

CASES = [  # tokens, hidden, dtype, experts, top_k, capacity, send_capacity
    (300, 256, jnp.bfloat16, 16, 4, 40, None),
    (300, 256, jnp.bfloat16, 16, 4, 8, 100),
    (97, 3, jnp.float32, 8, 1, 5, None),
    (64, 5, jnp.bfloat16, 300, 2, 3, None),
    (128, 6, jnp.float16, 8, 8, 1000, 17),
    (256, 1024, jnp.float32, 8, 8, 64, None),  # fused f32 sums
    (64, 7168, jnp.bfloat16, 256, 8, 16, None),  # decode-like: rows split into segments
]


FP8 = "float8_e4m3fn"
# FP8 dispatch variants: (wire_dtype, checkpoint_name); a name makes dispatch
# produce FP8 slabs (on the peer path: quantized inside the peer kernel).
FP8_VARIANTS = [(FP8, None), (FP8, "moe.dispatch")]


def round_trip(tokens, hidden, dtype, experts, top_k, capacity, send_capacity, axis,
               exchange="auto", mesh=None, wire_dtype=None, checkpoint_name=None,
               grouped_rows=None):
  paths = dict(transport="cupy", exchange=exchange, mesh=mesh)

  def loss(x, idx, w):
    d = dispatch(x, idx, w, num_experts=experts, expert_capacity=capacity, axis_name=axis,
                 send_capacity=send_capacity, wire_dtype=wire_dtype,
                 checkpoint_name=checkpoint_name, grouped_rows=grouped_rows, **paths)
    out = (d.tokens.astype(jnp.float32) * d.weights[..., None]).astype(x.dtype)
    y = combine(out, d.handle, num_tokens=x.shape[0], axis_name=axis, **paths)
    return jnp.sum(y.astype(jnp.float32) ** 2) + d.counts.sum() * 0.0
  return jax.value_and_grad(loss, argnums=(0, 2))


def grouped_buffers(tokens, experts, top_k, ranks=1):
  """Grouped buffer sizes: room for every row, and a buffer that drops some."""
  room = grouped_rows_for(tokens, top_k, experts, ranks)
  return (room, max(ROW_TILE, room // 4 // ROW_TILE * ROW_TILE))


def inputs(rng, ranks, tokens, hidden, dtype, experts, top_k):
  idx = rng.integers(-2, experts + 2, size=(ranks * tokens, top_k)).astype(np.int32)
  weights = rng.random(idx.shape).astype(np.float32)
  x = jnp.asarray(rng.normal(size=(ranks * tokens, hidden)), dtype)
  return x, idx, weights


def main():
  initialize_from_env()  # a no-op unless started by moe_ep.launch
  rng = np.random.default_rng(0)
  gpus = jax.devices("gpu")
  for case in CASES:
    x, idx, weights = inputs(rng, 1, *case[:2], case[2], *case[3:5])
    for wire in [(None, None)] + (FP8_VARIANTS if case[1] % 16 == 0 else []):
      value, grads = jax.jit(round_trip(*case, axis=None, wire_dtype=wire[0],
                                        checkpoint_name=wire[1]))(x, idx, weights)
      assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g, np.float32)).all()
                                               for g in grads)
    for rows in grouped_buffers(*case[:1], *case[3:5]):
      jax.block_until_ready(jax.jit(round_trip(*case, axis=None, grouped_rows=rows))(
          x, idx, weights))
  if len(gpus) >= 2:
    mesh = jax.sharding.Mesh(np.array(gpus[:2]), ("ep",))
    for case in CASES:
      host = [np.asarray(a) for a in inputs(rng, 2, *case[:2], case[2], *case[3:5])]
      if case[3] % 2:
        continue
      args = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("ep")),
                                           lambda index, a=a: a[index]) for a in host]
      for exchange in ("all_to_all", "peer"):
        for wire in [(None, None)] + (FP8_VARIANTS if case[1] % 16 == 0 else []):
          fn = jax.shard_map(round_trip(*case, axis="ep", exchange=exchange, mesh=mesh,
                                        wire_dtype=wire[0], checkpoint_name=wire[1]),
                             mesh=mesh, in_specs=P("ep"), out_specs=(P(), P("ep")),
                             check_vma=False)
          jax.block_until_ready(jax.jit(fn)(*args))
        for rows in grouped_buffers(case[0], case[3], case[4], ranks=2):
          fn = jax.shard_map(round_trip(*case, axis="ep", exchange=exchange, mesh=mesh,
                                        grouped_rows=rows),
                             mesh=mesh, in_specs=P("ep"), out_specs=(P(), P("ep")),
                             check_vma=False)
          jax.block_until_ready(jax.jit(fn)(*args))
  print(f"sanitizer workload done on {min(len(gpus), 2)} GPU(s), process {jax.process_index()}")


if __name__ == "__main__":
  main()
