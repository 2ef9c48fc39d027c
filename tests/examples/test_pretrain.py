"""examples/pretrain.py: the loss falls, resuming reproduces an uninterrupted
run, outputs are written, every run gets its own directory, Ctrl-C saves the
last step, the data stream is a pure function of (seed, step, row)."""

import json
import pathlib
import re
import shlex
import signal

import jax
import numpy as np
import pytest

from tiny_run import REPO, TINY_YAML, fast_overrides, skip_unless_devices_fit
from flax import nnx

from examples import flops, pretrain, tokenize_text, train_loop, train_program
from examples.run_dir import held_steps
from examples.data import ByteCorpus, SyntheticCorpus, make_corpus
from examples.progress import progress_line
from examples.train_config import load_config

pytestmark = pytest.mark.slow

STEPS = 6
PEAK_TFLOPS = 0.01  # the uninterrupted run's MFU is against this
EVAL_EVERY, EVAL_BATCHES = 3, 2  # the uninterrupted run's held-out loss


def argv(run_dir, *extra) -> list[str]:
  """The command line of the tests' run (steps 1-6, a checkpoint every 3)."""
  return [str(TINY_YAML), *fast_overrides(run_dir, f"train.steps={STEPS}",
                                          "train.checkpoint_every=3", *extra)]


def config(run_dir, *extra):
  return skip_unless_devices_fit(load_config(TINY_YAML, argv(run_dir, *extra)[1:]))


def losses(run_dir) -> list[float]:
  return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("uninterrupted")
  return run_dir, pretrain.train(config(run_dir, f"train.peak_tflops={PEAK_TFLOPS}",
                                        f"train.eval_every={EVAL_EVERY}",
                                        f"train.eval_batches={EVAL_BATCHES}"), progress=False)


def test_loss_falls_below_the_first_step(uninterrupted):
  _, result = uninterrupted
  losses = [record["ce_loss"] for record in result.records]
  assert len(losses) == STEPS
  assert losses[-1] < losses[0] - 0.1, losses


def test_run_writes_metrics_per_step_plot_summary_and_checkpoints(uninterrupted):
  run_dir, result = uninterrupted
  assert result.run_dir == run_dir
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
  assert summary["interrupted"] is False
  dp, ep = summary["mesh"]["dp"], summary["mesh"]["ep"]
  assert dp * ep == jax.device_count() and num_experts % ep == 0
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["3", "6"]


def test_summary_and_records_report_model_flops_and_mfu_against_the_peak(uninterrupted):
  run_dir, _ = uninterrupted
  summary = json.loads((run_dir / "summary.json").read_text())
  flops_per_token = flops.training_flops_per_token(config(run_dir))
  assert summary["flops_per_token"] == flops_per_token
  assert (summary["peak_tflops"], summary["device_kind"]) == (PEAK_TFLOPS,
                                                              jax.devices()[0].device_kind)
  # Tokens/s per device: the global rate over every device of the mesh.
  per_device = summary["tokens_per_s"] / jax.device_count()
  assert summary["model_tflops_per_device"] == pytest.approx(per_device * flops_per_token / 1e12)
  assert summary["mfu"] == pytest.approx(summary["model_tflops_per_device"] / PEAK_TFLOPS)
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    assert record["mfu"] == pytest.approx(
        record["tokens_per_s"] / jax.device_count() * flops_per_token / (PEAK_TFLOPS * 1e12))
    assert f"| MFU {flops.format_mfu(record['mfu'])} |" in progress_line(record)
  assert "MFU" not in progress_line({**record, "mfu": None})  # no known peak: no MFU


def test_peak_rank_load_is_the_largest_rank_share_of_any_step_and_layer(uninterrupted):
  run_dir, result = uninterrupted
  summary = json.loads((run_dir / "summary.json").read_text())
  num_experts = 8
  expected = {}
  for ranks in (2, 4, 8):  # the EP sizes that divide 8 experts
    per_rank = num_experts // ranks
    expected[str(ranks)] = max(
        ranks * sum(layer[rank * per_rank:(rank + 1) * per_rank])
        for record in result.records for layer in record["expert_load"]
        for rank in range(ranks))
  assert summary["peak_rank_load"].keys() == expected.keys()
  for ranks, load in expected.items():
    assert summary["peak_rank_load"][ranks] == pytest.approx(load, rel=1e-12)
    assert load >= 1.0  # some rank holds at least the balanced share


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


def test_a_fresh_run_in_a_used_run_dir_is_refused_and_deletes_nothing(uninterrupted, capsys):
  run_dir, _ = uninterrupted
  before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
  message = (rf"{re.escape(str(run_dir))} holds a run \(steps 1-{STEPS}\); use --resume to "
             r"continue it or choose another train\.run_dir")
  with pytest.raises(FileExistsError, match=message):
    pretrain.train(config(run_dir), progress=False)
  assert pretrain.main(argv(run_dir)) == 2  # the command line: the message, no traceback
  assert re.search(message, capsys.readouterr().err)
  assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_runs_without_a_run_dir_get_their_own_and_resume_takes_the_latest(
    tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  first = pretrain.train(config(None), stop_at=1, progress=False, name="tiny")
  second = pretrain.train(config(None), stop_at=2, progress=False, name="tiny")
  assert first.run_dir != second.run_dir
  for result in (first, second):
    assert result.run_dir.parent == pathlib.Path("runs")
    assert re.fullmatch(r"tiny-\d{8}-\d{6}(-\d+)?", result.run_dir.name), result.run_dir
  assert (tmp_path / "runs" / "tiny-latest").resolve() == (tmp_path / second.run_dir).resolve()
  assert held_steps(first.run_dir) == (1, 1)  # the first run is left as it was

  resumed = pretrain.train(config(None), resume=True, name="tiny")
  assert f"resuming {second.run_dir} from step 2" in capsys.readouterr().out
  assert resumed.run_dir == second.run_dir
  assert [r["step"] for r in resumed.records] == [3, 4, 5, 6]


class InterruptingCorpus:
  """The run's corpus, except that asking for batch ``at`` (0-based, so
  after ``at`` steps) interrupts: ``"raise"`` raises KeyboardInterrupt, as
  Ctrl-C inside the data pipeline would; ``"signal"`` sends this process
  ``signal_name``, as Ctrl-C in a terminal (SIGINT) or a scheduler (SIGTERM) does."""

  def __init__(self, corpus, at: int, how: str, signal_name: str = "SIGINT"):
    self.corpus, self.at, self.how, self.signal_name = corpus, at, how, signal_name

  def rows(self, step, start, stop):
    if step == self.at:
      if self.how == "raise":
        raise KeyboardInterrupt
      signal.raise_signal(signal.Signals[self.signal_name])
    return self.corpus.rows(step, start, stop)

  def __getattr__(self, name):
    return getattr(self.corpus, name)


def interrupt_at(monkeypatch, at: int, how: str, signal_name: str = "SIGINT"):
  # The training rows interrupt; held-out ones (split "eval") do not.
  monkeypatch.setattr(pretrain, "make_corpus", lambda config, split="train": (
      InterruptingCorpus(make_corpus(config), at, how, signal_name) if split == "train"
      else make_corpus(config, split)))


def interrupted_line(output: str, start: str = "interrupted") -> str:
  (line,) = [line for line in output.splitlines() if line.startswith(start)]
  return line


def test_ctrl_c_saves_the_last_step_and_resume_continues_as_if_uninterrupted(
    uninterrupted, tmp_path, monkeypatch, capsys):
  _, expected = uninterrupted
  interrupt_at(monkeypatch, 4, "raise")  # steps 1-4 done, a checkpoint at 3
  assert pretrain.main(argv(tmp_path)) == 130
  output = capsys.readouterr()
  line = interrupted_line(output.out)
  assert line.startswith("interrupted at step 4: saved a checkpoint; resume with: python ")
  assert "Traceback" not in output.out + output.err
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "4"]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert (summary["steps"], summary["interrupted"]) == (4, True)
  assert (tmp_path / "metrics.png").stat().st_size > 0
  assert held_steps(tmp_path) == (1, 4)

  monkeypatch.setattr(pretrain, "make_corpus", make_corpus)
  resume_argv = shlex.split(line.split("resume with: ", 1)[1])[3:]  # less "python -m <module>"
  assert pretrain.main(resume_argv) == 0
  assert losses(tmp_path) == [r["loss"] for r in expected.records]


def test_sigint_lets_the_step_in_progress_finish_then_saves_it(tmp_path, monkeypatch, capsys):
  config(tmp_path)  # skips where the devices cannot split the batch
  handler = signal.getsignal(signal.SIGINT)
  interrupt_at(monkeypatch, 2, "signal")  # batch 2 is made while step 2 runs
  assert pretrain.main(argv(tmp_path)) == 130
  assert interrupted_line(capsys.readouterr().out).startswith(
      "interrupted at step 2: saved a checkpoint; resume with:")
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
  assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
  assert signal.getsignal(signal.SIGINT) is handler  # restored after the run


def test_the_next_step_is_queued_before_a_step_is_read_except_where_its_state_is_used(
    tmp_path, monkeypatch):
  """The loop's host work runs under the device's: step k + 1 is dispatched
  before step k's metrics are read, except after a checkpointed step (3 and
  the last, 6), whose state the host saves first. The records and the saved
  steps are those of the uninterrupted run (checked by its own tests)."""
  events = []
  build = pretrain.build_program

  class LoggedStep:
    def __init__(self, compiled):
      self.compiled = compiled

    def __call__(self, state, batch):
      events.append(("dispatch", len([e for e in events if e[0] == "dispatch"]) + 1))
      return self.compiled(state, batch)

    def __getattr__(self, name):  # memory_analysis() for the summary
      return getattr(self.compiled, name)

  def logged_build(*args):
    setup, train_step = build(*args)
    return setup, LoggedStep(train_step)

  host = train_loop._host
  monkeypatch.setattr(pretrain, "build_program", logged_build)
  monkeypatch.setattr(train_loop, "_host", lambda metrics: (
      events.append(("read", len([e for e in events if e[0] == "read"]) + 1)), host(metrics))[1])
  result = pretrain.train(config(tmp_path), progress=False)
  assert [r["step"] for r in result.records] == list(range(1, STEPS + 1))
  assert sorted((p.name for p in (tmp_path / "checkpoints").iterdir()), key=int) == ["3", "6"]
  # A loop over the steps: what the order must be, one step at a time.
  expected = [("dispatch", 1)]
  for step in range(1, STEPS + 1):
    queued_early = step % 3 != 0 and step < STEPS
    expected += [("dispatch", step + 1)] * queued_early + [("read", step)]
    expected += [("dispatch", step + 1)] * (not queued_early and step < STEPS)
  assert events == expected


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


def test_command_line_takes_the_config_overrides_and_flags_in_any_order(capsys):
  config, resume, name = pretrain.parse_args(["moe.top_k=4", "--resume", str(TINY_YAML),
                                              "train.steps=80", "--data", "some file.txt"])
  assert (config.moe.top_k, config.train.steps, config.data.path, resume, name) == (
      4, 80, "some file.txt", True, "tiny")
  assert pretrain.parse_args([])[2] == "tiny"
  with pytest.raises(SystemExit):
    pretrain.parse_args(["moe.top_kk=4"])
  assert "unknown key 'moe.top_kk'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    pretrain.parse_args([str(TINY_YAML), "other.yaml"])
  assert "give one config file, got 2" in capsys.readouterr().err


def test_a_mesh_that_does_not_fit_the_devices_says_how_to_change_it(tmp_path, capsys):
  count = jax.device_count()
  assert pretrain.main(argv(tmp_path, f"mesh.dp={count + 1}", "mesh.ep=1",
                            f"train.batch_size={8 * count}")) == 2
  error = capsys.readouterr().err
  assert f"does not tile the {count} devices" in error
  assert "mesh.dp=null mesh.ep=null" in error
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in error
  assert not any(tmp_path.iterdir())  # refused before anything was written


def _cross_entropy_f64(logits, tokens) -> float:
  """Mean next-token cross-entropy in float64 numpy."""
  logits = np.asarray(logits, np.float64)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  labels = np.asarray(tokens)[:, 1:]
  return float(-np.take_along_axis(log_probs, labels[..., None], -1).mean())


def test_eval_loss_is_the_held_out_cross_entropy_of_the_state_at_that_step(uninterrupted):
  run_dir, result = uninterrupted
  evals = {r["step"]: r["eval_loss"] for r in result.records if "eval_loss" in r}
  assert sorted(evals) == [3, 6]
  assert (result.summary["eval_loss"], result.summary["eval_step"]) == (evals[6], 6)
  run_config = config(run_dir)
  held_out, train_data = make_corpus(run_config, "eval"), make_corpus(run_config)
  setup, _ = train_program.build_program(train_program.program_config(run_config), tuple(jax.devices()))
  forward = jax.jit(lambda state, tokens: nnx.merge(setup.model_def, state)(tokens))
  shape = (run_config.train.batch_size, run_config.train.seq_len + 1)
  losses = []
  for k in range(EVAL_BATCHES):
    tokens = np.asarray(held_out.rows(k, 0, shape[0]))
    assert not np.array_equal(tokens, train_data.rows(k, 0, shape[0]))  # held out
    batch = train_program.global_batch(held_out, k, sharding=setup.batch_sharding, shape=shape)
    losses.append(_cross_entropy_f64(forward(result.state["model"], batch[:, :-1]), tokens))
  # float32 logits of a 64-token vocabulary: ~1e-6 relative error per term.
  assert evals[6] == pytest.approx(np.mean(losses), rel=1e-5)


def test_tensorboard_events_hold_every_logged_scalar(uninterrupted):
  from tensorboard.backend.event_processing import event_accumulator  # noqa: PLC0415
  run_dir, result = uninterrupted
  events = event_accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
  events.Reload()
  tags = events.Tags()["scalars"]
  assert {"train/loss", "train/ce_loss", "train/dropped_fraction", "train/learning_rate",
          "train/grad_norm", "train/tokens_per_s", "train/mfu", "eval/loss"} <= set(tags)
  for key in ("loss", "ce_loss", "learning_rate", "grad_norm", "tokens_per_s"):
    logged = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))
    # TensorBoard keeps float32 values.
    np.testing.assert_allclose([v for _, v in logged], [r[key] for r in result.records],
                               rtol=1e-6)
  assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("eval/loss")] == [
      (r["step"], r["eval_loss"]) for r in result.records if "eval_loss" in r]
  schedule = train_program.make_schedule(config(run_dir).train)
  np.testing.assert_allclose([r["learning_rate"] for r in result.records],
                             [float(schedule(step)) for step in range(STEPS)], rtol=1e-6)


def test_a_resume_that_changes_the_steps_says_what_it_does_to_the_schedule(tmp_path, capsys):
  pretrain.train(config(tmp_path), stop_at=3, progress=False)
  pretrain.train(config(tmp_path, "train.steps=12"), resume=True, stop_at=4, progress=True)
  out = capsys.readouterr().out
  before = train_program.make_schedule(config(tmp_path).train)(3)
  after = train_program.make_schedule(config(tmp_path, "train.steps=12").train)(3)
  assert (f"schedule: train.steps 6 -> 12: the warm-up and cosine decay are recomputed for "
          f"the whole run, so at step 3 the learning rate goes from {float(before):.3g} "
          f"(the saved schedule) to {float(after):.3g}") in out


def test_token_shards_from_the_script_train_learn_and_resume_bitwise(tmp_path):
  text = (REPO / "README.md").read_text(encoding="utf-8")
  (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
  assert tokenize_text.main([str(tmp_path / "corpus.txt"), str(tmp_path / "shards")]) == 0
  steps = 10
  shard_config = lambda run_dir, *extra: config(
      run_dir, f"data.path={tmp_path / 'shards'}", "model.vocab_size=256",
      f"train.steps={steps}", "train.checkpoint_every=5", "train.eval_every=5",
      "train.eval_batches=1", *extra)
  whole = pretrain.train(shard_config(tmp_path / "whole"), progress=False)
  ce = [r["ce_loss"] for r in whole.records]
  assert ce[-1] < ce[0] - 0.5, ce  # bytes of English: the unigram table alone drops ~1.5
  assert [r["step"] for r in whole.records if "eval_loss" in r] == [5, 10]
  assert whole.records[-1]["eval_loss"] < whole.records[4]["eval_loss"]
  first = pretrain.train(shard_config(tmp_path / "split"), stop_at=5, progress=False)
  second = pretrain.train(shard_config(tmp_path / "split"), resume=True, progress=False)
  assert ([r["loss"] for r in first.records + second.records]
          == [r["loss"] for r in whole.records])
  for got, want in zip(jax.tree.leaves(second.state), jax.tree.leaves(whole.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
