"""examples/slurm/pretrain.sbatch: srun starts examples/pretrain.py in the
submit directory with the run directory and the script's arguments, adding
--resume where the run directory already holds checkpoints. srun is a stub
here that records its arguments (tests/multiprocess/test_multinode.py runs
pretrain.py as the tasks srun would start)."""

import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "slurm" / "pretrain.sbatch"
SRUN_STUB = '#!/bin/sh\nprintf "%s\\n" "$PWD" "$@" > "$SRUN_ARGS"\n'


def srun_arguments(tmp_path, *args, **env) -> list[str]:
  """The stub srun's working directory and arguments when the script runs
  (as sbatch would, in job 77) with ``args`` and ``env``."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "srun").write_text(SRUN_STUB)
  (bin_dir / "srun").chmod(0o755)
  record = tmp_path / "srun_args"
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_ARGS": str(record),
         "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NAME": "moe-ep-pretrain",
         "SLURM_JOB_ID": "77", **env}
  subprocess.run(["bash", str(SCRIPT), *args], env=env, check=True, timeout=30)
  return record.read_text().splitlines()


def test_srun_starts_pretrain_in_the_submit_dir_with_the_arguments(tmp_path):
  cwd, *args = srun_arguments(tmp_path, "configs/h200.yaml", "train.batch_size=192")
  assert cwd == str(tmp_path)
  assert args == ["--kill-on-bad-exit=1", "--gpu-bind=none", "--label", "python", "-m",
                  "examples.pretrain", "train.run_dir=runs/moe-ep-pretrain-77",
                  "configs/h200.yaml", "train.batch_size=192"]


def test_a_run_dir_with_checkpoints_is_resumed(tmp_path):
  (tmp_path / "runs" / "long" / "checkpoints").mkdir(parents=True)
  _, *args = srun_arguments(tmp_path, "configs/h200.yaml", RUN_DIR="runs/long")
  assert args[-3:] == ["train.run_dir=runs/long", "configs/h200.yaml", "--resume"]
  _, *args = srun_arguments(tmp_path, "configs/h200.yaml", RUN_DIR="runs/other")
  assert "--resume" not in args
