"""examples/pretrain.py: the command lines, config files and run directories
that used to end in a traceback (or a misleading message) are one line,
exit code 2, before anything compiles."""

import pytest

from test_pretrain import argv, config
from test_pretrain_failures import run_main
from examples import pretrain

pytestmark = pytest.mark.slow  # the resume case trains a run first


@pytest.mark.parametrize("override, message", [
    ("train.final_lr_fraction=abc", "TrainConfig.final_lr_fraction='abc' must be a finite "
                                    "number >= 0.0"),
    ("train.final_lr_fraction=[1]", "TrainConfig.final_lr_fraction=(1,) must be a finite "
                                    "number >= 0.0"),
    ("train.final_lr_fraction={a: 1}", "TrainConfig.final_lr_fraction={'a': 1} must be a finite "
                                       "number >= 0.0"),
    ("train.final_lr_fraction=true", "TrainConfig.final_lr_fraction=True must be a finite "
                                     "number >= 0.0"),
    ("train.final_lr_fraction=1.5", "TrainConfig.final_lr_fraction=1.5 must be in [0, 1]"),
    ("model.attention={a: 1}", "ModelConfig.attention={'a': 1} must be one of ('auto', 'xla', "
                               "'cudnn')"),
])
def test_a_value_of_the_wrong_type_is_one_line(tmp_path, capsys, override, message):
  code, err = run_main(argv(tmp_path / "run", override), capsys)
  assert code == 2 and err == f"pretrain.py: error: {message}\n", err
  assert not (tmp_path / "run").exists()


def test_a_config_file_whose_keys_mix_types_is_one_line(tmp_path, capsys):
  path = tmp_path / "mixed.yaml"
  path.write_text("1: 2\nfoo: 3\n")
  code, err = run_main([str(path)], capsys)
  assert code == 2 and err == ("pretrain.py: error: unknown key config.1 (known: ['data', "
                               "'mesh', 'model', 'moe', 'train'])\n"), err


def test_a_run_dir_that_is_a_file_or_holds_a_directory_for_a_file_is_one_line(tmp_path, capsys):
  (tmp_path / "file").write_text("")
  code, err = run_main(argv(tmp_path / "file"), capsys)
  assert code == 2 and err == (f"pretrain.py: error: train.run_dir='{tmp_path}/file' is a file, "
                               "not a directory; choose another train.run_dir\n"), err
  (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
  code, err = run_main(argv(tmp_path / "run"), capsys)
  assert code == 2 and err == (f"pretrain.py: error: {tmp_path}/run/metrics.jsonl is not a file, "
                               "so the run cannot write it; move it away or choose another "
                               "train.run_dir\n"), err


def test_a_dangling_latest_link_is_named_as_such(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs").mkdir()
  (tmp_path / "runs" / "tiny-latest").symlink_to("tiny-20261203-101010")
  code, err = run_main(argv(None, "--resume"), capsys)
  assert code == 2 and err == (
      "pretrain.py: error: --resume: no earlier run of tiny to continue (runs/tiny-latest "
      "points to tiny-20261203-101010, which is not a directory); name its directory with "
      "train.run_dir=...\n"), err


def test_resume_with_checkpoints_off_says_so_not_no_checkpoint(tmp_path, capsys):
  pretrain.train(config(tmp_path), stop_at=3, progress=False)  # checkpoint 3
  code, err = run_main(argv(tmp_path, "train.checkpoint_every=0", "--resume"), capsys)
  assert code == 2 and err == (
      "pretrain.py: error: --resume restores a checkpoint and saves more, which "
      "train.checkpoint_every=0 turns off: resume with a checkpoint_every > 0\n"), err
