"""The router's top-k on public models' router shapes, one device: the
arg-max passes :func:`moe_ep.router.top_k_indices` takes for ``E >= 128``
and ``K <= 16`` beside ``lax.top_k`` (a sort where XLA's TopK kernel does
not serve the row width), and the whole router forward and backward (scores, top-k, weights,
the load-balancing and z losses) as the layer runs it, timed in interleaved
rounds. Each call runs ``repeats`` routers of different logits in one
``lax.map``, so that the device's time, not the host's dispatch of a call
(tens of microseconds, as long as one router), is what is divided by
``repeats``. The two top-k give the same indices; the result says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from moe_ep import router

# name: (T, E, K, groups, group_top_k) of one device's router.
SHAPES = {
    "qwen3_30b_a3b": (16384, 128, 8, None, None),
    "olmoe_1b_7b": (16384, 64, 8, None, None),
    "granite_3_1b_a400m": (16384, 32, 8, None, None),
    "deepseek_v2_lite": (16384, 64, 6, None, None),
    "mixtral_8x7b": (16384, 8, 2, None, None),
    "deepseek_v3": (16384, 256, 8, 8, 4),
}


def _router_loss(logits, top_k, groups, group_top_k):
  """The router's part of a step: weights (into a stand-in for the combine),
  the load-balancing and z losses."""
  routing = router.route(logits, top_k=top_k, num_groups=groups, group_top_k=group_top_k,
                         score_function="sigmoid" if groups else "softmax")
  counts = router.expert_histogram(routing.topk_idx, logits.shape[-1])
  aux = router.load_balancing_loss(counts, routing.scores.mean(axis=0))
  return routing.topk_weights.sum() + aux + router.z_loss_terms(logits).mean()


def _per_router(timing: dict, repeats: int) -> dict:
  if "median_ms" not in timing:
    return timing
  return {"median_ms": timing["median_ms"] / repeats, "min_ms": timing["min_ms"] / repeats,
          "samples_ms": [round(t / repeats, 5) for t in timing["samples_ms"]]}


def _shape_result(rng, tokens: int, experts: int, top_k: int, groups, group_top_k,
                  iters: int, rounds: int, repeats: int) -> dict:
  logits = jnp.asarray(rng.normal(size=(repeats, tokens, experts)), jnp.float32)
  passes = jax.jit(lambda x: jax.lax.map(lambda l: router.top_k_indices(l, top_k), x))
  sort = jax.jit(lambda x: jax.lax.map(lambda l: jax.lax.top_k(l, top_k)[1], x))
  step = jax.jit(jax.value_and_grad(lambda x: jax.lax.map(
      lambda l: _router_loss(l, top_k, groups, group_top_k), x).sum()))
  calls = {"top_k_passes": (passes, (logits,)), "top_k_lax": (sort, (logits,)),
           "router_fwd_bwd": (step, (logits,))}
  timings = common.time_interleaved(calls, iters=iters, rounds=rounds)
  same = bool(jnp.array_equal(passes(logits), sort(logits)))
  return dict(tokens=tokens, experts=experts, top_k=top_k, groups=groups,
              group_top_k=group_top_k, repeats=repeats, same_indices=same,
              kernels={name: _per_router(timing, repeats) for name, timing in timings.items()})


def run(shapes: dict = SHAPES, iters: int = 5, rounds: int = 5, repeats: int = 16) -> dict:
  """Milliseconds per router (each call's time over ``repeats``)."""
  rng = np.random.default_rng(0)
  return dict(shapes={name: _shape_result(rng, *shape, iters, rounds, repeats)
                      for name, shape in shapes.items()})


def summary(result: dict) -> str:
  lines = ["router top-k and router fwd+bwd, ms (arg-max passes vs lax.top_k):"]
  for name, shape in result["shapes"].items():
    figures = ", ".join(f"{kernel} {timing['median_ms']:.3f}" if "median_ms" in timing
                        else f"{kernel} {timing['error']}"
                        for kernel, timing in shape["kernels"].items())
    lines.append(f"  {name} (T={shape['tokens']}, E={shape['experts']}, K={shape['top_k']}; "
                 f"same indices: {shape['same_indices']}): {figures}")
  return "\n".join(lines)
