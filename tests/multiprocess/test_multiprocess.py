"""Expert parallelism across JAX processes: ``worker.py`` launched as N
processes (gloo collectives on CPU, NCCL on GPU) against the same
computation in this one process, from the same seed.

Each launched job runs several cases at once, because process start-up and
compiles, not the tiny arithmetic, set the time.
"""

import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

import background
from conftest import gpu_devices
from moe_ep.launch import launch
from multiprocess_cases import (CASES, EXPERTS, OVERFLOW_CAPACITY, TRANSPORT_CAPACITY,
                                 run_cases)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("worker.py")
SEED = 0
# A job that stalls fails well before CI's limit; a healthy one takes ~30 s.
JOB_TIMEOUT_S = 300

# float32 on both sides, and every shard runs the same per-shard program, but
# the cross-device sums (psum over gloo, partial sums after the all_to_all)
# may add in another order: values agree to float32 rounding of O(1) sums
# (1e-5); gradients pass through two more reductions (1e-4). Integer results
# (counts, demand, tokens_per_expert) agree exactly. (Measured: bitwise equal
# but for the router gradient, 6e-11 apart.)
CPU_TOL = dict(rtol=1e-5, atol=1e-5)
CPU_GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
# GPU against the CPU reference: other kernels (CuPy gathers and sums, cuBLAS
# GEMMs at "highest" precision) round and order the float32 sums differently.
GPU_TOL = dict(rtol=1e-4, atol=1e-4)
GPU_GRAD_TOL = dict(rtol=1e-3, atol=1e-3)


def launch_worker(out_dir: Path, num_processes: int, *, cases, meshes,
                  cpu_devices_per_process=None, gpus_per_process=None, worker_args=(),
                  env=None) -> dict[str, np.ndarray]:
  """Runs ``worker.py`` as a job and returns process 0's gathered results."""
  out = out_dir / "results.npz"
  command = [sys.executable, str(WORKER), str(out), "--seed", str(SEED),
             "--cases", ",".join(cases), *(f"--mesh={dp}x{ep}" for dp, ep in meshes),
             *worker_args]
  launch(command, num_processes, timeout_s=JOB_TIMEOUT_S,
         cpu_devices_per_process=cpu_devices_per_process, gpus_per_process=gpus_per_process,
         env=env)
  with np.load(out) as results:
    return dict(results)


def single_process(num_devices: int, cases, meshes) -> dict[str, np.ndarray]:
  """The same cases on this process's first ``num_devices`` CPU devices,
  pure-JAX transport."""
  devices = jax.devices("cpu")[:num_devices]
  assert len(devices) == num_devices, "tests/conftest.py provides 8 CPU devices"
  with jax.default_device(devices[0]):
    return run_cases(devices, cases, meshes, SEED, "xla")


def assert_results_match(got: dict, want: dict, tol: dict, grad_tol: dict, prefix: str = ""):
  keys = sorted(key for key in want if key.startswith(prefix))
  assert keys, f"no results under {prefix!r}"
  assert sorted(key for key in got if key.startswith(prefix)) == keys
  for key in keys:
    if np.issubdtype(want[key].dtype, np.integer):
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    else:
      np.testing.assert_allclose(got[key], want[key], err_msg=key,
                                 **(grad_tol if key.endswith("_grad") else tol))


# --- EP=4: 2 processes x 2 CPU devices -------------------------------------------

# (2, 2): EP inside each process, DP across the two; (1, 4): EP across both.
EP4_MESHES = [(2, 2), (1, 4)]


def launch_ep4():
  return launch_worker(Path(tempfile.mkdtemp(prefix="moe_ep_ep4_")), 2,
                       cpu_devices_per_process=2, cases=CASES, meshes=EP4_MESHES)


def launch_ep8():
  return launch_worker(Path(tempfile.mkdtemp(prefix="moe_ep_ep8_")), 2,
                       cpu_devices_per_process=4, cases=("layer",), meshes=EP8_MESHES)


def background_jobs(item) -> dict:
  """The launched jobs this module's selected tests need (see tests/background.py)."""
  if "gpu" in item.keywords:
    return {}
  if item.name.startswith("test_layer_at_ep8"):
    return {"ep8": launch_ep8}
  return {"ep4": launch_ep4}


@pytest.fixture(scope="module")
def ep4_results():
  """``(launched, single)``: the results of 2 processes x 2 CPU devices and
  of this process's first 4 devices."""
  return background.result("ep4", launch_ep4), single_process(4, CASES, EP4_MESHES)


def test_transport_forward_and_gradients_match_one_process(ep4_results):
  launched, single = ep4_results
  assert_results_match(launched, single, CPU_TOL, CPU_GRAD_TOL, prefix="transport/")
  counts, demand = launched["transport/ep4/counts"], launched["transport/ep4/demand"]
  assert (counts < demand).any() and (counts == TRANSPORT_CAPACITY).any(), \
      "the skewed routing must overflow some slabs"
  assert ((counts == demand) & (demand > 0)).any(), "and leave some whole"


def test_layer_value_and_grad_with_saved_dispatch_matches_one_process(ep4_results):
  launched, single = ep4_results
  assert_results_match(launched, single, CPU_TOL, CPU_GRAD_TOL, prefix="layer/")
  for dp, ep in EP4_MESHES:
    assert float(launched[f"layer/{dp}x{ep}/dropped_fraction"]) == 0.0


def test_overflow_matches_one_process(ep4_results):
  launched, single = ep4_results
  assert_results_match(launched, single, CPU_TOL, CPU_GRAD_TOL, prefix="overflow/")


@pytest.mark.parametrize("dp, ep", EP4_MESHES)
def test_overflow_saved_dispatch_equals_recomputed_and_stays_finite(ep4_results, dp, ep):
  launched, _ = ep4_results
  saved = {key.replace("/saved/", "/"): value for key, value in launched.items()
           if key.startswith(f"overflow/{dp}x{ep}/saved/")}
  recomputed = {key.replace("/recomputed/", "/"): value for key, value in launched.items()
                if key.startswith(f"overflow/{dp}x{ep}/recomputed/")}
  for key, value in saved.items():
    assert np.isfinite(value).all(), key
  assert_results_match(saved, recomputed, CPU_GRAD_TOL, CPU_GRAD_TOL)


@pytest.mark.parametrize("dp, ep", EP4_MESHES)
def test_overflow_demand_above_capacity_is_visible_after_allgather(ep4_results, dp, ep):
  """tokens_per_expert counts routes before drops over the global batch, so
  an expert's demand exceeds what its dp slabs (one per dp row) can keep."""
  launched, _ = ep4_results
  tokens_per_expert = launched[f"overflow/{dp}x{ep}/saved/tokens_per_expert"]
  assert tokens_per_expert.shape == (EXPERTS,)
  assert (tokens_per_expert[2:] == 0).all(), "the bias sends every route to experts 0 and 1"
  assert tokens_per_expert.max() > OVERFLOW_CAPACITY * dp
  assert float(launched[f"overflow/{dp}x{ep}/saved/dropped_fraction"]) > 0.5


# --- EP=8: 2 processes x 4 CPU devices -------------------------------------------

# EP over both processes only: DP x EP with EP inside each process is already
# the (2, 2) mesh above, and each mesh costs a compile on every process.
EP8_MESHES = [(1, 8)]


def test_layer_at_ep8_across_processes_matches_one_process():
  launched = background.result("ep8", launch_ep8)
  single = single_process(8, ("layer",), EP8_MESHES)
  assert_results_match(launched, single, CPU_TOL, CPU_GRAD_TOL)


# --- GPU: 2 processes x 1 GPU, CuPy transport -------------------------------------

GPU_MESHES = [(1, 2)]


@pytest.mark.gpu
def test_two_gpu_processes_with_cupy_match_cpu_reference(tmp_path):
  """One GPU per process under NCCL, against the pure-JAX transport on 2 CPU
  devices here. This test's work in the parent stays on CPU, and the
  children do not preallocate, so they share the GPUs with this process."""
  if len(gpu_devices()) < 2:
    pytest.skip("needs 2 GPUs")
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  launched = launch_worker(tmp_path, 2, gpus_per_process=1, cases=CASES,
                           meshes=GPU_MESHES, env=env,
                           worker_args=("--platform", "gpu", "--transport", "cupy"))
  single = single_process(2, CASES, GPU_MESHES)
  assert_results_match(launched, single, GPU_TOL, GPU_GRAD_TOL)
