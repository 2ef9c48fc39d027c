"""Dispatch and combine: move token rows to the experts that own them and back.

One functional interface (:func:`dispatch`, :func:`combine`), its shapes and
names; everything behind it lives in the submodules, whose names this face
imports on first use, so a submodule (``kernel_source``, ``peer`` for the
benchmarks) imports without the differentiable core (the options the
configuration shares live below, in :mod:`moe_ep.options`):

* ``ops``: the ``custom_vjp`` operations and their argument checks;
* ``plan``, ``row_paths``, ``receive_slabs``, ``receive_grouped``: the
  dispatch plan (which exchange carries the rows, which launches move them,
  resolved once per call), the row paths executing it, the receiver's
  layouts (``[L, C]`` slabs or each expert's rows contiguous in ``[M, H]``);
* ``handle``, ``meta``, ``scopes``: the routing handle, the metadata's wire
  format, the scopes the exchanges run under (capacity math and the grouped
  layout's row groups live below, in :mod:`moe_ep.capacity` and
  :mod:`moe_ep.row_groups`);
* ``xla``, ``cupy_backend``, ``kernel_launch``, ``kernel_source``,
  ``launch_geometry``: the local passes, pure JAX or ``kernels/*.cu`` on
  XLA's stream (a plan's ``local_passes`` says which);
* ``fp8``: the FP8 wire format; ``peer``: direct stores into the other
  GPUs' memory.

Call path, from the layer to a kernel launch (the default GPU path, the
first launch of a dispatch; every launch of the layer's forward takes at
most these ten frames over six modules, ``tests/transport/test_call_path.py``)::

  layer.ExpertParallelMoE.__call__     the NNX shell: its parameters, forwarded
  layer_core.apply                     onto the mesh; shard_map over moe_shard
  layer_core.moe_shard                 route -> dispatch -> experts -> combine
  transport.ops.dispatch               the checks; the plan, plan.plan_dispatch
  transport.ops._dispatch_forward      the custom_vjp's forward rule
  transport.row_paths.routing          routing, the metadata exchange, the slab layout
  transport.row_paths._route           the sender's routing
  transport.row_paths._local_pass      by plan.local_passes: the kernels on CUDA
  transport.cupy_backend.route         the kernels' launch geometry
  transport.kernel_launch.call         one buffer_callback launching them on XLA's stream
"""

from typing import TYPE_CHECKING

from moe_ep.lazy import exports

if TYPE_CHECKING:  # the exports below, stated as imports for readers and tools
  from moe_ep.capacity import expert_capacity_for, send_capacity_for
  from moe_ep.options import CHECKPOINT_FIELDS, EXCHANGES, WIRE_DTYPES, check_wire_dtype
  from moe_ep.row_groups import ROW_TILE, grouped_rows_for
  from moe_ep.transport.handle import Dispatched, RoutingHandle
  from moe_ep.transport.ops import combine, dispatch
  from moe_ep.transport.scopes import NAMED_SCOPES

__all__, __getattr__, __dir__ = exports(__name__, {
    "ops": ("combine", "dispatch"),
    "handle": ("Dispatched", "RoutingHandle"),
    "moe_ep.capacity": ("expert_capacity_for", "send_capacity_for"),
    "moe_ep.row_groups": ("ROW_TILE", "grouped_rows_for"),
    "moe_ep.options": ("CHECKPOINT_FIELDS", "EXCHANGES", "WIRE_DTYPES", "check_wire_dtype"),
    "scopes": ("NAMED_SCOPES",),
})
