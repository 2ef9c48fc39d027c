"""examples/slurm/pretrain.sbatch, run by bash as sbatch would run it, with
stub ``srun`` and ``scontrol`` that record their arguments and environment
(tests/multiprocess/test_multinode.py runs pretrain.py as the tasks srun
would start): srun starts examples/pretrain.py in the submit directory with
the run directory and the script's arguments; --resume only where the run
directory holds an intact checkpoint; a run stopped before its first save is
moved aside on requeue instead of sticking; exit 143 (stopped and saved)
requeues the job; srun gets CPUs per task and the GPU job settings."""

import json
import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "slurm" / "pretrain.sbatch"
# srun: records its working directory, arguments and environment, then runs
# $SRUN_ACTION (what the job's tasks leave behind) and exits $SRUN_EXIT.
SRUN_STUB = """#!/bin/bash
python3 -c 'import json, os, sys; json.dump({"cwd": os.getcwd(), "args": sys.argv[1:],
  "env": dict(os.environ)}, open(os.environ["SRUN_RECORD"], "w"))' "$@"
eval "${SRUN_ACTION:-}"
exit "${SRUN_EXIT:-0}"
"""
SCONTROL_STUB = '#!/bin/sh\necho "$@" >> "$SCONTROL_RECORD"\n'


def run_script(tmp_path, *args, srun_exit=0, srun_action="", **env):
  """Runs the script as job 77 would; returns ``(exit code, stdout, srun's
  record, scontrol's calls)``."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  for name, text in (("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  record, calls = tmp_path / "srun.json", tmp_path / "scontrol"
  record.unlink(missing_ok=True)
  calls.unlink(missing_ok=True)
  env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "XLA_", "NCCL"))},
         "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_RECORD": str(record),
         "SCONTROL_RECORD": str(calls), "SRUN_EXIT": str(srun_exit),
         "SRUN_ACTION": srun_action, "SLURM_SUBMIT_DIR": str(tmp_path),
         "SLURM_JOB_NAME": "moe-ep-pretrain", "SLURM_JOB_ID": "77", "SLURM_CPUS_PER_TASK": "12",
         **env}
  result = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=30)
  srun = json.loads(record.read_text()) if record.exists() else None
  return (result.returncode, result.stdout, srun,
          calls.read_text().splitlines() if calls.exists() else [])


def test_srun_starts_pretrain_in_the_submit_dir_with_the_arguments(tmp_path):
  code, _, srun, calls = run_script(tmp_path, "configs/h200.yaml", "train.batch_size=192")
  assert code == 0 and calls == []
  assert srun["cwd"] == str(tmp_path)
  assert srun["args"] == ["--kill-on-bad-exit=1", "--gpu-bind=none", "--label", "python",
                          "-m", "examples.pretrain", "train.run_dir=runs/moe-ep-pretrain-77",
                          "configs/h200.yaml", "train.batch_size=192"]


def test_tasks_get_their_cpus_and_the_gpu_job_settings(tmp_path):
  _, _, srun, _ = run_script(tmp_path)
  env = srun["env"]
  assert env["SRUN_CPUS_PER_TASK"] == "12"  # srun >= 22.05 does not inherit it
  assert env["NCCL_NVLS_ENABLE"] == "0" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
  # The submitter's own settings win.
  _, _, srun, _ = run_script(tmp_path, XLA_FLAGS="--xla_dump_to=/tmp/d", NCCL_DEBUG="INFO")
  assert srun["env"]["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
  assert srun["env"]["NCCL_DEBUG"] == "INFO"


def test_the_header_asks_for_the_signal_requeue_append_logs_and_cpus():
  header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
  for option in ("--signal=TERM@300", "--requeue", "--open-mode=append", "--cpus-per-task=12",
                 "--ntasks-per-node=8", "--gpus-per-node=8"):
    assert f"#SBATCH {option}" in header, option


def make_checkpoint(run_dir: pathlib.Path, step: int, *, finished: bool = True) -> None:
  """A step folder as Orbax leaves it: finished (with its metadata file) or
  cut short (its temporary name)."""
  name = str(step) if finished else f"{step}.orbax-checkpoint-tmp-1733220000"
  (run_dir / "checkpoints" / name).mkdir(parents=True)
  if finished:
    (run_dir / "checkpoints" / name / "_CHECKPOINT_METADATA").write_text("{}")


def test_resume_only_where_an_intact_checkpoint_exists(tmp_path):
  make_checkpoint(tmp_path / "runs" / "long", 200)
  _, _, srun, _ = run_script(tmp_path, "configs/h200.yaml", RUN_DIR="runs/long")
  assert srun["args"][-3:] == ["train.run_dir=runs/long", "configs/h200.yaml", "--resume"]
  _, _, srun, _ = run_script(tmp_path, "configs/h200.yaml", RUN_DIR="runs/other")
  assert "--resume" not in srun["args"]


def test_a_job_killed_before_its_first_checkpoint_starts_afresh_when_requeued(tmp_path):
  """The requeue sequence: attempt 0 is killed before its first save (metrics,
  an empty checkpoints/ and a cut-short save left behind); SLURM requeues
  it; attempt 1 moves that aside and starts without --resume (which used to
  fail with "no checkpoint", and a fresh start with "holds a run"), saves,
  and is stopped at the time limit (143): the script requeues it; attempt 2
  resumes."""
  run_dir = tmp_path / "runs" / "moe-ep-pretrain-77"
  leave_partial_run = (f"mkdir -p {run_dir}/checkpoints/5.orbax-checkpoint-tmp-1 && "
                       f"echo '{{\"step\": 1}}' > {run_dir}/metrics.jsonl")
  code, _, srun, calls = run_script(tmp_path, srun_exit=137, srun_action=leave_partial_run,
                                    SLURM_RESTART_COUNT="0")
  assert code == 137 and calls == [] and "--resume" not in srun["args"]

  step = run_dir / "checkpoints" / "5"
  save_and_stop = f"mkdir -p {step} && touch {step}/_CHECKPOINT_METADATA"
  code, out, srun, calls = run_script(tmp_path, srun_exit=143, srun_action=save_and_stop,
                                      SLURM_RESTART_COUNT="1")
  aside = tmp_path / "runs" / "moe-ep-pretrain-77.attempt-1-no-checkpoint"
  assert "--resume" not in srun["args"]
  assert (aside / "metrics.jsonl").exists() and not (run_dir / "metrics.jsonl").exists()
  assert ("pretrain.sbatch: runs/moe-ep-pretrain-77 held no checkpoint (stopped before its "
          "first save): moved it to runs/moe-ep-pretrain-77.attempt-1-no-checkpoint; "
          "starting afresh") in out
  assert code == 143 and calls == ["requeue 77"]

  code, _, srun, calls = run_script(tmp_path, SLURM_RESTART_COUNT="2")
  assert code == 0 and calls == [] and srun["args"][-1] == "--resume"


def test_requeues_stop_at_max_requeues_and_failures_are_not_requeued(tmp_path):
  code, _, _, calls = run_script(tmp_path, srun_exit=143, SLURM_RESTART_COUNT="3",
                                 MAX_REQUEUES="3")
  assert code == 143 and calls == []
  code, _, _, calls = run_script(tmp_path, srun_exit=1, SLURM_RESTART_COUNT="0")
  assert code == 1 and calls == []
