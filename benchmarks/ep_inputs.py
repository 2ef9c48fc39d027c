"""P2's inputs on the EP mesh, its per-rank programs and the plans of its
dispatches: what the benchmarks at P2's shapes share (:mod:`~benchmarks.ep`,
:mod:`~benchmarks.timeline`, :mod:`~benchmarks.loopback`).

Routing is uniform top-k (every expert equally likely), made on the host
from a seed. A plan comes from the transport's
:func:`~moe_ep.transport.plan.plan_dispatch`, as dispatch resolves its own,
so a benchmark that times one row path alone runs the path dispatch runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.transport import expert_capacity_for, ops, row_paths, send_capacity_for
from moe_ep.transport.plan import DispatchPlan, plan_dispatch

AXIS = "ep"  # the EP mesh axis of every P2 program


def shard(mesh, array) -> jax.Array:
  """A global array sharded over "ep" from a host array every process holds."""
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, NamedSharding(mesh, P(AXIS)),
                                      lambda index: array[index])


def random_rows(mesh, rows: int, hidden: int, seed: int) -> jax.Array:
  """``[rows, hidden]`` bf16 normal values made on the devices, sharded over "ep"."""
  make = jax.jit(lambda key: jax.random.normal(key, (rows, hidden), jnp.bfloat16),
                 out_shardings=NamedSharding(mesh, P(AXIS)))
  return make(jax.random.key(seed))


def uniform_routing(rng: np.random.Generator, tokens: int, top_k: int,
                    num_experts: int) -> tuple[np.ndarray, np.ndarray]:
  """Host routing: ``(idx [tokens, K] int32, weights [tokens, K] float32)``,
  ``K`` distinct experts per token drawn uniformly, weights summing to 1."""
  idx = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)
  weights = rng.random((tokens, top_k)).astype(np.float32)
  return idx, weights / weights.sum(-1, keepdims=True)


def per_rank(mesh, fn):
  """``fn`` run on each rank: ``shard_map`` over "ep", every input and output
  split along its leading axis."""
  return jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))


def routing_only(plan: DispatchPlan):
  """Dispatch's routing alone (route, the metadata exchange and the slab
  layout by ``plan.meta_path``), what dispatch adds to its row path: a
  per-rank ``(idx [T, K], weights [T, K]) -> RoutingHandle``."""
  return lambda idx, weights: row_paths.routing(
      plan, *ops.merge_duplicate_routes(ops.valid_ids(idx, plan.num_experts), weights))[0]


@dataclasses.dataclass(frozen=True)
class EPInputs:
  """One P2 shape on ``mesh``: per rank ``tokens`` random bf16 rows ``x`` and
  their uniform routes ``idx``, ``weights``, sharded over "ep", with the
  capacities of ``capacity_factor``."""

  mesh: jax.sharding.Mesh
  tokens: int
  hidden: int
  num_experts: int
  top_k: int
  expert_capacity: int
  send_capacity: int
  x: jax.Array  # [R * T, H] bf16
  idx: jax.Array  # [R * T, K] int32
  weights: jax.Array  # [R * T, K] float32

  @property
  def dispatch_args(self) -> tuple:
    return self.x, self.idx, self.weights

  def dispatch_options(self, backend: str, exchange: str) -> dict:
    """The keyword arguments of :func:`~moe_ep.transport.dispatch` at this shape."""
    return dict(num_experts=self.num_experts, expert_capacity=self.expert_capacity,
                axis_name=AXIS, send_capacity=self.send_capacity, transport=backend,
                exchange=exchange, mesh=self.mesh)

  def plan(self, backend: str, exchange: str, **options) -> DispatchPlan:
    """The plan of this shape's dispatch (``options``: ``wire_dtype``,
    ``checkpoint_name``, ... as for :func:`~moe_ep.transport.plan.plan_dispatch`)."""
    return plan_dispatch(num_experts=self.num_experts, ep_size=self.mesh.shape[AXIS],
                         expert_capacity=self.expert_capacity,
                         send_capacity=self.send_capacity, top_k=self.top_k,
                         hidden=self.hidden, row_dtype=self.x.dtype, axis_name=AXIS,
                         transport=backend, exchange=exchange, mesh=self.mesh, **options)


def sharded_routing(mesh, tokens: int, top_k: int, num_experts: int,
                    seed: int) -> tuple[jax.Array, jax.Array]:
  """:func:`uniform_routing` of ``tokens`` per rank from ``seed``, sharded over "ep"."""
  rng = np.random.default_rng(seed)
  idx, weights = uniform_routing(rng, mesh.shape[AXIS] * tokens, top_k, num_experts)
  return shard(mesh, idx), shard(mesh, weights)


def ep_inputs(mesh, tokens: int, hidden: int, num_experts: int, top_k: int, capacity_factor,
              seed: int) -> EPInputs:
  """:class:`EPInputs` of one P2 shape (``capacity_factor``: as for
  :func:`~moe_ep.transport.expert_capacity_for`)."""
  ep_size = mesh.shape[AXIS]
  capacity = expert_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  send_capacity = send_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  x = random_rows(mesh, ep_size * tokens, hidden, seed)
  idx, weights = sharded_routing(mesh, tokens, top_k, num_experts, seed)
  return EPInputs(mesh=mesh, tokens=tokens, hidden=hidden, num_experts=num_experts,
                  top_k=top_k, expert_capacity=capacity, send_capacity=send_capacity, x=x,
                  idx=idx, weights=weights)
