"""examples/run_dir.py: new run directories, the -latest link, what an
earlier run left (edge states included), and the configs kept per resume."""

import datetime
import json

import pytest

from tiny_run import TINY_YAML
from examples.run_dir import (check_resumed_config, held_steps, latest_link, latest_run_dir,
                              link_latest, new_run_dir, run_configs, write_run_config)
from examples.train_config import ConfigError, load_config

NOW = datetime.datetime(2026, 12, 2, 13, 59, 16)


def test_a_new_run_dir_is_not_linked_until_link_latest(tmp_path):
  first = new_run_dir("tiny", root=tmp_path, now=NOW)
  second = new_run_dir("tiny", root=tmp_path, now=NOW)
  assert (first.name, second.name) == ("tiny-20261202-135916", "tiny-20261202-135916-2")
  assert latest_run_dir("tiny", root=tmp_path) is None
  link_latest(first, "tiny", root=tmp_path)
  assert latest_run_dir("tiny", root=tmp_path) == first
  link_latest(second, "tiny", root=tmp_path)
  assert latest_run_dir("tiny", root=tmp_path) == second
  assert str(latest_link("tiny", tmp_path).readlink()) == second.name  # relative
  # The name README and docs give users: runs/<config name>-latest, and no
  # other file left beside it (the partial link is renamed onto it).
  assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name, "tiny-latest"]
  assert (tmp_path / "tiny-latest").resolve() == second.resolve()


def test_held_steps_of_edge_states(tmp_path):
  assert held_steps(tmp_path / "missing") is None
  (tmp_path / "metrics.jsonl").write_text("")  # a run that stopped before its first step
  assert held_steps(tmp_path) is None
  (tmp_path / "checkpoints" / "5").mkdir(parents=True)
  (tmp_path / "checkpoints" / "10").mkdir()
  (tmp_path / "checkpoints" / "10.orbax-checkpoint-tmp-1").mkdir()
  assert held_steps(tmp_path) == (5, 10)  # the metrics are empty: the checkpoints tell
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s}) for s in (1, 2, 3)))
  assert held_steps(tmp_path) == (1, 3)


def test_each_resume_keeps_its_config_beside_the_first(tmp_path):
  config = load_config(TINY_YAML)
  write_run_config(tmp_path, config, resumed_from=None, changes=[])
  write_run_config(tmp_path, config, resumed_from=250,
                   changes=["train.learning_rate 0.003 -> 0.001"])
  for k in range(2, 12):  # numbers, not names, order them
    write_run_config(tmp_path, config, resumed_from=250 + k, changes=[])
  paths = run_configs(tmp_path)
  assert [p.name for p in paths] == ["config.yaml"] + [f"config.resume-{k}.yaml"
                                                        for k in range(1, 12)]
  assert paths[1].read_text().splitlines()[0] == (
      "# --resume from step 250: train.learning_rate 0.003 -> 0.001")
  assert load_config(paths[1]) == load_config(paths[0]) == config


def test_a_resume_never_overwrites_an_earlier_config(tmp_path):
  config = load_config(TINY_YAML)
  (tmp_path / "config.resume-7.yaml").write_text("# kept\n")
  (tmp_path / "config.resume-x.yaml").write_text("# not a resume's\n")
  assert write_run_config(tmp_path, config, resumed_from=3, changes=[]).name == (
      "config.resume-8.yaml")
  assert (tmp_path / "config.resume-7.yaml").read_text() == "# kept\n"
  assert [p.name for p in run_configs(tmp_path)] == ["config.resume-7.yaml",
                                                      "config.resume-8.yaml"]


def test_resume_compares_with_the_newest_saved_config(tmp_path):
  config = load_config(TINY_YAML)
  assert check_resumed_config(tmp_path, config) == []  # nothing saved: nothing to compare
  write_run_config(tmp_path, config, resumed_from=None, changes=[])
  faster = load_config(TINY_YAML, ["train.learning_rate=1e-2"])
  assert check_resumed_config(tmp_path, faster) == ["train.learning_rate 0.003 -> 0.01"]
  write_run_config(tmp_path, faster, resumed_from=100, changes=[])
  assert check_resumed_config(tmp_path, faster) == []
  with pytest.raises(ConfigError, match=(
      rf"^--resume: {tmp_path} was trained with another model or computation: "
      r"model\.d_model 64 -> 128; moe\.hidden_size 64 -> 128; moe\.num_experts 8 -> 4 "
      r"\(these change the parameters")):
    check_resumed_config(tmp_path, load_config(TINY_YAML, [
        "model.d_model=128", "moe.hidden_size=128", "moe.num_experts=4"]))


def test_a_dangling_latest_link_is_no_run(tmp_path):
  """The run the link names was deleted (or the link points at a file): no
  latest run, rather than a path that does not exist."""
  run = new_run_dir("tiny", root=tmp_path, now=NOW)
  link_latest(run, "tiny", root=tmp_path)
  run.rmdir()
  assert latest_link("tiny", tmp_path).is_symlink()
  assert latest_run_dir("tiny", root=tmp_path) is None
  run.write_text("not a run")
  assert latest_run_dir("tiny", root=tmp_path) is None
  latest_link("tiny", tmp_path).unlink()
  latest_link("tiny", tmp_path).mkdir()  # a directory, not a link
  assert latest_run_dir("tiny", root=tmp_path) is None
