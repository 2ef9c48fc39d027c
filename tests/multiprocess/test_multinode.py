"""A two-node job on this machine, joined through JAX's SLURM detection: two
processes with the environment ``srun`` sets for one task per node (node
list, task rank, node name; ``slurm_task.py``), 4 CPU devices each, train
the default config (configs/tiny.yaml) with examples/pretrain.py. They form
one job of 8 devices whose automatic mesh puts ep inside each process's node
(dp 2 x ep 4), and train as one process with the same mesh does.

The job runs in the background while the rest of the suite runs
(tests/background.py): about 35 s on 2 cores, 25 s of it the job.
"""

import json
import os
import random
import socket
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

import background
from slurm_task import NODES, PORT_BASE

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:  # examples/ is a folder of the repository, not installed
  sys.path.insert(0, str(REPO))

from examples import pretrain  # noqa: E402
from examples import train_program  # noqa: E402
from examples.checkpoints import RunCheckpoints  # noqa: E402
from examples.train_config import load_config  # noqa: E402
from moe_ep.launch import launch  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 30
JOB_TIMEOUT_S = 600
# Both runs are float32 with the same mesh, program and data; only the
# cross-process sums (gloo's all-reduces of the gradients and the aux psums)
# add in another order. Measured: the job's 30 losses within 9.5e-7 of the
# one-process run's, its final state (parameters and AdamW moments) within
# 2.4e-7. The bounds leave 10x room and still catch a wrong batch slice or a
# lost update (either moves the loss by > 1e-2 within a step or two).
LOSS_ATOL = 1e-5
PARAM_TOL = dict(rtol=0, atol=2.5e-6)


def free_slurm_port() -> int:
  """A free port in the range JAX's SLURM detection derives from job ids."""
  ports = list(range(PORT_BASE, 65536))
  random.shuffle(ports)
  for port in ports:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
      try:
        sock.bind(("127.0.0.1", port))
      except OSError:
        continue
      return port
  raise RuntimeError(f"no free port in {PORT_BASE}-65535")


def run_two_node_job() -> tuple[Path, list]:
  """The job's run directory and each process's launch result."""
  run_dir = Path(tempfile.mkdtemp(prefix="moe_ep_two_node_")) / "run"
  job_id = free_slurm_port() - PORT_BASE + 4096  # a plausible id with that port
  command = [sys.executable, str(HERE / "slurm_task.py"), str(job_id), "--",
             sys.executable, "-m", "examples.pretrain", f"train.steps={STEPS}",
             f"train.run_dir={run_dir}", "train.log_every=10"]
  # Run outside the repository: the examples are found through PYTHONPATH.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
  results = launch(command, 2, timeout_s=JOB_TIMEOUT_S, cpu_devices_per_process=4,
                   cwd=run_dir.parent, env=env)
  return run_dir, results


def background_jobs(item) -> dict:
  return {"two_node": run_two_node_job}


@pytest.fixture(scope="module")
def two_node_job():
  return background.result("two_node", run_two_node_job)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The same config in this process, on 8 devices meshed as the job's."""
  config = load_config(None, [f"train.steps={STEPS}", "mesh.dp=2", "mesh.ep=4",
                              f"train.run_dir={tmp_path_factory.mktemp('one_process')}"])
  return pretrain.train(config, progress=False, devices=jax.devices("cpu")[:8])


def test_each_task_joins_through_slurm_detection_and_says_where_it_is(two_node_job):
  _, results = two_node_job
  for task, result in enumerate(results):
    assert (f"SlurmCluster job: process {task} of 2, 4 local devices of 8 (cpu) on node "
            f"{NODES[task]}") in result.output, result.output
  assert "mesh: dp=2 x ep=4 over 8 cpu devices in 2 processes (auto)" in results[0].output
  assert "spans" not in results[0].output  # ep inside each node: no note
  assert "done: 30 steps" in results[0].output and "done" not in results[1].output


def test_two_node_losses_match_one_process_with_the_same_mesh(two_node_job, one_process):
  run_dir, _ = two_node_job
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  want = [r["loss"] for r in one_process.records]
  np.testing.assert_allclose([r["loss"] for r in records], want, rtol=0, atol=LOSS_ATOL)
  assert want[-1] < want[0] - 1.0  # it trained
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["processes"] == 2 and summary["mesh"] == {"dp": 2, "ep": 4}


def test_two_node_checkpoint_restores_in_one_process(two_node_job, one_process):
  """Orbax wrote each process's shards into one checkpoint; it restores here
  onto the same mesh as the one-process run's final state."""
  run_dir, _ = two_node_job
  config = load_config(None, [f"train.steps={STEPS}", "mesh.dp=2", "mesh.ep=4"])
  setup, _ = train_program.build_program(train_program.program_config(config),
                                    tuple(jax.devices("cpu")[:8]))
  checkpoints = RunCheckpoints(run_dir / "checkpoints")
  try:
    assert checkpoints.latest_step() == STEPS
    state, data_step = checkpoints.restore(STEPS, setup.abstract_state)
  finally:
    checkpoints.close()
  assert data_step == STEPS
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(one_process.state)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **PARAM_TOL)
