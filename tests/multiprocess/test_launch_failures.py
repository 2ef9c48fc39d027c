"""moe_ep.launch: a failing child's traceback is reported, the job's
processes do not outlive a failed or timed-out job, and the children's output
comes back without Gloo's connection notices. The children are plain Python
one-liners (one starts JAX), so these tests take a few seconds."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from moe_ep.launch import LaunchError, is_noise, launch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

# Each child starts a grandchild (`sleep`, its output detached), writes
# "<its pid> <its grandchild's pid>" to <dir>/<process id>; then process
# FAILING_ID, once every child has written, raises while the others sleep.
CHILD = """
import os, subprocess, sys, time
out_dir, failing_id = sys.argv[1], sys.argv[2]
process_id = os.environ["MOE_EP_PROCESS_ID"]
num_processes = int(os.environ["MOE_EP_NUM_PROCESSES"])
grandchild = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
partial = os.path.join(out_dir, process_id + ".partial")
with open(partial, "w") as f:
  f.write(f"{os.getpid()} {grandchild.pid}")
os.rename(partial, os.path.join(out_dir, process_id))
if process_id == failing_id:
  deadline = time.monotonic() + 30
  while len(os.listdir(out_dir)) < num_processes and time.monotonic() < deadline:
    time.sleep(0.01)
  raise RuntimeError("child " + process_id + " failed on purpose")
time.sleep(600)
"""
NO_FAILURE = "-1"


def is_gone(pid: int, wait_s: float = 2.0) -> bool:
  """Whether ``pid`` has exited (a zombie awaiting its parent's reaping counts
  as exited), polling for up to ``wait_s`` while a kill takes effect."""
  deadline = time.monotonic() + wait_s
  while True:
    try:
      stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
      return True
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
      return True
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)


@pytest.fixture
def failed_job(tmp_path, request):
  """Runs CHILD as a job that must fail; yields ``(error, seconds, pids)``
  with ``pids[process_id] = (child pid, grandchild pid)``, and afterwards
  kills whatever of those the launcher left running."""
  num_processes, failing_id, timeout_s = request.param
  start = time.monotonic()
  with pytest.raises(LaunchError) as error:
    launch([sys.executable, "-c", CHILD, str(tmp_path), failing_id], num_processes,
           timeout_s=timeout_s)
  seconds = time.monotonic() - start
  files = [tmp_path / str(i) for i in range(num_processes)]
  pids = [tuple(int(p) for p in f.read_text().split()) if f.exists() else () for f in files]
  yield error.value, seconds, pids
  for pid in (p for pair in pids for p in pair):
    if not is_gone(pid, wait_s=0):
      os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("failed_job", [(3, "1", 120)], indirect=True)
def test_failing_child_reports_its_traceback_and_the_others_are_killed(failed_job):
  error, seconds, pids = failed_job
  message = str(error)
  assert "process 1 of 3 exited with 1" in message
  assert "Traceback (most recent call last)" in message
  assert "RuntimeError: child 1 failed on purpose" in message
  assert seconds < 60, "the sleeping children must be killed, not waited for"
  for process_id in (0, 2):
    assert pids[process_id], f"process {process_id} never started"
    for pid in pids[process_id]:
      assert is_gone(pid), f"pid {pid} of process {process_id} outlived the failed job"


@pytest.mark.parametrize("failed_job", [(2, "1", 120)], indirect=True)
def test_failing_childs_own_subprocesses_are_killed(failed_job):
  _, _, pids = failed_job
  _, grandchild = pids[1]
  assert is_gone(grandchild), f"pid {grandchild} (process 1's child) outlived the failed job"


@pytest.mark.parametrize("failed_job", [(2, NO_FAILURE, 3)], indirect=True)
def test_hanging_job_is_killed_at_the_timeout(failed_job):
  error, seconds, pids = failed_job
  assert "timed out after 3s; still running: [0, 1]" in str(error)
  assert seconds < 30
  for process_id, pair in enumerate(pids):
    assert pair, f"process {process_id} never started within the timeout"
    for pid in pair:
      assert is_gone(pid), f"pid {pid} of process {process_id} outlived the timeout"


# Gathers each process's index + 1 over gloo: the first cross-process
# collective connects the processes, where Gloo prints its notice.
GLOO_CHILD = """
import jax, numpy as np
from jax.experimental import multihost_utils
from moe_ep import distributed
distributed.initialize_from_env()
print("total", int(multihost_utils.process_allgather(np.array([jax.process_index() + 1])).sum()))
"""
# Verbatim from jaxlib 0.10.2 (std::cout in its gloo; 0.11.2 has the same text).
GLOO_NOTICE = ("[Gloo] Rank 1 is connected to 1 peer ranks. "
               "Expected number of connected peer ranks is : 1\n")


def test_gloo_notice_is_noise_only_when_every_peer_connected():
  assert is_noise(GLOO_NOTICE)
  assert is_noise(GLOO_NOTICE.rstrip("\n"))
  assert not is_noise(GLOO_NOTICE.replace("connected to 1", "connected to 0"))
  assert not is_noise("step 10/100 | [Gloo] Rank 1 is connected to 1 peer ranks.\n")
  assert not is_noise("total 3\n")


def test_two_process_cpu_job_output_has_no_gloo_lines():
  results = launch([sys.executable, "-c", GLOO_CHILD], 2, timeout_s=120,
                   cpu_devices_per_process=1)
  for result in results:
    assert "total 3" in result.output, result.output  # the gloo collective ran
    assert "Gloo" not in result.output, result.output
