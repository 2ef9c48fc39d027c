"""Runs a command as one task of a SLURM step of one task per node, so that a
job started by ``moe_ep.launch`` on this machine joins through JAX's own
SLURM detection instead of the launcher's variables:

    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 4 -- \\
        python tests/multiprocess/slurm_task.py 1234 -- python -m examples.pretrain

It replaces ``MOE_EP_*`` (which :func:`moe_ep.distributed.initialize_from_env`
would take first) by what ``srun`` sets in task ``MOE_EP_PROCESS_ID`` of job
``JOB_ID``: the step's node list, the task count and rank, its local rank and
its node's name. The nodes are :data:`NODES` by name, both this machine over
loopback, so task 0's node, where JAX puts the coordinator, is ``localhost``,
at the port JAX derives from the job id (``JOB_ID % 4096 + 61440``).
"""

from __future__ import annotations

import os
import sys

from moe_ep import distributed

# Two names of this machine: the two "nodes" of the step.
NODES = ("localhost", "127.0.0.1")
PORT_BASE = 65536 - 4096  # JAX's SlurmCluster: port = job id % 4096 + PORT_BASE


def slurm_task_env(job_id: int, task: int, num_tasks: int) -> dict[str, str]:
  """The variables srun sets in task ``task`` of a step with one task per node."""
  return {
      "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id),
      "SLURM_STEP_NODELIST": ",".join(NODES[:num_tasks]),
      "SLURM_JOB_NODELIST": ",".join(NODES[:num_tasks]),
      "SLURM_NNODES": str(num_tasks), "SLURM_STEP_NUM_NODES": str(num_tasks),
      "SLURM_NTASKS": str(num_tasks), "SLURM_STEP_NUM_TASKS": str(num_tasks),
      "SLURM_PROCID": str(task), "SLURM_LOCALID": "0", "SLURM_NODEID": str(task),
      "SLURMD_NODENAME": NODES[task],
  }


def main(argv: list[str]) -> None:
  job_id, separator, *command = argv
  assert separator == "--" and command, __doc__
  task = int(os.environ.pop(distributed.ENV_PROCESS_ID))
  num_tasks = int(os.environ.pop(distributed.ENV_NUM_PROCESSES))
  if num_tasks > len(NODES):
    raise ValueError(f"{num_tasks} tasks: this shim names {len(NODES)} nodes")
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_LOCAL_DEVICE_IDS):
    os.environ.pop(name, None)
  os.environ.update(slurm_task_env(int(job_id), task, num_tasks))
  os.execvp(command[0], command)


if __name__ == "__main__":
  main(sys.argv[1:])
