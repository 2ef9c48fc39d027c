"""A run's Orbax checkpoints: the model and optimizer states plus the data
position, under ``run_dir/checkpoints``.

Every process calls :meth:`RunCheckpoints.save` and the restores; Orbax
writes each array's shards from the processes that hold them.

Checkpoints are verified. Each is saved with a fingerprint of its state
(:func:`state_fingerprint`), read back and compared before any older one is
deleted; on resume, a step that is damaged (its files do not restore,
restore non-finite values or do not match its fingerprint) is reported,
moved aside (to ``checkpoints-unusable/``, nothing is deleted) and the next
older one tried. A step that does not fit the state to restore into (another
model: other shapes or structure) is not damaged: it is left in place and
the resume refused. A save that fails (a full disk, a path that is not a
directory) is counted and reported in one line and the run goes on, until
:data:`MAX_FAILED_SAVES_IN_ROW` in a row stop it (:class:`SavesFailing`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import pathlib
import shutil
import sys
import types
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.run_dir import from_process_0
from examples.train_config import ConfigError


# --- fingerprints ----------------------------------------------------------------

# An odd multiplier (the golden ratio's 32-bit fraction): every element's
# weight is odd, so changing any one element always changes the sum mod 2**32.
_WEIGHT = np.uint32(0x9E3779B1)


def _leaf_sum(leaf: jax.Array) -> jax.Array:
  """``sum(bits[i] * odd weight of i) mod 2**32`` over ``leaf``'s elements
  (an 8-byte element counts as two 4-byte ones), without reshaping it, so a
  sharded leaf is summed where it lies."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  if leaf.dtype == jnp.bool_:
    bits = leaf.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
  index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
  for axis in reversed(range(bits.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * np.uint32(stride % 2**32)
    stride *= bits.shape[axis]
  return jnp.sum(bits * ((2 * index + 1) * _WEIGHT), dtype=jnp.uint32)


def _fingerprint_and_finite(leaves: list) -> tuple[jax.Array, jax.Array]:
  sums = jnp.stack([_leaf_sum(leaf) for leaf in leaves])
  finite = jnp.array(True)
  for leaf in leaves:
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      finite &= jnp.isfinite(leaf).all()
  return sums, finite


@functools.lru_cache(maxsize=8)
def _fingerprint_program(replicated: NamedSharding | None):
  return jax.jit(_fingerprint_and_finite, out_shardings=replicated)


def state_fingerprint(state) -> tuple[list[int], bool]:
  """``(fingerprint, finite)`` of a pytree of arrays: one position-weighted
  sum of its bits per leaf (in ``jax.tree.leaves`` order), and whether every
  floating value is finite. The same on every process; bitwise-equal states
  have equal fingerprints, and any one changed element changes its leaf's."""
  leaves = jax.tree.leaves(state)
  shardings = [leaf.sharding for leaf in leaves if isinstance(leaf.sharding, NamedSharding)]
  replicated = NamedSharding(shardings[0].mesh, P()) if shardings else None
  sums, finite = _fingerprint_program(replicated)(leaves)
  return ([int(v) for v in np.asarray(sums.addressable_data(0))],
          bool(np.asarray(finite.addressable_data(0))))


# --- checkpoints -----------------------------------------------------------------


# Saves that fail one after another before the run gives up (a full disk
# rarely empties by itself; a few tries ride out a brief filesystem hiccup).
MAX_FAILED_SAVES_IN_ROW = 3


class SavesFailing(RuntimeError):
  """:data:`MAX_FAILED_SAVES_IN_ROW` saves in a row failed; ``latest_step`` is
  the newest checkpoint that was saved intact (None: none)."""

  def __init__(self, count: int, reason: str, latest_step: int | None,
               directory: pathlib.Path):
    super().__init__(f"{count} checkpoint saves in a row failed (the last: {reason})")
    self.latest_step, self.directory = latest_step, directory


class CheckpointError(RuntimeError):
  """Checkpoint ``step`` is unusable; ``reason`` says why in a few words."""

  def __init__(self, step: int, reason: str):
    super().__init__(f"checkpoint {step} {reason}")
    self.step, self.reason = step, reason


def _on_every_process(ok: bool) -> bool:
  """Whether ``ok`` holds on every process (each reads its own shards, so a
  damaged file can fail a restore on one process only)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.asarray(multihost_utils.process_allgather(np.array(ok))).all())


def _first_line(error: BaseException) -> str:
  """The first line of the innermost exception ``error`` was raised from
  (TensorStore's reason rather than Orbax's wrapper), at most 200 characters."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  lines = [line for line in str(error).splitlines() if line.strip()]
  text = lines[0] if lines else type(error).__name__
  return text if len(text) <= 200 else text[:197] + "..."


def _is_abandoned_read(unraisable) -> bool:
  """Whether an unraisable exception is the leftover of an abandoned read:
  Orbax reads a checkpoint's arrays in coroutines, and when one read fails
  the others are dropped; Python then prints each dropped coroutine's error
  ("Exception ignored in: <coroutine ...>", with a page of TensorStore spec)
  when it is collected, and each TensorStore read that completes later
  reports into Orbax's closed event loop ("Event loop is closed")."""
  return (isinstance(unraisable.object, types.CoroutineType)
          or (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
              and str(unraisable.exc_value) == "Event loop is closed"))


def _drop_abandoned_reads() -> None:
  """From now on, :func:`_is_abandoned_read` leftovers are not printed (the
  restore's first error is reported instead); everything else is. Called
  once a restore has failed; the reads it abandoned may finish at any time."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_abandoned_reads", False):
    return

  def hook(unraisable):
    if not _is_abandoned_read(unraisable):
      previous(unraisable)

  hook.drops_abandoned_reads = True
  sys.unraisablehook = hook
  gc.collect()  # the dropped coroutines, now


class _OrbaxFailureLogs(logging.Filter):
  """Drops what Orbax's and asyncio's helper threads log when a save or
  restore fails (a traceback per thread and per unretrieved future); the
  failure itself reaches :class:`RunCheckpoints`, which reports it in one
  line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    if record.name == "asyncio":
      return "exception was never retrieved" not in record.getMessage()
    return "orbax" not in record.pathname


def _quiet_orbax_failures() -> None:
  """From now on, Orbax's failure leftovers are not printed: its threads'
  error logs (:class:`_OrbaxFailureLogs`), the errors of reads and writes it
  abandoned (:func:`_drop_abandoned_reads`) and the warnings of the
  coroutines it left unawaited."""
  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _OrbaxFailureLogs) for f in logger.filters):
      logger.addFilter(_OrbaxFailureLogs())
  warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                          category=RuntimeWarning)
  _drop_abandoned_reads()


def _leaf_shapes(tree) -> dict[str, tuple]:
  """``{"model/embed/embedding/value": (shape, dtype name)}`` of a state's
  leaves (arrays, ShapeDtypeStructs or Orbax's array metadata)."""
  def name(path):
    return "/".join(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))
                    for key in path)
  return {name(path): (tuple(leaf.shape), jnp.dtype(leaf.dtype).name)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _first(names: list[str]) -> str:
  return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def abstract_like(state, shardings=None):
  """``jax.ShapeDtypeStruct`` leaves with ``shardings`` (default: the leaves'
  own): a restore target."""
  if shardings is None:
    shardings = jax.tree.map(lambda value: value.sharding, state)
  return jax.tree.map(lambda value, sharding: jax.ShapeDtypeStruct(
      value.shape, value.dtype, sharding=sharding), state, shardings)


class RunCheckpoints:
  """Saves and restores ``state = {"model": nnx.State, "optimizer": nnx.State}``.

  Args:
    directory: where the numbered step folders go.
    max_to_keep: older steps are deleted once a newer one has been saved and
      read back intact.
    report: prints a one-line notice (a checkpoint set aside, a save that did
      not read back); called on every process.
  """

  def __init__(self, directory, max_to_keep: int = 2,
               report: Callable[[str], None] = lambda line: None):
    self.directory = pathlib.Path(directory).resolve()
    if self.directory.exists() and not self.directory.is_dir():
      raise FileExistsError(f"{self.directory} is not a directory: no checkpoint could be saved; "
                            "move it away (or set train.checkpoint_every=0)")
    self.max_to_keep, self.report = max_to_keep, report
    _quiet_orbax_failures()
    # No max_to_keep for Orbax: it would delete before the read-back.
    self.manager = ocp.CheckpointManager(self.directory)
    self.failed_saves = 0
    self.failed_in_row = 0

  @property
  def unusable_directory(self) -> pathlib.Path:
    """Where unusable steps are moved: ``checkpoints-unusable/`` beside ``directory``."""
    return self.directory.with_name(self.directory.name + "-unusable")

  def latest_step(self) -> int | None:
    try:
      return self.manager.latest_step()
    except OSError:  # the directory went away or became unreadable
      return None

  def save(self, step: int, state, data_step: int) -> bool:
    """Saves after ``step`` optimizer updates (``data_step``: the next batch
    index of the data stream), reads the step back and compares it with
    ``state``; only then are the steps older than the newest ``max_to_keep``
    deleted. Returns whether it read back intact; if not (the write failed or
    the read-back differs), it is reported in one line and counted in
    :attr:`failed_saves`, what it left is deleted, and the older steps are
    kept.

    Raises:
      ValueError: ``state`` holds non-finite values (a checkpoint never does).
      SavesFailing: this was the :data:`MAX_FAILED_SAVES_IN_ROW`-th failed
        save in a row.
    """
    fingerprint, finite = state_fingerprint(state)
    if not finite:
      raise ValueError(f"step {step}: the state holds non-finite values; not saved")
    try:
      self.manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          position=ocp.args.JsonSave({"step": step, "data_step": data_step,
                                      "fingerprint": fingerprint})))
      self.manager.wait_until_finished()
    # Orbax and TensorStore raise many types for a write that fails (OSError,
    # ValueError, RuntimeError, their own): all mean "not saved".
    except Exception as error:  # noqa: BLE001
      return self._failed(step, f"checkpoint {step} was not saved ({_first_line(error)})")
    try:
      self.restore_verified(step, abstract_like(state))
    except CheckpointError as error:
      return self._failed(step, str(error))
    if self.failed_in_row:  # the failure left the manager's list of steps stale
      self.manager.reload()
    self.failed_in_row = 0
    for old in sorted(self.manager.all_steps())[:-self.max_to_keep]:
      self.manager.delete(old)
    return True

  def _failed(self, step: int, reason: str) -> bool:
    """Counts and reports a failed save of ``step`` and deletes what it left."""
    self.failed_saves += 1
    self.failed_in_row += 1
    with contextlib.suppress(Exception):  # a partial step
      self.manager.delete(step)
    with contextlib.suppress(OSError):  # Orbax's temporary folder of the step
      for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(partial, ignore_errors=True)
    with contextlib.suppress(Exception):
      self.manager.reload()
    gc.collect()  # the save's unawaited coroutines, while their warnings are off
    if self.failed_in_row >= MAX_FAILED_SAVES_IN_ROW:
      raise SavesFailing(self.failed_in_row, reason, self.latest_step(), self.directory)
    self.report(f"{reason}: deleted what it left and kept the older checkpoints; "
                f"{self.failed_saves} failed save{'s' * (self.failed_saves != 1)} so far, the "
                "run goes on")
    return False

  def restore(self, step: int, abstract_state) -> tuple[object, int]:
    """``(state, data_step)`` of checkpoint ``step``, each array placed with
    the sharding of its ``jax.ShapeDtypeStruct`` in ``abstract_state``."""
    restored, _ = self._restore(step, abstract_state)
    return restored["state"], int(restored["position"]["data_step"])

  def _restore(self, step: int, abstract_state) -> tuple[dict, dict]:
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        position=ocp.args.JsonRestore()))
    return restored, restored["position"]

  def restore_verified(self, step: int, abstract_state) -> tuple[object, int]:
    """:meth:`restore`, checked: raises :class:`CheckpointError` (on every
    process alike) where the step does not restore, holds non-finite
    values or does not match the fingerprint it was saved with."""
    problem = None
    try:
      restored, position = self._restore(step, abstract_state)
    # Orbax and TensorStore raise many types for a damaged step (ValueError,
    # FileNotFoundError, RuntimeError, their own): all mean "unusable".
    except Exception as error:  # noqa: BLE001
      problem = f"does not restore ({_first_line(error)})"
    if problem:
      _drop_abandoned_reads()
    if not _on_every_process(problem is None):
      raise CheckpointError(step, problem or "does not restore on another process")
    fingerprint, finite = state_fingerprint(restored["state"])
    if not finite:
      raise CheckpointError(step, "holds non-finite values")
    if position.get("fingerprint", fingerprint) != fingerprint:
      raise CheckpointError(step, "does not match the fingerprint it was saved with")
    return restored["state"], int(position["data_step"])

  def restore_newest_intact(self, abstract_state) -> tuple[object, int, int]:
    """``(state, step, data_step)`` of the newest step that passes
    :meth:`restore_verified`; each newer one is reported and moved to
    :attr:`unusable_directory`.

    Raises:
      FileNotFoundError: no step is intact (or there is none).
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      mismatch = self.mismatch(step, abstract_state)
      if mismatch:
        raise ConfigError(
            f"--resume: checkpoint {step} in {self.directory} was saved from another model: "
            f"{mismatch}; resume with the config it was trained with, or start a new run "
            "(the checkpoints are left as they are)")
      try:
        state, data_step = self.restore_verified(step, abstract_state)
        return state, step, data_step
      except CheckpointError as error:
        aside = self._set_aside(step)
        older = [s for s in steps if s < step]
        self.report(f"{error}; moved it to {aside}"
                    + (f"; trying step {older[0]}" if older else ""))
    raise FileNotFoundError(f"no intact checkpoint in {self.directory}"
                            + (f" (steps {', '.join(map(str, steps))} are unusable)" if steps
                               else ""))

  def mismatch(self, step: int, abstract_state) -> str | None:
    """How checkpoint ``step`` differs in its arrays' names, shapes or dtypes
    from ``abstract_state`` (from the metadata Orbax saved beside them), or
    None: it fits, or its metadata cannot be read (then the restore tells
    whether it is damaged)."""
    try:
      with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(self.directory / str(step) / "state")
      saved = _leaf_shapes(getattr(metadata, "item_metadata", metadata))
    except Exception:  # noqa: BLE001 - damaged or missing metadata: not a mismatch
      return None
    if not saved:
      return None
    wanted = _leaf_shapes(abstract_state)
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
      parts = ([f"it lacks {_first(missing)}"] if missing else []) + (
          [f"it holds {_first(extra)}, which this model does not"] if extra else [])
      return ", and ".join(parts)
    for name, (shape, dtype) in wanted.items():
      if saved[name] != (shape, dtype):
        return (f"{name} is {saved[name][1]}{list(saved[name][0])} there and "
                f"{dtype}{list(shape)} in this model")
    return None

  def _set_aside(self, step: int) -> pathlib.Path:
    """Moves step ``step``'s folder into :attr:`unusable_directory` (process 0
    moves it, the others wait) and returns its new path."""
    target = ""
    if jax.process_index() == 0:
      target, count = self.unusable_directory / str(step), 1
      while target.exists():  # the same step set aside by an earlier resume
        count += 1
        target = self.unusable_directory / f"{step}-{count}"
      target.parent.mkdir(parents=True, exist_ok=True)
      os.replace(self.directory / str(step), target)
    target = pathlib.Path(from_process_0(str(target)))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
    self.manager.reload()
    return target

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
