"""examples/pretrain.py: the loss falls, resuming reproduces an uninterrupted
run, outputs are written, the data stream is a pure function of (seed, step, row)."""

import json

import jax
import numpy as np
import pytest

from tiny_run import TINY_YAML, fast_overrides
from examples import pretrain
from examples.data import ByteCorpus, SyntheticCorpus
from examples.train_config import load_config

STEPS = 6


def config(run_dir, *extra):
  return load_config(TINY_YAML, fast_overrides(run_dir, f"train.steps={STEPS}",
                                               "train.checkpoint_every=3", *extra))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("uninterrupted")
  return run_dir, pretrain.train(config(run_dir), progress=False)


def test_loss_falls_below_the_first_step(uninterrupted):
  _, result = uninterrupted
  losses = [record["ce_loss"] for record in result.records]
  assert len(losses) == STEPS
  assert losses[-1] < losses[0] - 0.1, losses


def test_run_writes_metrics_per_step_plot_summary_and_checkpoints(uninterrupted):
  run_dir, result = uninterrupted
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  num_moe_layers, num_experts = 2, 8
  for record in records:
    assert {"loss", "ce_loss", "aux_loss", "z_loss", "tokens_per_s",
            "dropped_fraction"} <= set(record)
    load = np.array(record["expert_load"])
    assert load.shape == (num_moe_layers, num_experts)
    np.testing.assert_allclose(load.sum(axis=1), 1.0, rtol=1e-6)
  assert (run_dir / "metrics.png").stat().st_size > 0
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["steps"] == STEPS and summary["peak_memory_bytes"] > 0
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["3", "6"]


def test_expert_bias_moves_per_layer_outside_the_optimizer(uninterrupted):
  _, result = uninterrupted
  bias = np.asarray(result.state["model"]["groups"]["moe_block"]["moe"]["expert_bias"][...])
  assert bias.shape == (2, 8)
  assert np.abs(bias).max() > 0
  assert not np.array_equal(bias[0], bias[1])  # each layer from its own load
  optimizer_state = jax.tree_util.keystr(result.state["optimizer"])
  assert "expert_bias" not in optimizer_state


def test_resume_reproduces_the_uninterrupted_losses_and_state(uninterrupted, tmp_path):
  _, expected = uninterrupted
  first = pretrain.train(config(tmp_path), stop_at=3, progress=False)
  second = pretrain.train(config(tmp_path), resume=True, progress=False)
  assert [r["step"] for r in second.records] == [4, 5, 6]
  assert ([r["loss"] for r in first.records + second.records]
          == [r["loss"] for r in expected.records])
  for got, want in zip(jax.tree.leaves(second.state), jax.tree.leaves(expected.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  steps = [json.loads(line)["step"]
           for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(1, STEPS + 1))


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    pretrain.train(config(tmp_path), resume=True, progress=False)


@pytest.mark.parametrize("corpus", ["synthetic", "bytes"])
def test_rows_are_a_pure_function_of_seed_step_and_row(corpus, tmp_path):
  if corpus == "synthetic":
    make = lambda seed: SyntheticCorpus(vocab_size=64, seq_len=16, num_topics=2,
                                        successors=3, seed=seed)
  else:
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)))
    make = lambda seed: ByteCorpus(text, seq_len=16, seed=seed)
  batch = make(0).rows(step=5, start=0, stop=8)
  assert batch.shape == (8, 17) and batch.dtype == np.int32
  np.testing.assert_array_equal(make(0).rows(step=5, start=2, stop=6), batch[2:6])
  assert not np.array_equal(make(0).rows(step=6, start=0, stop=8), batch)
  assert not np.array_equal(make(1).rows(step=5, start=0, stop=8), batch)


def test_command_line_takes_a_config_overrides_and_a_data_file(capsys):
  config, resume = pretrain.parse_args([str(TINY_YAML), "moe.top_k=4", "train.steps=80",
                                        "--data", "some file.txt", "--resume"])
  assert (config.moe.top_k, config.train.steps, config.data.path, resume) == (
      4, 80, "some file.txt", True)
  with pytest.raises(SystemExit):
    pretrain.parse_args(["moe.top_kk=4"])
  assert "unknown key 'moe.top_kk'" in capsys.readouterr().err


def test_a_fresh_run_in_a_used_run_dir_starts_over(tmp_path):
  pretrain.train(config(tmp_path), stop_at=3, progress=False)
  again = pretrain.train(config(tmp_path), stop_at=3, progress=False)
  assert [r["step"] for r in again.records] == [1, 2, 3]
  assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
