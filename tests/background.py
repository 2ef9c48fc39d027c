"""Slow subprocess jobs started when collection ends, so they run on the
second core while the single-process tests run on the first.

A test module opts in by defining ``background_jobs(item) -> {name: fn}``;
after collection, each selected item's jobs are submitted once (in collection
order, one at a time: the CI machine has two cores), and the test takes the
job's result with :func:`result`, which runs the job itself if nothing
started it (e.g. a single test run on its own).
"""

import concurrent.futures
import threading

_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bg-job")
_futures: dict[str, concurrent.futures.Future] = {}
_lock = threading.Lock()


def submit(name: str, fn) -> concurrent.futures.Future:
  with _lock:
    if name not in _futures:
      _futures[name] = _executor.submit(fn)
    return _futures[name]


def result(name: str, fn):
  """The result of job ``name`` (re-raising its error in the calling test)."""
  return submit(name, fn).result()


def start_for(items) -> None:
  for item in items:
    jobs = getattr(getattr(item, "module", None), "background_jobs", None)
    if jobs is not None:
      for name, fn in jobs(item).items():
        submit(name, fn)
