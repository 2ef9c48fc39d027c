"""moe_ep.distributed: which job a process joins, through JAX's own cluster
detection, without starting one (``jax.distributed.initialize`` is replaced
by a recorder; tests/multiprocess/test_multinode.py starts a real one)."""

import os

import jax
import pytest

from moe_ep import distributed

# The variables JAX's cluster environments look for (jax._src.clusters of
# 0.10.2 and 0.11): each test starts from an environment without them.
CLUSTER_PREFIXES = ("SLURM", "OMPI_", "PMIX", "KUBERNETES_", "TPU_", "MEGASCALE_", "CLOUD_TPU",
                    "MOE_EP_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS")
SLURM_TASK = {  # task 1 of a 2-node srun step, one task per node
    "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu008", "SLURM_STEP_NUM_NODES": "2",
}
OMPI_RANK = {  # rank 3 of `mpirun -np 4` (Open MPI 4)
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
}


@pytest.fixture
def calls(monkeypatch):
  """A clean environment; ``jax.distributed.initialize`` records its
  keyword arguments instead of joining anything."""
  for name in list(os.environ):
    if name.startswith(CLUSTER_PREFIXES):
      monkeypatch.delenv(name)
  recorded = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: recorded.append(kwargs))
  monkeypatch.setattr(jax.config, "update", lambda *args: None)  # gloo stays unset here
  return recorded


def test_no_cluster_stays_a_single_process_without_initializing(calls):
  assert distributed.detect_cluster() is None
  job = distributed.initialize_from_env()
  assert job == distributed.Job(None, 0, 1) and calls == []
  local = jax.local_device_count()  # 1 on a one-GPU machine: "1 local device"
  assert job.describe().startswith(
      f"single process: process 0 of 1, {local} local device{'' if local == 1 else 's'} "
      f"of {jax.device_count()} ({jax.devices()[0].platform}) on node ")


def test_slurm_task_is_found_by_jax_and_joined_with_jax_s_own_parameters(calls, monkeypatch):
  for name, value in SLURM_TASK.items():
    monkeypatch.setenv(name, value)
  cluster = distributed.detect_cluster()
  assert cluster.__name__ == "SlurmCluster"
  # JAX's rules, read back: coordinator on the first node, port from the job id.
  assert cluster.get_coordinator_address(None, None) == f"gpu007:{4242 % 4096 + 61440}"
  job = distributed.initialize_from_env(timeout_s=7)
  # JAX's own timeout is later than the bounded wait, which ends it first.
  assert calls == [{"cluster_detection_method": None, "initialization_timeout": 7 + 30}]
  assert job.cluster == "SlurmCluster"
  assert distributed.node_name() == "gpu008"


def test_open_mpi_rank_is_found(calls, monkeypatch):
  for name, value in OMPI_RANK.items():
    monkeypatch.setenv(name, value)
  cluster = distributed.detect_cluster()
  assert cluster.__name__ == "OmpiCluster"
  assert (cluster.get_process_count(), cluster.get_process_id()) == (4, 3)
  assert distributed.initialize_from_env().cluster == "OmpiCluster"
  assert len(calls) == 1


def test_one_task_job_stays_single(calls, monkeypatch):
  """``srun -n 1 python ...``: a cluster of one process joins nothing."""
  for name, value in {**SLURM_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}.items():
    monkeypatch.setenv(name, value)
  assert distributed.detect_cluster().__name__ == "SlurmCluster"
  assert distributed.initialize_from_env() == distributed.Job(None) and calls == []


def test_launch_variables_win_and_switch_jax_detection_off(calls, monkeypatch):
  """Inside a SLURM allocation, moe_ep.launch's children must not take
  SLURM_LOCALID for their GPU: detection is deactivated."""
  for name, value in SLURM_TASK.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  monkeypatch.setenv(distributed.ENV_LOCAL_DEVICE_IDS, "2,3")
  job = distributed.initialize_from_env(timeout_s=9)
  assert job == distributed.Job("moe_ep.launch", 1, 2)
  assert calls == [dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1,
                        local_device_ids=[2, 3], cluster_detection_method="deactivate",
                        initialization_timeout=9 + 30)]


def test_cluster_variable_chooses_or_refuses_a_detection_method(calls, monkeypatch):
  for name, value in SLURM_TASK.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setenv(distributed.ENV_CLUSTER, "deactivate")
  assert distributed.initialize_from_env() == distributed.Job(None) and calls == []
  monkeypatch.setenv(distributed.ENV_CLUSTER, "slurm")
  assert distributed.initialize_from_env().cluster == "SlurmCluster"
  assert calls[-1]["cluster_detection_method"] == "slurm"
  monkeypatch.setenv(distributed.ENV_CLUSTER, "ompi")  # known, but not present here
  with pytest.raises(ValueError, match="MOE_EP_CLUSTER='ompi': JAX finds no such environment"):
    distributed.initialize_from_env()
  monkeypatch.setenv(distributed.ENV_CLUSTER, "pbs")
  with pytest.raises(ValueError, match=r"MOE_EP_CLUSTER='pbs' is not a cluster_detection_method"
                                       r" of this JAX .*'slurm'"):
    distributed.initialize_from_env()


def test_single_process_knows_its_node(calls):
  assert distributed.process_nodes() == (distributed._node_key(),)  # noqa: SLF001


@pytest.mark.parametrize("cluster_env", [None, ""], ids=["unset", "empty"])
def test_empty_cluster_variable_is_unset(calls, monkeypatch, cluster_env):
  """``MOE_EP_CLUSTER=`` (as a job script's ``export MOE_EP_CLUSTER=$X``
  leaves it) means JAX's own detection: no cluster stays single, a SLURM
  task is found."""
  if cluster_env is not None:
    monkeypatch.setenv(distributed.ENV_CLUSTER, cluster_env)
  assert distributed.initialize_from_env() == distributed.Job(None) and calls == []
  for name, value in SLURM_TASK.items():
    monkeypatch.setenv(name, value)
  assert distributed.initialize_from_env().cluster == "SlurmCluster"
  assert [call["cluster_detection_method"] for call in calls] == [None]


def test_empty_local_device_ids_leave_the_choice_to_jax(calls, monkeypatch):
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  monkeypatch.setenv(distributed.ENV_LOCAL_DEVICE_IDS, "")
  assert distributed.initialize_from_env() == distributed.Job("moe_ep.launch", 0, 2)
  assert calls[-1]["local_device_ids"] is None


def test_launch_variables_missing_are_named(calls, monkeypatch):
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  with pytest.raises(ValueError, match=r"MOE_EP_NUM_PROCESSES=2 also needs MOE_EP_PROCESS_ID"):
    distributed.initialize_from_env()
  assert calls == []


def test_the_join_wait_defaults_to_60_s_and_is_set_by_its_variable(calls, monkeypatch):
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  distributed.initialize_from_env()
  monkeypatch.setenv(distributed.ENV_INIT_TIMEOUT, "12.5")
  distributed.initialize_from_env()
  assert [call["initialization_timeout"] for call in calls] == [60 + 30, 13 + 30]
  for bad in ("0", "-3", "inf", "soon"):
    monkeypatch.setenv(distributed.ENV_INIT_TIMEOUT, bad)
    with pytest.raises(ValueError, match=f"^MOE_EP_INIT_TIMEOUT_S='{bad}' must be a finite "
                                         "number of seconds > 0$"):
      distributed.initialize_from_env()


@pytest.mark.slow
@pytest.mark.parametrize("process_id", [0, 1])
def test_a_job_with_a_missing_process_ends_in_one_line_within_the_wait(process_id):
  """Process ``process_id`` of 2 starts, the other never does (a task that
  did not start, or a wrong port): after MOE_EP_INIT_TIMEOUT_S=3 one line
  names the coordinator, the process and the variable, exit code 1 (it used
  to wait ~5 minutes and abort with JAX's C++ CHECK and a stack trace)."""
  import subprocess
  import sys
  import time
  from moe_ep.launch import free_port
  coordinator = f"127.0.0.1:{free_port()}"
  env = {name: value for name, value in os.environ.items()
         if not name.startswith(CLUSTER_PREFIXES)}
  env.update(JAX_PLATFORMS="cpu", MOE_EP_NUM_PROCESSES="2", MOE_EP_PROCESS_ID=str(process_id),
             MOE_EP_COORDINATOR=coordinator, MOE_EP_INIT_TIMEOUT_S="3")
  start = time.monotonic()
  result = subprocess.run([sys.executable, "-c", "from moe_ep import distributed; "
                           "distributed.initialize_from_env(); print('joined')"],
                          capture_output=True, text=True, env=env, timeout=120)
  seconds = time.monotonic() - start
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stdout == ""
  assert result.stderr == (
      f"moe_ep.distributed: process {process_id} of 2 waited 3 s for the job's 2 processes at "
      f"the coordinator {coordinator} and not all joined (a task that did not start or died, "
      "or a wrong coordinator address or port); MOE_EP_INIT_TIMEOUT_S sets the wait\n")
  assert 3 <= seconds < 30
