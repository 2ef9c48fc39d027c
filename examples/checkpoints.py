"""Orbax checkpoints of a run: the model and optimizer states plus the data
position, under ``run_dir/checkpoints``.

Every process calls :meth:`RunCheckpoints.save` and :meth:`RunCheckpoints.restore`;
Orbax writes each array's shards from the processes that hold them.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


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

  def delete_all(self) -> list[int]:
    """Deletes every saved step (a fresh run reusing the directory); returns them."""
    steps = list(self.manager.all_steps())
    for step in steps:
      self.manager.delete(step)
    return steps

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
