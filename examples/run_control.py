"""When a training run stops early: on a signal, with every process at the
same step, or at a step that is not finite.

:func:`examples.pretrain.train` checks both after every step; the step's
metrics are read on the host each step anyway, so neither adds a sync.
"""

from __future__ import annotations

import math
import os
import pathlib
import signal
import threading

import jax
from jax.experimental import multihost_utils

# A step is finite when these metrics are (param_norm: after its update).
FINITE_METRICS = ("loss", "grad_norm", "param_norm")
# Exit codes of a run stopped by a signal (128 + the signal's number).
SIGNAL_EXIT_CODES = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}


class Interrupted(KeyboardInterrupt):
  """Ctrl-C, SIGTERM (or another KeyboardInterrupt) stopped the run.

  Attributes:
    step: the steps completed when it stopped.
    checkpoint_step: the newest checkpoint in ``run_dir`` (``step`` when the
      stop was saved), or None (checkpoints off).
    run_dir: the run's directory, holding its metrics and summary so far.
    signal_name: ``"SIGINT"`` or ``"SIGTERM"``.
  """

  def __init__(self, step: int, checkpoint_step: int | None, run_dir: pathlib.Path,
               signal_name: str = "SIGINT"):
    super().__init__(f"interrupted at step {step}")
    self.step, self.checkpoint_step, self.run_dir = step, checkpoint_step, run_dir
    self.signal_name = signal_name


class NonFiniteStep(RuntimeError):
  """A step's loss, gradient norm or updated parameters were not finite
  (beyond ``train.skip_nonfinite`` such steps in a row): the run stopped
  without saving it.

  Attributes:
    step: the step that was not finite.
    values: its :data:`FINITE_METRICS`.
    checkpoint_step: the newest checkpoint in ``run_dir`` (None: none).
    run_dir: the run's directory, holding its metrics and summary so far.
  """

  def __init__(self, step: int, values: dict, checkpoint_step: int | None,
               run_dir: pathlib.Path):
    shown = ", ".join(f"{key} {value:.4g}" for key, value in values.items())
    super().__init__(f"step {step} is not finite ({shown})")
    self.step, self.values = step, values
    self.checkpoint_step, self.run_dir = checkpoint_step, run_dir


def is_finite(record: dict) -> bool:
  """Whether a step's :data:`FINITE_METRICS` (host numbers) are all finite."""
  return all(math.isfinite(record[key]) for key in FINITE_METRICS)


class StopRequests:
  """Within ``with``, SIGINT (Ctrl-C) and SIGTERM (what a scheduler sends at
  a time limit; ``moe_ep.launch`` sends SIGTERM) ask the training loop to
  stop after the step in progress, which it then saves.

  One process: the handlers record the signal; a second Ctrl-C raises
  KeyboardInterrupt as usual. Several processes: JAX's preemption service
  (started by ``jax.distributed.initialize``) takes SIGTERM and agrees on a
  step at which every process stops (their checkpoint is collective); a
  SIGINT is passed to it as SIGTERM. Handlers are installed from the main
  thread only.
  """

  def __init__(self):
    self.several = jax.process_count() > 1
    self.enabled = threading.current_thread() is threading.main_thread()
    self.signal_name: str | None = None
    self.previous = {}

  def _handle(self, signum, frame):
    if signum == signal.SIGINT and self.signal_name == "SIGINT":
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    if self.several:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

  def __enter__(self):
    if self.enabled:
      # With several processes JAX's own SIGTERM handler must stay in place.
      for signum in [signal.SIGINT] + [signal.SIGTERM] * (not self.several):
        self.previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)
    self.previous = {}
    return False

  def stop_after(self, step: int) -> str | None:
    """The signal's name if the loop stops after ``step`` (steps completed),
    else None. With several processes every process calls this after every
    step, from the same first step, and all get the same answer."""
    if self.several:
      if not multihost_utils.reached_preemption_sync_point(step):
        return None
      return self.signal_name or "SIGTERM"
    return self.signal_name
