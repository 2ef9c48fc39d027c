"""Joining a multi-process JAX job from environment variables.

The layer itself needs no bootstrap or finalize call and keeps no
process-wide state; programs (the examples, the multi-process tests) call
:func:`initialize_from_env` once at start-up, before any JAX computation, and
:mod:`moe_ep.launch` sets the variables for each process it starts:

* ``MOE_EP_NUM_PROCESSES``: processes in the job (unset or 1: single process).
* ``MOE_EP_PROCESS_ID``: this process's index.
* ``MOE_EP_COORDINATOR``: ``host:port`` of process 0's coordinator.
* ``MOE_EP_LOCAL_DEVICE_IDS``: optional comma-separated GPU ids this process
  uses (one GPU per process: ``"0"``, ``"1"``, ...).
"""

from __future__ import annotations

import os

import jax

ENV_NUM_PROCESSES = "MOE_EP_NUM_PROCESSES"
ENV_PROCESS_ID = "MOE_EP_PROCESS_ID"
ENV_COORDINATOR = "MOE_EP_COORDINATOR"
ENV_LOCAL_DEVICE_IDS = "MOE_EP_LOCAL_DEVICE_IDS"


def initialize_from_env(timeout_s: int = 300) -> bool:
  """Calls ``jax.distributed.initialize`` when the environment asks for
  several processes; returns whether it did.

  CPU collectives across processes go through gloo (set here, harmless on
  GPU, where NCCL carries them). Gloo prints ``[Gloo] Rank N is connected
  to ...`` on stdout at its first collective, unconditionally (no setting
  turns it off); :mod:`moe_ep.launch` leaves that line out of what it forwards.
  """
  num_processes = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
  if num_processes <= 1:
    return False
  missing = [v for v in (ENV_PROCESS_ID, ENV_COORDINATOR) if v not in os.environ]
  if missing:
    raise ValueError(f"{ENV_NUM_PROCESSES}={num_processes} also needs {', '.join(missing)}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  local_ids = os.environ.get(ENV_LOCAL_DEVICE_IDS)
  jax.distributed.initialize(
      coordinator_address=os.environ[ENV_COORDINATOR],
      num_processes=num_processes,
      process_id=int(os.environ[ENV_PROCESS_ID]),
      local_device_ids=[int(i) for i in local_ids.split(",")] if local_ids else None,
      initialization_timeout=timeout_s,
  )
  return True
