"""P3 and P4 on the shapes of public MoE models, against a dense SwiGLU chain.

For each model shape ``(T, K, H, F, E)``, timed side by side in one run:

* ``dense``: the ceiling for the expert math, a plain two-GEMM SwiGLU chain
  over all ``T * K`` rows (``[TK, H] @ [H, 2F]``, the activation,
  ``@ [F, H]``), forward and backward with every gradient;
* the grouped bank (P3-grouped) on Zipf loads (expert ``i`` gets a share
  proportional to ``1 / i``, shuffled: a few experts hold many times the
  mean, as early in training) and on Dirichlet loads (alpha 4); where the
  activation is fused into the GEMMs by default, also with it as XLA passes
  (``_unfused``); with its groups on half tiles (``_align64``, the layout's
  ``group_align``), in clusters of two CTAs sharing their rows
  (``_cluster2``, ``TileConfig.cluster_columns``) and both, with each
  kernel's tiles' pipelines run one by one rather than as one chain
  (``_tile_by_tile``, ``TileConfig.chain_tiles``), and with the weight
  gradient's tiles run one by one rather than on one ring
  (``_wgrad_tile_by_tile``, its ``TileConfig.chain_tiles``): the bank's
  :class:`~moe_ep.experts.grouped.BankKernels`;
* the whole layer (P4) dropless with ``expert_layout="auto"`` (an untrained
  router, near balanced) and at capacity 1.0 on slabs, each with the input's
  gradient.

Every figure is TFLOP/s of the routed rows' useful FLOPs, and each method
also as a fraction of ``dense`` from the same run. The chain and the banks
are timed in interleaved rounds, so a bank's fraction is the median of its
round-by-round ratios (``of_dense_rounds``), which a drift of the device's
clocks reaches on both sides. The layers are timed in the same rounds.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from benchmarks import common, experts, layer
from moe_ep.experts import BankKernels, bank_layout, fp8, grouped_expert_mlp
from moe_ep.activations import small_activation
from moe_ep.row_groups import GROUP_ALIGN, grouped_rows_for

# name: (T, K, H, F, E). DeepSeek-V3's 256 experts at 8192 tokens: its bank
# at 16384 does not fit beside its gradients on one device.
SHAPES = {
    "qwen3_30b_a3b": (16384, 8, 2048, 768, 128),
    "olmoe_1b_7b": (16384, 8, 2048, 1024, 64),
    "mixtral_8x7b": (16384, 2, 4096, 14336, 8),
    "mixtral_8x22b": (16384, 2, 6144, 16384, 8),
    "deepseek_v2_lite": (16384, 6, 2048, 1408, 64),
    "gpt_oss_20b": (16384, 4, 2880, 2880, 32),
    "phi_3_5_moe": (16384, 2, 4096, 6400, 16),
    "deepseek_v3": (8192, 8, 7168, 2048, 256),
}
LOADS = ("zipf", "skewed")
# Shapes whose layer does not fit on one device beside the banks: its float32
# expert parameters and their gradients, for both variants (DeepSeek-V3's
# 256 experts: 45 GB each).
NO_LAYER = ("deepseek_v3",)
# The bank also with these options against the defaults in the same rounds:
# half tiles, clusters of two CTAs along the columns, tiles not chained, the
# weight gradient's tiles not chained, and the three GEMMs in block-scaled FP8
# (MoEConfig.expert_precision="fp8": the weights quantized once per step,
# inside the timed step, as the layer does).
BANK_OPTIONS = {"_align64": dict(group_align=64), "_cluster2": dict(cluster_columns=2),
                "_align64_cluster2": dict(group_align=64, cluster_columns=2),
                "_tile_by_tile": dict(chain_tiles=False),
                "_wgrad_tile_by_tile": dict(chain_wgrad=False),
                "_fp8": dict(precision="fp8")}


def dense_call(rows: int, hidden: int, ffn: int) -> tuple:
  """The two-GEMM SwiGLU chain over ``rows`` rows, forward+backward:
  ``(fn, args)``."""
  keys = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(keys[0], (rows, hidden), jnp.bfloat16)
  w_in = jax.random.normal(keys[1], (hidden, 2 * ffn), jnp.bfloat16) * hidden ** -0.5
  w_out = jax.random.normal(keys[2], (ffn, hidden), jnp.bfloat16) * ffn ** -0.5

  def chain(x, w_in, w_out):
    gate, up = jnp.split(x @ w_in, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w_out

  return experts.fwd_bwd(chain), (x, w_in, w_out)


def bank_call(tokens: int, top_k: int, num_experts: int, load: str, w_in: jax.Array,
              w_out: jax.Array, fuse_activation: bool | None = None,
              group_align: int = GROUP_ALIGN, cluster_columns: int | None = None,
              chain_tiles: bool | None = None,
              chain_wgrad: bool | None = None,
              precision: str | None = None) -> tuple[tuple, dict]:
  """The grouped bank over groups of ``load`` sizes, its activation fused
  into the GEMMs or not, its groups on whole or half tiles (``group_align``),
  its kernels in clusters of ``cluster_columns``, their tiles chained or not
  (``chain_tiles``) and the weight gradient's too (``chain_wgrad``; None:
  :class:`BankKernels`' defaults, :meth:`BankKernels.scheduled`), its GEMMs
  in FP8 with ``precision="fp8"`` (:mod:`moe_ep.experts.fp8`): ``(fn, args)``
  and its facts."""
  routed, hidden = tokens * top_k, w_in.shape[1]
  sizes = experts.group_sizes(routed, num_experts, load)
  counts = jnp.asarray(sizes)
  rows = experts.grouped_rows(sizes, grouped_rows_for(tokens, top_k, num_experts, 1), hidden,
                              seed=3, align=group_align)
  if precision == "fp8":
    mlp = experts.fwd_bwd(lambda x, a, b: fp8.fp8_grouped_expert_mlp(
        x, counts, a, b, fp8.quantize_weights(a), fp8.quantize_weights(b), "swiglu"))
  else:
    kernels = BankKernels().scheduled(cluster_columns=cluster_columns, chain_tiles=chain_tiles,
                                      chain_wgrad=chain_wgrad)
    mlp = experts.fwd_bwd(lambda x, a, b: grouped_expert_mlp(
        x, counts, a, b, "swiglu", fuse_activation=fuse_activation, group_align=group_align,
        kernels=kernels))
  return (mlp, (rows, w_in, w_out)), {"largest_over_mean": float(sizes.max() * num_experts
                                                                  / routed)}


LAYER_VARIANTS = {"layer_dropless": dict(factor=None),
                  "layer_cf1.0_slabs": dict(factor=1.0, expert_layout="slabs")}


def layer_calls(tokens: int, top_k: int, hidden: int, ffn: int, num_experts: int,
                backend: str) -> dict:
  """The layer's fwd+bwd step (:func:`layer.step_call`) of each of
  :data:`LAYER_VARIANTS`: ``{name: (fn, args)}``."""
  calls = {}
  for name, options in LAYER_VARIANTS.items():
    step, args, _ = layer.step_call(
        None, hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k, tokens=tokens,
        seq=min(tokens, 2048), backend=backend, exchange="auto", dispatch_dtype=None,
        **options)
    calls[name] = (step, args)
  return calls


def banks(tokens: int, top_k: int, hidden: int, ffn: int, num_experts: int, loads,
          iters: int, rounds: int, more_calls: dict | None = None,
          bank_options=BANK_OPTIONS) -> dict:
  """The dense chain, the grouped bank on each of ``loads`` (and unfused
  where the activation is fused by default, and with each of
  ``bank_options``) and ``more_calls``, timed in
  interleaved rounds (:func:`common.time_interleaved`); each method's
  ``of_dense_rounds`` is its speed over the chain's, round by round."""
  w_in, w_out = experts.weights(hidden, ffn, num_experts, seed=1)
  calls, facts = {"dense": dense_call(tokens * top_k, hidden, ffn)}, {}
  variants = [("", {})] + ([("_unfused", dict(fuse_activation=False))]
                           if small_activation(hidden, ffn) else [])
  variants += list(bank_options.items())
  for load in loads:
    for suffix, options in variants:
      calls[f"grouped_{load}{suffix}"], facts[f"grouped_{load}{suffix}"] = bank_call(
          tokens, top_k, num_experts, load, w_in, w_out, **options)
  calls.update(more_calls or {})
  methods = {name: {**facts.get(name, {}), **timing} for name, timing
             in common.time_interleaved(calls, iters=iters, rounds=rounds).items()}
  dense = methods["dense"].get("samples_ms")
  for method in methods.values():
    if dense and "samples_ms" in method:
      method["of_dense_rounds"] = [round(d / m, 4) for d, m in zip(dense, method["samples_ms"])]
  return methods


def run(shapes: dict = SHAPES, loads=LOADS, iters: int = 5, rounds: int = 4,
        layers: bool = True, backend: str = "auto", on_shape=None,
        bank_options=BANK_OPTIONS) -> dict:
  """Every shape of ``shapes``; ``on_shape(partial)``, if given, after each
  with the result so far (``"partial": true`` until the last), so that a run
  cut off by a time limit still leaves its finished shapes."""
  results = {}
  for name, (tokens, top_k, hidden, ffn, num_experts) in shapes.items():
    flops = experts.bank_flops(tokens * top_k, hidden, ffn)
    more = (layer_calls(tokens, top_k, hidden, ffn, num_experts, backend)
            if layers and name not in NO_LAYER else {})
    methods = banks(tokens, top_k, hidden, ffn, num_experts, loads, iters, rounds, more,
                    bank_options)
    for variant, (step, args) in more.items():
      if "median_ms" in methods[variant]:
        (_, aux), _ = step(*args)
        methods[variant]["dropped_fraction"] = float(aux.dropped_fraction)
    del more
    for method in methods.values():
      if "median_ms" in method:  # the same useful FLOPs as the chain: the routed rows
        method["tflops"] = flops / method["median_ms"] / 1e9
    for method in methods.values():
      if "of_dense_rounds" in method:  # timed beside the chain: the median of its rounds
        method["of_dense"] = statistics.median(method["of_dense_rounds"])
    results[name] = {"tokens": tokens, "top_k": top_k, "hidden": hidden, "ffn": ffn,
                     "num_experts": num_experts, "flops": flops,
                     "bank_layout": bank_layout("auto", jnp.bfloat16, hidden, ffn),
                     "methods": methods}
    if on_shape is not None and len(results) < len(shapes):
      on_shape({"activation": "swiglu", "dtype": "bfloat16", "models": results, "partial": True})
  return {"activation": "swiglu", "dtype": "bfloat16", "models": results}


def summary(result: dict) -> str:
  lines = ["P3/P4 on model shapes, fwd+bwd, routed-row TFLOP/s (fraction of the dense chain)"]
  for name, shape in result["models"].items():
    lines.append(f"  {name} T={shape['tokens']} K={shape['top_k']} H={shape['hidden']} "
                 f"F={shape['ffn']} E={shape['num_experts']} (auto: {shape['bank_layout']}):")
    for method_name, method in shape["methods"].items():
      if "tflops" not in method:
        lines.append(f"    {method_name}: {method.get('error', '?')[:80]}")
        continue
      share = f" ({method['of_dense']:.2f})" if "of_dense" in method else ""
      rounds = method.get("of_dense_rounds")
      if rounds and method_name != "dense":
        share = f" ({method['of_dense']:.2f}; rounds {min(rounds):.2f}-{max(rounds):.2f})"
      lines.append(f"    {method_name}: {method['median_ms']:.2f} ms, "
                   f"{method['tflops']:.0f}{share}")
  return "\n".join(lines)
