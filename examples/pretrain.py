"""Pretrains a small Mixture-of-Experts language model with moe_ep.

    python -m examples.pretrain                          # configs/tiny.yaml, 8 virtual CPU devices
    python -m examples.pretrain configs/small_gpu.yaml train.steps=2000 moe.top_k=4
    python -m examples.pretrain --data some.txt          # byte-level on a text file
    python -m examples.pretrain data.path=data/corpus    # token shards (examples/tokenize_text.py)
    python -m examples.pretrain --resume                 # continue the latest run of tiny.yaml
    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 4 -- \\
        python -m examples.pretrain

Each run gets its own directory, ``runs/<config name>-<YYYYmmdd-HHMMSS>``
(``runs/<config name>-latest`` links the newest), or ``train.run_dir=...``;
it holds ``config.yaml``, Orbax ``checkpoints/``, ``metrics.jsonl`` (one line
per step, with the held-out loss every ``train.eval_every`` steps),
TensorBoard event files, ``metrics.png`` (a panel per training signal; see
docs/data_and_logs.md) and ``summary.json`` (with the model FLOPs per token and the MFU against the
device's dense bf16 peak, ``examples/flops.py``). The mesh fits the devices
present (``mesh.dp``/``mesh.ep`` null).

Nothing good is lost: Ctrl-C (SIGINT) or SIGTERM (a scheduler's time limit;
``moe_ep.launch`` sends SIGTERM) finishes the step in progress, saves it and
exits with code 130 or 143, every process at the same step; ``--resume``
continues from there. A step whose loss, gradient norm or parameters are not
finite stops the run unsaved, exit code 1 (``train.skip_nonfinite`` skips a few
instead). Every checkpoint is read back before an older one is deleted, and
``--resume`` falls back past a damaged one. ``--resume`` refuses a config that
changes the model (naming the fields); schedule changes are recorded in
``config.resume-<k>.yaml``. ``runs/<config name>-latest`` moves once a run's
first step is done.
"""

from __future__ import annotations

import os
import pathlib
import sys

import argparse
import dataclasses
import functools
import json
import shlex
import textwrap
import time

import jax

if not __package__:  # run as a file: python examples/pretrain.py (examples/script_form.py)
  import script_form
  script_form.checkout_first()

from examples import flops, plots
from examples import mesh as device_mesh
from examples.checkpoints import RunCheckpoints, SavesFailing
from examples.metrics_log import (MetricsLog, require_wandb, tensorboard_writer,
                                  wandb_run)
from examples.run_dir import (check_resumed_config, choose_run_dir, latest_link,
                              run_configs, write_run_config)
from examples.run_lock import lock_run_dir, release_all, release_run_dir
from examples.data import make_corpus
from examples.run_control import (FINITE_METRICS, SIGNAL_EXIT_CODES, Interrupted,
                                  NonFiniteStep)
from examples.run_summary import FINAL_LOSS_WINDOW, device_peak_tflops, summarize
from examples.train_config import (DEFAULT_CONFIG, Config, ConfigError, load_config,
                                   split_config_path)
from examples.train_loop import LoopResult, Run, train_loop
from examples.train_program import (build_program, make_schedule, parameter_count,
                                    peak_memory_bytes, program_config)
from moe_ep.config import to_dict
from moe_ep import distributed, launch


@dataclasses.dataclass
class RunResult:
  """What :func:`train` returns (on every process).

  Attributes:
    records: one metrics dict per step run by this call.
    summary: the run summary also written to ``summary.json``.
    state: final ``{"model": nnx.State, "optimizer": nnx.State}``.
    run_dir: where the outputs went.
  """

  records: list[dict]
  summary: dict
  state: dict
  run_dir: pathlib.Path


def _read_records(path: pathlib.Path, up_to_step: int) -> list[dict]:
  if not path.exists():
    return []
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [r for r in records if r["step"] <= up_to_step]


def _si(value: float) -> str:
  """``2.75e9`` -> ``"2.75 G"``, ``940032`` -> ``"940 k"``."""
  for exponent, prefix in ((12, "T"), (9, "G"), (6, "M"), (3, "k")):
    if value >= 10**exponent:
      return f"{value / 10**exponent:.3g} {prefix}"
  return f"{value:.3g} "


def open_corpus(config: Config, split: str = "train"):
  """The run's corpus (:func:`make_corpus`; ``split="eval"``: its held-out
  data, None where there is none); a data file that cannot be used raises
  :class:`ConfigError` naming ``data.path`` (``data.eval_path``)."""
  try:
    return make_corpus(config) if split == "train" else make_corpus(config, split)
  except (OSError, ValueError) as error:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    key = "data.path" if split == "train" or config.data.eval_path is None else "data.eval_path"
    raise ConfigError(f"{key}={getattr(config.data, key[5:])!r}: {reason}") from None


def _is_intact(state) -> bool:
  """Whether no buffer of ``state`` was donated away (by a step interrupted
  between taking the state and returning the next one)."""
  return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def schedule_change_note(run_dir: pathlib.Path, config: Config, start: int) -> str | None:
  """What resuming ``run_dir`` at step ``start`` with ``config`` does to the
  learning-rate schedule, where it changes (None where it does not)."""
  saved = run_configs(run_dir)
  if not saved:
    return None
  before, after = load_config(saved[-1]).train, config.train
  keys = ("steps", "warmup_steps", "learning_rate", "final_lr_fraction")
  changed = [f"train.{key} {getattr(before, key)} -> {getattr(after, key)}" for key in keys
             if getattr(before, key) != getattr(after, key)]
  if not changed:
    return None
  old_rate, new_rate = float(make_schedule(before)(start)), float(make_schedule(after)(start))
  final = after.learning_rate * after.final_lr_fraction
  return (f"schedule: {', '.join(changed)}: the warm-up and cosine decay are recomputed for "
          f"the whole run, so at step {start} the learning rate goes from {old_rate:.3g} "
          f"(the saved schedule) to {new_rate:.3g}, and decays to {final:.3g} at step "
          f"{after.steps}")


def describe_config(config: Config, width: int = 100) -> str:
  """The resolved config, compactly: one wrapped ``section: key=value ...`` line
  per section (nested mappings as ``remat.save=[...]``), each value as an
  override would spell it.

  >>> print(describe_config(Config()).splitlines()[-1])
    mesh: dp=null ep=null
  """
  lines = []
  for section, values in to_dict(config).items():
    flat = []
    for key, value in values.items():
      items = value.items() if isinstance(value, dict) else [(None, value)]
      for sub, item in items:
        name = key if sub is None else f"{key}.{sub}"
        flat.append(f"{name}={json.dumps(item)}")  # YAML: pastes back as an override
    lines.append(textwrap.fill(" ".join(flat), width, initial_indent=f"  {section}: ",
                               subsequent_indent=" " * (len(section) + 4),
                               break_on_hyphens=False, break_long_words=False))
  return "config:\n" + "\n".join(lines)


def start_run(config: Config, *, resume: bool, stop_at: int | None, progress: bool, name: str,
              devices, announce: bool = True) -> Run:
  """Checks the run, chooses its directory, compiles its step, prints the
  start-up lines (with ``progress`` and ``announce``) and creates or restores
  its state (see :func:`train`)."""
  wall_start = time.perf_counter()
  is_main = jax.process_index() == 0
  say = (functools.partial(print, flush=True) if progress and announce and is_main
         else lambda *_: None)
  # Checkpoint notices (a damaged step set aside) show even without progress.
  notice = functools.partial(print, file=sys.stderr, flush=True) if is_main else say
  devices = jax.devices() if devices is None else list(devices)
  # Device-count and data errors before anything is written.
  mesh_shape = device_mesh.mesh_shape(config, devices)
  corpus = open_corpus(config)
  eval_corpus = open_corpus(config, "eval") if config.train.eval_every else None
  try:
    require_wandb(config.train.wandb_project)
  except ValueError as error:
    raise ConfigError(str(error)) from None
  if config.train.eval_every and eval_corpus is None:
    raise ConfigError(f"train.eval_every={config.train.eval_every} needs held-out data: set "
                      "data.eval_path (or train.eval_every=0)")
  run_dir, created = choose_run_dir(config.train.run_dir, name, resume=resume)
  lock_run_dir(run_dir)  # one run per directory, until this process exits or the run ends
  config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                 run_dir=str(run_dir)))
  changes = check_resumed_config(run_dir, config) if resume else []
  train_config = config.train
  every = train_config.checkpoint_every
  checkpoints = RunCheckpoints(run_dir / "checkpoints", report=notice) if every else None
  end = train_config.steps if stop_at is None else min(stop_at, train_config.steps)
  if resume:
    if not checkpoints:
      raise ConfigError("--resume restores a checkpoint and saves more, which "
                        "train.checkpoint_every=0 turns off: resume with a checkpoint_every > 0")
    newest = checkpoints.latest_step()
    if newest is None:
      raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    if newest >= end:
      raise ConfigError(f"--resume: {run_dir} is finished: its newest checkpoint is step "
                        f"{newest} and the run ends at step {end}; raise train.steps to "
                        "train further")

  say(f"run dir: {run_dir}"
      + (f" ({latest_link(name)} links to it once its first step is done)" if created else ""))
  say(describe_config(config))
  processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  chosen = f" ({config.mesh.chosen})" if config.mesh.chosen else ""
  say(f"mesh: dp={mesh_shape[0]} x ep={mesh_shape[1]} over {len(devices)} "
      f"{devices[0].platform} device{'s' * (len(devices) != 1)}{processes}{chosen}")
  if train_config.warmup_steps_used != train_config.warmup_steps:
    used = train_config.warmup_steps_used
    say(f"note: train.warmup_steps={train_config.warmup_steps} is not below "
        f"train.steps={train_config.steps}: warming up over {used} step{'s' * (used != 1)} "
        "(steps // 10) instead")
  say(corpus.describe())
  if eval_corpus is not None:
    say(f"eval every {train_config.eval_every} steps on {train_config.eval_batches} held-out "
        f"batch{'es' * (train_config.eval_batches != 1)}: {eval_corpus.describe()}")
  say("compiling the train step...")
  compile_start = time.perf_counter()
  setup, train_step = build_program(program_config(config), tuple(devices))
  compile_s = time.perf_counter() - compile_start
  ep_note = device_mesh.ep_span_note(setup.mesh, config)
  if ep_note:
    say(ep_note)
  flops_per_token = flops.training_flops_per_token(config)
  peak = device_peak_tflops(config, devices[0])
  say(f"model: {_si(parameter_count(setup.abstract_state))} parameters, "
      f"{_si(flops_per_token)}FLOP per token (6 x active matmul parameters + causal "
      "attention); " + (f"MFU against {peak:g} TFLOP/s per device" if peak is not None else
                        f"no MFU: no known peak for {devices[0].device_kind!r} "
                        "(set train.peak_tflops)"))
  start = 0
  if resume:
    state, _, start = checkpoints.restore_newest_intact(setup.abstract_state)
    say(f"resuming {run_dir} from step {start}"
        + (f" with {'; '.join(changes)}" if changes else ""))
    schedule_note = schedule_change_note(run_dir, config, start)
    if schedule_note:
      say(schedule_note)
  else:
    state = setup.create()
  previous = _read_records(run_dir / "metrics.jsonl", start) if resume else []
  if is_main:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(run_dir, config, resumed_from=start if resume else None, changes=changes)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in previous))
  return Run(config=config, run_dir=run_dir, name=name, created=created, is_main=is_main,
             devices=devices, setup=setup, train_step=train_step, compile_s=compile_s,
             corpus=corpus, eval_corpus=eval_corpus, eval_step=None, checkpoints=checkpoints,
             state=state, start=start, end=end, previous=previous,
             flops_per_token=flops_per_token, peak=peak, wall_start=wall_start, say=say,
             notice=notice)


def finish_run(run: Run, loop: LoopResult) -> RunResult:
  """Saves a stopped run's last step, writes ``summary.json`` and
  ``metrics.png``, and returns, or raises how the loop ended."""
  checkpoints, state = run.checkpoints, loop.state
  if (loop.stopped_by and checkpoints and loop.state_step != loop.checkpoint_step
      and _is_intact(state) and checkpoints.save(loop.state_step, state,
                                                 data_step=loop.state_step)):
    loop.checkpoint_step = loop.state_step
  if checkpoints:
    checkpoints.close()
  summary = None
  if loop.records:
    summary = summarize(loop.records, config=run.config, mesh=run.setup.mesh,
                        compile_s=run.compile_s, wall_s=time.perf_counter() - run.wall_start,
                        peak_memory=peak_memory_bytes(run.train_step),
                        interrupted=loop.stopped_by is not None,
                        nonfinite_step=loop.nonfinite and loop.nonfinite["step"],
                        previous=run.previous)
    if run.is_main:
      (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
      plots.plot_run(run.previous + loop.records, run.run_dir / "metrics.png",
                     loss_floor=getattr(run.corpus, "entropy_floor", None))
  release_run_dir(run.run_dir)
  if loop.nonfinite:
    raise NonFiniteStep(loop.nonfinite["step"],
                        {key: loop.nonfinite[key] for key in FINITE_METRICS},
                        loop.checkpoint_step, run.run_dir)
  if loop.stopped_by:
    raise Interrupted(loop.state_step, loop.checkpoint_step, run.run_dir, loop.stopped_by)
  return RunResult(loop.records, summary, state, run.run_dir)


def open_log(run: Run, *, resume: bool) -> MetricsLog | None:
  """Process 0's :class:`MetricsLog` of ``run`` (None on the others); says
  where TensorBoard events go, or why they do not."""
  if not run.is_main:
    return None
  train_config = run.config.train
  tensorboard, note = tensorboard_writer(run.run_dir, train_config.tensorboard)
  if note:
    run.notice(note)
  elif tensorboard is not None:
    run.say(f"TensorBoard: tensorboard --logdir {run.run_dir}")
  wandb = wandb_run(train_config.wandb_project, run.run_dir, to_dict(run.config), resume)
  return MetricsLog(run.run_dir / "metrics.jsonl", tensorboard=tensorboard, wandb=wandb)


def train(config: Config, *, resume: bool = False, stop_at: int | None = None,
          progress: bool = True, name: str = "run", devices=None,
          announce: bool = True) -> RunResult:
  """Runs (or resumes) training as ``config`` says: :func:`start_run`, then
  :func:`train_loop`, then :func:`finish_run`.

  Args:
    config: the run.
    resume: continue from the newest intact checkpoint in ``train.run_dir``
      (with ``train.run_dir`` null: of the latest run named ``name``).
    stop_at: leave after this step count (and checkpoint there), as a run
      cut short by a job time limit would; ``--resume`` continues it.
    progress: print the start-up lines and the progress bar (process 0 only).
    announce: with ``progress``, the start-up lines too (False: only the
      progress, as each variant of a sweep shows it).
    name: names a new run directory, ``runs/<name>-<YYYYmmdd-HHMMSS>``,
      when ``train.run_dir`` is null (the command line passes the config
      file's stem).
    devices: the devices to train on (None: all of the job's). A run resumes
      onto any device count and mesh its batch and experts divide.

  Raises:
    ConfigError: the data file cannot be used, the run to resume is finished,
      ``config`` changes its model or computation, or W&B is asked for but
      not installed.
    FileExistsError: a fresh run's explicit ``train.run_dir`` holds another run,
      or another live run is using it (:class:`examples.run_lock.RunDirInUse`).
    FileNotFoundError: ``resume`` finds no (intact) checkpoint.
    ValueError: the mesh does not fit the devices (the message says how to fix it).
    Interrupted: Ctrl-C or SIGTERM stopped the loop; the last completed step
      was checkpointed (when checkpoints are on) and this run's
      ``summary.json`` and ``metrics.png`` written first.
    NonFiniteStep: a step was not finite; it was not saved (summary and plot
      written as for Interrupted).
  """
  run = start_run(config, resume=resume, stop_at=stop_at, progress=progress, name=name,
                  devices=devices, announce=announce)
  log = open_log(run, resume=resume)
  try:
    loop = train_loop(run, progress=progress, log=log)
  finally:
    if log is not None:
      log.close()
  return finish_run(run, loop)


def parse_args(argv=None) -> tuple[Config, bool, str]:
  """``(config, resume, name)`` from the command line; ``name`` (the config
  file's stem) names new run directories."""
  parser = argparse.ArgumentParser(
      prog="pretrain.py", description=__doc__.splitlines()[0],
      usage="%(prog)s [-h] [--data PATH] [--resume] [CONFIG.yaml] [key=value ...]",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Overrides use dotted keys of the YAML sections: model., moe., train., data., "
             "mesh. (e.g. moe.top_k=4 train.steps=50 moe.capacity_factor=null), in any "
             "order with the config file and the flags.")
  parser.add_argument("args", nargs="*", metavar="CONFIG.yaml key=value",
                      help="a config file (default configs/tiny.yaml) and overrides")
  parser.add_argument("--data", metavar="PATH", help="train on this text file (byte-level) "
                      "or these token shards (same as data.path=PATH)")
  parser.add_argument("--resume", action="store_true",
                      help="continue from the latest checkpoint in train.run_dir (default: "
                           "of the latest run of this config)")
  args = parser.parse_intermixed_args(argv)
  try:
    config_path, overrides = split_config_path(args.args)
    if args.data:
      overrides.append(f"data.path={json.dumps(args.data)}")
    config = load_config(config_path, overrides)
  except ValueError as error:  # a bad file or override: its one line, not the usage
    parser.exit(2, f"{parser.prog}: error: {error}\n")
  name = pathlib.Path(config_path or DEFAULT_CONFIG).stem
  return config, args.resume, name


def resume_command(argv: list[str], run_dir: pathlib.Path) -> str:
  """The command line, run from this working directory, that continues the
  run of ``argv`` (this script's arguments) in ``run_dir``; under
  ``moe_ep.launch``, the launcher's command line comes first."""
  words = [arg for arg in argv if arg != "--resume"]
  if not any(arg.startswith("train.run_dir=") for arg in words):
    words.append(f"train.run_dir={run_dir}")
  # Under moe_ep.launch: its command line first, so the line is the whole command.
  launcher = os.environ.get(launch.ENV_LAUNCH_COMMAND)
  return " ".join([*([launcher] if launcher else []),
                   shlex.join(["python", "-m", "examples.pretrain", *words, "--resume"])])


def interrupted_line(stop: Interrupted, argv: list[str]) -> str:
  """The one line printed when Ctrl-C or SIGTERM stops a run."""
  what = (f"interrupted at step {stop.step}" if stop.signal_name == "SIGINT"
          else f"stopped by {stop.signal_name} at step {stop.step}")
  if stop.checkpoint_step is None:
    return (f"{what}: no checkpoint (train.checkpoint_every=0); "
            f"metrics and summary in {stop.run_dir}/")
  saved = ("saved a checkpoint" if stop.checkpoint_step == stop.step
           else f"the latest checkpoint is step {stop.checkpoint_step}")
  return f"{what}: {saved}; resume with: {resume_command(argv, stop.run_dir)}"


def nonfinite_line(stop: NonFiniteStep, argv: list[str]) -> str:
  """The one line printed when a step that is not finite stops a run."""
  if stop.checkpoint_step is None:
    saved = f"no checkpoint; metrics and summary in {stop.run_dir}/"
  else:
    saved = (f"the newest checkpoint is step {stop.checkpoint_step}; resume from it with: "
             f"{resume_command(argv, stop.run_dir)}")
  return (f"{stop}: stopped without saving it; {saved} (a lower train.learning_rate, or "
          "train.skip_nonfinite=N to skip up to N such steps in a row, may get past it)")


def saves_failing_line(stop: SavesFailing, argv: list[str]) -> str:
  """The one line printed when checkpoints keep failing to save."""
  run_dir = stop.directory.parent
  if stop.latest_step is None:
    return f"{stop}: stopped; no checkpoint was saved (metrics in {run_dir}/)"
  return (f"{stop}: stopped; the newest checkpoint is step {stop.latest_step}; resume from it "
          f"with: {resume_command(argv, run_dir)}")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  device_mesh.request_cpu_devices()  # before JAX starts its backends
  job = distributed.initialize_from_env()  # before any JAX computation
  if job.cluster:
    print(job.describe(), flush=True)
  config, resume, name = parse_args(argv)
  is_main = jax.process_index() == 0

  def fail(error: Exception) -> int:
    if is_main:
      print(f"pretrain.py: error: {error}", file=sys.stderr, flush=True)
    return 2

  try:
    config.mesh_shape(jax.device_count())
  except ValueError as error:  # the mesh does not fit the devices present
    return fail(error)
  try:
    result = train(config, resume=resume, name=name)
  except Interrupted as stop:
    if is_main:
      print(interrupted_line(stop, argv), flush=True)
    return SIGNAL_EXIT_CODES[stop.signal_name]
  except KeyboardInterrupt:
    if is_main:
      print("interrupted outside the training steps: nothing more saved", flush=True)
    return SIGNAL_EXIT_CODES["SIGINT"]
  except NonFiniteStep as stop:
    if is_main:
      print(f"pretrain.py: error: {nonfinite_line(stop, argv)}", file=sys.stderr, flush=True)
    return 1
  except SavesFailing as stop:
    if is_main:
      print(f"pretrain.py: error: {saves_failing_line(stop, argv)}", file=sys.stderr, flush=True)
    return 1
  # The run dir, --resume (no checkpoint, a finished run, another model), --data.
  except (ConfigError, FileExistsError, FileNotFoundError) as error:
    return fail(error)
  finally:
    release_all()  # the run directory's lock, whichever way the run ended
  if is_main:
    print(done_line(result.summary, result.run_dir), flush=True)
  return 0


def done_line(summary: dict, run_dir: pathlib.Path) -> str:
  """The one line printed when a run finishes."""
  mfu = "" if summary["mfu"] is None else f" (MFU {flops.format_mfu(summary['mfu'])})"
  skipped = summary["skipped_steps"]
  skipped = f", {skipped} non-finite step{'s' * (skipped != 1)} skipped" if skipped else ""
  loss = "n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.3f}"
  held_out = ("" if summary.get("eval_loss") is None else
              f", held-out loss {summary['eval_loss']:.3f} at step {summary['eval_step']}")
  return (f"done: {summary['steps']} steps{skipped}, final loss {loss} "
          f"(mean of the last {min(FINAL_LOSS_WINDOW, summary['steps_this_run'])}){held_out}, "
          f"{summary['tokens_per_s']:,.0f} tokens/s{mfu}, wall {summary['wall_s']:.0f} s "
          f"(compile {summary['compile_s']:.0f} s); outputs in {run_dir}/")


if __name__ == "__main__":
  sys.exit(main())
