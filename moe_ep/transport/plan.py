"""The dispatch plan: every static decision of one dispatch or combine,
resolved once where it is called, as a value.

:func:`plan_dispatch` (and :func:`plan_combine`, for a combine's handle)
resolves the exchange (XLA's ``all_to_all``, or direct stores into the
other GPUs' memory, :mod:`~moe_ep.transport.peer`), how the routing
metadata crosses and is laid out, and which launches move the rows each
way, from the sizes, the rows' dtype and what the peer kernels take. The
row paths (:mod:`~moe_ep.transport.row_paths`) only execute a
:class:`DispatchPlan`; every path gives bitwise the same results.

The paths, each a small closed set:

* ``meta_path`` (:data:`META_PATHS`): ``"local"`` (one rank: nothing
  crosses), ``"exchange"`` (the drop-in exchange, then the backend's
  ``slab_layout``) or ``"fused_layout"`` (one peer launch does both, at
  decode sizes: :func:`~moe_ep.transport.peer.fused_layout.fused_layout_fits`).
* ``dispatch_row_path`` (:data:`DISPATCH_ROW_PATHS`), rows -> slabs:
  ``"local"`` (one rank), ``"exchange"`` (the backend's row passes around
  the drop-in exchange), ``"fused"`` (one peer launch moves them, quantizing
  them on an FP8 wire: :func:`~moe_ep.transport.peer.rows.fused_rows_problem`),
  ``"fused_wire"`` (FP8: each token quantized on its rank, its wire row
  moved by the fused byte-row launch) or ``"one_launch"`` (the metadata, the
  layout and the rows in one peer launch, at decode sizes, where enabled:
  :func:`~moe_ep.transport.peer.dispatch_layout_enabled`; the rows alone
  then take ``"fused"``'s launch).
* ``combine_row_path`` (:data:`COMBINE_ROW_PATHS`), slabs -> summed rows:
  ``"local"``, ``"exchange"`` or ``"fused"``.

A fused launch runs where the program is lowered for CUDA; elsewhere its
other branch runs the plan :meth:`DispatchPlan.on_all_to_all`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name as name_value

from moe_ep.options import EXCHANGES, check_transport, check_wire_dtype
from moe_ep.row_groups import GROUP_ALIGN
from moe_ep.transport import fp8, kernel_launch
from moe_ep.transport.handle import RoutingHandle
from moe_ep.transport.launch_geometry import SlabSizes
from moe_ep.transport.peer import dispatch_layout, fused_layout, reachability
from moe_ep.transport.peer import rows as peer_rows
from moe_ep.transport.peer import runtime as peer_runtime

__all__ = ["COMBINE_ROW_PATHS", "DISPATCH_ROW_PATHS", "DispatchPlan", "LOCAL_PASSES",
           "META_PATHS", "local_passes_for", "plan_combine", "plan_dispatch", "resolve_exchange"]

META_PATHS = ("local", "exchange", "fused_layout")
DISPATCH_ROW_PATHS = ("local", "exchange", "fused", "fused_wire", "one_launch")
COMBINE_ROW_PATHS = ("local", "exchange", "fused")
LOCAL_PASSES = ("xla", "cupy", "per_platform")


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """The resolved static decisions of one dispatch or combine (hashable: the
  ``custom_vjp`` rules take it as a static argument). Build it with
  :func:`plan_dispatch` or :func:`plan_combine`.

  Attributes:
    num_experts, ep_size, expert_capacity, send_capacity, top_k: ``E``,
      ``R``, ``C``, ``S``, ``K``.
    hidden, row_dtype: ``H`` and the dtype name of the rows the plan moves
      (the tokens and their slabs; a combine's expert outputs).
    grouped_rows: None: ``[L, C]`` slabs; ``M``: the grouped layout's rows.
    group_align: where the grouped layout's groups start.
    axis_name, mesh: the EP axis and the enclosing ``shard_map``'s mesh
      (None on ``all_to_all`` branches).
    transport: the local passes' implementation asked for
      (:data:`~moe_ep.options.TRANSPORTS`).
    local_passes: :data:`LOCAL_PASSES`, the implementation that runs them
      (:func:`local_passes_for`).
    exchange: ``"all_to_all"`` or ``"peer"`` (resolved, never ``"auto"``).
    meta_path: :data:`META_PATHS`; None for a combine, which routes nothing.
    dispatch_row_path: :data:`DISPATCH_ROW_PATHS`.
    combine_row_path: :data:`COMBINE_ROW_PATHS`.
    wire_dtype: None (rows cross as they are) or ``"float8_e4m3fn"``.
    weight_dtype: the dtype name of dispatch's routing weights (the weight
      gradient's).
    checkpoint_name: the prefix of the names remat policies see, or None.
    fp8_rows: an FP8 dispatch into the grouped layout that also returns the
      rows' codes and scales as they crossed (:attr:`fp8_slabs` then holds).
  """

  num_experts: int
  ep_size: int
  expert_capacity: int
  send_capacity: int
  top_k: int
  hidden: int
  row_dtype: str
  axis_name: object
  transport: str
  exchange: str
  meta_path: str | None
  dispatch_row_path: str
  combine_row_path: str
  mesh: object = None
  grouped_rows: int | None = None
  group_align: int = GROUP_ALIGN
  wire_dtype: str | None = None
  weight_dtype: str = "float32"
  checkpoint_name: str | None = None
  fp8_rows: bool = False
  local_passes: str = "xla"

  def __post_init__(self):
    for field, value, allowed in (("exchange", self.exchange, ("all_to_all", "peer")),
                                  ("local_passes", self.local_passes, LOCAL_PASSES),
                                  ("meta_path", self.meta_path, META_PATHS + (None,)),
                                  ("dispatch_row_path", self.dispatch_row_path,
                                   DISPATCH_ROW_PATHS),
                                  ("combine_row_path", self.combine_row_path,
                                   COMBINE_ROW_PATHS)):
      if value not in allowed:
        raise ValueError(f"DispatchPlan.{field}={value!r} must be one of {allowed}")

  @property
  def num_local_experts(self) -> int:
    return self.num_experts // self.ep_size

  @property
  def fp8_slabs(self) -> bool:
    """Whether dispatch lands FP8 slabs ``[L, C, W]`` (named
    ``"{checkpoint_name}.tokens"``, so remat saves them) and dequantizes
    them after, rather than dequantizing each received row into its slabs
    (also where they are returned as codes and scales, :attr:`fp8_rows`)."""
    return self.wire_dtype is not None and (self.checkpoint_name is not None or self.fp8_rows)

  def on_all_to_all(self) -> "DispatchPlan":
    """This plan (``R > 1``) on XLA's ``all_to_all``: a fused peer launch's
    other branch, which runs where the program is not lowered for CUDA, so
    per-platform local passes are the pure-JAX ones there."""
    return dataclasses.replace(
        self, exchange="all_to_all", mesh=None,
        meta_path=None if self.meta_path is None else "exchange",
        dispatch_row_path="exchange", combine_row_path="exchange",
        local_passes="xla" if self.local_passes == "per_platform" else self.local_passes)

  def name(self, field: str, value):
    """``value`` named ``f"{checkpoint_name}.{field}"`` for remat policies
    (as is without a checkpoint name)."""
    if self.checkpoint_name is None:
      return value
    return name_value(value, f"{self.checkpoint_name}.{field}")


def local_passes_for(transport: str) -> str:
  """Which implementation runs the local passes for ``transport``
  (:data:`LOCAL_PASSES`): ``"xla"`` pure JAX; ``"cupy"`` the CuPy kernels
  (ImportError naming the extra where CuPy is missing); ``"auto"`` the
  kernels where the program is lowered for CUDA and pure JAX elsewhere
  (``"per_platform"``) where CuPy imports, else pure JAX."""
  check_transport(transport)
  if transport == "xla":
    return "xla"
  if transport == "cupy":
    kernel_launch.require_cupy()
    return "cupy"
  return "per_platform" if kernel_launch.cupy_available() else "xla"


def auto_exchange_reason(transport: str, axis_name, ep_size: int, mesh) -> str | None:
  """Why ``exchange="auto"`` keeps XLA's ``all_to_all`` here (None: it takes
  the peer path): one rank, the ``"xla"`` transport, no ``mesh``, or GPUs of
  the EP groups that do not reach each other by peer access on one host."""
  if ep_size == 1:
    return "one rank"
  if transport == "xla":
    return "transport='xla'"
  if mesh is None:
    return "no mesh given"
  return reachability.unsupported_reason(mesh, axis_name)


def resolve_exchange(exchange: str, transport: str, axis_name, ep_size: int, mesh) -> str:
  """The exchange one dispatch/combine uses: ``"peer"`` or ``"all_to_all"``.

  ``"auto"`` takes the peer path where :func:`auto_exchange_reason` finds
  nothing against it; ``"peer"`` insists (with any transport) and says why
  not."""
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange={exchange!r} is not one of {EXCHANGES}")
  if ep_size == 1 or exchange == "all_to_all":
    return "all_to_all"
  if exchange == "auto":
    return ("peer" if auto_exchange_reason(transport, axis_name, ep_size, mesh) is None
            else "all_to_all")
  if mesh is None:
    raise ValueError(f"exchange='peer' needs mesh=, the mesh of the enclosing shard_map over "
                     f"axis {axis_name!r}")
  reason = reachability.unsupported_reason(mesh, axis_name)
  if reason is not None:
    raise ValueError(f"exchange='peer' cannot run on this mesh: {reason}; use "
                     "exchange='auto' or 'all_to_all'")
  return "peer"


class _PathRequest(NamedTuple):
  """What one dispatch's (or combine's) paths are chosen from: whether the
  peer exchange carries it, its rows and their sizes."""

  on_peer: bool
  row_dtype: np.dtype
  hidden: int
  sizes: SlabSizes
  wire_dtype: str | None = None  # the FP8 wire, or rows crossing as they are
  fp8_slabs: bool = False  # FP8 slabs land (DispatchPlan.fp8_slabs)
  grouped_rows: int | None = None


def _fused_rows(request: _PathRequest, sums: bool, wire_dtype: str | None = None) -> bool:
  """Whether the fused row launches move the request's rows (``wire_dtype``:
  quantizing them on the way)."""
  return request.on_peer and peer_rows.fused_rows_problem(
      request.row_dtype, request.hidden, request.sizes.ep_size, request.sizes.top_k, sums=sums,
      wire_dtype=wire_dtype) is None


def _combine_row_path(request: _PathRequest) -> str:
  if request.sizes.ep_size == 1:
    return "local"
  return "fused" if _fused_rows(request, sums=True) else "exchange"


def _dispatch_row_path(request: _PathRequest) -> str:
  """Rows -> slabs, apart from the one-launch dispatch. FP8 rows
  dequantized as they land take the drop-in exchange; FP8 slabs, the
  quantizing launch where it takes the rows, else the byte-row launch."""
  if request.sizes.ep_size == 1:
    return "local"
  if request.wire_dtype is None:
    return "fused" if _fused_rows(request, sums=False) else "exchange"
  if not request.fp8_slabs:
    return "exchange"
  if _fused_rows(request, sums=False, wire_dtype=request.wire_dtype):
    return "fused"
  wire_rows = request._replace(row_dtype=np.dtype(np.uint8),
                               hidden=fp8.wire_bytes(request.hidden))
  if _fused_rows(wire_rows, sums=False):
    return "fused_wire"
  return "exchange"


def _one_launch(request: _PathRequest) -> bool:
  """Whether the whole dispatch runs as one peer launch (decode sizes, when
  enabled: :func:`~moe_ep.transport.peer.dispatch_layout_enabled`)."""
  return (request.on_peer and not request.wire_dtype and request.grouped_rows is None
          and peer_runtime.dispatch_layout_enabled()
          and dispatch_layout.dispatch_layout_fits(request.row_dtype, request.hidden,
                                                   request.sizes))


def _meta_path(request: _PathRequest) -> str:
  if request.sizes.ep_size == 1:
    return "local"
  if request.on_peer and fused_layout.fused_layout_fits(request.sizes):
    return "fused_layout"
  return "exchange"


def plan_dispatch(*, num_experts: int, ep_size: int, expert_capacity: int, send_capacity: int,
                  top_k: int, hidden: int, row_dtype, axis_name, transport: str = "auto",
                  exchange: str = "auto", mesh=None, wire_dtype: str | None = None,
                  grouped_rows: int | None = None, group_align: int = GROUP_ALIGN,
                  checkpoint_name: str | None = None, weight_dtype: str = "float32",
                  fp8_rows: bool = False) -> DispatchPlan:
  """The plan of one dispatch (and of its backward) at these sizes, as
  :func:`~moe_ep.transport.dispatch` resolves it: every path chosen here,
  the local passes too (a missing CuPy fails at trace time).

  Args:
    num_experts, ep_size, expert_capacity, send_capacity, top_k: ``E``,
      ``R``, ``C``, ``S``, ``K`` (as dispatch clamps them: ``C`` at most the
      dropless bound, ``S`` at most ``T``).
    hidden, row_dtype: ``H`` and the tokens' dtype (a name or a dtype).
    axis_name, transport, exchange, mesh, wire_dtype, grouped_rows, group_align,
      checkpoint_name: as for :func:`~moe_ep.transport.dispatch`
      (``exchange="auto"`` resolved by :func:`resolve_exchange`).
    weight_dtype: the dtype of the routing weights dispatch differentiates
      (float32 after :func:`~moe_ep.transport.ops.merge_duplicate_routes`).
    fp8_rows: as for :func:`~moe_ep.transport.dispatch`.

  Returns:
    :class:`DispatchPlan`.
  """
  check_transport(transport)
  wire_dtype = check_wire_dtype(wire_dtype)
  resolved = resolve_exchange(exchange, transport, axis_name, ep_size, mesh)
  dtype = jnp.dtype(row_dtype)
  request = _PathRequest(
      on_peer=resolved == "peer", row_dtype=dtype, hidden=hidden,
      sizes=SlabSizes(ep_size, send_capacity, top_k, num_experts // ep_size, expert_capacity),
      wire_dtype=wire_dtype,
      fp8_slabs=wire_dtype is not None and (checkpoint_name is not None or fp8_rows),
      grouped_rows=grouped_rows)
  return DispatchPlan(
      num_experts=num_experts, ep_size=ep_size, expert_capacity=expert_capacity,
      send_capacity=send_capacity, top_k=top_k, hidden=hidden, row_dtype=dtype.name,
      axis_name=axis_name, transport=transport, exchange=resolved,
      meta_path=_meta_path(request),
      dispatch_row_path="one_launch" if _one_launch(request) else _dispatch_row_path(request),
      combine_row_path=_combine_row_path(request),
      mesh=mesh, grouped_rows=grouped_rows, group_align=group_align, wire_dtype=wire_dtype,
      weight_dtype=weight_dtype, checkpoint_name=checkpoint_name, fp8_rows=fp8_rows,
      local_passes=local_passes_for(transport))


def plan_combine(handle: RoutingHandle, *, hidden: int, row_dtype, axis_name,
                 transport: str = "auto", exchange: str = "auto", mesh=None) -> DispatchPlan:
  """The plan of one combine (and of its backward) of expert outputs of
  ``hidden`` channels of ``row_dtype`` along ``handle``, as
  :func:`~moe_ep.transport.combine` resolves it. Combine reads only the
  handle's flat maps: to it a grouped buffer is one group of ``M`` rows. It
  routes nothing (``meta_path`` None) and its rows cross as they are."""
  check_transport(transport)
  local_experts, capacity = ((1, handle.slab_row.shape[0]) if handle.grouped
                             else handle.slab_row.shape)
  ep_size = handle.ep_size
  resolved = resolve_exchange(exchange, transport, axis_name, ep_size, mesh)
  dtype = jnp.dtype(row_dtype)
  request = _PathRequest(on_peer=resolved == "peer", row_dtype=dtype, hidden=hidden,
                         sizes=SlabSizes(ep_size, handle.send_capacity, handle.top_k,
                                         local_experts, capacity))
  return DispatchPlan(
      num_experts=local_experts * ep_size, ep_size=ep_size, expert_capacity=capacity,
      send_capacity=handle.send_capacity, top_k=handle.top_k, hidden=hidden,
      row_dtype=dtype.name, axis_name=axis_name, transport=transport, exchange=resolved,
      meta_path=None, dispatch_row_path=_dispatch_row_path(request),
      combine_row_path=_combine_row_path(request), mesh=mesh,
      local_passes=local_passes_for(transport))


def ep_size_of(axis_name, caller: str) -> int:
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
