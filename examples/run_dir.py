"""A run's directory: where a new run goes, the link to the newest, what an
earlier run left there, and the configs it ran with.

``runs/<name>-<YYYYmmdd-HHMMSS>/`` holds ``config.yaml`` (the config the run
started with), one ``config.resume-<k>.yaml`` per ``--resume`` (headed by
the step it resumed from and what it changed), ``checkpoints/``
(:mod:`examples.checkpoints`), ``metrics.jsonl``, ``metrics.png`` and
``summary.json``; ``runs/<name>-latest`` links the newest run that started.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re

import jax
import numpy as np
from jax.experimental import multihost_utils

from examples.train_config import (Config, ConfigError, config_to_yaml, load_config,
                                   resume_changes)

RUNS_ROOT = pathlib.Path("runs")
# What each --resume writes beside config.yaml: config.resume-1.yaml, -2, ...
RESUMED_CONFIG = re.compile(r"config\.resume-(\d+)\.yaml")


def from_process_0(text: str, size: int = 4096) -> str:
  """Process 0's ``text`` (a path it chose) on every process; every process
  calls this."""
  if jax.process_count() == 1:
    return text
  encoded = np.zeros(size, np.int32)
  encoded[:len(text.encode())] = np.frombuffer(text.encode(), np.uint8)
  received = np.asarray(multihost_utils.broadcast_one_to_all(encoded))
  return bytes(received[received > 0].astype(np.uint8)).decode()


def latest_link(name: str, root=RUNS_ROOT) -> pathlib.Path:
  """``root/<name>-latest``: the link to the newest run named ``name``."""
  return pathlib.Path(root) / f"{name}-latest"


def new_run_dir(name: str, root=RUNS_ROOT, now: datetime.datetime | None = None) -> pathlib.Path:
  """Creates ``root/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... appended
  when runs start within one second); :func:`link_latest` points at it
  (examples/pretrain.py: once its first step is done)."""
  root = pathlib.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  stem = f"{name}-{(now or datetime.datetime.now()):%Y%m%d-%H%M%S}"
  run_dir, count = root / stem, 1
  while True:
    try:
      run_dir.mkdir()
      return run_dir
    except FileExistsError:
      count += 1
      run_dir = root / f"{stem}-{count}"


def link_latest(run_dir, name: str, root=RUNS_ROOT) -> None:
  """Points :func:`latest_link` at ``run_dir`` (a directory in ``root``)."""
  # A relative link, replaced atomically: the runs folder can move.
  link = latest_link(name, root)
  partial = link.with_name(f".{link.name}.{os.getpid()}")
  partial.unlink(missing_ok=True)
  partial.symlink_to(pathlib.Path(run_dir).name)
  os.replace(partial, link)


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


# The files a run writes in its directory (examples/pretrain.py).
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "metrics.png")


def check_run_files(run_dir: pathlib.Path) -> None:
  """Raises FileExistsError (one line) where ``run_dir`` is a file or one of
  the :data:`RUN_FILES` in it is not a file, before anything is compiled."""
  if run_dir.exists() and not run_dir.is_dir():
    raise FileExistsError(f"train.run_dir={str(run_dir)!r} is a file, not a directory; "
                          "choose another train.run_dir")
  for name in RUN_FILES:
    path = run_dir / name
    if path.exists() and not path.is_file():
      raise FileExistsError(f"{path} is not a file, so the run cannot write it; move it away "
                            "or choose another train.run_dir")


def choose_run_dir(run_dir: str | None, name: str, *, resume: bool) -> tuple[pathlib.Path, bool]:
  """``(directory, whether this call created it)`` of a run.

  An explicit ``run_dir`` is used as it is, but a fresh run (not ``resume``)
  refuses one that holds another run's outputs. Without one, a fresh run gets
  a new ``runs/<name>-<YYYYmmdd-HHMMSS>`` (made by process 0, its name shared
  with the others; ``runs/<name>-latest`` links it once its first step is
  done) and ``resume`` continues the one ``runs/<name>-latest`` links.
  """
  if run_dir is not None:
    run_dir = pathlib.Path(run_dir)
    check_run_files(run_dir)
    held = held_steps(run_dir)
    if held and not resume:
      raise FileExistsError(f"{run_dir} holds a run (steps {held[0]}-{held[1]}); use --resume "
                            "to continue it or choose another train.run_dir")
    return run_dir, False
  if resume:
    latest = latest_run_dir(name)
    if latest is None:
      link = latest_link(name)
      state = (f"{link} points to {os.readlink(link)}, which is not a directory"
               if link.is_symlink() else f"{link} does not exist")
      raise FileNotFoundError(f"--resume: no earlier run of {name} to continue ({state}); "
                              "name its directory with train.run_dir=...")
    check_run_files(latest)
    return latest, False
  created = str(new_run_dir(name)) if jax.process_index() == 0 else ""
  return pathlib.Path(from_process_0(created)), True


# --- the configs a run ran with ------------------------------------------------


def _resumes(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
  """``{k: config.resume-<k>.yaml}`` of the resumes recorded in ``run_dir``."""
  matches = (RESUMED_CONFIG.fullmatch(path.name) for path in run_dir.glob("config.resume-*"))
  return {int(match[1]): run_dir / match[0] for match in matches if match}


def run_configs(run_dir: pathlib.Path) -> list[pathlib.Path]:
  """``config.yaml`` (the run's start) and each resume's
  ``config.resume-<k>.yaml``, oldest first, of those present."""
  resumes = _resumes(run_dir)
  first = [run_dir / "config.yaml"] if (run_dir / "config.yaml").exists() else []
  return first + [resumes[k] for k in sorted(resumes)]


def check_resumed_config(run_dir: pathlib.Path, config: Config) -> list[str]:
  """The changes ``config`` makes to the config the run in ``run_dir`` last
  ran with (its newest :func:`run_configs` file): the allowed ones, as
  ``"train.learning_rate 0.003 -> 0.001"``.

  Raises:
    ConfigError: a change to the parameters or the computation
      (:func:`examples.train_config.resume_changes`), naming every such field.
  """
  saved = run_configs(run_dir)
  if not saved:
    return []
  refused, allowed = resume_changes(load_config(saved[-1]), config)
  if refused:
    raise ConfigError(
        f"--resume: {run_dir} was trained with another model or computation: "
        f"{'; '.join(refused)} (these change the parameters or what a step computes: "
        "resume with the saved values, or start a new run)")
  return allowed


def write_run_config(run_dir: pathlib.Path, config: Config, *, resumed_from: int | None,
                     changes: list[str]) -> pathlib.Path:
  """Writes ``config.yaml`` (a new run) or the next ``config.resume-<k>.yaml``
  (a resumed one, headed by its step and changes); returns its path."""
  if resumed_from is None:
    path, header = run_dir / "config.yaml", ""
  else:
    path = run_dir / f"config.resume-{max(_resumes(run_dir), default=0) + 1}.yaml"
    header = (f"# --resume from step {resumed_from}: "
              + ("; ".join(changes) if changes else "no changes") + "\n")
  path.write_text(header + config_to_yaml(config))
  return path
