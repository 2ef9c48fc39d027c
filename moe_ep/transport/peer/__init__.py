"""Direct peer exchange: the EP axis's exchanges as stores straight into the
other GPUs' memory (``kernels/peer*.cu``), for GPUs of one host with peer
access (:func:`supported`). The protocol (channels, flags, bounded waits):
``docs/peer.md``.

:func:`exchange` is a drop-in for ``jax.lax.all_to_all(x, axis_name, 0, 0,
tiled=True)`` inside ``shard_map``, bitwise; on CUDA it is one
``buffer_callback`` (command-buffer compatible) on XLA's stream, elsewhere
the ``all_to_all`` itself. The transport's row paths also run dispatch and
combine as one launch each, and at decode sizes the metadata exchange with
the slab layout (:mod:`~moe_ep.transport.peer.rows`,
:mod:`~moe_ep.transport.peer.fused_layout`,
:mod:`~moe_ep.transport.peer.dispatch_layout`), where the dispatch plan
takes them (:mod:`moe_ep.transport.plan`), on CUDA
(:mod:`moe_ep.transport.row_paths`).

Every wait ends after :func:`timeout_s` (default 30 s,
``$MOE_EP_PEER_TIMEOUT_S``); :func:`raise_if_failed` (also run by every
peer callback) then raises :class:`PeerTimeoutError` naming the peer and the
step, and :func:`reset` rearms after all ranks are idle. The receive
buffers live outside XLA, allocated once per (EP group, chunk size) at trace
time (:func:`buffer_bytes`), until :func:`release` frees them.

Modules: ``settings`` (what :func:`configure` sets), ``channel`` (a
channel's byte layout, the EP groups), ``reachability`` (who may use it),
``runtime`` (the process's state: channels, sites, failure records),
``failures`` (the timeout record and its error), ``kernels`` and
``callback`` (compiling and launching), ``dropin`` (the drop-in exchange),
``rows``, ``fused_layout``, ``dispatch_layout`` (the fused launches).
Every rank's kernels on one GPU, for tests and benchmarks, is
:mod:`benchmarks.peer_loopback` (in the checkout, not the wheel).
"""

from moe_ep.transport.peer.dropin import exchange, write_ceiling
from moe_ep.transport.peer.failures import PeerTimeoutError
from moe_ep.transport.peer.reachability import supported, unsupported_reason
from moe_ep.transport.peer.runtime import (buffer_bytes, configure, dispatch_layout_enabled,
                                           raise_if_failed, release, reset, timeout_s)
from moe_ep.transport.peer.settings import DISPATCH_LAYOUT_ENV, TIMEOUT_ENV

__all__ = [
    "DISPATCH_LAYOUT_ENV",
    "PeerTimeoutError",
    "TIMEOUT_ENV",
    "buffer_bytes",
    "configure",
    "dispatch_layout_enabled",
    "exchange",
    "raise_if_failed",
    "release",
    "reset",
    "supported",
    "timeout_s",
    "unsupported_reason",
    "write_ceiling",
]
