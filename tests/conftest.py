"""Test set-up: 8 virtual CPU devices, GPU test selection, shared helpers."""

import functools
import os
import pathlib
import re

# Must happen before JAX initialises its backends. No GPU memory preallocation:
# multi-process GPU tests start children that need the GPUs too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()


def _cuda_plugin_installed() -> bool:
  import importlib.metadata
  return any(dist.metadata["Name"].lower().replace("_", "-").startswith("jax-cuda")
             for dist in importlib.metadata.distributions())


# On CPU-only machines (CI) compiling dominates the suite's time and the
# programs are tiny: skip LLVM's optimisations and the fusion emitters
# (about 2x faster compiles; same IEEE arithmetic, so tolerances hold).
if not _cuda_plugin_installed() and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                              " --xla_cpu_use_fusion_emitters=false")
# The example tests compare resumed runs with uninterrupted ones bit for bit;
# on GPUs the embedding gradient's scatter-add must then add in a fixed order.
if "xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# float32 tests compare against float32 references: no TF32 matmuls on GPU.
jax.config.update("jax_default_matmul_precision", "highest")


@functools.cache
def cpu_compiler_options() -> dict:
  """Per-jit compiler options that cut the compile of tiny test graphs
  several-fold on CPU (LLVM optimisation and the fusion emitters off; also
  where a GPU plugin keeps them out of XLA_FLAGS), each dropped where this
  XLA does not know it."""
  options = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
  probe = jax.device_put(1.0, jax.devices("cpu")[0])
  for name in list(options):
    try:
      jax.jit(lambda v: v + 1).lower(probe).compile(compiler_options={name: options[name]})
    except Exception:  # noqa: BLE001 - unknown option names raise XlaRuntimeError
      del options[name]
  return options


def x64_enabled():
  """``jax_enable_x64`` on inside the block, restored after (jax.enable_x64 on
  newer JAX, jax.experimental.enable_x64 on older)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64  # pylint: disable=g-import-not-at-top
  return enable_x64()


def gpu_devices() -> list:
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def cupy_usable() -> bool:
  if not gpu_devices():
    return False
  from moe_ep.transport import kernel_launch
  return kernel_launch.cupy_available()


# The pure-JAX backend always runs (on CPU devices); the CuPy one where a GPU
# and CuPy are present.
BACKENDS = ["xla"] + (["cupy"] if cupy_usable() else [])


_REPO = pathlib.Path(__file__).resolve().parents[1]

# The quick tier, `python -m pytest -m quick`: under two minutes on two CPU
# cores (README). Whole modules (None) or the tests whose names start with one
# of the given prefixes: configuration, data, logs, command lines, the router,
# the expert banks, the transport's transforms and kernel sources, and the
# layer against its dense reference. Slow tests never join it.
QUICK = {
    "tests/test_config.py": None,
    "tests/test_router.py": None,
    "tests/test_activations.py": None,
    "tests/interop/test_families.py": None,
    "tests/test_layer.py": ("test_layer_matches_dense_reference",),
    "tests/experts/test_slabs.py": None,
    "tests/experts/test_grouped.py": None,
    "tests/transport/test_transforms.py": None,
    "tests/transport/test_call_path.py": None,
    "tests/transport/test_kernel_source.py": None,
    "tests/transport/test_kernel_loading.py": None,
    "tests/benchmarks/test_main.py": None,
    "tests/benchmarks/test_common.py": None,
    "tests/benchmarks/test_results.py": None,
    "tests/examples/test_train_config.py": None,
    "tests/examples/test_token_data.py": None,
    "tests/examples/test_plots.py": None,
    "tests/examples/test_progress.py": None,
    "tests/examples/test_run_dir.py": None,
    "tests/examples/test_mesh.py": None,
    "tests/examples/test_checkpoints.py": None,
    "tests/examples/test_slurm_script.py": None,
    "tests/test_quick_tier.py": None,
    "tests/test_packaging.py": None,
    "tests/test_layout_doc.py": None,
}


def _is_quick(item) -> bool:
  path = pathlib.Path(str(item.fspath)).resolve().relative_to(_REPO).as_posix()
  if path not in QUICK or item.get_closest_marker("slow"):
    return False
  prefixes = QUICK[path]
  return prefixes is None or item.name.startswith(prefixes)


def pytest_collection_modifyitems(config, items):
  for item in items:
    if _is_quick(item):
      item.add_marker(pytest.mark.quick)
  # Tests that wait for a background job run last, so the job overlaps the
  # rest of the suite (see tests/background.py).
  waits = [hasattr(getattr(item, "module", None), "background_jobs") for item in items]
  items[:] = ([item for item, w in zip(items, waits) if not w]
              + [item for item, w in zip(items, waits) if w])
  if cupy_usable():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_collection_finish(session):
  # Under pytest-xdist every worker collects every item: each test then runs
  # its own job when it needs it, rather than every worker starting them all.
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return
  import background
  background.start_for(session.items)


@pytest.fixture
def pretend_cupy(monkeypatch):
  """CuPy reported available: lowering for CUDA never touches CuPy, only the
  availability check does."""
  from moe_ep.transport import kernel_launch
  monkeypatch.setattr(kernel_launch, "cupy_available", lambda: True)


def devices_for(backend: str, count: int) -> list:
  """``count`` devices that run ``backend``: GPUs for CuPy, CPUs otherwise."""
  devices = gpu_devices() if backend == "cupy" else jax.devices("cpu")
  if len(devices) < count:
    pytest.skip(f"needs {count} devices for backend={backend}, have {len(devices)}")
  return devices[:count]


def device_count(backend: str) -> int:
  return len(gpu_devices()) if backend == "cupy" else len(jax.devices("cpu"))


def layer_mesh_cases() -> list[tuple[str, tuple[int, int]]]:
  """(backend, ("dp", "ep") shape) pairs with EP > 1 that this machine can run:
  2x4 and 1x8 on the 8 CPU devices; all GPUs on the EP axis for CuPy."""
  cases = [("xla", (2, 4)), ("xla", (1, 8))]
  if "cupy" in BACKENDS and device_count("cupy") >= 2:
    cases.append(("cupy", (1, device_count("cupy"))))
  return cases


def make_mesh(shape: tuple, names: tuple, backend: str = "xla") -> jax.sharding.Mesh:
  count = int(np.prod(shape))
  devices = np.array(devices_for(backend, count)).reshape(shape)
  return jax.sharding.Mesh(devices, names)


def custom_call_scopes(text: str) -> list[tuple[str, str]]:
  """``(target, location name)`` of every custom call in debug-info MLIR."""
  names = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', text, flags=re.M))
  calls = re.findall(r"custom_call @(\w+)\(.*loc\((#loc\d+)\)\s*$", text, flags=re.M)
  return [(target, names.get(loc, "")) for target, loc in calls]


def nested_jaxprs(jaxpr):
  """``jaxpr`` and every jaxpr inside its equations (shard_map, checkpoint,
  custom_vjp, pjit bodies), depth first."""
  yield jaxpr
  for eqn in jaxpr.eqns:
    for param in eqn.params.values():
      for value in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(value, "jaxpr", value)  # ClosedJaxpr -> Jaxpr
        if hasattr(inner, "eqns"):
          yield from nested_jaxprs(inner)


@pytest.fixture(params=[128, 64], ids=lambda align: f"align{align}")
def group_align(request):
  """Groups of the grouped layout on whole row tiles and on half tiles: the
  ``group_align`` a test passes to the layout's sizes, the transport and the
  bank alike."""
  return request.param
