"""Starts one command as N cooperating JAX processes on this machine.

    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 2 -- \\
        python -m examples.pretrain
    python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 -- python ...

Each child gets the environment :mod:`moe_ep.distributed` reads (a free
loopback port for the coordinator); its output comes back (with a ``[pN]``
prefix when echoed) less Gloo's connection notice. If a child fails, the
others are killed and its output tail (the traceback) is reported, naming
any process that stopped responding.

A job has no deadline unless ``--timeout`` gives one. The deadline, a
SIGHUP (a closed terminal, a dropped ssh session), a SIGTERM (a scheduler's
time limit or preemption), a SIGINT (Ctrl-C) to the launcher, and a child
that stops on its own signal (exit 143 or 130: one worker preempted) all
take one path: every child still running gets SIGTERM (examples/pretrain.py
saves a checkpoint and exits 143), ``--grace`` seconds to exit, and then
SIGKILL. The launcher's exit code tells a requeue script what happened
(:func:`exit_code`): 143 stopped and saved (SIGTERM, SIGHUP, the deadline, a
preempted worker), 130 interrupted (SIGINT), 137 a child had to be killed
after the grace period, a failing child's own code otherwise (128 + N for a
child killed by signal N), 2 bad flags.
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


# Signals the launcher catches and turns into a SIGTERM to every child.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A child that exits with one of these stopped on that signal (a preempted
# worker that saved): the job stops as if the launcher had received it.
_STOPPED_CODES = {128 + signal.SIGTERM: signal.SIGTERM, 128 + signal.SIGINT: signal.SIGINT,
                  -signal.SIGTERM: signal.SIGTERM, -signal.SIGINT: signal.SIGINT}
# The launcher's exit code when a child had to be killed after the grace period.
KILLED_EXIT_CODE = 128 + signal.SIGKILL


def shell_code(returncode: int) -> int:
  """A child's exit status as a shell reports it (killed by signal N: 128 + N)."""
  return 128 - returncode if returncode < 0 else returncode


class LaunchError(RuntimeError):
  """A child failed; the message holds the output tail. ``exit_code`` is the
  failing child's own (:func:`shell_code`)."""

  def __init__(self, message: str, exit_code: int = 1):
    super().__init__(message)
    self.exit_code = exit_code


class LaunchStopped(LaunchError):
  """The job was stopped (a signal to the launcher, the deadline, or a child
  that stopped on its own signal): every child got SIGTERM and the grace
  period. ``reason`` is ``"SIGINT"``, ``"SIGTERM"``, ``"SIGHUP"`` or
  ``"deadline"``; ``exit_code`` is 130 (SIGINT) or 143 (the others) where
  every child exited by itself with 0, 130 or 143, :data:`KILLED_EXIT_CODE`
  where one had to be killed, else the first other child's own code. The
  message says which processes exited and which were killed."""

  def __init__(self, message: str, reason: str, exit_code: int):
    super().__init__(message, exit_code)
    self.reason = reason


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
      try:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
      except (OSError, ValueError):
        # The terminal went away (SIGHUP): keep draining the child's pipe,
        # which would otherwise fill and block the child while it saves.
        echo = False
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
    if argument == "timeout_s" and value is None:
      continue
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
        or not 0 < value < math.inf):
      raise ValueError(f"{name(argument)}={value!r} must be a finite number of seconds > 0")
  if cpu_devices_per_process is not None and gpus_per_process is not None:
    raise ValueError(f"give {name('cpu_devices_per_process')} or "
                     f"{name('gpus_per_process')}, not both")


class _SignalForwarding:
  """Within ``with`` (from the main thread only), :data:`STOP_SIGNALS` are
  recorded for the launcher's wait loop instead of ending the launcher."""

  def __init__(self, enabled: bool):
    self.enabled = enabled and threading.current_thread() is threading.main_thread()
    self.received: list[int] = []
    self.previous = {}

  def _handle(self, signum, frame):
    self.received.append(signum)

  def __enter__(self):
    if self.enabled:
      for signum in STOP_SIGNALS:
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
        + f"; last output:\n{self.tail(blamed)}", shell_code(codes[blamed]))

  def stopped_child(self) -> int | None:
    """The first child that exited on its own SIGTERM or SIGINT (a preempted
    worker), or None."""
    codes = self.codes()
    return next((pid for pid in self.exit_order if codes[pid] in _STOPPED_CODES), None)

  def stop(self, reason: str, grace_s: float, until=lambda: False,
           lead: str | None = None) -> LaunchStopped:
    """Sends SIGTERM to every child's process group, waits up to ``grace_s``
    for them to save and exit (or for ``until()``: a second signal), then
    kills the rest; the error names what happened and carries the launcher's
    exit code."""
    for pid in self.running():
      _signal_group(self.children[pid], signal.SIGTERM)
    self.wait(grace_s, until=until)
    left, codes = self.running(), self.codes()
    self.end()
    own = [shell_code(code) for pid, code in enumerate(codes)
           if pid not in left and code not in _STOPPED_CODES and code != 0]
    if left:
      outcome = (f"process{'es' * (len(left) > 1)} {', '.join(map(str, left))} did not exit "
                 f"within {grace_s:g}s and {'were' if len(left) > 1 else 'was'} killed")
      exit_code = own[0] if own else KILLED_EXIT_CODE
    else:
      outcome = f"every process exited (codes {', '.join(map(str, codes))})"
      exit_code = own[0] if own else 128 + (signal.SIGINT if reason == "SIGINT"
                                            else signal.SIGTERM)
    return LaunchStopped(f"{lead or reason}: sent SIGTERM to the {self.num_processes} "
                         f"processes; {outcome}", reason, exit_code)

  def results(self) -> list[ChildResult]:
    for pump in self.pumps:
      pump.join(timeout=5)
    return [ChildResult(pid, child.returncode, "".join(self.outputs[pid]))
            for pid, child in enumerate(self.children)]


def launch(command: list[str], num_processes: int, *, timeout_s: float | None = None,
           grace_s: float = DEFAULT_GRACE_S, cpu_devices_per_process: int | None = None,
           gpus_per_process: int | None = None, echo: bool = False, env=None, cwd=None,
           forward_signals: bool = True) -> list[ChildResult]:
  """Runs ``command`` as ``num_processes`` processes and waits for all.

  Returns each child's result when all exit 0. A stop (the module
  docstring: a signal in :data:`STOP_SIGNALS` to this process, when called
  from the main thread with ``forward_signals``; the ``timeout_s`` deadline,
  None: none; a child exiting on its own SIGTERM or SIGINT) sends SIGTERM to
  every child, which gets ``grace_s`` seconds to save and exit.

  Raises:
    ValueError: an argument :func:`check_arguments` refuses.
    LaunchStopped: the job was stopped.
    LaunchError: a child failed (naming it, with its output tail, and any
      process that stopped responding).
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
      deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
      while True:
        if forwarding.received:
          count = len(forwarding.received)
          raise job.stop(signal.Signals(forwarding.received[0]).name, grace_s,
                         until=lambda: len(forwarding.received) > count)
        if time.monotonic() > deadline:
          raise job.stop("deadline", grace_s, until=lambda: bool(forwarding.received))
        stopped = job.stopped_child()
        if stopped is not None:
          code = job.codes()[stopped]
          name = signal.Signals(_STOPPED_CODES[code]).name
          raise job.stop(name, grace_s, until=lambda: bool(forwarding.received),
                         lead=f"process {stopped} of {num_processes} stopped on {name} "
                              f"(exit {code})")
        codes = job.codes()
        if any(code not in (None, 0) for code in codes):
          raise job.failure()
        if all(code == 0 for code in codes):
          return job.results()
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
  parser.add_argument("--timeout", type=float, default=None,
                      help="a deadline in seconds for the whole job, after which it is "
                           "stopped as by SIGTERM (default: none)")
  parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                      help="seconds the processes get to save and exit after the SIGTERM "
                           "a stop sends them (a SIGINT, SIGTERM or SIGHUP to the launcher, "
                           "the deadline, a preempted process) before they are killed")
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
  except LaunchError as error:  # LaunchStopped too
    _report(f"moe_ep.launch: {error}")
    return error.exit_code
  return 0


def _report(message: str) -> None:
  """Prints to stderr; a terminal that went away (SIGHUP) does not turn the
  exit code into a traceback."""
  try:
    print(message, file=sys.stderr, flush=True)
  except (OSError, ValueError):
    pass


if __name__ == "__main__":
  sys.exit(main())
