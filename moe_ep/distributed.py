"""Joining a multi-process JAX job: :mod:`moe_ep.launch`'s on one machine, or
one that a cluster's own launcher started (``srun``, ``mpirun``, a Kubernetes
indexed Job), and which node each process runs on.

The layer itself needs no bootstrap or finalize call and keeps no
process-wide state; programs (the examples, the multi-process tests) call
:func:`initialize_from_env` once at start-up, before any JAX computation.
It joins, in this order:

1. a job of :mod:`moe_ep.launch`, which sets for each process it starts:

   * ``MOE_EP_NUM_PROCESSES``: processes in the job (unset or 1: single process).
   * ``MOE_EP_PROCESS_ID``: this process's index.
   * ``MOE_EP_COORDINATOR``: ``host:port`` of process 0's coordinator.
   * ``MOE_EP_LOCAL_DEVICE_IDS``: optional comma-separated GPU ids this
     process uses (one GPU per process: ``"0"``, ``"1"``, ...).

2. any job that ``jax.distributed.initialize()`` detects with no arguments:
   the cluster environments of the installed JAX (``jax._src.clusters``;
   JAX 0.10 and 0.11 know Open MPI 4 through ``mpirun``, SLURM through
   ``srun``, Cloud TPU and Kubernetes Jobs with ``completionMode: Indexed``
   and the ``kubernetes`` package), with JAX's own rules for the coordinator's
   address and port and for each process's GPUs (SLURM and Open MPI: one GPU
   per process, its local rank, unless ``JAX_LOCAL_DEVICE_IDS`` lists them).
   ``MOE_EP_CLUSTER`` names one of JAX's ``cluster_detection_method`` values
   instead of the first environment found (``mpi4py`` for Open MPI 5, MPICH
   and other MPIs; ``deactivate`` to stay single).

3. otherwise nothing: a single process, no coordinator, no port, no network.

Joining waits a bounded time for every process (``MOE_EP_INIT_TIMEOUT_S``,
default :data:`DEFAULT_INIT_TIMEOUT_S`): a task that never starts, or a wrong
coordinator address or port, ends the wait with one line naming the
coordinator, this process and the variable, and exit code
:data:`INIT_FAILED_EXIT_CODE`, instead of JAX's C++ abort (a CHECK failure
and a stack trace, after its own five-minute default).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
import sys
import threading

import jax

ENV_NUM_PROCESSES = "MOE_EP_NUM_PROCESSES"
ENV_PROCESS_ID = "MOE_EP_PROCESS_ID"
ENV_COORDINATOR = "MOE_EP_COORDINATOR"
ENV_LOCAL_DEVICE_IDS = "MOE_EP_LOCAL_DEVICE_IDS"
ENV_CLUSTER = "MOE_EP_CLUSTER"
# SLURM's name for the node a task runs on (set by slurmd in every task).
ENV_SLURM_NODE = "SLURMD_NODENAME"
LAUNCH = "moe_ep.launch"
# How long process_nodes waits for another process's node name.
NODE_TIMEOUT_S = 120
# Seconds every process of a job gets to join it (MOE_EP_INIT_TIMEOUT_S).
ENV_INIT_TIMEOUT = "MOE_EP_INIT_TIMEOUT_S"
DEFAULT_INIT_TIMEOUT_S = 60.0
# JAX's own initialization timeout is this much later than ours, so ours ends
# the wait (one line) before JAX aborts (a C++ CHECK and a stack trace).
_JAX_TIMEOUT_MARGIN_S = 30
INIT_FAILED_EXIT_CODE = 1


@dataclasses.dataclass(frozen=True)
class Job:
  """What :func:`initialize_from_env` joined.

  Attributes:
    cluster: ``"moe_ep.launch"``, the JAX cluster environment that found the
      job (``"SlurmCluster"``, ``"OmpiCluster"``, ``"K8sCluster"``, ...), or
      None: a single process.
    process_index: this process's index in the job.
    process_count: processes in the job.
  """

  cluster: str | None
  process_index: int = 0
  process_count: int = 1

  def describe(self) -> str:
    """One line: the cluster, this process's index and count, and the local
    and global device counts (starts JAX's backends)."""
    local, total = jax.local_device_count(), jax.device_count()
    where = f"{self.cluster} job" if self.cluster else "single process"
    return (f"{where}: process {self.process_index} of {self.process_count}, "
            f"{local} local device{'s' * (local != 1)} of {total} "
            f"({jax.devices()[0].platform}) on node {node_name()}")


def _cluster_types() -> list:
  """JAX's cluster environments in its detection order (empty where this JAX
  keeps them elsewhere: then only moe_ep.launch's variables join a job)."""
  try:
    from jax._src import clusters  # noqa: PLC0415 - private; read only at start-up
  except ImportError:  # pragma: no cover - a future JAX
    return []
  return list(clusters.ClusterEnv._cluster_types)  # noqa: SLF001


def detect_cluster(method: str | None = None):
  """The JAX cluster environment (a ``ClusterEnv`` subclass) that
  ``jax.distributed.initialize(cluster_detection_method=method)`` would use,
  or None. JAX's own rule: ``method`` None takes the first present
  environment that is not opt-in only; a name takes that one if present.

  Raises:
    ValueError: ``method`` names no environment this JAX knows.
  """
  types = _cluster_types()
  if method is None:
    return next((env for env in types
                 if not env.opt_in_only_method and env.is_env_present()), None)
  named = [env for env in types if env.name == method]
  if not named:
    known = sorted({env.name for env in types if env.name} | {"deactivate"})
    raise ValueError(f"{ENV_CLUSTER}={method!r} is not a cluster_detection_method of this "
                     f"JAX ({jax.__version__}): one of {known}")
  return named[0] if named[0].is_env_present() else None


def _use_gloo() -> None:
  """CPU collectives across processes go through gloo (harmless on GPU, where
  NCCL carries them). Gloo prints ``[Gloo] Rank N is connected to ...`` on
  stdout at its first collective, unconditionally (no setting turns it off);
  :mod:`moe_ep.launch` leaves that line out of what it forwards."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


def init_timeout_s() -> float:
  """The join wait: ``MOE_EP_INIT_TIMEOUT_S`` if set, else the default.

  Raises:
    ValueError: the variable is not a finite number of seconds > 0.
  """
  text = os.environ.get(ENV_INIT_TIMEOUT)
  if text is None:
    return DEFAULT_INIT_TIMEOUT_S
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value < math.inf:
    raise ValueError(f"{ENV_INIT_TIMEOUT}={text!r} must be a finite number of seconds > 0")
  return value


def _join(timeout_s: float, coordinator: str, process_id: int, num_processes: int, /,
          **initialize_kwargs) -> None:
  """``jax.distributed.initialize(**initialize_kwargs)``, given up after
  ``timeout_s`` with one line on stderr and exit code
  :data:`INIT_FAILED_EXIT_CODE` (JAX's connect blocks in C++ and cannot be
  interrupted from Python: the process ends from a watchdog thread)."""

  def give_up():
    print(f"moe_ep.distributed: process {process_id} of {num_processes} waited {timeout_s:g} s "
          f"for the job's {num_processes} processes at the coordinator {coordinator} and not "
          f"all joined (a task that did not start or died, or a wrong coordinator address or "
          f"port); {ENV_INIT_TIMEOUT} sets the wait", file=sys.stderr, flush=True)
    os._exit(INIT_FAILED_EXIT_CODE)

  watchdog = threading.Timer(timeout_s, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        initialization_timeout=math.ceil(timeout_s) + _JAX_TIMEOUT_MARGIN_S,
        **initialize_kwargs)
  finally:
    watchdog.cancel()


def initialize_from_env(timeout_s: float | None = None) -> Job:
  """Joins the job the environment describes (see the module docstring) with
  ``jax.distributed.initialize``; a single process is left alone.

  Call it once, before any JAX computation. ``timeout_s`` (None:
  :func:`init_timeout_s`) bounds the wait for the other processes; then the
  process exits with one line (see the module docstring).

  Raises:
    ValueError: ``MOE_EP_NUM_PROCESSES`` > 1 without the other variables, or
      ``MOE_EP_CLUSTER`` names no environment JAX knows, or names one that is
      not present, or ``MOE_EP_INIT_TIMEOUT_S`` is not a number of seconds.
  """
  if timeout_s is None:
    timeout_s = init_timeout_s()
  num_processes = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
  if num_processes > 1:
    missing = [v for v in (ENV_PROCESS_ID, ENV_COORDINATOR) if v not in os.environ]
    if missing:
      raise ValueError(f"{ENV_NUM_PROCESSES}={num_processes} also needs {', '.join(missing)}")
    _use_gloo()
    local_ids = os.environ.get(ENV_LOCAL_DEVICE_IDS)
    process_id = int(os.environ[ENV_PROCESS_ID])
    # "deactivate": inside a SLURM allocation JAX would otherwise fill the
    # unset local_device_ids from SLURM_LOCALID.
    _join(timeout_s, os.environ[ENV_COORDINATOR], process_id, num_processes,
          coordinator_address=os.environ[ENV_COORDINATOR],
          num_processes=num_processes,
          process_id=process_id,
          local_device_ids=[int(i) for i in local_ids.split(",")] if local_ids else None,
          cluster_detection_method="deactivate")
    return Job(LAUNCH, process_id, num_processes)

  method = os.environ.get(ENV_CLUSTER) or None
  if method == "deactivate":
    return Job(None)
  cluster = detect_cluster(method)
  if cluster is None:
    if method is not None:
      raise ValueError(f"{ENV_CLUSTER}={method!r}: JAX finds no such environment here")
    return Job(None)
  if cluster.get_process_count() <= 1:  # e.g. `srun -n 1`: nothing to join
    return Job(None)
  _use_gloo()
  try:
    coordinator = cluster.get_coordinator_address(None, None)
  except Exception:  # noqa: BLE001 - some environments look it up over the network
    coordinator = "(found by JAX)"
  _join(timeout_s, coordinator, cluster.get_process_id(), cluster.get_process_count(),
        cluster_detection_method=method)
  return Job(cluster.__name__, jax.process_index(), jax.process_count())


def node_name() -> str:
  """The node this process runs on: SLURM's name for it (``SLURMD_NODENAME``,
  set in every task) where set, else the hostname."""
  return os.environ.get(ENV_SLURM_NODE) or socket.gethostname()


def boot_id() -> str:
  """This machine's boot id ("" where the kernel does not give one): with the
  hostname it tells two containers of one hostname on two machines apart."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def _node_key() -> str:
  return f"{node_name()}/{boot_id()}"


@functools.cache
def process_nodes() -> tuple[str, ...]:
  """Which node each process of the job runs on, by process index: a key
  equal for processes of one node (:func:`node_name` and the boot id).

  Each process publishes its own in the ``jax.distributed`` key-value store
  and reads the others' (a bounded wait); every process must call it.

  Raises:
    RuntimeError: another process did not publish within ``NODE_TIMEOUT_S``
      (naming it), or the job was joined without ``jax.distributed``.
  """
  own = _node_key()
  if jax.process_count() == 1:
    return (own,)
  from jax._src import distributed  # noqa: PLC0415 - the job's key-value store
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("process_nodes: a job of several processes needs "
                       "jax.distributed.initialize() (moe_ep.distributed.initialize_from_env)")
  client.key_value_set(f"moe_ep/node/{jax.process_index()}", own)
  names = []
  for process in range(jax.process_count()):
    try:
      names.append(client.blocking_key_value_get(f"moe_ep/node/{process}",
                                                 NODE_TIMEOUT_S * 1000))
    except Exception as error:  # jaxlib raises its own status errors
      raise RuntimeError(f"process_nodes: waited {NODE_TIMEOUT_S} s for process {process}'s "
                         f"node name; every process must call it: {error}") from error
  return tuple(names)
