"""Timing, device facts and result files shared by the benchmarks."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

# Where results go unless told otherwise: ignored by git, so a run leaves the checkout clean.
RESULTS_DIR = pathlib.Path("runs/bench")
_CHECKOUT = pathlib.Path(__file__).resolve().parents[1]
# What source_digest covers: the package, the kernels and the benchmarks that measure them.
_SOURCE_FILES = (("moe_ep", "*.py"), ("kernels", "*.cu"), ("kernels", "*.cuh"),
                 ("benchmarks", "*.py"))
# The benchmarks count where they are a package (they were moe_ep/bench, inside the package,
# until they moved here), so that older commits' digests, which left benchmarks/ out, stay.
_BENCHMARKS_PACKAGE = "benchmarks/__init__.py"


def git_commit(checkout: pathlib.Path = _CHECKOUT) -> str | None:
  """``HEAD``'s hash of ``checkout`` (default: the source checkout this code
  runs from), ``+dirty`` where tracked files differ from it; None outside a
  git checkout of this project (an installed wheel)."""
  if not (checkout / "pyproject.toml").is_file():
    return None
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=checkout, capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+dirty" if dirty else "")


def source_files(relatives: list[str]) -> list[str]:
  """Those of a tree's files (posix paths from its root) that
  :func:`source_digest` covers."""
  covered = [folder for folder, _ in _SOURCE_FILES
             if folder != "benchmarks" or _BENCHMARKS_PACKAGE in relatives]
  paths = [pathlib.PurePosixPath(relative) for relative in relatives]
  return [path.as_posix() for path in paths
          if any(path.parts[0] == folder and folder in covered and path.match(pattern)
                 for folder, pattern in _SOURCE_FILES)]


def digest_sources(sources: dict[str, bytes]) -> str:
  """The first 16 hex digits of the SHA-256 over ``{relative path: bytes}``:
  each path, then its bytes, in path order (by path components)."""
  digest = hashlib.sha256()
  for relative in sorted(sources, key=lambda r: pathlib.PurePosixPath(r).parts):
    digest.update(relative.encode() + b"\0")
    digest.update(sources[relative] + b"\0")
  return digest.hexdigest()[:16]


def source_digest(checkout: pathlib.Path = _CHECKOUT) -> str | None:
  """:func:`digest_sources` of the package's, kernels' and benchmarks' source
  files of ``checkout``: which code a result ran, which a commit can be
  checked against also where the checkout's git history is not that code's (a
  copied working tree, whose HEAD is older; ``benchmarks/index.py --trace``).
  None outside a source checkout."""
  if not (checkout / "pyproject.toml").is_file():
    return None
  found = {path.relative_to(checkout).as_posix() for folder, pattern in _SOURCE_FILES
           for path in (checkout / folder).rglob(pattern)}
  return digest_sources({relative: (checkout / relative).read_bytes()
                         for relative in source_files(sorted(found))})


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
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "commit": git_commit(),
      "source_digest": source_digest(),
  }
  try:
    import cupy
    facts["cupy"] = cupy.__version__
  except ImportError:
    facts["cupy"] = None
  return facts


def failure(error: Exception) -> dict:
  """A method's result where it raised (out of memory is a result in a
  benchmark): its type and the start of its message."""
  return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def _back_to_back_ms(fn, args, iters: int) -> float:
  """Milliseconds per call of ``iters`` calls dispatched back to back (JAX
  runs them asynchronously), with one wait at the end."""
  start = time.perf_counter()
  out = None
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / iters * 1e3


def _timing(samples: list[float]) -> dict:
  """Milliseconds per call over repeated measurements: median, min, each."""
  return {"median_ms": statistics.median(samples), "min_ms": min(samples),
          "samples_ms": [round(s, 4) for s in samples]}


def time_ms(fn, *args, iters: int = 10, repeats: int = 5, warmup: int = 2) -> dict:
  """Device time per call: ``iters`` calls dispatched back to back (JAX runs
  them asynchronously), one wait at the end; median over ``repeats``."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  return _timing([_back_to_back_ms(fn, args, iters) for _ in range(repeats)])


def time_interleaved(calls: dict, *, iters: int, rounds: int, warmup: int = 1) -> dict:
  """Device time per call of each of ``calls`` (``{name: (fn, args)}``),
  measured as :func:`time_ms` does but in ``rounds`` rounds that each time
  every call in turn, so that a drift of the device's clocks or temperature
  reaches all of them alike and ratios between them can be taken round by
  round. A call that raises (out of memory is a result here) gives
  ``{"error": ...}`` and leaves the rounds; the others go on.

  Returns:
    ``{name: {"median_ms", "min_ms", "samples_ms": [one per round]}}``.
  """
  samples, results = {}, {}
  for name, (fn, args) in calls.items():
    try:
      for _ in range(warmup):
        jax.block_until_ready(fn(*args))
      samples[name] = []
    except Exception as error:  # noqa: BLE001
      results[name] = failure(error)
  for _ in range(rounds):
    for name in list(samples):
      fn, args = calls[name]
      try:
        samples[name].append(_back_to_back_ms(fn, args, iters))
      except Exception as error:  # noqa: BLE001
        results[name] = failure(error)
        del samples[name]
  for name, times in samples.items():
    results[name] = _timing(times)
  return {name: results[name] for name in calls}


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> dict:
  """Device-to-device copy ceiling, bytes read + written per second: the
  better of an XLA elementwise pass (``x + 1`` over bf16) and, on CUDA with
  CuPy, ``cudaMemcpyAsync`` device to device timed with CUDA events."""
  x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
  fn = jax.jit(lambda v: v + jnp.ones((), v.dtype))
  timing = time_ms(fn, x, iters=10)
  result = {"bytes": 2 * num_bytes, "xla_elementwise_gbs": 2 * num_bytes / timing["median_ms"] / 1e6,
            "xla_elementwise": timing}
  memcpy = _cupy_memcpy_ms(num_bytes)
  if memcpy is not None:
    result["memcpy_gbs"] = 2 * num_bytes / memcpy / 1e6
  result["gbs"] = max(result["xla_elementwise_gbs"], result.get("memcpy_gbs", 0.0))
  return result


def _cupy_memcpy_ms(num_bytes: int, iters: int = 20) -> float | None:
  if jax.devices()[0].platform != "gpu":
    return None
  try:
    import cupy
  except ImportError:
    return None
  with cupy.cuda.Device(0):
    src = cupy.ones(num_bytes // 2, cupy.float16)
    dst = cupy.empty_like(src)
    samples = []
    for _ in range(5):
      start, stop = cupy.cuda.Event(), cupy.cuda.Event()
      start.record()
      for _ in range(iters):
        dst.data.copy_from_device_async(src.data, num_bytes)
      stop.record()
      stop.synchronize()
      samples.append(cupy.cuda.get_elapsed_time(start, stop) / iters)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
  return statistics.median(samples)


def matmul_tflops(size: int = 8192, dtype=jnp.bfloat16) -> dict:
  """Dense matmul ceiling on random data (never zeros)."""
  keys = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(keys[0], (size, size), dtype)
  b = jax.random.normal(keys[1], (size, size), dtype)
  timing = time_ms(jax.jit(jnp.matmul), a, b, iters=10)
  return {"size": size, "tflops": 2 * size ** 3 / timing["median_ms"] / 1e9, **timing}


def is_clean_commit(commit: str | None) -> bool:
  """Whether ``commit`` (:func:`git_commit`'s) names the code exactly: a
  commit with no uncommitted change to tracked files."""
  return commit is not None and not commit.endswith("+dirty")


def write_result(name: str, payload: dict, results_dir: pathlib.Path = RESULTS_DIR,
                 path: pathlib.Path | None = None) -> pathlib.Path:
  """``results_dir/<name>-<date>-<time>.json``: ``payload`` with the
  benchmark's name and :func:`environment`, marked ``"traceable": false``
  where no clean commit names the code it ran (benchmarks/index.py leaves
  such results out of the index; the source digest is still recorded).
  ``path``: rewrite that file instead (a result written as it grows)."""
  results_dir.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  first = path is None
  path = path or results_dir / f"{name}-{stamp}.json"
  facts = environment()
  traceable = is_clean_commit(facts["commit"])
  if not traceable and first:
    print(f"{path.name}: no clean commit names this code ({facts['commit'] or 'no git checkout'}"
          f"); marked untraceable, source digest {facts['source_digest']}")
  path.write_text(json.dumps({"benchmark": name, "traceable": traceable, "environment": facts,
                              **payload}, indent=2, default=float))
  return path
