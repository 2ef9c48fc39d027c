"""Which exchange carries a dispatch/combine pair's rows between the EP
ranks: XLA's ``all_to_all``, or direct stores into the other GPUs' memory
(:mod:`~moe_ep.transport.peer`), with bitwise the same results; and where
the peer path runs fused launches instead of the drop-in exchange. The
choice is made once per pair and recorded in its :class:`Spec`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from moe_ep.transport import backend as transport_backend
from moe_ep.transport import peer
from moe_ep.options import EXCHANGES
from moe_ep.transport.peer import dispatch_layout, fused_layout, reachability, rows
from moe_ep.transport.peer import runtime as peer_runtime


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static arguments of one dispatch/combine pair."""

  num_experts: int
  ep_size: int
  expert_capacity: int
  send_capacity: int
  axis_name: object
  backend: str
  checkpoint_name: str | None = None
  weight_dtype: str = "float32"
  exchange: str = "all_to_all"  # resolved: "all_to_all" or "peer"
  mesh: object = None
  wire_dtype: str | None = None  # dispatch rows on the wire: None (as-is) or "float8_e4m3fn"
  grouped_rows: int | None = None  # None: [L, C] slabs; M: the grouped layout's rows

  @property
  def ops(self):
    """The backend running the local passes."""
    return transport_backend.resolve(self.backend)

  @property
  def num_local_experts(self) -> int:
    return self.num_experts // self.ep_size

  def on_all_to_all(self) -> "Spec":
    """This spec on XLA's ``all_to_all`` (a fused peer path's other branch)."""
    return dataclasses.replace(self, exchange="all_to_all", mesh=None)

  def name(self, field: str, value):
    """``value`` named ``f"{checkpoint_name}.{field}"`` for remat policies
    (as is without a checkpoint name)."""
    if self.checkpoint_name is None:
      return value
    return checkpoint_name(value, f"{self.checkpoint_name}.{field}")


def ep_size(axis_name, caller: str) -> int:
  """The size of the mapped axis ``axis_name`` (1 for None); ValueError
  naming ``caller`` outside ``shard_map`` over it."""
  if axis_name is None:
    return 1
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"{caller}(axis_name={axis_name!r}): no mapped axis of that name here; call {caller} "
        f"inside jax.shard_map over the {axis_name!r} mesh axis (or pass axis_name=None for "
        f"one rank)") from None


def resolve_exchange(exchange: str, backend: str, axis_name, ep_size: int, mesh) -> str:
  """The exchange one dispatch/combine uses: ``"peer"`` or ``"all_to_all"``.

  ``"auto"`` takes the peer path where it runs: more than one rank, the
  kernels' backend (not ``"xla"``), a ``mesh`` given, and every pair of GPUs
  of each EP group reaching the other by peer access on one host
  (:func:`moe_ep.transport.peer.supported`); ``"peer"`` insists and says why
  not."""
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange={exchange!r} is not one of {EXCHANGES}")
  if ep_size == 1 or exchange == "all_to_all":
    return "all_to_all"
  if exchange == "auto" and (backend == "xla" or mesh is None):
    return "all_to_all"
  if mesh is None:
    raise ValueError(f"exchange='peer' needs mesh=, the mesh of the enclosing shard_map over "
                     f"axis {axis_name!r}")
  reason = reachability.unsupported_reason(mesh, axis_name)
  if reason is None:
    return "peer"
  if exchange == "peer":
    raise ValueError(f"exchange='peer' cannot run on this mesh: {reason}; use "
                     "exchange='auto' or 'all_to_all'")
  return "all_to_all"


def exchange(spec: Spec, x: jax.Array, what: str) -> jax.Array:
  """``all_to_all`` over the leading [R] axis: row d goes to rank d, and the
  result's row src is what rank src sent here; by direct stores into the
  peers' memory when ``spec.exchange == "peer"`` (bitwise the same result).
  ``what`` names the exchange inside the enclosing pass's scope
  (``moe_dispatch_fwd/exchange_rows``)."""
  if spec.exchange == "peer":
    return peer.exchange(x, spec.axis_name, spec.mesh, what)
  with jax.named_scope(what):
    return jax.lax.all_to_all(x, spec.axis_name, 0, 0, tiled=True)


def fused_rows(spec: Spec, dtype, hidden: int, top_k: int, sums: bool,
               wire_dtype: str | None = None) -> bool:
  """Whether the peer exchange moves these rows with its fused row kernels
  (:func:`~moe_ep.transport.peer.rows.dispatch_rows` / ``combine_rows``)
  rather than the drop-in exchange between the local row passes
  (``wire_dtype``: quantizing them on the way)."""
  return spec.exchange == "peer" and rows.fused_rows_problem(
      dtype, hidden, spec.ep_size, top_k, sums=sums, wire_dtype=wire_dtype) is None


def fused_slab_layout(spec: Spec, top_k: int) -> bool:
  """Whether the peer exchange runs the metadata exchange and the slab
  layout as one launch (decode sizes:
  :func:`~moe_ep.transport.peer.fused_layout.fused_layout_fits`)."""
  return spec.exchange == "peer" and fused_layout.fused_layout_fits(
      spec.ep_size, spec.send_capacity, top_k, spec.num_local_experts, spec.expert_capacity)


def one_launch_dispatch(spec: Spec, dtype, hidden: int, top_k: int) -> bool:
  """Whether the whole dispatch runs as one peer launch (decode sizes, when
  enabled: :func:`~moe_ep.transport.peer.dispatch_layout_enabled`)."""
  return (spec.exchange == "peer" and not spec.wire_dtype and spec.grouped_rows is None
          and peer_runtime.dispatch_layout_enabled()
          and dispatch_layout.dispatch_layout_fits(dtype, hidden, spec.ep_size,
                                                   spec.send_capacity, top_k,
                                                   spec.num_local_experts,
                                                   spec.expert_capacity))
