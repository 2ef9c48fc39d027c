"""Starts one command as N cooperating JAX processes on this machine.

    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 2 -- \\
        python -m examples.pretrain
    python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 -- python ...

Each child gets the environment :mod:`moe_ep.distributed` reads (a free
loopback port for the coordinator); its output comes back (with a ``[pN]``
prefix when echoed) less Gloo's connection notice. Every wait is bounded: if
a child fails, the others are killed and its output tail (the traceback) is
reported, naming any process that stopped responding; if the whole job
outlives ``timeout_s``, all are killed. A SIGINT (Ctrl-C) or SIGTERM (a
scheduler's time limit) to the launcher is passed to every child, which gets
``--grace`` seconds to save a checkpoint and exit before it is killed; the
launcher then exits with 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from moe_ep import distributed

_TAIL_LINES = 60
_POLL_S = 0.05
# After a child fails, how long the others get to exit on their own before
# the report chooses which one to show.
_SETTLE_S = 2.0
# Seconds the children get to save and exit after a forwarded signal.
DEFAULT_GRACE_S = 60.0
# The launcher's own command line up to the launched command, for the
# children: a resume line they print is then the whole command.
ENV_LAUNCH_COMMAND = "MOE_EP_LAUNCH_COMMAND"
# A frame of a C++ stack trace ("    @     0x7f6a...  symbol") and its heading.
_STACK_FRAME = re.compile(r"\s*(@\s+0x[0-9a-f]+|\*\*\* Check failure stack trace)")
# JAX's coordination service naming tasks (= process ids) that went silent.
_NO_HEARTBEATS = re.compile(r"stopped sending heartbeats\):\s*\n((?:\s*\d+\s*\n)+)")
# Gloo (the CPU collectives of jaxlib 0.10 and 0.11) writes this line to stdout
# with std::cout when a process connects to its peers; no environment variable
# or logging setting silences it. The launcher drops it where every peer
# connected, and keeps it where some did not (a hint when a job hangs).
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)\n?")


def is_noise(line: str) -> bool:
  """Whether ``line`` of a child's output is Gloo's all-connected notice."""
  match = _GLOO_CONNECTED.fullmatch(line)
  return match is not None and match[1] == match[2]


class LaunchError(RuntimeError):
  """A child failed or the job timed out; the message holds the output tail."""


class LaunchStopped(LaunchError):
  """A SIGINT or SIGTERM to the launcher, passed to the children, ended the
  job; ``signum`` is the signal. The message says which processes exited
  and which were killed after the grace period."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


@dataclasses.dataclass
class ChildResult:
  process_id: int
  returncode: int
  output: str  # everything the child printed (stdout and stderr interleaved)


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def child_env(process_id: int, num_processes: int, port: int, *,
              cpu_devices_per_process: int | None = None,
              gpus_per_process: int | None = None, base_env=None) -> dict:
  """The environment of child ``process_id``."""
  env = dict(os.environ if base_env is None else base_env)
  env.update({
      distributed.ENV_NUM_PROCESSES: str(num_processes),
      distributed.ENV_PROCESS_ID: str(process_id),
      distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
      "NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off on shared hosts
      "PYTHONUNBUFFERED": "1",
  })
  if cpu_devices_per_process is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={cpu_devices_per_process}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
  if gpus_per_process is not None:
    first = process_id * gpus_per_process
    env[distributed.ENV_LOCAL_DEVICE_IDS] = ",".join(
        str(i) for i in range(first, first + gpus_per_process))
  return env


def _pump(stream, sink: list, tail: collections.deque, prefix: str, echo: bool):
  for line in iter(stream.readline, ""):
    if is_noise(line):
      continue
    sink.append(line)
    tail.append(line)
    if echo:
      sys.stdout.write(prefix + line)
      sys.stdout.flush()
  stream.close()


def _kill(process: subprocess.Popen) -> None:
  """Kills the child's whole process group (its own subprocesses too, even
  after the child itself exited) and reaps it."""
  _signal_group(process, signal.SIGKILL)
  try:
    process.wait(timeout=5)
  except subprocess.TimeoutExpired:
    pass


def _signal_group(process: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(process.pid, signum)
  except (ProcessLookupError, PermissionError):
    pass


def _is_stopped(pid: int) -> bool:
  """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP; not a debugger's
  tracing stop); False where /proc cannot tell."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return False
  return stat.rsplit(")", 1)[1].split()[0] == "T"


def _readable_tail(lines) -> str:
  """A child's last lines less the addresses of a C++ stack trace (XLA's
  fatal errors print one; the line above it says what happened)."""
  return "".join(line for line in lines if not _STACK_FRAME.match(line))


# The command-line flag of each launch() argument, for check_arguments' errors.
_FLAGS = {"num_processes": "--num-processes", "timeout_s": "--timeout", "grace_s": "--grace",
          "cpu_devices_per_process": "--cpu-devices-per-process",
          "gpus_per_process": "--gpus-per-process"}


def check_arguments(num_processes, *, timeout_s, grace_s, cpu_devices_per_process=None,
                    gpus_per_process=None, as_flags: bool = False) -> None:
  """Raises ValueError naming the first argument :func:`launch` cannot use
  (as its command-line flag where ``as_flags``)."""
  name = lambda argument: _FLAGS[argument] if as_flags else argument  # noqa: E731
  for argument, value in (("num_processes", num_processes),
                          ("cpu_devices_per_process", cpu_devices_per_process),
                          ("gpus_per_process", gpus_per_process)):
    if value is None and argument != "num_processes":
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name(argument)}={value!r} must be an integer >= 1")
  for argument, value in (("timeout_s", timeout_s), ("grace_s", grace_s)):
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
        or not 0 < value < math.inf):
      raise ValueError(f"{name(argument)}={value!r} must be a finite number of seconds > 0")
  if cpu_devices_per_process is not None and gpus_per_process is not None:
    raise ValueError(f"give {name('cpu_devices_per_process')} or "
                     f"{name('gpus_per_process')}, not both")


class _SignalForwarding:
  """Within ``with`` (from the main thread only), SIGINT and SIGTERM are
  recorded for the launcher's wait loop instead of ending the launcher."""

  def __init__(self, enabled: bool):
    self.enabled = enabled and threading.current_thread() is threading.main_thread()
    self.received: list[int] = []
    self.previous = {}

  def _handle(self, signum, frame):
    self.received.append(signum)

  def __enter__(self):
    if self.enabled:
      for signum in (signal.SIGINT, signal.SIGTERM):
        self.previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)
    return False


class _Job:
  """The running children of one :func:`launch`, their output and exit order."""

  def __init__(self, command, num_processes: int, env_for, cwd, echo: bool):
    self.num_processes = num_processes
    self.children, self.outputs, self.tails, self.pumps = [], [], [], []
    self.exit_order: list[int] = []
    for pid in range(num_processes):
      child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=cwd, env=env_for(pid), start_new_session=True)
      sink, tail = [], collections.deque(maxlen=_TAIL_LINES)
      pump = threading.Thread(target=_pump, args=(child.stdout, sink, tail, f"[p{pid}] ", echo),
                              daemon=True)
      pump.start()
      self.children.append(child)
      self.outputs.append(sink)
      self.tails.append(tail)
      self.pumps.append(pump)

  def codes(self) -> list[int | None]:
    """Each child's exit code (None: running); notes the order they exit in."""
    codes = [child.poll() for child in self.children]
    self.exit_order += [pid for pid, code in enumerate(codes)
                        if code is not None and pid not in self.exit_order]
    return codes

  def running(self) -> list[int]:
    return [pid for pid, code in enumerate(self.codes()) if code is None]

  def wait(self, seconds: float, until=lambda: False) -> None:
    """Waits up to ``seconds`` for every child to exit, or for ``until()``."""
    deadline = time.monotonic() + seconds
    while self.running() and time.monotonic() < deadline and not until():
      time.sleep(_POLL_S)

  def end(self) -> None:
    """Kills every child's process group and collects the rest of their output."""
    for child in self.children:
      _kill(child)
    for pump in self.pumps:
      pump.join(timeout=5)

  def tail(self, pid: int) -> str:
    return _readable_tail(self.tails[pid])

  def unresponsive(self) -> list[int]:
    """Processes that stopped responding: stopped ones still running, and
    those JAX's coordination service names as no longer sending heartbeats."""
    named = {int(task) for lines in self.tails
             for match in _NO_HEARTBEATS.finditer("".join(lines))
             for task in match[1].split()}
    stopped = {pid for pid in self.running() if _is_stopped(self.children[pid].pid)}
    return sorted(stopped | (named & set(range(self.num_processes))))

  def failure(self) -> LaunchError:
    """The error of a job in which a child failed: it names the process that
    stopped responding, if one did, and the failed process whose output
    tells most (the first to exit that printed anything)."""
    # Children often fail together (one bad config, one lost peer): a moment
    # lets them all exit, so the report can choose.
    self.wait(_SETTLE_S)
    codes = self.codes()
    failed = [pid for pid in self.exit_order if codes[pid] != 0]
    unresponsive = self.unresponsive()
    self.end()
    blamed = next((pid for pid in failed if self.tail(pid).strip()), failed[0])
    others = [f"process {pid} with {codes[pid]}" for pid in failed if pid != blamed]
    lead = ""
    if unresponsive:
      lead = (f"process{'es' * (len(unresponsive) > 1)} {', '.join(map(str, unresponsive))} "
              f"of {self.num_processes} stopped responding; ")
    return LaunchError(
        f"{lead}process {blamed} of {self.num_processes} exited with {codes[blamed]}"
        + (f" (also failed: {', '.join(others)})" if others else "")
        + f"; last output:\n{self.tail(blamed)}")

  def stop(self, forwarding: _SignalForwarding, grace_s: float) -> LaunchStopped:
    """Passes the received signal to every child's process group, waits up to
    ``grace_s`` for them to save and exit (a second signal ends the wait),
    then kills the rest, naming them."""
    signum = forwarding.received[0]
    name = signal.Signals(signum).name
    for child in self.children:
      _signal_group(child, signum)
    self.wait(grace_s, until=lambda: len(forwarding.received) > 1)
    left, codes = self.running(), self.codes()
    self.end()
    if left:
      outcome = (f"process{'es' * (len(left) > 1)} {', '.join(map(str, left))} did not exit "
                 f"within {grace_s:g}s and {'were' if len(left) > 1 else 'was'} killed")
    else:
      outcome = f"every process exited (codes {', '.join(map(str, codes))})"
    return LaunchStopped(f"{name}: passed it to the {self.num_processes} processes; {outcome}",
                         signum)

  def results(self) -> list[ChildResult]:
    for pump in self.pumps:
      pump.join(timeout=5)
    return [ChildResult(pid, child.returncode, "".join(self.outputs[pid]))
            for pid, child in enumerate(self.children)]


def launch(command: list[str], num_processes: int, *, timeout_s: float = 600,
           grace_s: float = DEFAULT_GRACE_S, cpu_devices_per_process: int | None = None,
           gpus_per_process: int | None = None, echo: bool = False, env=None, cwd=None,
           forward_signals: bool = True) -> list[ChildResult]:
  """Runs ``command`` as ``num_processes`` processes and waits for all.

  Returns each child's result when all exit 0. Called from the main thread
  (and ``forward_signals``), a SIGINT or SIGTERM to this process is passed to
  every child, which gets ``grace_s`` seconds to save and exit.

  Raises:
    ValueError: an argument :func:`check_arguments` refuses.
    LaunchError: a child failed (naming it, with its output tail, and any
      process that stopped responding) or the job outlived ``timeout_s``.
    LaunchStopped: a forwarded signal ended the job.
  """
  check_arguments(num_processes, timeout_s=timeout_s, grace_s=grace_s,
                  cpu_devices_per_process=cpu_devices_per_process,
                  gpus_per_process=gpus_per_process)
  port = free_port()
  env_for = lambda pid: child_env(pid, num_processes, port,  # noqa: E731
                                  cpu_devices_per_process=cpu_devices_per_process,
                                  gpus_per_process=gpus_per_process, base_env=env)
  with _SignalForwarding(forward_signals) as forwarding:
    job = _Job(command, num_processes, env_for, cwd, echo)
    try:
      deadline = time.monotonic() + timeout_s
      while True:
        if forwarding.received:
          raise job.stop(forwarding, grace_s)
        codes = job.codes()
        if any(code not in (None, 0) for code in codes):
          raise job.failure()
        if all(code == 0 for code in codes):
          return job.results()
        if time.monotonic() > deadline:
          running = job.running()
          job.end()
          raise LaunchError(f"timed out after {timeout_s:g}s; still running: {running}; "
                            f"last output of process {running[0]}:\n{job.tail(running[0])}")
        time.sleep(_POLL_S)
    finally:
      job.end()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m moe_ep.launch",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--num-processes", type=int, required=True)
  devices = parser.add_mutually_exclusive_group()
  devices.add_argument("--cpu-devices-per-process", type=int)
  devices.add_argument("--gpus-per-process", type=int)
  parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole job")
  parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                      help="seconds the processes get to save and exit after a SIGINT or "
                           "SIGTERM to the launcher (passed on to them) before they are killed")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="the command, after '--'")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after '--'")
  words = sys.argv[1:] if argv is None else list(argv)
  os.environ[ENV_LAUNCH_COMMAND] = shlex.join(
      ["python", "-m", "moe_ep.launch", *words[:len(words) - len(command)]])
  try:
    check_arguments(args.num_processes, timeout_s=args.timeout, grace_s=args.grace,
                    cpu_devices_per_process=args.cpu_devices_per_process,
                    gpus_per_process=args.gpus_per_process, as_flags=True)
  except ValueError as error:
    parser.exit(2, f"moe_ep.launch: error: {error}\n")
  try:
    launch(command, args.num_processes, timeout_s=args.timeout, grace_s=args.grace,
           cpu_devices_per_process=args.cpu_devices_per_process,
           gpus_per_process=args.gpus_per_process, echo=True)
  except LaunchStopped as stopped:
    print(f"moe_ep.launch: {stopped}", file=sys.stderr)
    return 128 + stopped.signum
  except LaunchError as error:
    print(f"moe_ep.launch: {error}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
