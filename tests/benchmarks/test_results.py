"""benchmarks/results/ holds only what the README and docs/ cite, each cited
by its full path and traceable to a clean commit, and its INDEX.md is what
benchmarks/index.py writes from the files."""

import importlib.util
import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
CITING = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def index_module():
  spec = importlib.util.spec_from_file_location("index", REPO / "benchmarks" / "index.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_index_is_up_to_date_and_lists_every_result():
  index = index_module()
  assert (RESULTS / "INDEX.md").read_text() == index.render(), \
      "run python benchmarks/index.py"
  listed = set(re.findall(r"\]\(([^)]+)\)", index.render()))
  assert listed == {p.relative_to(RESULTS).as_posix() for p in index.result_files()}


def test_index_reads_each_files_benchmark_device_date_and_commit():
  facts = index_module().facts(RESULTS / "ep" / "ep-20261201-093403.json")
  assert facts == {"benchmark": "ep", "device": "2 x NVIDIA H200", "date": "2026-12-01 09:34",
                   "commit": "2639f7f979 (by source digest)"}  # recorded 0c0d370ce4+dirty
  facts = index_module().facts(RESULTS / "tuning" / "grouped-gemm-tiles-1xH200-20261202.json")
  assert facts["commit"] == "07942d7"  # a short hash, as a scratch driver recorded it


def test_every_kept_result_is_cited_and_every_cited_result_is_kept():
  text = "\n".join(path.read_text() for path in CITING)
  for path in RESULTS.rglob("*"):
    if path.is_file() and path.name != "INDEX.md":
      relative = path.relative_to(RESULTS).as_posix()
      twin = path.with_suffix(".md" if path.suffix == ".json" else ".json")  # one report
      assert relative in text or twin.relative_to(RESULTS).as_posix() in text, relative
  cited = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:json|md|csv|png))`", text))
  for name in cited:
    if name.startswith("benchmarks/results/"):
      assert (REPO / name).is_file(), name
  assert len([name for name in cited if name.startswith("benchmarks/results/")]) > 20


def test_every_result_is_cited_by_its_full_path():
  """``benchmarks/results/ep/x.json``, never ``ep/x.json`` or ``x.json``: a
  reader finds the file from the text alone."""
  kept = {path.relative_to(RESULTS).as_posix() for path in RESULTS.rglob("*") if path.is_file()}
  names = {relative.rsplit("/", 1)[-1] for relative in kept}
  for doc in CITING:
    for quoted in re.findall(r"`([^`\s]+\.(?:json|md|csv|png))`", doc.read_text()):
      short = quoted in kept or quoted in names
      assert not short or quoted == "INDEX.md", (
          f"{doc.relative_to(REPO)} cites {quoted!r}: write benchmarks/results/<folder>/<file>")


def test_index_hides_results_no_clean_commit_names(tmp_path, monkeypatch):
  """Traceable: a clean commit recorded, or a commit traced by source
  digest; not a ``+dirty`` one, one beside a note that the working tree ran
  too, none at all, or a mark of ``"traceable": false``."""
  index = index_module()
  monkeypatch.setattr(index, "RESULTS", tmp_path)
  monkeypatch.setattr(index, "INDEX", tmp_path / "INDEX.md")
  (tmp_path / "ep").mkdir()
  env = {"device": "NVIDIA H200", "device_count": 1, "date": "2026-12-03T10:00:00"}
  records = {
      "clean": {"traceable": True, "environment": {**env, "commit": "0c0d370ce4aa"}},
      "short": {"environment": {**env, "code": "07942d7"}},
      "traced": {"traceable": False, "traced_commit": "2639f7f979d6",
                 "environment": {**env, "commit": "0c0d370ce4aa+dirty"}},
      "dirty": {"traceable": False, "environment": {**env, "commit": "0c0d370ce4aa+dirty"}},
      "noted": {"environment": {**env, "code": "bf152a6 plus the working tree's fp8.cu"}},
      "unrecorded": {"environment": env},
  }
  for name, record in records.items():
    (tmp_path / "ep" / f"{name}.json").write_text(json.dumps({"benchmark": "ep", **record}))
  (tmp_path / "ep" / "dirty.md").write_text("the dirty run's report")  # its JSON twin's
  (tmp_path / "ep" / "plot.png").write_bytes(b"no record of its own")
  assert [p.name for p in index.result_files()] == ["clean.json", "short.json", "traced.json"]
  assert "dirty" not in index.render() and "clean.json" in index.render()


def test_every_kept_result_is_traceable():
  """A cited figure names the code it ran: every kept file (a report by its
  JSON twin) records a clean commit or was traced to one."""
  index = index_module()
  for path in RESULTS.rglob("*"):
    if path.is_file() and path.name != "INDEX.md":
      assert index.traceable(path), f"{path}: no clean commit; --trace it, or stop citing it"


def test_a_traced_commit_has_the_results_source_digest():
  """``index.py --trace`` records the commit whose sources hash to the
  result's digest; recomputed here from git (where the history is there)."""
  import subprocess
  index = index_module()
  traced = [(path, json.loads(path.read_text())) for path in RESULTS.rglob("*.json")]
  traced = [(path, record) for path, record in traced
            if isinstance(record, dict) and record.get("traced_commit")]
  assert traced  # the models results of 2026-12-03 are traced this way
  for path, record in traced:
    try:
      digest = index.source_digest_at(record["traced_commit"])
    except subprocess.CalledProcessError:
      continue  # a shallow clone without that commit
    assert digest == record["environment"]["source_digest"], path


def test_a_commits_digest_from_git_is_the_digest_of_its_checkout(tmp_path):
  """``index.source_digest_at`` (git's tree) and ``common.source_digest`` (the
  files on disk, what a benchmark records) choose the same files: HEAD
  exported, then digested from disk."""
  import subprocess
  import tarfile
  from benchmarks import common  # noqa: PLC0415  (jax)
  archive = tmp_path / "head.tar"
  subprocess.run(["git", "archive", "-o", str(archive), "HEAD"], cwd=REPO, check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(tmp_path / "head", filter="data")
  assert index_module().source_digest_at("HEAD") == common.source_digest(tmp_path / "head")
