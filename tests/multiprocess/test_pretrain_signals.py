"""examples/pretrain.py as a 2-process job (2 x 4 CPU devices) under
``python -m moe_ep.launch``: SIGHUP to the launcher (a closed terminal or a
dropped ssh session; a scheduler's SIGTERM and the deadline take the same
path) reaches both processes as SIGTERM; they stop at the same step, save it
together and exit 143, and so does the launcher; ``--resume`` then continues
the job from that step, each process restoring (and verifying) its shards."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import background

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "examples"))
from tiny_run import fast_overrides  # noqa: E402

STEPS = 400  # far more than run before the signal
STOP_AFTER = 3  # the signal is sent once process 0 has printed this step


def launcher_command(run_dir: pathlib.Path, *extra) -> list[str]:
  return [sys.executable, "-m", "moe_ep.launch", "--num-processes", "2",
          "--cpu-devices-per-process", "4", "--timeout", "300", "--",
          sys.executable, "-m", "examples.pretrain",
          *fast_overrides(run_dir, f"train.steps={STEPS}", "train.checkpoint_every=1000"),
          *extra]


def sighup_then_resume() -> dict:
  """Runs the job, SIGHUPs the launcher after step STOP_AFTER, then resumes
  it for two more steps; returns what the tests check."""
  run_dir = pathlib.Path(tempfile.mkdtemp(prefix="moe_ep_sigterm_")) / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  launcher = subprocess.Popen(launcher_command(run_dir), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
  lines = []
  for line in launcher.stdout:
    lines.append(line)
    if line.startswith(f"[p0] step {STOP_AFTER}/"):
      launcher.send_signal(signal.SIGHUP)
      break
  rest, err = launcher.communicate(timeout=240)
  stopped = {"code": launcher.returncode, "out": "".join(lines) + rest, "err": err,
             "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
             "summary": json.loads((run_dir / "summary.json").read_text())}
  step = stopped["summary"]["steps"]
  resumed = subprocess.run(launcher_command(run_dir, f"train.steps={step + 2}", "--resume"),
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  return {"stopped": stopped, "resumed": resumed, "run_dir": run_dir, "step": step,
          "metrics": [json.loads(line) for line in
                      (run_dir / "metrics.jsonl").read_text().splitlines()]}


def background_jobs(item) -> dict:
  return {"sighup": sighup_then_resume}


@pytest.fixture(scope="module")
def job():
  return background.result("sighup", sighup_then_resume)


def test_sighup_stops_both_processes_at_one_step_and_saves_it(job):
  stopped, step = job["stopped"], job["step"]
  assert stopped["code"] == 143, stopped["out"][-3000:] + stopped["err"][-3000:]
  assert stopped["err"].endswith("moe_ep.launch: SIGHUP: sent SIGTERM to the 2 processes; "
                                 "every process exited (codes 143, 143)\n"), stopped["err"]
  assert STOP_AFTER <= step < STEPS
  assert re.search(rf"^\[p0\] stopped by SIGTERM at step {step}: saved a checkpoint; resume "
                   r"with: python .*--resume$", stopped["out"], re.M), stopped["out"][-3000:]
  assert stopped["checkpoints"] == [str(step)]
  assert stopped["summary"]["interrupted"] is True


def test_the_job_resumes_from_the_saved_step(job):
  resumed, step = job["resumed"], job["step"]
  output = resumed.stdout[-3000:] + resumed.stderr[-3000:]
  assert resumed.returncode == 0, output
  assert f"[p0] resuming {job['run_dir']} from step {step} with train.steps {STEPS} -> " \
         f"{step + 2}" in resumed.stdout, output
  assert [r["step"] for r in job["metrics"]] == list(range(1, step + 3)), output
  assert sorted((p.name for p in (job["run_dir"] / "checkpoints").iterdir()), key=int) == [
      str(step), str(step + 2)], output
  assert [p.name for p in sorted(job["run_dir"].glob("config*.yaml"))] == [
      "config.resume-1.yaml", "config.yaml"], output
