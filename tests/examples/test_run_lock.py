"""examples/run_lock.py: one run per directory. A second run of a directory
in use is refused in one line; a lock left by a process that is gone (same
host), or not refreshed for STALE_AFTER_S (another host), is taken over;
the lock goes when its run ends."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from tiny_run import REPO, fast_overrides
from examples import run_lock
from examples.run_lock import LOCK_NAME, RunDirInUse, lock_run_dir, release_run_dir


def write_lock(run_dir: pathlib.Path, *, host=None, boot_id=None, pid, age_s: float = 0):
  run_dir.mkdir(parents=True, exist_ok=True)
  lock = run_dir / LOCK_NAME
  lock.write_text(json.dumps({"host": host or socket.gethostname(),
                              "boot_id": run_lock._boot_id() if boot_id is None else boot_id,
                              "pid": pid, "since": "2026-12-03 10:00:00"}))
  stamp = time.time() - age_s
  os.utime(lock, (stamp, stamp))
  return lock


@pytest.fixture
def sleeper():
  process = subprocess.Popen(["sleep", "60"])
  yield process.pid
  process.kill()
  process.wait()


def dead_pid() -> int:
  process = subprocess.Popen(["true"])
  process.wait()
  return process.pid


def test_a_live_run_on_this_host_holds_its_directory(tmp_path, sleeper):
  write_lock(tmp_path, pid=sleeper)
  with pytest.raises(RunDirInUse) as error:
    lock_run_dir(tmp_path)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"{tmp_path.resolve()} is in use by another run (host "
                            f"{socket.gethostname()}, pid {sleeper}, since 2026-12-03 10:00:00)")


def test_a_lock_whose_process_is_gone_is_taken_over_and_released(tmp_path):
  lock = write_lock(tmp_path, pid=dead_pid())
  lock_run_dir(tmp_path)
  assert json.loads(lock.read_text())["pid"] == os.getpid()
  release_run_dir(tmp_path)
  assert not lock.exists()


@pytest.mark.parametrize("age_s, live", [(10, True), (run_lock.STALE_AFTER_S + 60, False)])
def test_a_lock_of_another_host_is_live_while_it_is_refreshed(tmp_path, age_s, live):
  write_lock(tmp_path, host="gpu-node-17", boot_id="x", pid=4242, age_s=age_s)
  if live:
    with pytest.raises(RunDirInUse, match="host gpu-node-17, pid 4242"):
      lock_run_dir(tmp_path)
  else:
    lock_run_dir(tmp_path)
    release_run_dir(tmp_path)


def test_another_boot_of_this_host_is_stale_by_age_not_pid(tmp_path, sleeper):
  """Same hostname, another boot id (a rebooted node, or a container of that
  name on another machine): its pid says nothing here, its age does."""
  write_lock(tmp_path, boot_id="another-boot", pid=sleeper, age_s=run_lock.STALE_AFTER_S + 60)
  lock_run_dir(tmp_path)
  release_run_dir(tmp_path)


@pytest.mark.slow
def test_a_second_run_of_a_directory_in_use_is_refused_in_one_line(tmp_path):
  """Two real runs: A trains; B (--resume, as a requeue script or a second
  terminal would start it) is refused before it compiles, naming A's pid,
  and A's metrics hold A's steps only; A, stopped by SIGTERM, saves and
  exits 143 and its lock goes with it."""
  run_dir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "examples.pretrain",
             *fast_overrides(run_dir, "train.steps=400", "train.checkpoint_every=2")]
  first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=REPO, env=env)
  try:
    for line in first.stdout:
      if line.startswith("step 3/"):
        break
    second = subprocess.run([*command, "--resume"], capture_output=True, text=True, cwd=REPO,
                            env=env, timeout=120)
    first.send_signal(signal.SIGTERM)
    rest, _ = first.communicate(timeout=120)
  finally:
    first.kill()
  assert second.returncode == 2, second.stdout + second.stderr
  assert second.stderr == (f"pretrain.py: error: {run_dir.resolve()} is in use by another run "
                           f"(host {socket.gethostname()}, pid {first.pid}, since "
                           + second.stderr.split(", since ")[1]), second.stderr
  assert len(second.stderr.splitlines()) == 1 and "compiling" not in second.stdout
  assert first.returncode == 143, rest
  metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(line)["step"] for line in metrics]
  assert steps == list(range(1, steps[-1] + 1))
  assert not (run_dir / LOCK_NAME).exists()


def test_a_lock_left_by_this_very_process_is_taken_over(tmp_path):
  """An earlier call in this process that ended by an exception (ablate's
  variants, a test) left its lock: this process's pid is alive, but the lock
  is no other run's, so the next call takes it."""
  lock = write_lock(tmp_path / "run", pid=os.getpid())
  assert run_lock.holder_if_live(lock) is None
  lock_run_dir(tmp_path / "run")
  try:
    assert json.loads(lock.read_text())["pid"] == os.getpid()
  finally:
    release_run_dir(tmp_path / "run")
  assert not lock.exists()
