"""moe_ep.launch's child environments (no process started; the launches
themselves are tests/multiprocess/test_launch_failures.py): each process
gets GPUs no other process gets, and CPU children their device count."""

import itertools

import pytest

from moe_ep import distributed
from moe_ep.launch import child_env


@pytest.mark.parametrize("num_processes, gpus_per_process",
                         list(itertools.product((1, 2, 3, 4), (1, 2, 3))))
def test_every_process_gets_its_own_gpus(num_processes, gpus_per_process):
  assigned = []
  for process_id in range(num_processes):
    env = child_env(process_id, num_processes, 1234, gpus_per_process=gpus_per_process,
                    base_env={})
    assert env[distributed.ENV_PROCESS_ID] == str(process_id)
    assert env[distributed.ENV_NUM_PROCESSES] == str(num_processes)
    ids = [int(i) for i in env[distributed.ENV_LOCAL_DEVICE_IDS].split(",")]
    assert len(ids) == len(set(ids)) == gpus_per_process
    assigned.append(set(ids))
  for first, second in itertools.combinations(assigned, 2):
    assert not first & second, f"two processes share GPUs {sorted(first & second)}"
  assert set().union(*assigned) == set(range(num_processes * gpus_per_process))


def test_cpu_children_get_their_device_count_and_no_gpu_ids():
  base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x",
          "KEEP": "1"}
  env = child_env(1, 2, 1234, cpu_devices_per_process=3, base_env=base)
  assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x",
                                      "--xla_force_host_platform_device_count=3"]
  assert env["JAX_PLATFORMS"] == "cpu" and env["KEEP"] == "1"
  assert distributed.ENV_LOCAL_DEVICE_IDS not in env
  assert env[distributed.ENV_COORDINATOR] == "127.0.0.1:1234"
  assert base["XLA_FLAGS"].startswith("--xla_force")  # the caller's dict is left alone
