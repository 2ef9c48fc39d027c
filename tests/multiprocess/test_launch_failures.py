"""moe_ep.launch: a failing child's traceback is reported (from the child
that said why, naming a process that stopped responding), the job's
processes do not outlive a failed, stopped or signalled job; SIGINT,
SIGTERM, SIGHUP, the deadline and a child preempted on its own all send
SIGTERM to the children (killed after the grace period) and give the exit
code a requeue script reads (143 saved, 130 interrupted, 137 killed, a
failing child's own); bad arguments are refused up front, and the
children's output comes back without Gloo's connection notices. The
children are plain Python one-liners (one starts JAX), so these tests take
a few seconds."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_ep.launch import LaunchError, LaunchStopped, is_noise, launch
from moe_ep.launch import main as launch_main

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
  """Runs CHILD as a job that must fail or be stopped; yields ``(error,
  seconds, pids)`` with ``pids[process_id] = (child pid, grandchild pid)``,
  and afterwards kills whatever of those the launcher left running."""
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
def test_a_job_past_its_deadline_is_stopped_with_its_subprocesses(failed_job):
  error, seconds, pids = failed_job
  # CHILD has no SIGTERM handler: the forwarded SIGTERM ends it (-15).
  assert isinstance(error, LaunchStopped) and error.reason == "deadline"
  assert str(error) == ("deadline: sent SIGTERM to the 2 processes; every process exited "
                        "(codes -15, -15)")
  assert error.exit_code == 143
  assert 3 <= seconds < 30
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


@pytest.mark.parametrize("arguments, message", [
    (dict(num_processes=0), "num_processes=0 must be an integer >= 1"),
    (dict(num_processes=2.0), "num_processes=2.0 must be an integer >= 1"),
    (dict(cpu_devices_per_process=0), "cpu_devices_per_process=0 must be an integer >= 1"),
    (dict(gpus_per_process=0), "gpus_per_process=0 must be an integer >= 1"),
    (dict(timeout_s=0), "timeout_s=0 must be a finite number of seconds > 0"),
    (dict(timeout_s=-1), "timeout_s=-1 must be a finite number of seconds > 0"),
    (dict(timeout_s=float("inf")), "timeout_s=inf must be a finite number of seconds > 0"),
    (dict(grace_s=float("nan")), "grace_s=nan must be a finite number of seconds > 0"),
    (dict(cpu_devices_per_process=1, gpus_per_process=1),
     "give cpu_devices_per_process or gpus_per_process, not both"),
])
def test_bad_launch_arguments_are_refused_before_anything_starts(arguments, message, tmp_path):
  marker = tmp_path / "started"
  arguments = {"num_processes": 2, **arguments}
  with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
    launch([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], **arguments)
  assert not marker.exists()


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "0"], "--num-processes=0 must be an integer >= 1"),
    (["--num-processes", "2", "--cpu-devices-per-process", "0"],
     "--cpu-devices-per-process=0 must be an integer >= 1"),
    (["--num-processes", "2", "--timeout", "0"], "--timeout=0.0 must be a finite number"),
    (["--num-processes", "2", "--timeout", "-1"], "--timeout=-1.0 must be a finite number"),
    (["--num-processes", "2", "--grace", "nan"], "--grace=nan must be a finite number"),
])
def test_bad_launcher_flags_are_one_line(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    launch_main([*flags, "--", sys.executable, "-c", "pass"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and err.startswith(f"moe_ep.launch: error: {message}")
  assert len(err.splitlines()) == 1


def test_a_failed_job_exits_with_the_failing_childs_code_and_its_report(capsys):
  code = launch_main(["--num-processes", "2", "--", sys.executable, "-c",
                      "import sys; print('bad input'); sys.exit(3)"])
  err = capsys.readouterr().err
  assert code == 3 and "exited with 3" in err and "bad input" in err


def test_the_launcher_has_no_deadline_by_default():
  """A job that runs past the old one-hour default is not stopped: the
  parsed default is None, and launch() keeps a None deadline (a sleeping
  child finishes on its own)."""
  results = launch([sys.executable, "-c", "import time; time.sleep(1.5)"], 2)
  assert [r.returncode for r in results] == [0, 0]
  import inspect
  assert inspect.signature(launch).parameters["timeout_s"].default is None


# Process 0 prints what went wrong, a moment after the others exit silently
# (as examples/pretrain.py's processes do on a config error: process 0 prints).
SILENT_OTHERS = """
import os, sys, time
if os.environ["MOE_EP_PROCESS_ID"] == "0":
  time.sleep(0.5)
  print("error: train.batch_size=8 must be divisible by the 3 devices")
sys.exit(2)
"""


def test_the_report_shows_the_failed_process_that_said_why():
  with pytest.raises(LaunchError) as error:
    launch([sys.executable, "-c", SILENT_OTHERS], 3, timeout_s=60)
  message = str(error.value)
  assert message.startswith("process 0 of 3 exited with 2 (also failed: process ")
  assert re.search(r"also failed: process [12] with 2, process [12] with 2\)", message)
  assert message.endswith("error: train.batch_size=8 must be divisible by the 3 devices\n")


# Each child marks itself ready (its pid), then waits; SIGTERM or SIGINT makes
# it write the signal's number (its "checkpoint") and exit with 128 + it,
# except process IGNORING, which ignores them.
TRAPPING_CHILD = """
import os, signal, sys, time
out_dir, ignoring = sys.argv[1], sys.argv[2]
process_id = os.environ["MOE_EP_PROCESS_ID"]
def save_and_exit(signum, frame):
  with open(os.path.join(out_dir, process_id + ".saved"), "w") as f:
    f.write(str(signum))
  sys.exit(128 + signum)
for signum in (signal.SIGINT, signal.SIGTERM):
  signal.signal(signum, signal.SIG_IGN if process_id == ignoring else save_and_exit)
with open(os.path.join(out_dir, process_id + ".partial"), "w") as f:
  f.write(str(os.getpid()))
os.rename(os.path.join(out_dir, process_id + ".partial"), os.path.join(out_dir, process_id))
time.sleep(600)
"""


def trapping_job(tmp_path, *flags, ignoring: str = NO_FAILURE, grace_s: float = 30,
                 stop=lambda launcher, pids: None):
  """Runs ``python -m moe_ep.launch`` with 2 TRAPPING_CHILD processes and
  calls ``stop(launcher, child pids)`` once both are ready; returns ``(exit
  code, stderr, seconds from the stop to the launcher's exit, child pids)``."""
  launcher = subprocess.Popen(
      [sys.executable, "-m", "moe_ep.launch", "--num-processes", "2", "--grace", str(grace_s),
       *flags, "--", sys.executable, "-c", TRAPPING_CHILD, str(tmp_path), ignoring],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  while not all((tmp_path / str(i)).exists() for i in (0, 1)):
    assert time.monotonic() < deadline and launcher.poll() is None, "the children never started"
    time.sleep(0.05)
  pids = [int((tmp_path / str(i)).read_text()) for i in (0, 1)]
  start = time.monotonic()
  stop(launcher, pids)
  _, err = launcher.communicate(timeout=grace_s + 60)
  return launcher.returncode, err, time.monotonic() - start, pids


def signal_launcher(tmp_path, signum, **kwargs):
  return trapping_job(tmp_path, stop=lambda launcher, pids: launcher.send_signal(signum),
                      **kwargs)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 143),
                                          (signal.SIGINT, 130)], ids=lambda s: str(s))
def test_a_signal_to_the_launcher_becomes_sigterm_to_every_child(tmp_path, signum, code):
  """SIGHUP (a closed terminal) no longer leaves the children running: like
  SIGTERM and SIGINT it reaches them as SIGTERM, they save, and the exit
  code says 143 (stopped, saved) or 130 (interrupted)."""
  exit_code, err, _, pids = signal_launcher(tmp_path, signum)
  name = signal.Signals(signum).name
  assert exit_code == code, err
  assert err == (f"moe_ep.launch: {name}: sent SIGTERM to the 2 processes; every process "
                 f"exited (codes 143, 143)\n")
  for process_id in (0, 1):
    assert (tmp_path / f"{process_id}.saved").read_text() == str(int(signal.SIGTERM))
    assert is_gone(pids[process_id])


def test_the_deadline_stops_the_job_the_same_way(tmp_path):
  exit_code, err, _, pids = trapping_job(tmp_path, "--timeout", "4")
  assert exit_code == 143, err
  assert err == ("moe_ep.launch: deadline: sent SIGTERM to the 2 processes; every process "
                 "exited (codes 143, 143)\n")
  for process_id in (0, 1):
    assert (tmp_path / f"{process_id}.saved").read_text() == str(int(signal.SIGTERM))
    assert is_gone(pids[process_id])


def test_one_preempted_child_stops_the_job_with_143(tmp_path):
  """A scheduler's SIGTERM to one worker: it saves and exits 143; the others
  get SIGTERM, save, and the launcher exits 143, not 1."""
  exit_code, err, _, pids = trapping_job(
      tmp_path, stop=lambda launcher, pids: os.kill(pids[1], signal.SIGTERM))
  assert exit_code == 143, err
  assert err == ("moe_ep.launch: process 1 of 2 stopped on SIGTERM (exit 143): sent SIGTERM to "
                 "the 2 processes; every process exited (codes 143, 143)\n")
  for process_id in (0, 1):
    assert (tmp_path / f"{process_id}.saved").read_text() == str(int(signal.SIGTERM))
    assert is_gone(pids[process_id])


def test_a_child_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path):
  code, err, seconds, pids = signal_launcher(tmp_path, signal.SIGTERM, ignoring="1", grace_s=1)
  assert code == 137
  assert err == ("moe_ep.launch: SIGTERM: sent SIGTERM to the 2 processes; process 1 did not "
                 "exit within 1s and was killed\n")
  assert (tmp_path / "0.saved").exists() and not (tmp_path / "1.saved").exists()
  assert 1 <= seconds < 15
  assert all(is_gone(pid) for pid in pids)


# Process 1 stops itself (as SIGSTOP or a hung node would leave it); process 0
# then dies as JAX does when a peer's heartbeats stop: XLA's fatal log line
# naming the task, and a C++ stack trace.
STOPPED_PEER = """
import os, signal, sys, time
out_dir = sys.argv[1]
if os.environ["MOE_EP_PROCESS_ID"] == "1":
  open(os.path.join(out_dir, "1"), "w").write(str(os.getpid()))
  os.kill(os.getpid(), signal.SIGSTOP)
  time.sleep(600)
while not os.path.exists(os.path.join(out_dir, "1")):
  time.sleep(0.01)
time.sleep(0.3)
print("E1202 coordination_service.cc:1549] The following tasks are unhealthy "
      "(stopped sending heartbeats):\\n1\\nThe tasks have crashed.")
print("F1202 client.h:80] Terminating process because the JAX distributed service "
      "detected fatal errors.")
print("*** Check failure stack trace: ***")
print("    @     0x7f6abaa40634  absl::log_internal::LogMessage::SendToLog()")
print("    @     0x7f6ac22a71f5  (unknown)")
sys.stdout.flush()
os.abort()
"""


def test_a_process_that_stopped_responding_is_named(tmp_path):
  with pytest.raises(LaunchError) as error:
    launch([sys.executable, "-c", STOPPED_PEER, str(tmp_path)], 2, timeout_s=60)
  message = str(error.value)
  assert message.startswith(f"process 1 of 2 stopped responding; process 0 of 2 exited with "
                            f"{-signal.SIGABRT}; last output:\n")
  assert "Terminating process because the JAX distributed service" in message
  assert "0x7f6a" not in message and "stack trace" not in message
  assert is_gone(int((tmp_path / "1").read_text()))
