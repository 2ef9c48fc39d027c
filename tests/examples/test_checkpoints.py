"""examples/checkpoints.py: a checkpoint is read back before an older one is
deleted, and a resume falls back past a step that does not restore, holds
non-finite values or does not match its fingerprint, setting it aside.

The states are a few small arrays sharded over the 8 CPU devices (no model),
so each test takes about a second."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tiny_run  # noqa: F401  (puts the repository on sys.path)
from examples.checkpoints import (MAX_FAILED_SAVES_IN_ROW, RunCheckpoints, SavesFailing,
                                  abstract_like, state_fingerprint)
from examples.train_config import ConfigError


def make_state(seed: int) -> dict:
  """``{"w": [8, 6] float32 over 8 devices, "b": [5] bfloat16, "count": int32}``."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("ep",))
  rng = np.random.default_rng(seed)
  return {
      "w": jax.device_put(rng.normal(size=(8, 6)).astype(np.float32),
                          NamedSharding(mesh, P("ep"))),
      "b": jax.device_put(jnp.asarray(rng.normal(size=5), jnp.bfloat16),
                          NamedSharding(mesh, P())),
      "count": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P())),
  }


def reference_fingerprint(state: dict) -> list[int]:
  """The documented formula in numpy (uint64 arithmetic, then mod 2**32):
  per leaf, sum of bits[i] * (2 i + 1) * 0x9E3779B1 over row-major i."""
  sums = []
  for leaf in jax.tree.leaves(state):
    value = np.asarray(leaf)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[value.dtype.itemsize]
    bits = value.view(unsigned).ravel().astype(np.uint64)
    weights = (2 * np.arange(bits.size, dtype=np.uint64) + 1) * np.uint64(0x9E3779B1)
    sums.append(int((bits * (weights % 2**32)).sum() % 2**32))
  return sums


def assert_same(got: dict, want: dict):
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def test_fingerprint_follows_its_formula_and_sees_any_one_flipped_bit():
  state = make_state(0)
  fingerprint, finite = state_fingerprint(state)
  assert fingerprint == reference_fingerprint(state) and finite
  w = np.asarray(state["w"])
  for index in [(0, 0), (3, 5), (7, 5)]:
    for bit in (0, 22, 31):  # mantissa, exponent-adjacent, sign: the sign bit's
      flipped = w.copy()     # change of 2**31 needs odd weights to show
      flipped.view(np.uint32)[index] ^= np.uint32(1 << bit)
      changed = {**state, "w": jax.device_put(flipped, state["w"].sharding)}
      assert state_fingerprint(changed)[0][2] != fingerprint[2], (index, bit)
  assert state_fingerprint({**state, "b": state["b"].at[1].set(jnp.nan)})[1] is False


def saved(tmp_path, steps, **kwargs) -> tuple[RunCheckpoints, dict, list[str]]:
  """A RunCheckpoints with ``make_state(step)`` saved at each of ``steps``."""
  lines = []
  checkpoints = RunCheckpoints(tmp_path / "checkpoints", report=lines.append, **kwargs)
  for step in steps:
    assert checkpoints.save(step, make_state(step), data_step=step)
  return checkpoints, lines


def test_save_keeps_the_newest_steps_and_deletes_only_after_the_read_back(tmp_path,
                                                                            monkeypatch):
  checkpoints, lines = saved(tmp_path, [1, 2, 3], max_to_keep=2)
  assert sorted(checkpoints.manager.all_steps()) == [2, 3] and lines == []
  # Step 4 is written but reads back wrong (as a failing disk would return it):
  # it is deleted, and steps 2 and 3 are kept.
  real_restore = RunCheckpoints._restore

  def damaged_read(self, step, abstract_state):
    restored, position = real_restore(self, step, abstract_state)
    if step == 4:
      restored["state"]["w"] = restored["state"]["w"] + 1
    return restored, position

  monkeypatch.setattr(RunCheckpoints, "_restore", damaged_read)
  assert checkpoints.save(4, make_state(4), data_step=4) is False
  assert lines == ["checkpoint 4 does not match the fingerprint it was saved with: deleted what "
                   "it left and kept the older checkpoints; 1 failed save so far, the run goes on"]
  assert sorted(checkpoints.manager.all_steps()) == [2, 3]
  assert checkpoints.failed_saves == 1
  monkeypatch.setattr(RunCheckpoints, "_restore", real_restore)
  assert checkpoints.save(5, make_state(5), data_step=5)
  assert sorted(checkpoints.manager.all_steps()) == [3, 5]
  checkpoints.close()


def test_save_refuses_a_non_finite_state(tmp_path):
  checkpoints, _ = saved(tmp_path, [1])
  state = make_state(2)
  state["w"] = state["w"].at[0, 0].set(jnp.inf)
  with pytest.raises(ValueError, match="step 2: the state holds non-finite values; not saved"):
    checkpoints.save(2, state, data_step=2)
  assert sorted(checkpoints.manager.all_steps()) == [1]
  checkpoints.close()


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  """The files holding the arrays of checkpoint ``step_dir`` (OCDBT data files)."""
  return [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


def truncate(path: pathlib.Path):
  path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def rewrite_step_with_one_value_changed(checkpoints: RunCheckpoints, step: int):
  """Checkpoint ``step``'s data changed after it was fingerprinted, as bytes
  that still decode (silent corruption) leave it: one value of ``w`` differs
  from the one saved, the recorded fingerprint is the original's."""
  state, position = checkpoints._restore(step, abstract_like(make_state(step)))
  state["state"]["w"] = state["state"]["w"].at[2, 3].add(1.0)
  checkpoints.manager.delete(step)
  checkpoints.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state["state"]), position=ocp.args.JsonSave(position)))
  checkpoints.manager.wait_until_finished()


def write_non_finite_step(checkpoints: RunCheckpoints, step: int):
  """A step holding NaN, as this trainer wrote them before its guard (no fingerprint)."""
  state = make_state(step)
  state["w"] = state["w"] * jnp.nan
  checkpoints.manager.delete(step)
  checkpoints.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      position=ocp.args.JsonSave({"step": step, "data_step": step})))
  checkpoints.manager.wait_until_finished()


DAMAGES = {
    "truncated data files": (lambda ck, step_dir: [truncate(p) for p in data_files(step_dir)],
                             "does not restore ("),
    "missing data files": (lambda ck, step_dir: [p.unlink() for p in data_files(step_dir)],
                           "does not restore ("),
    "silently changed value": (lambda ck, step_dir: rewrite_step_with_one_value_changed(ck, 2),
                               "does not match the fingerprint it was saved with"),
    "non-finite values": (lambda ck, step_dir: write_non_finite_step(ck, 2),
                          "holds non-finite values"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_falls_back_past_a_damaged_newest_step_and_sets_it_aside(tmp_path, damage):
  checkpoints, _ = saved(tmp_path, [1, 2])
  damage_fn, reason = DAMAGES[damage]
  damage_fn(checkpoints, checkpoints.directory / "2")
  checkpoints.close()

  lines = []
  resumed = RunCheckpoints(tmp_path / "checkpoints", report=lines.append)
  state, step, data_step = resumed.restore_newest_intact(abstract_like(make_state(1)))
  assert (step, data_step) == (1, 1)
  assert_same(state, make_state(1))
  aside = tmp_path / "checkpoints-unusable" / "2"
  (line,) = lines
  assert line.startswith(f"checkpoint 2 {reason}") and line.endswith(
      f"; moved it to {aside}; trying step 1"), line
  assert "\n" not in line and len(line) < 400
  assert aside.is_dir() and sorted(resumed.manager.all_steps()) == [1]
  # Training on saves step 2 again, where the damaged one was.
  assert resumed.save(2, make_state(2), data_step=2)
  assert_same(resumed.restore(2, abstract_like(make_state(2)))[0], make_state(2))
  resumed.close()


def test_no_intact_step_is_an_error_naming_every_step(tmp_path):
  checkpoints, _ = saved(tmp_path, [1, 2])
  for step in (1, 2):
    for path in data_files(checkpoints.directory / str(step)):
      path.unlink()
  checkpoints.close()
  resumed = RunCheckpoints(tmp_path / "checkpoints")
  with pytest.raises(FileNotFoundError, match=r"no intact checkpoint in .* \(steps 2, 1 are "
                                              r"unusable\)"):
    resumed.restore_newest_intact(abstract_like(make_state(1)))
  assert sorted(p.name for p in (tmp_path / "checkpoints-unusable").iterdir()) == ["1", "2"]


def test_setting_aside_never_reuses_a_taken_name(tmp_path):
  """Step 2 set aside by two earlier resumes (``2`` and ``2-2`` taken, with
  something in each): the third goes to ``2-3`` and both earlier ones stay."""
  checkpoints, _ = saved(tmp_path, [1, 2])
  for path in data_files(checkpoints.directory / "2"):
    truncate(path)
  checkpoints.close()
  unusable = tmp_path / "checkpoints-unusable"
  for taken in ("2", "2-2"):
    (unusable / taken).mkdir(parents=True)
    (unusable / taken / "earlier").write_text(taken)
  lines = []
  resumed = RunCheckpoints(tmp_path / "checkpoints", report=lines.append)
  _, step, _ = resumed.restore_newest_intact(abstract_like(make_state(1)))
  assert step == 1 and lines[0].endswith(f"; moved it to {unusable / '2-3'}; trying step 1")
  assert sorted(p.name for p in unusable.iterdir()) == ["2", "2-2", "2-3"]
  for taken in ("2", "2-2"):
    assert (unusable / taken / "earlier").read_text() == taken
  assert (unusable / "2-3" / "state").is_dir()
  resumed.close()


def block_directory(directory: pathlib.Path) -> pathlib.Path:
  """Moves ``directory`` aside and puts a file in its place (a save there
  fails for real, as on a full or broken disk); returns where it went."""
  aside = directory.with_name(directory.name + "-moved")
  directory.rename(aside)
  directory.write_text("not a directory")
  return aside


def unblock_directory(directory: pathlib.Path, aside: pathlib.Path) -> None:
  directory.unlink()
  aside.rename(directory)


def test_a_failed_save_is_one_line_and_counted_until_too_many_in_a_row(tmp_path):
  checkpoints, lines = saved(tmp_path, [1, 2])
  directory = checkpoints.directory
  aside = block_directory(directory)
  assert checkpoints.save(3, make_state(3), data_step=3) is False
  (line,) = lines
  assert line.startswith("checkpoint 3 was not saved (") and line.endswith(
      "): deleted what it left and kept the older checkpoints; 1 failed save so far, the run "
      "goes on"), line
  assert "\n" not in line and len(line) < 400
  assert (checkpoints.failed_saves, checkpoints.failed_in_row) == (1, 1)
  unblock_directory(directory, aside)
  assert checkpoints.save(4, make_state(4), data_step=4)  # a save that works resets the row
  assert (checkpoints.failed_saves, checkpoints.failed_in_row) == (1, 0)
  aside = block_directory(directory)
  for step in (5, 6):
    assert checkpoints.save(step, make_state(step), data_step=step) is False
  with pytest.raises(SavesFailing) as error:
    checkpoints.save(7, make_state(7), data_step=7)
  assert str(error.value).startswith(f"{MAX_FAILED_SAVES_IN_ROW} checkpoint saves in a row "
                                     "failed (the last: checkpoint 7 was not saved (")
  assert checkpoints.failed_saves == 4 and len(lines) == 3
  unblock_directory(directory, aside)
  assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [2, 4]
  assert_same(RunCheckpoints(directory).restore(4, abstract_like(make_state(4)))[0],
              make_state(4))


def test_a_checkpoints_path_that_is_a_file_is_refused_in_one_line(tmp_path):
  (tmp_path / "checkpoints").write_text("")
  with pytest.raises(FileExistsError, match=r"^.*/checkpoints is not a directory: no checkpoint "
                                            r"could be saved; move it away"):
    RunCheckpoints(tmp_path / "checkpoints")


@pytest.mark.parametrize("other_state, difference", [
    (lambda state: {**state, "w": jax.ShapeDtypeStruct((8, 7), jnp.float32,
                                                        sharding=state["w"].sharding)},
     "w is float32[8, 6] there and float32[8, 7] in this model"),
    (lambda state: {key: state[key] for key in ("w", "count")},
     "it holds b, which this model does not"),
    (lambda state: {**state, "extra": state["b"]}, "it lacks extra"),
])
def test_a_checkpoint_of_another_model_is_refused_and_left_in_place(tmp_path, other_state,
                                                                     difference):
  """Not damaged, only another model (a resume with a changed config where
  config.yaml is gone): nothing is moved to checkpoints-unusable."""
  checkpoints, lines = saved(tmp_path, [1, 2])
  checkpoints.close()
  resumed = RunCheckpoints(tmp_path / "checkpoints", report=lines.append)
  with pytest.raises(ConfigError) as error:
    resumed.restore_newest_intact(other_state(abstract_like(make_state(1))))
  assert str(error.value) == (
      f"--resume: checkpoint 2 in {resumed.directory} was saved from another model: "
      f"{difference}; resume with the config it was trained with, or start a new run (the "
      "checkpoints are left as they are)")
  assert lines == [] and not (tmp_path / "checkpoints-unusable").exists()
  assert sorted(resumed.manager.all_steps()) == [1, 2]
  resumed.close()


@pytest.mark.slow
def test_a_run_on_a_full_disk_goes_on_then_stops_in_one_line(tmp_path):
  """pretrain.py with every file limited to 16 KiB (RLIMIT_FSIZE: writes past
  it fail with EFBIG, as on a full disk; the metrics stay below it): each
  failed save is one line and the run goes on, the third in a row stops it
  with exit code 1 and one line (it used to end in pages of tracebacks)."""
  import resource
  import subprocess
  import sys
  from tiny_run import REPO, fast_overrides

  def limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

  run_dir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "examples.pretrain",
       *fast_overrides(run_dir, "train.steps=8", "train.checkpoint_every=2")],
      capture_output=True, text=True, cwd=REPO, timeout=300, preexec_fn=limit_file_size,
      env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  lines = result.stderr.splitlines()
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr and len(lines) == 3, result.stderr[-3000:]
  for step, line in zip((2, 4), lines):
    assert line.startswith(f"checkpoint {step} was not saved (") and line.endswith(
        f"failed save{'s' * (step == 4)} so far, the run goes on"), line
  assert lines[2].startswith("pretrain.py: error: 3 checkpoint saves in a row failed (the last: "
                             "checkpoint 6 was not saved (") and lines[2].endswith(
      f": stopped; no checkpoint was saved (metrics in {run_dir.resolve()}/)"), lines[2]
  # Stopped at the third failed save (step 6), its metrics written first.
  metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in metrics] == list(range(1, 7))
  assert "step 7/8" not in result.stdout
