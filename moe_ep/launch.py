"""Starts one command as N cooperating JAX processes on this machine.

    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 2 -- \\
        python examples/pretrain.py
    python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 -- python ...

Each child gets the environment :mod:`moe_ep.distributed` reads (a free
loopback port for the coordinator); its output comes back (with a ``[pN]``
prefix when echoed) less Gloo's connection notice. Every wait is bounded: if
a child fails, the others are killed and its output tail (the traceback) is
reported; if the whole job outlives ``timeout_s``, all are killed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from moe_ep import distributed

_TAIL_LINES = 60
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
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  try:
    process.wait(timeout=5)
  except subprocess.TimeoutExpired:
    pass


def launch(command: list[str], num_processes: int, *, timeout_s: float = 600,
           cpu_devices_per_process: int | None = None, gpus_per_process: int | None = None,
           echo: bool = False, env=None, cwd=None) -> list[ChildResult]:
  """Runs ``command`` as ``num_processes`` processes and waits for all.

  Returns each child's result when all exit 0; raises :class:`LaunchError`
  naming the first failing child, with its output tail, otherwise.
  """
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes} must be >= 1")
  port = free_port()
  children, outputs, tails, pumps = [], [], [], []
  try:
    for pid in range(num_processes):
      child = subprocess.Popen(
          command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
          env=child_env(pid, num_processes, port, cpu_devices_per_process=cpu_devices_per_process,
                        gpus_per_process=gpus_per_process, base_env=env),
          start_new_session=True)
      sink, tail = [], collections.deque(maxlen=_TAIL_LINES)
      pump = threading.Thread(target=_pump, args=(child.stdout, sink, tail, f"[p{pid}] ", echo),
                              daemon=True)
      pump.start()
      children.append(child)
      outputs.append(sink)
      tails.append(tail)
      pumps.append(pump)

    deadline = time.monotonic() + timeout_s
    while True:
      codes = [child.poll() for child in children]
      failed = [pid for pid, code in enumerate(codes) if code not in (None, 0)]
      if failed:
        pid = failed[0]
        for child in children:
          _kill(child)
        for pump in pumps:
          pump.join(timeout=5)
        raise LaunchError(f"process {pid} of {num_processes} exited with {codes[pid]}; "
                          f"last output:\n{''.join(tails[pid])}")
      if all(code == 0 for code in codes):
        break
      if time.monotonic() > deadline:
        for child in children:
          _kill(child)
        for pump in pumps:
          pump.join(timeout=5)
        running = [pid for pid, code in enumerate(codes) if code is None]
        raise LaunchError(f"timed out after {timeout_s}s; still running: {running}; "
                          f"last output of process {running[0]}:\n{''.join(tails[running[0]])}")
      time.sleep(0.05)
    for pump in pumps:
      pump.join(timeout=5)
    return [ChildResult(pid, child.returncode, "".join(outputs[pid]))
            for pid, child in enumerate(children)]
  finally:
    for child in children:
      _kill(child)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num-processes", type=int, required=True)
  devices = parser.add_mutually_exclusive_group()
  devices.add_argument("--cpu-devices-per-process", type=int)
  devices.add_argument("--gpus-per-process", type=int)
  parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole job")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="the command, after '--'")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after '--'")
  try:
    launch(command, args.num_processes, timeout_s=args.timeout,
           cpu_devices_per_process=args.cpu_devices_per_process,
           gpus_per_process=args.gpus_per_process, echo=True)
  except LaunchError as error:
    print(f"moe_ep.launch: {error}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
