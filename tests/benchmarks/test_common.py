"""Which code a benchmark result ran (``common.source_digest`` over a copy of
the checkout's sources, and the mark on a result no clean commit names), and
how ``common.time_interleaved`` takes its rounds."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import pytest

from benchmarks import common

REPO = pathlib.Path(__file__).resolve().parents[2]


def copy_sources(target: pathlib.Path) -> pathlib.Path:
  for folder in ("moe_ep", "kernels", "benchmarks"):
    shutil.copytree(REPO / folder, target / folder,
                    ignore=shutil.ignore_patterns("__pycache__", "results"))
  shutil.copy2(REPO / "pyproject.toml", target / "pyproject.toml")
  return target


def test_source_digest_names_the_code_not_the_folder(tmp_path):
  first = copy_sources(tmp_path / "a")
  second = copy_sources(tmp_path / "b")
  digest = common.source_digest(first)
  assert digest == common.source_digest(REPO) == common.source_digest(second)
  assert len(digest) == 16 and int(digest, 16) >= 0
  (second / "README.md").write_text("not source")  # outside the package and kernels
  (second / "moe_ep" / "__pycache__").mkdir(exist_ok=True)
  (second / "moe_ep" / "__pycache__" / "x.pyc").write_bytes(b"\0")
  assert common.source_digest(second) == digest
  kernel = second / "kernels" / "peer_dispatch.cu"
  kernel.write_bytes(kernel.read_bytes() + b" ")  # one byte more in a kernel
  edited = common.source_digest(second)
  assert edited != digest
  kernel.rename(second / "kernels" / "peer_dispatch2.cu")  # the same bytes under another name
  assert common.source_digest(second) not in (digest, edited)
  (second / "pyproject.toml").unlink()
  assert common.source_digest(second) is None  # not a source checkout


def test_source_digest_covers_the_benchmarks_where_they_are_a_package(tmp_path):
  """A benchmark's code is part of what a result ran; a tree from before the
  benchmarks left moe_ep/ (its benchmarks/ a folder of scripts, no package)
  keeps the digest its results recorded: there benchmarks/ counts for nothing."""
  tree = copy_sources(tmp_path / "tree")
  digest = common.source_digest(tree)
  program = tree / "benchmarks" / "models.py"
  program.write_bytes(program.read_bytes() + b" ")
  edited = common.source_digest(tree)
  assert edited != digest
  (tree / "benchmarks" / "__init__.py").unlink()
  without_package = common.source_digest(tree)
  shutil.rmtree(tree / "benchmarks")
  assert without_package == common.source_digest(tree) not in (digest, edited)


@pytest.mark.parametrize("commit, traceable", [
    ("0c0d370ce4aa", True), ("0c0d370ce4aa+dirty", False), (None, False)])
def test_write_result_marks_a_result_without_a_clean_commit(tmp_path, monkeypatch, commit,
                                                            traceable):
  monkeypatch.setattr(common, "git_commit", lambda *args: commit)
  path = common.write_result("unit", {"median_ms": 1.5}, tmp_path)
  record = json.loads(path.read_text())
  assert record["traceable"] is traceable and record["environment"]["commit"] == commit
  assert record["median_ms"] == 1.5 and record["environment"]["source_digest"]


def test_time_interleaved_times_every_call_in_each_round_and_keeps_going_past_a_failure():
  """Rounds visit the calls in turn (the order a drift must reach alike), each
  round gives each call one sample, and a call that raises is reported
  without stopping the others (the reference: the order of a loop over
  rounds and calls, written out)."""
  order = []

  def call(name):
    def fn(x):
      order.append(name)
      return x + 1
    return fn

  def fails_in_round_two(x):
    order.append("flaky")
    if order.count("flaky") > 2:  # the warm-up and round one's first call pass
      raise RuntimeError("out of memory")
    return x

  x = jnp.zeros(())
  calls = {"a": (call("a"), (x,)), "flaky": (fails_in_round_two, (x,)), "b": (call("b"), (x,))}
  timings = common.time_interleaved(calls, iters=2, rounds=3, warmup=1)
  assert list(timings) == ["a", "flaky", "b"]
  warmup = ["a", "flaky", "b"]
  round_one = ["a", "a", "flaky", "flaky", "b", "b"]  # flaky's second call raises
  later_rounds = ["a", "a", "b", "b"] * 2
  assert order == warmup + round_one + later_rounds
  assert timings["flaky"] == {"error": "RuntimeError: out of memory"}
  for name in "ab":
    assert len(timings[name]["samples_ms"]) == 3
    assert timings[name]["min_ms"] <= timings[name]["median_ms"]
