"""The computations the multi-process tests run twice from one seed: once in
the launched processes (``worker.py``) and once in a single process.

Every function here takes the devices of the job (all processes' devices in
``jax.devices()`` order), builds global arrays from full numpy arrays that
every process computes identically, and returns host numpy results gathered
with ``multihost_utils.process_allgather``, so the same call gives the same
dict in either setting. Result keys are ``"{case}/{mesh}/{name}"``; names
ending in ``_grad`` are gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from moe_ep.transport import combine, dispatch

CASES = ("transport", "layer", "overflow")

# The layer: tiny, so compiles dominate and stay short.
HIDDEN, FFN, EXPERTS, TOP_K = 16, 24, 8, 2
BATCH_PER_SHARD, SEQ = 2, 3
# Overflow: two experts take every route, each keeps OVERFLOW_CAPACITY rows.
OVERFLOW_CAPACITY = 2
# The transport: 16 experts, skewed routing, 13 tokens per EP rank, slabs of
# 8 rows (below the busiest experts' demand, above the others').
TRANSPORT_EXPERTS, TRANSPORT_TOP_K, TRANSPORT_TOKENS = 16, 3, 13
TRANSPORT_CAPACITY = 8


def build_mesh(devices, dp: int, ep: int) -> jax.sharding.Mesh:
  """A ("dp", "ep") mesh over the first ``dp * ep`` of ``devices``.

  Not ``jax.make_mesh``: its default Explicit axis types reject the layer's
  ``shard_map`` in_specs.
  """
  return jax.sharding.Mesh(np.array(devices[:dp * ep]).reshape(dp, ep), ("dp", "ep"))


def global_array(mesh: jax.sharding.Mesh, spec: P, full: np.ndarray) -> jax.Array:
  """``full`` laid out over ``mesh``; each process supplies only its shards."""
  return jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec),
                                      lambda index: full[index])


def to_host(tree) -> dict:
  """Global arrays -> full numpy arrays, on every process."""
  return multihost_utils.process_allgather(tree, tiled=True)


# --- the transport ---------------------------------------------------------------


def transport_problem(seed: int, ep: int) -> dict[str, np.ndarray]:
  """``tokens [R*T, H]``, skewed ``topk_idx``/``topk_weights [R*T, K]``,
  ``maps [E, H, H]`` and a ``cotangent [R*T, H]``, all float32 but the ids."""
  rng = np.random.default_rng(seed)
  rows = ep * TRANSPORT_TOKENS
  log_probs = -0.4 * np.arange(TRANSPORT_EXPERTS)
  # Gumbel top-k: K distinct experts per token, drawn with the skewed probabilities.
  idx = np.argsort(-(log_probs + rng.gumbel(size=(rows, TRANSPORT_EXPERTS))), axis=1)
  return {
      "tokens": rng.normal(size=(rows, HIDDEN)).astype(np.float32),
      "topk_idx": idx[:, :TRANSPORT_TOP_K].astype(np.int32),
      "topk_weights": rng.uniform(0.1, 1.0, size=(rows, TRANSPORT_TOP_K)).astype(np.float32),
      "maps": (rng.normal(size=(TRANSPORT_EXPERTS, HIDDEN, HIDDEN))
               / np.sqrt(HIDDEN)).astype(np.float32),
      "cotangent": rng.normal(size=(rows, HIDDEN)).astype(np.float32),
  }


def run_transport(devices, seed: int, backend: str) -> dict[str, np.ndarray]:
  """dispatch -> ``tanh(x @ M_e) * w`` -> combine with EP over all ``devices``:
  ``y``, ``counts``, ``demand`` and the gradients of ``<y, cotangent>`` wrt
  tokens, weights and maps. The skewed routing overflows the first experts'
  slabs of TRANSPORT_CAPACITY rows and leaves the others whole."""
  ep = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
  # Every input is split over the ranks: tokens by row, maps by expert.
  problem = {key: global_array(mesh, P("ep"), value)
             for key, value in transport_problem(seed, ep).items()}

  def body(tokens, idx, weights, maps):
    d = dispatch(tokens, idx, weights, num_experts=TRANSPORT_EXPERTS,
                 expert_capacity=TRANSPORT_CAPACITY, axis_name="ep", transport=backend)
    hidden = jnp.tanh(jnp.einsum("lch,lhg->lcg", d.tokens, maps))
    y = combine(hidden * d.weights[..., None], d.handle, num_tokens=tokens.shape[0],
                axis_name="ep", transport=backend)
    return y, d.counts, d.demand

  run = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

  def loss(tokens, weights, maps, idx, cotangent):
    y, counts, demand = run(tokens, idx, weights, maps)
    return jnp.vdot(y, cotangent), (y, counts, demand)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, (y, counts, demand)), grads = step(problem["tokens"], problem["topk_weights"],
                                         problem["maps"], problem["topk_idx"],
                                         problem["cotangent"])
  out = to_host({"y": y, "counts": counts, "demand": demand, "tokens_grad": grads[0],
                 "weights_grad": grads[1], "maps_grad": grads[2]})
  return {f"transport/ep{ep}/{key}": value for key, value in out.items()}


# --- the layer -------------------------------------------------------------------


def layer_config(transport: str, **overrides) -> MoEConfig:
  return MoEConfig(**{**dict(hidden_size=HIDDEN, ffn_size=FFN, num_experts=EXPERTS,
                             top_k=TOP_K, dtype="float32", transport=transport,
                             aux_loss_coeff=0.01, z_loss_coeff=1e-3), **overrides})


def biased_sigmoid_layer(mesh, seed: int, transport: str) -> ExpertParallelMoE:
  """Sigmoid router whose bias sends every token to experts 0 and 1, whose
  slabs keep only OVERFLOW_CAPACITY rows each (as in tests/test_layer.py)."""
  layer = ExpertParallelMoE(
      layer_config(transport, score_function="sigmoid", use_expert_bias=True,
                   expert_capacity=OVERFLOW_CAPACITY), mesh=mesh, rngs=nnx.Rngs(seed))
  layer.expert_bias[...] = jnp.zeros(EXPERTS).at[:2].set(10.0)
  return layer


def layer_batch(seed: int, mesh) -> jax.Array:
  """``x [B, S, H]`` float32, B = BATCH_PER_SHARD per device, batch-sharded."""
  full = np.random.default_rng(seed).normal(
      size=(BATCH_PER_SHARD * mesh.devices.size, SEQ, HIDDEN)).astype(np.float32)
  return global_array(mesh, P(("dp", "ep")), full)


def layer_value_and_grad(layer: ExpertParallelMoE, x: jax.Array, policy) -> dict:
  """value_and_grad of ``mean(y**2) + aux losses`` wrt the params and x,
  through ``jax.checkpoint(policy=policy)`` around the whole layer."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y ** 2) + aux.aux_loss + aux.z_loss, aux

  step = jax.jit(jax.value_and_grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1),
                                    has_aux=True))
  (value, aux), (param_grads, x_grad) = step(params, x)
  out = {"loss": value, "tokens_per_expert": aux.tokens_per_expert,
         "dropped_fraction": aux.dropped_fraction, "x_grad": x_grad}
  out.update({f"{key}_grad": grad for key, grad in nnx.to_pure_dict(param_grads).items()})
  return to_host(out)


def run_layer(devices, seed: int, dp: int, ep: int, transport: str) -> dict[str, np.ndarray]:
  """The layer's value_and_grad with the dispatch saved by RematConfig."""
  mesh = build_mesh(devices, dp, ep)
  layer = ExpertParallelMoE(layer_config(transport), mesh=mesh, rngs=nnx.Rngs(seed))
  out = layer_value_and_grad(layer, layer_batch(seed, mesh),
                             RematConfig(save=("dispatch",)).policy())
  return {f"layer/{dp}x{ep}/{key}": value for key, value in out.items()}


def run_overflow(devices, seed: int, dp: int, ep: int, transport: str) -> dict[str, np.ndarray]:
  """Capacity below demand, with the dispatch saved and with nothing saved."""
  mesh = build_mesh(devices, dp, ep)
  layer = biased_sigmoid_layer(mesh, seed, transport)
  x = layer_batch(seed, mesh)
  results = {}
  for label, policy in (("saved", RematConfig(save=("dispatch",)).policy()),
                        ("recomputed", jax.checkpoint_policies.nothing_saveable)):
    out = layer_value_and_grad(layer, x, policy)
    results.update({f"overflow/{dp}x{ep}/{label}/{key}": value for key, value in out.items()})
  return results


def run_cases(devices, cases, meshes, seed: int, transport: str) -> dict[str, np.ndarray]:
  """Every case in ``cases``: the transport over all ``devices``, the layer
  cases on each ``(dp, ep)`` of ``meshes``."""
  unknown = set(cases) - set(CASES)
  if unknown:
    raise ValueError(f"unknown cases {sorted(unknown)}; known: {CASES}")
  results = {}
  if "transport" in cases:
    results.update(run_transport(devices, seed, transport))
  for dp, ep in meshes:
    if "layer" in cases:
      results.update(run_layer(devices, seed, dp, ep, transport))
    if "overflow" in cases:
      results.update(run_overflow(devices, seed, dp, ep, transport))
  return results


def parse_mesh(text: str) -> tuple[int, int]:
  """``"2x2"`` -> ``(2, 2)``, as (dp, ep)."""
  dp, ep = text.lower().split("x")
  return int(dp), int(ep)

