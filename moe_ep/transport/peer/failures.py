"""What a peer wait that timed out leaves behind, and the error that names it.

A kernel whose wait ran past the bound writes one :class:`Failure` record
(``PeerFailure`` in ``kernels/peer.cuh``) into host-mapped memory; reading
it needs no device synchronisation. The text here is pure.
"""

from __future__ import annotations

import ctypes
import dataclasses

from moe_ep.transport.peer.settings import TIMEOUT_ENV

WAIT_KINDS = {1: "acknowledge reading step", 2: "deliver its chunk of step",
              3: "finish (every receiver block of its own launch) the slab maps of step"}


class PeerTimeoutError(RuntimeError):
  """A peer exchange waited past the timeout for another rank.

  Attributes: ``device`` (this process's device), ``rank`` (its EP rank),
  ``peer_rank``, ``peer_device``, ``step``, ``what`` (the exchange's name).
  """

  def __init__(self, message: str, *, device: str, rank: int, peer_rank: int, peer_device: str,
               step: int, what: str):
    super().__init__(message)
    self.device, self.rank, self.peer_rank = device, rank, peer_rank
    self.peer_device, self.step, self.what = peer_device, step, what


class Failure(ctypes.Structure):
  """One device's timeout record, as ``PeerFailure`` in ``kernels/peer.cuh``."""

  _fields_ = [("kind", ctypes.c_uint32), ("peer", ctypes.c_uint32), ("site", ctypes.c_uint32),
              ("rank", ctypes.c_uint32), ("step", ctypes.c_uint64),
              ("waited_ns", ctypes.c_uint64)]


@dataclasses.dataclass(frozen=True)
class Site:
  """One traced exchange: what timeouts name."""

  what: str
  shape: tuple
  dtype: str
  channel: str


def failure_message(record: Failure, ordinal: int, channel, site: Site | None) -> tuple[str, dict]:
  """The error text for one device's record, and :class:`PeerTimeoutError`'s
  fields (pure: no device access). ``channel``: the site's channel, or None."""
  state = channel.on_device.get(ordinal) if channel is not None else None
  rank = int(record.rank)
  peer_rank = int(record.peer)
  peer_device = (str(state.group[peer_rank]) if state is not None
                 and 0 <= peer_rank < len(state.group) else f"EP rank {peer_rank}")
  what = site.what if site is not None else f"site {record.site}"
  shape = f" {site.dtype}{list(site.shape)}" if site is not None else ""
  waited = WAIT_KINDS.get(int(record.kind), f"wait kind {record.kind}")
  message = (f"peer exchange {what!r}{shape}: cuda:{ordinal} (EP rank {rank}) waited "
             f"{record.waited_ns / 1e9:.2f} s for rank {peer_rank} ({peer_device}) to {waited} "
             f"{record.step}, past the {TIMEOUT_ENV} bound. Every rank must run the same "
             f"sequence of exchanges; later exchanges on this device returned without waiting "
             f"(their results are invalid) until peer.reset().")
  return message, dict(device=f"cuda:{ordinal}", rank=rank, peer_rank=peer_rank,
                       peer_device=peer_device, step=int(record.step), what=what)
