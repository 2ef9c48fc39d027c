"""What :func:`moe_ep.transport.peer.configure` sets: the wait bound, the
grids of the exchanges, and whether decode's dispatch runs as one launch."""

from __future__ import annotations

import dataclasses
import os

TIMEOUT_ENV = "MOE_EP_PEER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 24 * 3600.0
DISPATCH_LAYOUT_ENV = "MOE_EP_PEER_DISPATCH_LAYOUT"


def check_timeout(name: str, value) -> float:
  try:
    seconds = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name}={value!r} must be a number of seconds") from None
  if not 0 < seconds <= MAX_TIMEOUT_S:
    raise ValueError(f"{name}={value!r} must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")
  return seconds


@dataclasses.dataclass(frozen=True)
class Settings:
  """The peer exchanges' settings (None: the default), checked on construction.

  Attributes:
    timeout_s: the wait bound; None: ``$MOE_EP_PEER_TIMEOUT_S``, else
      :data:`DEFAULT_TIMEOUT_S`.
    blocks_per_peer: the blocks each peer's chunk is split over in the
      drop-in exchange; None: half the device's SMs / (R - 1).
    row_blocks: the blocks (one per SM) of a fused row exchange; None: every SM.
    send_blocks: how many of those store rows into the other GPUs; None:
      ``SEND_SHARE`` of them (:mod:`~moe_ep.transport.peer.rows`).
    dispatch_layout: whether dispatch at decode sizes runs as one launch with
      its metadata exchange and slab layout; None:
      ``$MOE_EP_PEER_DISPATCH_LAYOUT`` = ``1``.
  """

  timeout_s: float | None = None
  blocks_per_peer: int | None = None
  row_blocks: int | None = None
  send_blocks: int | None = None
  dispatch_layout: bool | None = None

  def __post_init__(self):
    if self.timeout_s is not None:
      check_timeout("timeout_s", self.timeout_s)
    for name, least in (("blocks_per_peer", 1), ("row_blocks", 2), ("send_blocks", 1)):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                or value < least):
        raise ValueError(f"{name}={value!r} must be an integer >= {least} or None")
    if self.dispatch_layout is not None and not isinstance(self.dispatch_layout, bool):
      raise ValueError(f"dispatch_layout={self.dispatch_layout!r} must be True, False or None")
    if (self.row_blocks is not None and self.send_blocks is not None
        and self.send_blocks >= self.row_blocks):
      raise ValueError(f"send_blocks={self.send_blocks} must be below "
                       f"row_blocks={self.row_blocks} (at least one block receives)")

  def wait_bound_s(self) -> float:
    """The wait bound new exchanges get: :attr:`timeout_s`, else
    ``$MOE_EP_PEER_TIMEOUT_S``, else 30 s."""
    if self.timeout_s is not None:
      return float(self.timeout_s)
    env = os.environ.get(TIMEOUT_ENV)
    if env is None or env.strip() == "":
      return DEFAULT_TIMEOUT_S
    return check_timeout(TIMEOUT_ENV, env)

  def dispatch_layout_on(self) -> bool:
    """:attr:`dispatch_layout`, else ``$MOE_EP_PEER_DISPATCH_LAYOUT`` = ``1``."""
    if self.dispatch_layout is not None:
      return self.dispatch_layout
    return os.environ.get(DISPATCH_LAYOUT_ENV, "").strip() == "1"
