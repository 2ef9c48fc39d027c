"""Where a run's metrics go: ``metrics.jsonl`` (one JSON line per step),
TensorBoard event files beside it (``tensorboardX``, optional) and Weights &
Biases (``wandb``, only when installed and ``train.wandb_project`` asks).

TensorBoard tags: ``train/<key>`` for each scalar of a step's record
(:data:`TRAIN_SCALARS`), ``eval/loss`` for the held-out loss.
"""

from __future__ import annotations

import json
import pathlib

# A step record's scalars that go to TensorBoard and W&B, in this order.
TRAIN_SCALARS = ("loss", "ce_loss", "aux_loss", "z_loss", "dropped_fraction", "learning_rate",
                 "grad_norm", "param_norm", "tokens_per_s", "mfu", "step_time_s")


def scalars(record: dict) -> dict[str, float]:
  """``{tag: value}`` of a metrics record for TensorBoard and W&B."""
  tags = {f"train/{key}": record[key] for key in TRAIN_SCALARS
          if isinstance(record.get(key), (int, float))}
  if record.get("eval_loss") is not None:
    tags["eval/loss"] = record["eval_loss"]
  return tags


def tensorboard_writer(run_dir: pathlib.Path, wanted: bool):
  """``(writer or None, note or None)``: a tensorboardX ``SummaryWriter`` on
  ``run_dir``, or the one line saying why there is none."""
  if not wanted:
    return None, None
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415  (optional)
  except ImportError:
    return None, ("note: no TensorBoard events: tensorboardX is not installed "
                  "(pip install tensorboardX, or train.tensorboard=false to silence this)")
  return SummaryWriter(logdir=str(run_dir), flush_secs=10), None


def require_wandb(project: str | None):
  """The ``wandb`` module where ``project`` is set (None where it is not).

  Raises:
    ValueError: ``project`` is set but wandb is not installed.
  """
  if project is None:
    return None
  try:
    import wandb  # noqa: PLC0415  (optional)
  except ImportError:
    raise ValueError(f"train.wandb_project={project!r} needs the wandb package: pip install "
                     "wandb (or train.wandb_project=null)") from None
  return wandb


def wandb_run(project: str | None, run_dir: pathlib.Path, config: dict, resume: bool):
  """A W&B run in ``project`` (None: no W&B), one per run directory."""
  wandb = require_wandb(project)
  if wandb is None:
    return None
  return wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config,
                    id=run_dir.name, resume="allow" if resume else None)


class MetricsLog:
  """Appends records to ``metrics.jsonl`` and, where set up, TensorBoard and W&B.

  Args:
    path: ``metrics.jsonl``; opened for appending (a resumed run's earlier
      records already written there).
    tensorboard: a tensorboardX ``SummaryWriter`` or None.
    wandb: a W&B run or None.
  """

  def __init__(self, path: pathlib.Path, *, tensorboard=None, wandb=None):
    self.file = pathlib.Path(path).open("a")
    self.tensorboard, self.wandb = tensorboard, wandb

  def write(self, record: dict) -> None:
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    tags = scalars(record)
    if self.tensorboard is not None:
      for tag, value in tags.items():
        self.tensorboard.add_scalar(tag, value, global_step=record["step"])
    if self.wandb is not None:
      self.wandb.log(tags, step=record["step"])

  def close(self) -> None:
    self.file.close()
    if self.tensorboard is not None:
      self.tensorboard.close()
    if self.wandb is not None:
      self.wandb.finish()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False
