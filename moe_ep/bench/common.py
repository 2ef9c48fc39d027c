"""Timing, device facts and result files shared by the benchmarks."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp

RESULTS_DIR = pathlib.Path("benchmarks/results")


def environment() -> dict:
  """Device and version facts recorded with every result."""
  import flax
  device = jax.devices()[0]
  facts = {
      "device": getattr(device, "device_kind", str(device)),
      "platform": device.platform,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  try:
    import cupy
    facts["cupy"] = cupy.__version__
  except ImportError:
    facts["cupy"] = None
  return facts


def time_ms(fn, *args, iters: int = 10, repeats: int = 5, warmup: int = 2) -> dict:
  """Device time per call: ``iters`` calls dispatched back to back (JAX runs
  them asynchronously), one wait at the end; median over ``repeats``."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / iters * 1e3)
  return {"median_ms": statistics.median(samples), "min_ms": min(samples),
          "samples_ms": [round(s, 4) for s in samples]}


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> dict:
  """Device-to-device copy ceiling: ``x + 1`` over a large bf16 array
  (reads and writes every byte once), bytes read + written per second."""
  x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
  fn = jax.jit(lambda v: v + jnp.ones((), v.dtype))
  timing = time_ms(fn, x, iters=10)
  return {"bytes": 2 * num_bytes, "gbs": 2 * num_bytes / timing["median_ms"] / 1e6, **timing}


def matmul_tflops(size: int = 8192, dtype=jnp.bfloat16) -> dict:
  """Dense matmul ceiling on random data (never zeros)."""
  keys = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(keys[0], (size, size), dtype)
  b = jax.random.normal(keys[1], (size, size), dtype)
  timing = time_ms(jax.jit(jnp.matmul), a, b, iters=10)
  return {"size": size, "tflops": 2 * size ** 3 / timing["median_ms"] / 1e9, **timing}


def write_result(name: str, payload: dict, results_dir: pathlib.Path = RESULTS_DIR) -> pathlib.Path:
  results_dir.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = results_dir / f"{name}-{stamp}.json"
  path.write_text(json.dumps({"benchmark": name, "environment": environment(), **payload},
                             indent=2, default=float))
  return path
