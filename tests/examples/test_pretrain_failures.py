"""examples/pretrain.py when things go wrong, as issue #32 probed it: a step
that is not finite stops the run (or is skipped) and never becomes a
checkpoint; a damaged newest checkpoint is set aside and the run resumes
from the one before it, reproducing the uninterrupted losses; SIGTERM saves
the step in progress; a resume that changes the model is refused naming the
fields; a failed start leaves ``-latest`` alone; every bad command line or
config file gets one line.

The runs share the compiled program of test_pretrain.py's run (one compile
per session); the two that change it (a NaN learning rate, skipping) compile
their own."""

import json
import shutil

import jax
import numpy as np
import pytest

from test_pretrain import STEPS, argv, config, interrupt_at, interrupted_line, losses
from tiny_run import TINY_YAML
from examples import pretrain
from examples import train_program
from examples.checkpoints import RunCheckpoints
from examples.data import make_corpus
from examples.run_control import NonFiniteStep
from examples.run_dir import latest_run_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished run of the tests' config: steps 1-6, checkpoints 3 and 6."""
  run_dir = tmp_path_factory.mktemp("finished")
  return run_dir, pretrain.train(config(run_dir), progress=False)


def copy_run(run_dir, tmp_path):
  target = tmp_path / "run"
  shutil.copytree(run_dir, target)
  return target


def run_main(args, capsys) -> tuple[int, str]:
  """``pretrain.main(args)``'s exit code and stderr (parse errors included)."""
  try:
    code = pretrain.main(args)
  except SystemExit as exit_:
    code = exit_.code
  return code, capsys.readouterr().err


def checkpoint_steps(run_dir) -> list[str]:
  return sorted((p.name for p in (run_dir / "checkpoints").iterdir()), key=int)


def assert_intact(run_dir, steps):
  """Every checkpoint in ``steps`` restores finite and matches its fingerprint."""
  setup, _ = train_program.build_program(train_program.program_config(config(run_dir)),
                                    tuple(jax.devices()))
  checkpoints = RunCheckpoints(run_dir / "checkpoints")
  for step in steps:
    checkpoints.restore_verified(step, setup.abstract_state)
  checkpoints.close()


def test_a_non_finite_step_stops_the_run_unsaved_and_keeps_the_good_checkpoints(
    finished, tmp_path, capsys):
  run_dir = copy_run(finished[0], tmp_path)
  # The probe: --resume with a learning rate that sends the
  # parameters to inf at the first step (1e30: finite, so the config takes it).
  code, err = run_main(argv(run_dir, "train.steps=9", "train.learning_rate=1e30")
                       + ["--resume"], capsys)
  assert code == 1
  (line,) = err.splitlines()
  assert line.startswith("pretrain.py: error: step 7 is not finite (loss ")
  assert "param_norm inf): stopped without saving it; the newest checkpoint is step 6; " \
         "resume from it with: python " in line
  assert checkpoint_steps(run_dir) == ["3", "6"]
  assert_intact(run_dir, [3, 6])
  summary = json.loads((run_dir / "summary.json").read_text())
  assert (summary["nonfinite_step"], summary["steps"]) == (7, 7)
  assert (run_dir / "config.resume-1.yaml").read_text().splitlines()[0] == (
      "# --resume from step 6: train.steps 6 -> 9; train.learning_rate 0.01 -> 1e+30")
  code, err = run_main(argv(run_dir, "train.learning_rate=.nan", "--resume"), capsys)
  assert code == 2 and err == ("pretrain.py: error: TrainConfig.learning_rate=nan must be a "
                               "finite number >= 0.0\n")


class PoisonedCorpus:
  """The run's corpus with out-of-range token ids in the batches of the
  given steps (1-based): the embedding reads NaN, as a corrupt batch would."""

  def __init__(self, corpus, steps, vocab_size: int):
    self.corpus, self.steps, self.vocab_size = corpus, set(steps), vocab_size

  def rows(self, step, start, stop):
    rows = self.corpus.rows(step, start, stop)
    return rows + self.vocab_size if step + 1 in self.steps else rows

  def __getattr__(self, name):
    return getattr(self.corpus, name)


def poison(monkeypatch, *steps):
  monkeypatch.setattr(pretrain, "make_corpus", lambda c, split="train": (
      PoisonedCorpus(make_corpus(c), steps, c.model.vocab_size) if split == "train"
      else make_corpus(c, split)))


def test_a_skipped_step_leaves_the_state_as_it_was_and_is_counted(tmp_path, monkeypatch):
  skipping = lambda run_dir: config(run_dir, "train.skip_nonfinite=1")  # noqa: E731
  before = pretrain.train(skipping(tmp_path / "a"), stop_at=1, progress=False)
  poison(monkeypatch, 2)
  after = pretrain.train(skipping(tmp_path / "b"), stop_at=2, progress=False)
  assert [r.get("skipped", False) for r in after.records] == [False, True]
  assert np.isnan(after.records[1]["loss"])
  assert after.summary["skipped_steps"] == 1 and after.summary["nonfinite_step"] is None
  assert after.summary["final_loss"] == after.records[0]["ce_loss"]  # finite steps only
  # Step 2's update was discarded: the state is step 1's, bit for bit (the
  # optimizer's count and the expert biases included), and it was saved.
  for got, want in zip(jax.tree.leaves(after.state), jax.tree.leaves(before.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert checkpoint_steps(tmp_path / "b") == ["2"]
  # Two in a row are one more than train.skip_nonfinite=1 allows.
  poison(monkeypatch, 2, 3)
  with pytest.raises(NonFiniteStep, match=r"^step 3 is not finite \(loss nan, ") as stop:
    pretrain.train(skipping(tmp_path / "d"), progress=False)
  assert stop.value.checkpoint_step is None and checkpoint_steps(tmp_path / "d") == []


DAMAGES = {
    # 64 flipped bytes in the middle of every data file of the step.
    "flipped bytes": lambda state: [
        path.write_bytes(bytes(b ^ 0xFF if len(data) // 2 <= i < len(data) // 2 + 64 else b
                               for i, b in enumerate(data)))
        for path in state.rglob("*") if path.is_file() and path.parent.name == "d"
        for data in [path.read_bytes()]],
    "missing _METADATA": lambda state: (state / "_METADATA").unlink(),
}


# Orbax's reads of a damaged step that were abandoned finish later on
# TensorStore's threads; examples/checkpoints.py keeps their errors out of the
# run's output, but pytest swaps its own hook in around each test phase, so
# one may reach pytest as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_falls_back_past_a_damaged_checkpoint_and_loses_nothing(
    finished, tmp_path, capsys, damage):
  _, expected = finished
  pretrain.train(config(tmp_path), stop_at=5, progress=False)  # checkpoints 3 and 5
  DAMAGES[damage](tmp_path / "checkpoints" / "5" / "state")
  code, err = run_main(argv(tmp_path, "--resume"), capsys)
  assert code == 0
  (line,) = err.splitlines()
  assert line.startswith("checkpoint 5 ") and line.endswith(
      f"; moved it to {tmp_path.resolve()}/checkpoints-unusable/5; trying step 3"), line
  assert losses(tmp_path) == [r["loss"] for r in expected.records]
  assert checkpoint_steps(tmp_path) == ["3", "6"]


def test_sigterm_lets_the_step_in_progress_finish_then_saves_it(tmp_path, monkeypatch, capsys):
  interrupt_at(monkeypatch, 2, "signal", signal_name="SIGTERM")
  assert pretrain.main(argv(tmp_path)) == 143
  assert interrupted_line(capsys.readouterr().out, "stopped").startswith(
      "stopped by SIGTERM at step 2: saved a checkpoint; resume with:")
  assert checkpoint_steps(tmp_path) == ["2"]
  assert_intact(tmp_path, [2])


def test_resume_with_another_model_is_refused_naming_the_fields(finished, capsys):
  run_dir, _ = finished
  before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
  code, err = run_main(argv(run_dir, "train.steps=9", "moe.top_k=1", "model.dtype=bfloat16",
                            "model.num_layers=4", "--resume"), capsys)
  assert code == 2
  assert err == (f"pretrain.py: error: --resume: {run_dir} was trained with another model or "
                 "computation: model.num_layers 2 -> 4; model.dtype 'float32' -> 'bfloat16'; "
                 "moe.top_k 2 -> 1 (these change the parameters or what a step computes: "
                 "resume with the saved values, or start a new run)\n")
  assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_failed_start_leaves_latest_on_the_run_that_started(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  started = pretrain.train(config(None), stop_at=1, progress=False, name="tiny")
  assert latest_run_dir("tiny") == started.run_dir
  # Refused before a directory is made: a data file that is not there.
  code, err = run_main(argv(None, "model.vocab_size=256", "--data", str(tmp_path / "nope.txt")),
                       capsys)
  assert code == 2 and err == (f"pretrain.py: error: data.path='{tmp_path}/nope.txt': "
                               "No such file or directory\n")
  assert len(list((tmp_path / "runs").iterdir())) == 2  # the run and its link

  # Failing after its directory is made, before its first step.
  def fail(*args):
    raise RuntimeError("the compile failed")

  monkeypatch.setattr(pretrain, "build_program", fail)
  with pytest.raises(RuntimeError, match="the compile failed"):
    pretrain.train(config(None), progress=False, name="tiny")
  assert len(list((tmp_path / "runs").iterdir())) == 3
  assert latest_run_dir("tiny") == started.run_dir
  monkeypatch.undo()
  monkeypatch.chdir(tmp_path)
  resumed = pretrain.train(config(None), resume=True, stop_at=2, progress=False, name="tiny")
  assert resumed.run_dir == started.run_dir and [r["step"] for r in resumed.records] == [2]


BAD_FILES = {
    "bad.yaml": ("train:\n  steps: [5\n", "{path}, line 3, column 1: expected ',' or ']'"),
    "twice.yaml": ("train:\n  steps: 5\n  steps: 7\n",
                   "{path}, line 3, column 3: duplicate key 'steps'"),
    "moe5.yaml": ("moe: 5\n", "config.moe must be a mapping of MoEConfig keys, got 5"),
}


@pytest.mark.parametrize("name", [*BAD_FILES, "a directory"])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, capsys, name):
  text, message = BAD_FILES.get(name, (None, "{path} is a directory, not a YAML file"))
  path = tmp_path / name
  path.mkdir() if text is None else path.write_text(text)
  code, err = run_main([str(path)], capsys)
  assert code == 2 and err.startswith(f"pretrain.py: error: {message.format(path=path)}")
  assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["moe=5"], "override 'moe=5': moe is a section; set its keys (moe.<key>=value)"),
    (["train.grad_clip_norm=.inf"],
     "TrainConfig.grad_clip_norm=inf must be a finite number >= 0.0"),
    (["model.vocab_size=256", "--data", "{tmp}/empty.txt"],
     "data.path='{tmp}/empty.txt': {tmp}/empty.txt has 0 bytes; needs more than "
     "train.seq_len + 1 = 17"),
    (["model.vocab_size=256", "--data", "{tmp}/shards"],
     "data.path='{tmp}/shards': no train*.bin (or other .bin) token shards found in "
     "{tmp}/shards"),
    (["model.vocab_size=256", "--data", "{tmp}/odd.bin"],
     "data.path='{tmp}/odd.bin': {tmp}/odd.bin is 3 bytes: not a whole number of uint16 ids "
     "(set data.token_dtype)"),
    (["train.eval_every=5", "--data", "{tmp}/odd.txt", "model.vocab_size=256"],
     "train.eval_every=5 needs held-out data: set data.eval_path (or train.eval_every=0)"),
])
def test_a_bad_command_line_is_one_line(tmp_path, capsys, args, message):
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "odd.bin").write_bytes(b"abc")
  (tmp_path / "shards").mkdir()
  (tmp_path / "odd.txt").write_bytes(b"abc" * 20)
  args = [arg.format(tmp=tmp_path) for arg in args]
  code, err = run_main(argv(tmp_path / "run", *args), capsys)
  assert code == 2 and err == f"pretrain.py: error: {message.format(tmp=tmp_path)}\n"
  assert not (tmp_path / "run").exists()


def test_resume_of_a_finished_run_is_one_line(finished, capsys):
  run_dir, _ = finished
  code, err = run_main(argv(run_dir, "--resume"), capsys)
  assert code == 2 and err == (
      f"pretrain.py: error: --resume: {run_dir} is finished: its newest checkpoint is step "
      f"{STEPS} and the run ends at step {STEPS}; raise train.steps to train further\n")


def test_the_config_file_is_read_as_yaml_1_2_numbers(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(TINY_YAML.read_text().replace("learning_rate: 0.003", "learning_rate: 3e-3"))
  assert pretrain.parse_args([str(path)])[0].train.learning_rate == 0.003
