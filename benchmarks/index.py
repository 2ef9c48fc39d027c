"""Writes benchmarks/results/INDEX.md: every traceable result kept in
benchmarks/results/ (the ones README.md and docs/ cite), by benchmark folder,
with the benchmark, device, date and commit each file records (a markdown
report's are its JSON twin's; what a file does not record is said so).

    python benchmarks/index.py
    python benchmarks/index.py --trace FILE.json ...

``--trace`` names the commit of results written where git could not (a
copied working tree whose HEAD is older, so the result is marked
untraceable): the commit among the last 300 whose package and kernel
sources have the result's ``source_digest``, recorded as ``traced_commit``.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "INDEX.md"
NOT_RECORDED = "not recorded"


def _record(path: pathlib.Path) -> dict:
  """The JSON a result file's facts come from: itself, its ``.json`` twin,
  or none."""
  source = path if path.suffix == ".json" else path.with_suffix(".json")
  if not source.is_file():
    return {}
  data = json.loads(source.read_text())
  return data if isinstance(data, dict) else {}


def _from_name(path: pathlib.Path) -> tuple[str, str]:
  """``(date, device)`` the file's or its folder's name gives, for what the
  file itself does not record."""
  name = path.relative_to(RESULTS).as_posix()
  date = re.search(r"(20\d\d)(\d\d)(\d\d)(?:-(\d\d)(\d\d))?", name)
  devices = re.search(r"(\d+)x(H\d+)", name)
  if date is None:
    date_text = NOT_RECORDED
  else:
    year, month, day, hour, minute = date.groups()
    date_text = f"{year}-{month}-{day}" + (f" {hour}:{minute}" if hour else "")
  device = f"{devices.group(1)} x {devices.group(2)} (from the name)" if devices else NOT_RECORDED
  return date_text, device


def _commit(record: dict, env: dict) -> str:
  """The commit (10 hex digits, ``+dirty`` where so recorded, or where a
  note beside it says the working tree's changes ran too) a result ran, else
  its source digest, else not recorded."""
  if record.get("traced_commit"):
    return f"{record['traced_commit'][:10]} (by source digest)"
  for value in (env.get("commit"), env.get("kernel_commit"), env.get("code"),
                record.get("git_commit"), record.get("commit")):
    match = re.match(r"([0-9a-f]{7,40})(\+dirty)?", str(value or ""))
    if match:
      dirty = match.group(2) or "working tree" in str(value)
      return match.group(1)[:10] + ("+dirty" if dirty else "")
  digest = env.get("source_digest") or record.get("source_digest")
  return f"source digest {digest}" if digest else NOT_RECORDED


def facts(path: pathlib.Path) -> dict[str, str]:
  """``benchmark``, ``device``, ``date`` and ``commit`` of one result file."""
  record = _record(path)
  env = record.get("environment") if isinstance(record.get("environment"), dict) else {}
  benchmark = record.get("benchmark") or record.get("config")
  if not benchmark:  # the name without its device and date (a sweep's files: its folder's)
    name = path.parent.relative_to(RESULTS).as_posix() if path.stem == "results" else path.stem
    benchmark = re.sub(r"-(\d+x)?H\d+|-?20\d{6}.*", "", name)
  benchmark = str(benchmark).split(" (")[0]
  named_date, named_device = _from_name(path)
  device = env.get("device") or env.get("device_kind") or record.get("device")
  count = env.get("device_count")
  device = f"{count} x {device}" if device and count else (device or named_device)
  date = env.get("date") or record.get("date")
  date = str(date)[:16].replace("T", " ") if date else named_date
  return {"benchmark": benchmark, "device": device, "date": date,
          "commit": _commit(record, env)}


def traceable(path: pathlib.Path) -> bool:
  """Whether a clean commit names the code the file (or its JSON twin) ran:
  one it records (not ``+dirty``; ``benchmarks.common.write_result`` marks
  the others ``"traceable": false``) or the one its source digest was traced
  to (``--trace``)."""
  record = _record(path)
  if record.get("traced_commit"):
    return True
  env = record.get("environment") if isinstance(record.get("environment"), dict) else {}
  return (record.get("traceable", True) is not False
          and re.fullmatch(r"[0-9a-f]{7,10}", _commit(record, env)) is not None)


def source_digest_at(commit: str) -> str:
  """``benchmarks.common.source_digest`` of ``commit``'s tree: the same
  files and bytes, read from git in one batch."""
  from benchmarks.common import digest_sources, source_files  # noqa: PLC0415  (jax)
  names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
  names = source_files(names)
  batch = subprocess.run(["git", "cat-file", "--batch"], cwd=REPO, capture_output=True,
                         check=True, input="".join(f"{commit}:{n}\n" for n in names).encode()
                         ).stdout
  sources, at = {}, 0
  for name in names:  # each: "<sha> blob <size>\n", the bytes, "\n"
    header_end = batch.index(b"\n", at)
    size = int(batch[at:header_end].split()[2])
    sources[name] = batch[header_end + 1:header_end + 1 + size]
    at = header_end + 1 + size + 1
  return digest_sources(sources)


def trace(path: pathlib.Path, depth: int = 300) -> str | None:
  """Records in ``path`` the commit whose sources have its ``source_digest``
  (the newest of the last ``depth``); returns it, or None where none has."""
  record = json.loads(path.read_text())
  digest = (record.get("environment") or {}).get("source_digest")
  commits = subprocess.run(["git", "rev-list", "-n", str(depth), "HEAD"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
  for commit in commits if digest else ():
    if source_digest_at(commit) == digest:
      record["traced_commit"] = commit
      path.write_text(json.dumps(record, indent=2))
      return commit
  return None


def result_files() -> list[pathlib.Path]:
  """The indexed results: every file kept but the index and untraceable ones."""
  return sorted(p for p in RESULTS.rglob("*")
                if p.is_file() and p != INDEX and traceable(p))


def render() -> str:
  lines = ["# Benchmark results", "",
           "The results README.md and docs/ cite, by benchmark (older ones are in git's",
           "history). Generated by `python benchmarks/index.py` from the files themselves.",
           ""]
  for folder in sorted({p.parent for p in result_files()}):
    lines += [f"## {folder.relative_to(RESULTS).as_posix()}", "",
              "| file | benchmark | device | date | commit |", "|---|---|---|---|---|"]
    for path in result_files():
      if path.parent == folder:
        row = facts(path)
        lines.append(f"| [{path.name}]({path.relative_to(RESULTS).as_posix()}) | "
                     f"{row['benchmark']} | {row['device']} | {row['date']} | {row['commit']} |")
    lines.append("")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if argv[:1] == ["--trace"]:
    for name in argv[1:]:
      commit = trace(pathlib.Path(name))
      print(f"{name}: {commit or 'no commit of the last 300 has its source digest'}")
    return
  INDEX.write_text(render())
  print(f"wrote {INDEX}")


if __name__ == "__main__":
  if not __package__:  # run as a file: the checkout, not benchmarks/, heads sys.path
    sys.path[0] = str(REPO)
  main(sys.argv[1:])
