"""P3: the expert bank's forward+backward TFLOP/s.

* ``banks``: the slab bank on ``[E, C, H]`` slabs against a dense matmul of
  the same FLOPs measured in the same run.
* ``grouped`` (P3-grouped): the grouped bank (:mod:`moe_ep.experts.grouped`)
  over exact-size groups against the slab bank at capacity 1.0 and dropless
  (``C = T``) and ``jax.lax.ragged_dot``, side by side, for group sizes that
  are uniform, skewed (Dirichlet, alpha 4), with one empty expert, and with
  one expert holding every row (:mod:`benchmarks.models` runs it on public
  models' shapes, Zipf loads too, against a dense chain). Every figure counts
  the routed rows' FLOPs (``T * K`` rows), whatever a method computes or drops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from moe_ep.experts import expert_mlp, grouped_expert_mlp
from moe_ep.row_groups import GROUP_ALIGN, ROW_TILE, group_of_rows, group_starts, grouped_rows_for

SHAPES = ((4096, 14336, 8), (2048, 1408, 64), (7168, 2048, 32))  # (H, F, E)
GROUP_SIZES = ("uniform", "skewed", "zipf", "one_empty", "all_in_one")
# (T, K, H, F, E) and options: Mixtral-like, DeepSeek-like at 64 and at 256
# experts. ragged_dot's weight gradient is a dense [E, T*K, H] product (out
# of memory on the DeepSeek-like shapes), and 256 dropless slabs of 8192 rows
# do not fit beside their gradients: those runs are left out.
GROUPED_SHAPES = (
    ((49152, 2, 2048, 4096, 8), dict()),
    ((8192, 8, 7168, 2048, 64), dict(ragged_dot=False)),
    ((8192, 8, 7168, 2048, 256), dict(ragged_dot=False, dropless_slabs=False,
                                      kinds=("uniform", "skewed"))),
)


def bank_flops(rows: int, hidden: int, ffn: int) -> int:
  """SwiGLU bank forward+backward: forward 2*rows*H*2F + 2*rows*F*H, backward twice that."""
  return 3 * (2 * rows * hidden * 2 * ffn + 2 * rows * ffn * hidden)


def group_sizes(rows: int, experts: int, kind: str, seed: int = 0) -> np.ndarray:
  """``[E]`` int32 rows per expert summing to ``rows``, of one of :data:`GROUP_SIZES`."""
  if kind == "uniform":
    sizes = np.full(experts, rows // experts)
  elif kind == "skewed":
    share = np.random.default_rng(seed).dirichlet(np.full(experts, 4.0))
    sizes = np.floor(share * rows)
  elif kind == "zipf":  # expert i's share is 1/i, the experts shuffled
    share = 1.0 / np.arange(1, experts + 1)
    sizes = np.floor(np.random.default_rng(seed).permutation(share / share.sum()) * rows)
  elif kind == "one_empty":
    sizes = np.full(experts, rows // (experts - 1))
    sizes[experts // 2] = 0
  elif kind == "all_in_one":
    sizes = np.zeros(experts)
    sizes[-1] = rows
  else:
    raise ValueError(f"kind={kind!r} is not one of {GROUP_SIZES}")
  sizes = sizes.astype(np.int32)
  sizes[np.argmax(sizes)] += rows - sizes.sum()
  return sizes


def weights(hidden: int, ffn: int, experts: int, seed: int):
  keys = jax.random.split(jax.random.key(seed), 2)
  w_in = jax.random.normal(keys[0], (experts, hidden, 2 * ffn), jnp.bfloat16) * hidden ** -0.5
  w_out = jax.random.normal(keys[1], (experts, ffn, hidden), jnp.bfloat16) * ffn ** -0.5
  return w_in, w_out


def fwd_bwd(mlp):
  """jit of the gradient of a scalar of ``mlp(tokens, w_in, w_out)`` in all three."""
  return jax.jit(jax.grad(lambda *a: jnp.sum(mlp(*a).astype(jnp.float32)), argnums=(0, 1, 2)))


def grouped_rows(sizes: np.ndarray, num_rows: int, hidden: int, seed: int,
                 align: int = GROUP_ALIGN) -> jax.Array:
  """``[M, H]`` bf16 rows in the grouped layout of ``sizes`` (zero padding),
  groups starting at multiples of ``align`` (default whole tiles)."""
  counts = jnp.asarray(sizes)
  starts, padded = group_starts(counts, num_rows, align)
  row = jnp.arange(num_rows, dtype=jnp.int32)
  group = group_of_rows(starts, padded, row)
  in_group = (group >= 0) & (row - starts[jnp.maximum(group, 0)] < counts[jnp.maximum(group, 0)])
  rows = jax.random.normal(jax.random.key(seed), (num_rows, hidden), jnp.bfloat16)
  return jnp.where(in_group[:, None], rows, 0)


def measure(fn, *args, iters: int) -> dict:
  try:
    return common.time_ms(fn, *args, iters=iters, repeats=3, warmup=1)
  except Exception as error:  # noqa: BLE001 - out of memory is a result here
    return common.failure(error)


def grouped_bank(tokens: int, top_k: int, hidden: int, ffn: int, experts: int,
                 kinds=GROUP_SIZES, iters: int = 5, ragged_dot: bool = True,
                 dropless_slabs: bool = True) -> dict:
  """One shape of P3-grouped: ms and routed-row TFLOP/s of each method."""
  routed = tokens * top_k
  flops = bank_flops(routed, hidden, ffn)
  w_in, w_out = weights(hidden, ffn, experts, seed=1)
  result = {"tokens": tokens, "top_k": top_k, "hidden": hidden, "ffn": ffn,
            "num_experts": experts, "flops": flops, "methods": {}}

  def record(name, timing, **facts):
    if "median_ms" in timing:
      timing["tflops"] = flops / timing["median_ms"] / 1e9
    result["methods"][name] = {**facts, **timing}

  slab_mlp = fwd_bwd(lambda x, a, b: expert_mlp(x, a, b, "swiglu"))
  slab_sizes = [("slabs_cf1.0", -(-routed // experts // ROW_TILE) * ROW_TILE)]
  if dropless_slabs:
    slab_sizes.append(("slabs_dropless", tokens))
  for name, capacity in slab_sizes:
    slabs = jax.random.normal(jax.random.key(2), (experts, capacity, hidden), jnp.bfloat16)
    record(name, measure(slab_mlp, slabs, w_in, w_out, iters=iters), rows_per_expert=capacity)
    del slabs

  num_rows = grouped_rows_for(tokens, top_k, experts, 1)
  for kind in kinds:
    sizes = group_sizes(routed, experts, kind)
    counts = jnp.asarray(sizes)
    rows = grouped_rows(sizes, num_rows, hidden, seed=3)
    mlp = fwd_bwd(lambda x, a, b: grouped_expert_mlp(x, counts, a, b, "swiglu"))
    capacity = result["methods"]["slabs_cf1.0"]["rows_per_expert"]
    record(f"grouped_{kind}", measure(mlp, rows, w_in, w_out, iters=iters), rows=num_rows,
           largest_over_mean=float(sizes.max() * experts / routed),
           slabs_cf1_kept_fraction=float(np.minimum(sizes, capacity).sum() / routed))
    if ragged_dot and kind == "skewed":
      def ragged(x, a, b):
        hidden_rows = jax.lax.ragged_dot(x, a, counts)
        gate, up = jnp.split(hidden_rows, 2, axis=-1)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, b, counts)
      dense_rows = jax.random.normal(jax.random.key(3), (routed, hidden), jnp.bfloat16)
      record("ragged_dot_skewed", measure(fwd_bwd(ragged), dense_rows, w_in, w_out,
                                           iters=iters))
      del dense_rows
    del rows
  reference = result["methods"]["slabs_cf1.0"].get("tflops")
  for method in result["methods"].values():
    if reference and "tflops" in method:
      method["of_slabs_cf1"] = method["tflops"] / reference
  return result


def run(shapes=SHAPES, total_rows: int = 65536, iters: int = 3, matmul_size: int = 8192,
        grouped_shapes=GROUPED_SHAPES) -> dict:
  peak = common.matmul_tflops(matmul_size)
  results = []
  for hidden, ffn, experts in shapes:
    capacity = total_rows // experts
    keys = jax.random.split(jax.random.key(hidden + ffn + experts), 4)
    tokens = jax.random.normal(keys[0], (experts, capacity, hidden), jnp.bfloat16)
    w_in = jax.random.normal(keys[1], (experts, hidden, 2 * ffn), jnp.bfloat16) * hidden ** -0.5
    w_out = jax.random.normal(keys[2], (experts, ffn, hidden), jnp.bfloat16) * ffn ** -0.5
    cotangent = jax.random.normal(keys[3], tokens.shape, jnp.bfloat16)

    def loss(tokens, w_in, w_out):
      out = expert_mlp(tokens, w_in, w_out, "swiglu")
      return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    timing = common.time_ms(step, tokens, w_in, w_out, iters=iters)
    flops = bank_flops(experts * capacity, hidden, ffn)
    results.append({"hidden": hidden, "ffn": ffn, "num_experts": experts,
                    "rows_per_expert": capacity, "flops": flops,
                    "tflops": flops / timing["median_ms"] / 1e9,
                    "fraction_of_dense": flops / timing["median_ms"] / 1e9 / peak["tflops"],
                    **timing})
  grouped = [grouped_bank(*shape, **{"iters": iters, **options})
             for shape, options in grouped_shapes]
  return {"dense_matmul": peak, "activation": "swiglu", "dtype": "bfloat16", "banks": results,
          "grouped": grouped}


def summary(result: dict) -> str:
  lines = [f"P3 expert bank fwd+bwd; dense matmul {result['dense_matmul']['tflops']:.0f} TFLOP/s"]
  for bank in result["banks"]:
    lines.append(f"  H={bank['hidden']} F={bank['ffn']} E={bank['num_experts']}: "
                 f"{bank['tflops']:.0f} TFLOP/s ({100 * bank['fraction_of_dense']:.0f}% of dense)")
  for shape in result.get("grouped", ()):
    lines.append(f"  P3-grouped T={shape['tokens']} K={shape['top_k']} H={shape['hidden']} "
                 f"F={shape['ffn']} E={shape['num_experts']} (routed-row TFLOP/s):")
    for name, method in shape["methods"].items():
      figure = (f"{method['tflops']:.0f}" if "tflops" in method
                else method.get("error", "?")[:60])
      share = f" ({100 * method['of_slabs_cf1']:.0f}% of slabs cf1.0)" if "of_slabs_cf1" in method \
          else ""
      lines.append(f"    {name}: {figure}{share}")
  return "\n".join(lines)
