"""Test set-up: 8 virtual CPU devices, GPU test selection, shared helpers."""

import os

# Must happen before JAX initialises its backends.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def gpu_devices() -> list:
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def cupy_usable() -> bool:
  if not gpu_devices():
    return False
  from moe_ep.transport import cupy as cupy_backend
  return cupy_backend.cupy_available()


# The pure-JAX backend always runs (on CPU devices); the CuPy one where a GPU
# and CuPy are present.
BACKENDS = ["xla"] + (["cupy"] if cupy_usable() else [])


def pytest_collection_modifyitems(config, items):
  if cupy_usable():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def devices_for(backend: str, count: int) -> list:
  """``count`` devices that run ``backend``: GPUs for CuPy, CPUs otherwise."""
  devices = gpu_devices() if backend == "cupy" else jax.devices("cpu")
  if len(devices) < count:
    pytest.skip(f"needs {count} devices for backend={backend}, have {len(devices)}")
  return devices[:count]


def make_mesh(shape: tuple, names: tuple, backend: str = "xla") -> jax.sharding.Mesh:
  count = int(np.prod(shape))
  devices = np.array(devices_for(backend, count)).reshape(shape)
  return jax.sharding.Mesh(devices, names)
