"""A run's directory on disk: where a new run goes, what an old one holds,
and its Orbax checkpoints (the model and optimizer states plus the data
position, under ``run_dir/checkpoints``).

Every process calls :meth:`RunCheckpoints.save` and :meth:`RunCheckpoints.restore`;
Orbax writes each array's shards from the processes that hold them.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

import jax
import orbax.checkpoint as ocp

RUNS_ROOT = pathlib.Path("runs")


def latest_link(name: str, root=RUNS_ROOT) -> pathlib.Path:
  """``root/<name>-latest``: the link to the newest run named ``name``."""
  return pathlib.Path(root) / f"{name}-latest"


def new_run_dir(name: str, root=RUNS_ROOT, now: datetime.datetime | None = None) -> pathlib.Path:
  """Creates ``root/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... appended
  when runs start within one second) and points :func:`latest_link` at it."""
  root = pathlib.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  stem = f"{name}-{(now or datetime.datetime.now()):%Y%m%d-%H%M%S}"
  run_dir, count = root / stem, 1
  while True:
    try:
      run_dir.mkdir()
      break
    except FileExistsError:
      count += 1
      run_dir = root / f"{stem}-{count}"
  # A relative link, replaced atomically: the runs folder can move.
  link = latest_link(name, root)
  partial = link.with_name(f".{link.name}.{os.getpid()}")
  partial.unlink(missing_ok=True)
  partial.symlink_to(run_dir.name)
  os.replace(partial, link)
  return run_dir


def latest_run_dir(name: str, root=RUNS_ROOT) -> pathlib.Path | None:
  """The run :func:`latest_link` points at, or None if there is none."""
  link = latest_link(name, root)
  if not (link.is_symlink() and link.resolve().is_dir()):
    return None
  return link.parent / os.readlink(link)


def held_steps(run_dir) -> tuple[int, int] | None:
  """``(first, last)`` step an earlier run left in ``run_dir``: of its
  ``metrics.jsonl`` records, else of its checkpoints; None if it holds none."""
  run_dir = pathlib.Path(run_dir)
  metrics = run_dir / "metrics.jsonl"
  if metrics.exists():
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
             if line.strip()]
    if steps:
      return steps[0], steps[-1]
  checkpoints = run_dir / "checkpoints"
  if not checkpoints.is_dir():
    return None
  steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  return (steps[0], steps[-1]) if steps else None


class RunCheckpoints:
  """Saves and restores ``state = {"model": nnx.State, "optimizer": nnx.State}``.

  Args:
    directory: where the numbered step folders go.
    max_to_keep: older steps are deleted as new ones are saved.
  """

  def __init__(self, directory, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).resolve()
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_step: int) -> None:
    """Saves after ``step`` optimizer updates; ``data_step`` is the next
    batch index of the data stream."""
    self.manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        position=ocp.args.JsonSave({"step": step, "data_step": data_step})))

  def restore(self, step: int, abstract_state) -> tuple[object, int]:
    """``(state, data_step)`` of checkpoint ``step``, each array placed with
    the sharding of its ``jax.ShapeDtypeStruct`` in ``abstract_state``."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        position=ocp.args.JsonRestore()))
    return restored["state"], int(restored["position"]["data_step"])

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state, shardings):
  """``jax.ShapeDtypeStruct`` leaves with the given shardings: a restore target."""
  return jax.tree.map(lambda value, sharding: jax.ShapeDtypeStruct(
      value.shape, value.dtype, sharding=sharding), state, shardings)
