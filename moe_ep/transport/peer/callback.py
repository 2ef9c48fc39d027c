"""One peer exchange in the compiled program: a command-buffer-compatible
``buffer_callback`` launching each device's kernels, fixed at trace time, on
XLA's stream."""

from __future__ import annotations

import jax
from jax.experimental.buffer_callback import buffer_callback

from moe_ep.transport import kernel_launch
from moe_ep.transport.peer.kernels import Kernel
from moe_ep.transport.peer.runtime import RUNTIME

SCOPE = "moe_peer_exchange"  # the HLO counts read it as the exchange it replaces


def fused_call(name: str, launches: dict[int, list[Kernel]], inputs, out_shape, axis_name):
  """One callback running ``launches[ordinal]`` on XLA's stream, under the
  scope :data:`SCOPE`, after checking for an earlier timeout on those devices.
  ``out_shape``: one ShapeDtypeStruct, or a list of them (then a tuple of
  outputs). The outputs vary over the inputs' axes and ``axis_name``, as an
  ``all_to_all``'s do."""

  generation = RUNTIME.generation  # the channels the launches' pointers name

  def callback(ctx, outs, *buffers):
    import cupy
    RUNTIME.check_traced(generation, name)
    if RUNTIME.failed_on(launches):
      RUNTIME.raise_if_failed()
    ordinal = kernel_launch.buffer_ordinal(buffers[0])
    kernels = launches.get(ordinal)
    if kernels is None:
      raise RuntimeError(f"peer {name} ran on cuda:{ordinal}, which it was not set up for at "
                         f"trace time (was it traced for another mesh or platform?)")
    pointers = [kernel_launch.pointer(b) for b in (*buffers, *outs)]
    with cupy.cuda.Device(ordinal), kernel_launch.xla_stream(ordinal, ctx.stream):
      for kernel in kernels:
        kernel.launch(pointers)

  shapes = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
  with jax.named_scope(SCOPE):
    outs = buffer_callback(callback, list(shapes), command_buffer_compatible=True)(*inputs)
  outs = kernel_launch.varying_like(outs, inputs, also={axis_name})
  return tuple(outs) if isinstance(out_shape, (list, tuple)) else outs[0]
