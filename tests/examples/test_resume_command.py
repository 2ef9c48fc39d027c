"""The resume line a stopped run prints is the whole command, the launcher's
part included when ``moe_ep.launch`` started it."""

import pathlib
import shlex
import subprocess
import sys

import pytest

from tiny_run import REPO
from examples import pretrain
from moe_ep import launch


def test_alone_the_resume_line_is_python_m_the_module_and_its_arguments(monkeypatch):
  monkeypatch.delenv(launch.ENV_LAUNCH_COMMAND, raising=False)
  monkeypatch.chdir(REPO)
  line = pretrain.resume_command(["moe.top_k=1"], pathlib.Path("runs/x"))
  assert shlex.split(line) == ["python", "-m", "examples.pretrain", "moe.top_k=1",
                               "train.run_dir=runs/x", "--resume"]


@pytest.mark.slow  # launches a job
def test_under_the_launcher_the_resume_line_starts_with_its_command_line(tmp_path):
  # The launcher tells its children its own command line; a child's resume
  # line is then the launcher's words followed by the child's.
  child = ("import pathlib; from examples import pretrain; "
           "print(pretrain.resume_command(['moe.top_k=1'], pathlib.Path('runs/x')))")
  done = subprocess.run(
      [sys.executable, "-m", "moe_ep.launch", "--num-processes", "1",
       "--cpu-devices-per-process", "1", "--timeout", "120", "--", sys.executable, "-c", child],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert done.returncode == 0, done.stderr
  (line,) = [line.split("] ", 1)[-1] for line in done.stdout.splitlines() if "--resume" in line]
  assert shlex.split(line) == [
      "python", "-m", "moe_ep.launch", "--num-processes", "1", "--cpu-devices-per-process", "1",
      "--timeout", "120", "--", "python", "-m", "examples.pretrain", "moe.top_k=1",
      "train.run_dir=runs/x", "--resume"]
