"""The training loop of ``examples/pretrain.py``: a set-up :class:`Run`
stepped from its start to its end, each step's record logged, evaluated and
checkpointed where due, a signal or a non-finite step ending it early."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from typing import Callable

import jax
import numpy as np

from examples import flops
from examples.checkpoints import RunCheckpoints
from examples.metrics_log import MetricsLog
from examples.progress import ProgressReporter
from examples.run_control import StopRequests, is_finite
from examples.run_dir import link_latest
from examples.train_config import Config
from examples.train_program import Setup, compile_eval_step, global_batch, make_schedule


@dataclasses.dataclass(kw_only=True)
class Run:
  """A run once set up, between ``examples.pretrain.start_run``,
  :func:`train_loop` and ``examples.pretrain.finish_run``."""

  config: Config
  run_dir: pathlib.Path
  name: str
  created: bool  # a new run directory (the -latest link moves once a step is done)
  is_main: bool
  devices: list
  setup: Setup
  train_step: object
  compile_s: float
  corpus: object
  eval_corpus: object | None
  eval_step: object | None  # compiled at the first evaluation
  checkpoints: RunCheckpoints | None
  state: dict
  start: int
  end: int
  previous: list  # the resumed run's records up to `start`
  flops_per_token: float
  peak: float | None
  wall_start: float
  say: Callable
  notice: Callable


def _host(metrics: dict) -> dict:
  """Replicated device metrics -> plain Python numbers and lists."""
  return {key: np.asarray(value.addressable_data(0)).tolist() for key, value in metrics.items()}


def evaluate(run: Run, state) -> float:
  """Mean held-out cross-entropy over ``train.eval_batches`` fixed batches
  (the eval step is compiled on the first call: a run too short to evaluate
  does not compile it)."""
  train_config = run.config.train
  shape = (train_config.batch_size, train_config.seq_len + 1)
  if run.eval_step is None:
    run.eval_step = compile_eval_step(run.setup, shape)
  batches = (global_batch(run.eval_corpus, k, sharding=run.setup.batch_sharding, shape=shape)
             for k in range(train_config.eval_batches))
  losses = [run.eval_step(state, batch) for batch in batches]
  return float(np.mean([np.asarray(loss.addressable_data(0)) for loss in losses]))


@dataclasses.dataclass
class LoopResult:
  """What :func:`train_loop` leaves: the records of its steps, the state,
  how it ended."""

  records: list
  state: dict
  state_step: int
  checkpoint_step: int | None
  stopped_by: str | None = None
  nonfinite: dict | None = None


def train_loop(run: Run, *, progress: bool, log: MetricsLog | None) -> LoopResult:
  """Runs steps ``run.start..run.end``: each one's record is logged (with the
  held-out loss every ``train.eval_every`` steps) and checkpointed every
  ``train.checkpoint_every``; a signal or a non-finite step ends it early.

  The host reads a step's metrics while the device runs the next one: step
  ``k + 1`` is dispatched before step ``k``'s record is made, so the record,
  the log and the dispatch never leave the device idle. Where the host needs
  the state after step ``k`` (a checkpoint, an evaluation, the last step) or
  a Ctrl-C came while making the next batch, step ``k + 1`` waits. A stop
  found in step ``k``'s record ends the run after step ``k + 1``, the step
  then in progress, which is recorded and saved; a non-finite step ends it
  with the in-flight step unrecorded."""
  train_config, setup = run.config.train, run.setup
  every = train_config.checkpoint_every
  batch_shape = (train_config.batch_size, train_config.seq_len + 1)
  make_batch = functools.partial(global_batch, run.corpus, sharding=setup.batch_sharding,
                                 shape=batch_shape)
  tokens_per_step = train_config.batch_size * train_config.seq_len
  schedule = make_schedule(train_config)
  # A resumed run starts from a checkpoint (of a step > 0).
  out = LoopResult([], run.state, run.start, run.start or None)
  nonfinite_in_row = 0
  reporter = ProgressReporter(total=run.end, start=run.start, enabled=progress and run.is_main,
                              log_every=train_config.log_every)
  batch = make_batch(run.start)
  tick = time.perf_counter()

  def eval_due(done: int) -> bool:
    return run.eval_corpus is not None and done % train_config.eval_every == 0

  def checkpoint_due(done: int) -> bool:
    return bool(run.checkpoints) and (done % every == 0 or done == run.end)

  def needs_state(done: int) -> bool:
    """Whether the host uses the state after ``done`` steps."""
    return done == run.end or checkpoint_due(done) or eval_due(done)

  def dispatch(step: int):
    """Queues step ``step`` on the device and makes the next batch meanwhile;
    a Ctrl-C while making it is returned, to be raised once the step is recorded."""
    nonlocal batch
    out.state, metrics = run.train_step(out.state, batch)
    out.state_step = step + 1
    interrupt = None
    if step + 1 < run.end:
      try:
        batch = make_batch(step + 1)
      except KeyboardInterrupt as error:
        interrupt = error
    return step, metrics, interrupt

  def finish(step: int, metrics: dict) -> bool:
    """Records step ``step`` (waiting for it), evaluates and checkpoints where
    due; True where the run must stop because the step was not finite."""
    nonlocal nonfinite_in_row, tick
    record = {"step": step + 1, **_host(metrics)}
    now = time.perf_counter()
    record["step_time_s"] = now - tick
    tick = now
    record["tokens_per_s"] = tokens_per_step / record["step_time_s"]
    record["mfu"] = flops.mfu(record["tokens_per_s"] / len(run.devices),
                              run.flops_per_token, run.peak)
    record["learning_rate"] = float(schedule(step))  # the rate of this step's update
    nonfinite_in_row = 0 if is_finite(record) else nonfinite_in_row + 1
    if nonfinite_in_row:
      record["skipped"] = nonfinite_in_row <= train_config.skip_nonfinite
    if eval_due(step + 1):
      record["eval_loss"] = evaluate(run, out.state)
      reporter.note(f"step {step + 1}: held-out loss {record['eval_loss']:.4f}")
    out.records.append(record)
    if log is not None:
      log.write(record)
    if nonfinite_in_row > train_config.skip_nonfinite:
      out.nonfinite = record
      return True
    if run.created and run.is_main and len(out.records) == 1:
      link_latest(run.run_dir, run.name)  # the run has started
    if checkpoint_due(step + 1):
      if run.checkpoints.save(step + 1, out.state, data_step=step + 1):
        out.checkpoint_step = step + 1
    reporter.update(record)
    return False

  with reporter, StopRequests() as stop_requests:
    try:
      in_flight = dispatch(run.start) if run.start < run.end else None
      while in_flight is not None:
        step, metrics, interrupt = in_flight
        in_flight = None
        if step + 1 < run.end and interrupt is None and not needs_state(step + 1):
          in_flight = dispatch(step + 1)
        if finish(step, metrics):
          break
        if interrupt is not None:
          raise interrupt
        out.stopped_by = stop_requests.stop_after(step + 1)
        if out.stopped_by:
          if in_flight is not None:  # the step in progress: recorded and saved
            step, metrics, interrupt = in_flight
            finish(step, metrics)
          break
        if in_flight is None and step + 1 < run.end:
          tick = time.perf_counter()  # an eval's or a checkpoint's time is not the next step's
          in_flight = dispatch(step + 1)
    except KeyboardInterrupt:
      if jax.process_count() > 1:
        raise  # the processes may be at different steps: no collective save
      out.stopped_by = "SIGINT"
  return out
