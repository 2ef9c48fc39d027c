"""examples/ablate.py: sweep files expand to named variants, and a sweep
writes a markdown table, a CSV and a PNG with one row / curve per variant;
every variant is checked before any trains, and a bad sweep file or override
is one line."""

import csv
import json

import jax
import pytest
import yaml

from test_pretrain import interrupt_at
from tiny_run import FAST_OVERRIDES, TINY_YAML, skip_unless_devices_fit
from examples.ablate import (COLUMNS, NOT_AVAILABLE, Sweep, ablate, main, markdown_table,
                             parse_args)
from examples.train_config import load_config

pytestmark = pytest.mark.slow


def write_sweep(path, **sections):
  path.write_text(yaml.safe_dump({"base": str(TINY_YAML), **sections}, sort_keys=False))
  return path


def test_variants_cross_the_grid_and_apply_overrides_first(tmp_path):
  sweep = Sweep.load(write_sweep(
      tmp_path / "sweep.yaml", overrides={"train.steps": 5},
      variants={"a": {"moe.top_k": 1}, "b": {}}, grid={"moe.capacity_factor": [None, 2.0]}))
  variants = sweep.variant_overrides()
  assert list(variants) == ["a,capacity_factor=null", "a,capacity_factor=2.0",
                            "b,capacity_factor=null", "b,capacity_factor=2.0"]
  assert variants["a,capacity_factor=2.0"] == [
      "train.steps=5", "moe.top_k=1", "moe.capacity_factor=2.0"]


SWEEPS = sorted((TINY_YAML.parent / "ablations").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_shipped_sweep_expands_to_valid_configs(path):
  sweep = Sweep.load(path)
  variants = sweep.variant_overrides()
  assert len(variants) >= 2, path.name  # a sweep compares something
  for name, overrides in variants.items():
    config = load_config(sweep.base, overrides)  # raises ConfigError naming the key
    for override in overrides:  # each top-level setting reaches the config
      key, value = override.split("=", 1)
      section, field = key.split(".", 1)
      if "." in field:  # a nested one, e.g. moe.remat.save
        continue
      got = getattr(getattr(config, section), field)
      assert json.dumps(list(got) if isinstance(got, tuple) else got) == value, (name, key)


def test_sweep_file_errors_name_the_key_and_the_variant(tmp_path):
  with pytest.raises(ValueError, match="unknown key 'variant'"):
    Sweep.load(write_sweep(tmp_path / "a.yaml", variant={}))
  bad = write_sweep(tmp_path / "b.yaml", variants={"typo": {"moe.top_kk": 1}})
  with pytest.raises(ValueError, match=r"variant 'typo'.*moe\.top_kk"):
    ablate(bad, out_dir=tmp_path / "out", echo=False)


def test_two_variant_sweep_writes_table_csv_and_png(tmp_path):
  overrides = {key: yaml.safe_load(value) for key, value in
               (item.split("=", 1) for item in FAST_OVERRIDES)}
  sweep = write_sweep(tmp_path / "sweep.yaml",
                      # The program of test_pretrain's run: compiled once per session.
                      overrides={**overrides, "train.steps": 6, "train.checkpoint_every": 0,
                                 "train.peak_tflops": 0.01},
                      variants={"scan": {"model.scan_layers": True},
                                "loop": {"model.scan_layers": False}})
  skip_unless_devices_fit(load_config(TINY_YAML, FAST_OVERRIDES))
  out = tmp_path / "out"
  results = ablate(sweep, out_dir=out, echo=False)
  assert [r.name for r in results] == ["scan", "loop"]

  table = (out / "results.md").read_text().splitlines()
  rows = [line for line in table if line.startswith("| ")]
  assert len(rows) == 3  # header + 2 variants
  assert rows[1].startswith("| scan |") and rows[2].startswith("| loop |")
  with (out / "results.csv").open() as file:
    records = list(csv.DictReader(file))
  assert [r["variant"] for r in records] == ["scan", "loop"]
  assert list(records[0]) == list(COLUMNS)
  for record, result, row in zip(records, results, rows[1:]):
    assert float(record["median_step_ms"]) > 0 and float(record["peak_memory_mib"]) > 0
    assert float(record["final_loss"]) > 0 and float(record["tokens_per_s"]) > 0
    assert result.summary["mfu"] > 0
    assert float(record["mfu"]) == pytest.approx(result.summary["mfu"])
    assert f"| {result.summary['mfu']:.1%} |" in row
  assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for name in ("scan", "loop"):
    assert json.loads((out / name / "summary.json").read_text())["steps"] == 6


def test_mfu_without_a_known_peak_shows_as_not_available():
  row = {key: 1.0 for key in COLUMNS} | {"variant": "cpu", "mfu": None}
  assert markdown_table([row]).splitlines()[-1].split(" | ")[list(COLUMNS).index("mfu")] == (
      NOT_AVAILABLE)


def test_command_line_takes_overrides_before_and_after_the_sweep_file_and_flags():
  args = parse_args(["train.steps=20", "configs/ablations/remat.yaml", "--processes", "2",
                     "moe.top_k=1"])
  assert (args.sweep, args.overrides, args.processes) == (
      "configs/ablations/remat.yaml", ["train.steps=20", "moe.top_k=1"], 2)
  with pytest.raises(SystemExit):
    parse_args(["train.steps=20"])  # no sweep file
  with pytest.raises(SystemExit):
    parse_args(["a.yaml", "b.yaml"])


def test_an_out_dir_holding_an_earlier_sweep_is_refused_before_anything_trains(tmp_path):
  sweep = write_sweep(tmp_path / "sweep.yaml", overrides={"train.steps": 5},
                      variants={"a": {}, "b": {"moe.top_k": 1}})
  out = tmp_path / "out"
  (out / "b").mkdir(parents=True)
  (out / "b" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n"
                                           + json.dumps({"step": 5}) + "\n")
  with pytest.raises(FileExistsError, match=r"b holds a run \(steps 1-5\) of an earlier sweep"):
    ablate(sweep, out_dir=out, echo=False)
  assert sorted(p.name for p in out.iterdir()) == ["b"]  # variant a did not train


def run_main(args, capsys) -> tuple[int, str]:
  try:
    code = main(args)
  except SystemExit as exit_:
    code = exit_.code
  return code, capsys.readouterr().err


def test_every_variant_is_checked_on_its_devices_before_any_trains(tmp_path, capsys):
  sweep = write_sweep(tmp_path / "sweep.yaml", overrides={"train.steps": 2},
                      variants={"fits": {}, "ep3": {"mesh.ep": 3}})
  count = jax.device_count()
  code, err = run_main([str(sweep), "--out", str(tmp_path / "out")], capsys)
  assert code == 2
  assert err.startswith(f"ablate.py: error: sweep {sweep}, variant 'ep3': MeshConfig dp=None "
                        f"ep=3 does not tile the {count} devices") and len(err.splitlines()) == 1
  assert not (tmp_path / "out").exists()  # variant 'fits' did not train


@pytest.mark.parametrize("text, args, message", [
    ("base: {tiny}\nvariants: [a, b]\n", [], "{sweep}: variants must be a mapping, got ['a', 'b']"),
    ("base: {tiny}\nvariants:\n  a: 5\n", [],
     "{sweep}: variants.a must be a mapping of dotted.key: value (or empty), got 5"),
    ("base: {tiny}\nvariants:\n  a: {{}}\n  a: {{}}\n", [],
     "{sweep}, line 4, column 3: duplicate key 'a'"),
    ("base: {tiny}\nvariants: {{a: [}}\n", [], "{sweep}, line 2, column "),
    ("variants: {{}}\n", [], "{sweep}: needs a 'base' config file, got None"),
    ("base: {tiny}\n", ["moe.top_k=100"],
     "sweep {sweep}, variant 'base': MoEConfig.top_k=100 must be <= num_experts=8"),
    ("base: {tiny}\n", ["train.learning_rate=1e-3", "moe=5"],
     "sweep {sweep}, variant 'base': override 'moe=5': moe is a section"),
])
def test_a_bad_sweep_or_override_is_one_line(tmp_path, capsys, text, args, message):
  sweep = tmp_path / "sweep.yaml"
  sweep.write_text(text.format(tiny=TINY_YAML))
  code, err = run_main([str(sweep), *args, "--out", str(tmp_path / "out")], capsys)
  assert code == 2 and err.startswith(f"ablate.py: error: {message.format(sweep=sweep)}"), err
  assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_sigterm_during_a_variant_saves_it_and_exits_143(tmp_path, monkeypatch, capsys):
  overrides = {key: yaml.safe_load(value) for key, value in
               (item.split("=", 1) for item in FAST_OVERRIDES)}
  sweep = write_sweep(tmp_path / "sweep.yaml",
                      overrides={**overrides, "train.steps": 6, "train.checkpoint_every": 3},
                      variants={"a": {}, "b": {"moe.top_k": 1}})
  skip_unless_devices_fit(load_config(TINY_YAML, FAST_OVERRIDES))
  interrupt_at(monkeypatch, 2, "signal", signal_name="SIGTERM")
  assert main([str(sweep), "--out", str(tmp_path / "out")]) == 143
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("variant 1/2: a (6 steps, in this process")
  assert lines[-1].startswith("interrupted: the sweep stopped")
  assert sorted(p.name for p in (tmp_path / "out" / "a" / "checkpoints").iterdir()) == ["2"]
  assert not (tmp_path / "out" / "b").exists()


def _fake_result(name, steps):
  from examples.ablate import VariantResult
  summary = {"median_step_s": 0.1, "peak_memory_bytes": 2**20, "final_loss": 2.0,
             "dropped_fraction": 0.0, "tokens_per_s": 1e4, "mfu": None, "compile_s": 1.0,
             "steps_this_run": steps, "mesh": {"dp": 1, "ep": 8}, "processes": 1,
             "backend": "cpu"}
  return VariantResult(name, summary, [{"step": s, "ce_loss": 2.0} for s in range(1, steps + 1)])


@pytest.mark.parametrize("steps, flagged", [(20, True), (50, True), (51, False)])
def test_a_sweep_shows_each_variant_as_it_starts_and_flags_timings_from_too_few_steps(
    tmp_path, monkeypatch, capsys, steps, flagged):
  from examples import ablate as ablate_module
  sweep = write_sweep(tmp_path / "sweep.yaml", overrides={"train.steps": steps},
                      variants={"a": {}, "b": {"moe.top_k": 1}})
  started = []

  def run_variant(name, config, overrides, **kwargs):
    started.append((name, capsys.readouterr().out))  # what showed before it trained
    return _fake_result(name, steps)

  monkeypatch.setattr(ablate_module, "run_variant", run_variant)
  ablate(sweep, out_dir=tmp_path / "out")
  assert [name for name, _ in started] == ["a", "b"]
  assert started[0][1].startswith(f"variant 1/2: a ({steps} steps, in this process; run dir ")
  assert started[1][1].splitlines()[-1].startswith("variant 2/2: b (")
  results_md = (tmp_path / "out" / "results.md").read_text()
  out = capsys.readouterr().out
  for text in (results_md, out):
    rows = [line for line in text.splitlines() if line.startswith("| a ") or line.startswith("| b ")]
    assert all(line.endswith(f"| {steps - 1}{' (too few)' * flagged} |") for line in rows), rows
    assert ("timed steps" in text) and (("fewer than 50 timed steps" in text) == flagged)


def test_a_variants_missing_data_file_is_found_before_any_trains(tmp_path, capsys):
  """The second variant's data file is missing: refused in one line naming the
  variant, before the first trains (it used to fail after it had trained,
  naming no variant and writing no results.md)."""
  (tmp_path / "text.txt").write_text("some text to train on, " * 40)
  sweep = write_sweep(tmp_path / "sweep.yaml", overrides={"train.steps": 2},
                      variants={"text": {"data.path": str(tmp_path / "text.txt"),
                                         "model.vocab_size": 256},
                                "missing": {"data.path": str(tmp_path / "nope.txt"),
                                            "model.vocab_size": 256}})
  code, err = run_main([str(sweep), "--out", str(tmp_path / "out")], capsys)
  assert code == 2
  assert err == (f"ablate.py: error: sweep {sweep}, variant 'missing': data.path="
                 f"'{tmp_path}/nope.txt': No such file or directory\n")
  assert not (tmp_path / "out").exists()
