"""A workload for ``compute-sanitizer`` on the grouped bank's Hopper kernels.

Not a pytest module: run it on an H100/H200 under the sanitizer, with XLA
allocating each buffer on its own (so an access past one is out of bounds
for memcheck, not inside XLA's pool):

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \\
        --target-processes application-only --error-exitcode 7 \\
        python tests/experts/hopper_sanitizer_workload.py
    (the same with --tool racecheck and --no-reference: the reference's
    cuBLAS kernels report shared-memory hazards of their own under racecheck,
    and make the run many times longer; ``--align 64``: groups on half
    tiles, ``group_align=64``; ``--cluster 2``: the kernels in clusters of
    two CTAs, ``TileConfig.cluster_columns``; ``--no-chain``: each CTA's
    tiles' pipelines one by one, not chained, and the weight gradient's
    tiles too, not on its ring, ``TileConfig.chain_tiles``: the bank's
    ``BankKernels``)

It runs the forward, the input gradient and the weight gradient of
``grouped_matmul`` on the edge cases of the layout: empty groups, a group of
one row, a group holding every row, row tiles of no group at the buffer's
end, groups cut off by the end of the buffer, and many small groups; then the
SwiGLU bank forward and backward, and the bank with its activation fused
into the kernels' epilogues (``moe_ep.experts.hopper_fused``). Each result is checked against the
``ragged_dot`` implementation, so a kernel that the sanitizer passes but that
computes the wrong rows still fails (exit code 1).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep.experts import grouped
from moe_ep.experts.grouped import ROW_TILE
from moe_ep.capacity import round_up

CASES = [  # group sizes, spare row tiles of no group, K, N
    ([300, 0, 1, 129, 128, 64], 2, 256, 512),
    ([0, 0, 517, 0], 1, 512, 256),
    ([5, 0, 0], 0, 256, 256),
    ([700, 700], -3, 256, 256),  # the buffer ends inside the second group
    ([37] * 64, 0, 256, 256),  # many groups of one tile each
    ([300, 0, 129], 1, 1408, 2880),  # edge tiles past K and N (TMA fill and clip)
    ([200, 1], 1, 200, 72),  # sizes of only 8 | size, below one tile
    ([64, 65, 1, 192, 0, 63], 1, 256, 512),  # half tiles (with --align 64)
    ([448, 64], 0, 256, 256),  # a half tile ends the buffer (TMA fill past it)
]


START = time.monotonic()


def progress(done: str):
  """One line on stderr per case run, so a run cut short names its case."""
  print(f"{time.monotonic() - START:7.1f} s  {done}", file=sys.stderr, flush=True)


def grouped_problem(rng, sizes, spare_tiles, contraction, columns, align):
  """``(lhs [M, K], rhs [G, K, N], cotangent [M, N], tiles, in_group [M])``:
  bf16 operands with zero rows outside the groups, the layout's
  :class:`GroupTiles` (groups at multiples of ``align``) and which rows hold
  a group's row."""
  num_rows = round_up(sum(round_up(s, align) for s in sizes), ROW_TILE) + spare_tiles * ROW_TILE
  counts = jnp.asarray(sizes, jnp.int32)
  tiles = grouped.group_tiles(counts, num_rows, align)
  in_group = np.zeros(num_rows, bool)
  for start, rows, size in zip(np.asarray(tiles.group_start), np.asarray(tiles.group_rows), sizes):
    in_group[start:start + min(rows, size)] = True
  lhs = rng.normal(size=(num_rows, contraction)) * in_group[:, None]
  rhs = rng.normal(size=(len(sizes), contraction, columns)) / contraction ** 0.5
  cotangent = rng.normal(size=(num_rows, columns)) * in_group[:, None]
  cast = lambda a: jnp.asarray(a, jnp.bfloat16)
  return cast(lhs), cast(rhs), cast(cotangent), tiles, in_group


def passes(implementation, kernels):
  def run(lhs, rhs, cotangent, tiles):
    out, vjp = jax.vjp(lambda a, b: grouped.grouped_matmul(a, b, tiles, implementation, kernels),
                       lhs, rhs)
    return (out, *vjp(cotangent))
  return jax.jit(run)


def main(check_reference: bool = True, align: int = ROW_TILE,
         kernels: grouped.BankKernels = grouped.BankKernels()):
  if not grouped.hopper_available():
    raise SystemExit("needs a GPU of compute capability 9.0")
  rng = np.random.default_rng(0)
  failures = []
  for sizes, spare, contraction, columns in CASES:
    lhs, rhs, cotangent, tiles, in_group = grouped_problem(rng, sizes, spare, contraction, columns,
                                                           align)
    got = jax.block_until_ready(passes("hopper", kernels)(lhs, rhs, cotangent, tiles))
    progress(f"grouped_matmul {sizes} K={contraction} N={columns}")
    if not check_reference:
      continue
    want = passes("xla", kernels)(lhs, rhs, cotangent, tiles)
    for name, g, w in zip(("forward", "input gradient", "weight gradient"), got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      if name != "weight gradient":  # rows of no group are unspecified
        g, w = g[in_group], w[in_group]
      # Both accumulate in float32 and round once to bf16: within 2 bf16 ulps.
      if not np.allclose(g, w, rtol=2 ** -7, atol=2 ** -7 * np.abs(w).max()):
        failures.append(f"{name} of {sizes}: max error {np.abs(g - w).max()}")
  hidden, ffn, counts = 256, 512, jnp.asarray([300, 0, 129, 1], jnp.int32)
  rows = round_up(sum(round_up(int(c), align) for c in counts), ROW_TILE) + ROW_TILE
  x = jnp.asarray(rng.normal(size=(rows, hidden)), jnp.bfloat16)
  w_in = jnp.asarray(rng.normal(size=(4, hidden, 2 * ffn)) / hidden ** 0.5, jnp.bfloat16)
  w_out = jnp.asarray(rng.normal(size=(4, ffn, hidden)) / ffn ** 0.5, jnp.bfloat16)
  loss = lambda x, a, b: jnp.sum(grouped.grouped_expert_mlp(
      x, counts, a, b, "swiglu", implementation="hopper", group_align=align,
      kernels=kernels).astype(jnp.float32) ** 2)
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w_in, w_out)
  progress("the SwiGLU bank")
  if not (np.isfinite(float(value)) and all(np.isfinite(np.asarray(g, np.float32)).all()
                                            for g in grads)):
    failures.append("the SwiGLU bank's loss or gradients are not finite")
  failures += fused_activation_cases(rng, check_reference, align, kernels)
  if failures:
    raise SystemExit("\n".join(failures))
  print(f"hopper sanitizer workload done: {len(CASES)} grouped_matmul cases, the SwiGLU bank "
        f"and {len(FUSED_CASES)} fused-activation banks")


FUSED_CASES = [  # group sizes, spare row tiles, H, F, activation
    ([300, 0, 1, 129], 1, 256, 512, "swiglu"),
    ([700, 700], -3, 256, 256, "gelu"),  # the buffer ends inside the second group
    ([300, 0, 129], 1, 2880, 1408, "swiglu"),  # edge tiles (TMA fill and clip)
    ([200, 1], 1, 200, 72, "geglu"),  # sizes of only 8 | size
    ([64, 65, 1, 63], 1, 256, 512, "swiglu"),  # half tiles (with --align 64)
    ([448, 64], 0, 256, 256, "swiglu"),  # a half tile ends the buffer
    ([300, 0, 1, 129], 1, 768, 256, "swiglu"),  # the fused input gradient chains too
]


def fused_activation_cases(rng, check_reference: bool, align: int,
                           kernels: grouped.BankKernels) -> list[str]:
  """The bank with its activation in the kernels' epilogues, weighted, forward
  and every gradient, against the same bank on ``ragged_dot``."""
  failures = []
  for sizes, spare, hidden, ffn, activation in FUSED_CASES:
    n = 1 if activation == "gelu" else 2
    x, w_in, _, tiles, in_group = grouped_problem(rng, sizes, spare, hidden, n * ffn, align)
    w_out = jnp.asarray(rng.normal(size=(len(sizes), ffn, hidden)) / ffn ** 0.5, jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(0.1, 1, x.shape[0]) * in_group, jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=x.shape) * in_group[:, None], jnp.bfloat16)
    counts = jnp.asarray(sizes, jnp.int32)

    def run(implementation, fuse):
      mlp = lambda r, a, b, w: grouped.grouped_expert_mlp(
          r, counts, a, b, activation, implementation=implementation, row_weights=w,
          fuse_activation=fuse, group_align=align, kernels=kernels)
      out, vjp = jax.vjp(mlp, x, w_in, w_out, weights)
      return (out, *vjp(cotangent))

    got = jax.block_until_ready(jax.jit(lambda: run("hopper", True))())
    progress(f"fused {activation} {sizes} H={hidden} F={ffn}")
    if not check_reference:
      continue
    want = jax.jit(lambda: run("xla", False))()
    for name, g, w in zip(("out", "d_rows", "d_w_in", "d_w_out", "d_weights"), got, want):
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      # bf16 roundings of hidden, act and d_hidden at different points: 2e-2
      # of the norm (tests/experts/test_fused_activation.py's bound).
      error = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
      if not error <= 2e-2:
        failures.append(f"fused {activation} {name} of {sizes} H={hidden} F={ffn}: {error:.3g}")
  return failures


def option(name: str) -> int | None:
  """The integer after ``name`` on the command line, or None."""
  return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv[1:] else None


if __name__ == "__main__":
  chain = False if "--no-chain" in sys.argv[1:] else None
  main(check_reference="--no-reference" not in sys.argv[1:], align=option("--align") or ROW_TILE,
       kernels=grouped.BankKernels().scheduled(cluster_columns=option("--cluster"),
                                               chain_tiles=chain, chain_wgrad=chain))
