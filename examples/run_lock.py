"""One run per directory: an exclusive lock file in ``run_dir``.

``run_dir/.run.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local
filesystems and NFS v3+, unlike ``flock`` across nodes) and holds the host,
boot id and pid of the run's process 0. A second run that finds it is
refused in one line, unless the lock is stale: on the same host (and boot),
its process is gone; on another host, it was not refreshed for
:data:`STALE_AFTER_S` (a background thread of the holder touches it every
:data:`REFRESH_S`): a job requeued onto another node after its node died
takes its directory back. The lock goes when the process exits.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import socket
import threading
import time

import jax

from examples.run_dir import from_process_0

LOCK_NAME = ".run.lock"
REFRESH_S = 30.0
STALE_AFTER_S = 300.0
# The directories this process holds: {path: stop event of its refresher}.
_held: dict[pathlib.Path, threading.Event] = {}


class RunDirInUse(FileExistsError):
  """Another live run holds the run directory."""


def _boot_id() -> str:
  try:
    return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
  except OSError:
    return ""


def _owner() -> dict:
  return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
  return True


def holder_if_live(lock: pathlib.Path) -> dict | None:
  """The owner recorded in ``lock`` if that run may still be going, else
  None (no lock, or a stale one: see the module docstring). A lock of this
  very process is not live either: an earlier call in this process
  (ablate's variants, a test) that ended by an exception left it."""
  try:
    owner = json.loads(lock.read_text())
    age = time.time() - lock.stat().st_mtime
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    return {"host": "?", "pid": "?", "since": "?"}  # unreadable, or being written
  same_machine = owner.get("host") == socket.gethostname() and owner.get("boot_id") == _boot_id()
  if same_machine:
    pid = int(owner.get("pid", -1))
    return owner if pid != os.getpid() and _pid_alive(pid) else None
  return owner if age < STALE_AFTER_S else None


def _refresh(lock: pathlib.Path, stop: threading.Event) -> None:
  while not stop.wait(REFRESH_S):
    try:
      os.utime(lock)
    except OSError:
      return


def _try_lock(run_dir: pathlib.Path) -> str:
  """Process 0's attempt: "" when it now holds ``run_dir``, else the refusal."""
  lock = run_dir / LOCK_NAME
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    return f"train.run_dir={str(run_dir)!r}: cannot create it: {error.strerror or error}"
  for _ in range(3):
    try:
      fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      owner = holder_if_live(lock)
      if owner is not None:
        return (f"{run_dir} is in use by another run (host {owner['host']}, pid "
                f"{owner['pid']}, since {owner['since']}): wait for it to end or choose another "
                f"train.run_dir (if that run is gone, delete {lock})")
      # A stale lock: replace it. Two runs taking over at once both unlink
      # and race to O_EXCL-create it again; one wins.
      lock.unlink(missing_ok=True)
      continue
    except OSError as error:
      return f"train.run_dir={str(run_dir)!r}: cannot write its lock: {error.strerror or error}"
    with os.fdopen(fd, "w") as f:
      json.dump(_owner(), f)
    stop = threading.Event()
    threading.Thread(target=_refresh, args=(lock, stop), daemon=True,
                     name="run-dir-lock").start()
    _held[run_dir] = stop
    return ""
  return f"{run_dir}: could not take its lock ({lock}) after three tries"


def lock_run_dir(run_dir) -> None:
  """Makes this job the only run of ``run_dir`` until this process exits
  (or :func:`release_run_dir`); every process calls it, process 0 holds it.

  Raises:
    RunDirInUse: another live run holds it (one line naming its host and pid).
  """
  run_dir = pathlib.Path(run_dir).resolve()
  refusal = ""
  if run_dir in _held:  # this process already holds it (a resumed run in one process)
    refusal = ""
  elif jax.process_index() == 0:
    refusal = _try_lock(run_dir)
  refusal = from_process_0(refusal)
  if refusal:
    raise RunDirInUse(refusal)


def release_run_dir(run_dir) -> None:
  """Lets ``run_dir`` go (a no-op where this process does not hold it)."""
  run_dir = pathlib.Path(run_dir).resolve()
  stop = _held.pop(run_dir, None)
  if stop is None:
    return
  stop.set()
  try:
    lock = run_dir / LOCK_NAME
    if json.loads(lock.read_text()).get("pid") == os.getpid():
      lock.unlink()
  except (OSError, ValueError):
    pass


@atexit.register
def release_all() -> None:
  """Lets every run directory this process holds go."""
  for run_dir in list(_held):
    release_run_dir(run_dir)
