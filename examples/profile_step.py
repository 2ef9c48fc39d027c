"""Profiles the train step of examples/pretrain.py and writes where the step goes.

    python -m examples.profile_step configs/h200.yaml                  # 5 traced steps
    python -m examples.profile_step configs/tiny.yaml model.remat_blocks=true --steps 3
    python -m examples.profile_step configs/h200.yaml train.batch_size=16 --out /tmp/p

Builds the program ``examples/pretrain.py`` trains
(:func:`examples.train_program.build_program`: same mesh, shardings and
compiled step), runs ``--warmup`` steps, times
``--steps`` steps without the profiler, then as many again under
``jax.profiler.trace``. Every device op of the trace is mapped to the
instruction of the compiled step it ran (the events' ``hlo_op`` /
``hlo_module`` args; on GPUs the kernels of the CUDA streams, on CPUs the thunk
events of each ``device_ordinal``) and classified by that instruction's
``metadata={op_name=...}`` (see :class:`Classifier`). Time where several ops of
one device run at once (other streams, other threads) is split evenly
between them, so the categories add up to the device's busy time, and
``idle / host gaps`` (the wall time per step less the busy time) completes the
step.

Writes ``<out>/profile-<config stem>-<device kind>-<N>dev.md`` (the table)
and ``.json`` (the same numbers, the top ops, the environment, the overrides
and the git commit); ``--trace-dir`` keeps the raw trace for Perfetto or XProf.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import sys
import tempfile
import time

import jax

if not __package__:  # run as a file: python examples/profile_step.py (examples/script_form.py)
  import script_form
  script_form.checkout_first()

from examples import flops
from examples.run_summary import device_peak_tflops
from examples.train_program import build_program, global_batch, program_config
from examples.data import make_corpus
from examples.mesh import request_cpu_devices
from examples.train_config import (DEFAULT_CONFIG, Config, config_to_yaml,
                                   load_config, split_config_path)
from moe_ep import distributed
from benchmarks import common
from benchmarks.hlo import parse_hlo
from benchmarks.step_profile import (
    BACKWARD, CATEGORIES, FORWARD, IDLE, Classifier, breakdown, xla_instruction_profile)
from benchmarks.timeline import op_events, read_trace

_COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def command_buffers_off() -> bool:
  """Whether XLA_FLAGS turns XLA's command buffers (CUDA graphs) off. Kernels
  replayed from a graph reach the trace as one event per graph, with no op
  to attribute them to."""
  return any(flag == _COMMAND_BUFFERS_OFF for flag in os.environ.get("XLA_FLAGS", "").split())


def turn_command_buffers_off() -> None:
  """Profiles without command buffers unless XLA_FLAGS sets them: the step's
  time changed by under 1.5% on an H200 (configs/h200.yaml), and every
  kernel becomes visible. Only before JAX starts its backends (run as a
  program), when the flag still takes effect; a process that already uses
  JAX keeps its flags."""
  from jax._src import xla_bridge  # noqa: PLC0415 - the check jax.distributed makes
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_command_buffer" not in flags and not xla_bridge.backends_are_initialized():
    os.environ["XLA_FLAGS"] = f"{flags} {_COMMAND_BUFFERS_OFF}".strip()


_REPO = pathlib.Path(__file__).resolve().parent.parent  # the checkout: its runs/ and commit
DEFAULT_OUT = _REPO / "runs" / "profile"


# --- running the step ----------------------------------------------------------------------------

@dataclasses.dataclass
class Measured:
  """What :func:`run_steps` measured."""

  compiled: object  # the compiled train step
  mesh: jax.sharding.Mesh
  untraced_s: float  # wall time of `steps` steps without the profiler
  traced_s: float  # wall time of `steps` steps under jax.profiler.trace


def _profile_options():
  """No Python tracer (its events slow the host and bloat the trace); where
  this JAX has ProfileOptions."""
  if not hasattr(jax.profiler, "ProfileOptions"):
    return None
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  return options


def run_steps(config: Config, *, steps: int, warmup: int, trace_dir: pathlib.Path,
              perfetto: bool = False) -> Measured:
  """Compiles the train step as examples/pretrain.py does, runs ``warmup``
  steps, times ``steps`` steps, then traces ``steps`` more into ``trace_dir``
  (with a ``perfetto_trace.json.gz`` copy for ui.perfetto.dev if
  ``perfetto``). Each wall time runs from the first step's dispatch to the
  last step's outputs being ready; the next batch is made while a step runs,
  as in training."""
  setup, train_step = build_program(program_config(config), tuple(jax.devices()))
  corpus = make_corpus(config)
  shape = (config.train.batch_size, config.train.seq_len + 1)
  make_batch = lambda step: global_batch(corpus, step, sharding=setup.batch_sharding,
                                         shape=shape)
  state = setup.create()
  step_index = 0

  def run(count: int) -> float:
    nonlocal state, step_index
    if count == 0:
      return 0.0
    batch = make_batch(step_index)
    jax.block_until_ready((state, batch))
    start = time.perf_counter()
    for _ in range(count):
      state, metrics = train_step(state, batch)
      step_index += 1
      batch = make_batch(step_index)
    jax.block_until_ready((state, metrics))
    return time.perf_counter() - start

  run(warmup)
  untraced_s = run(steps)
  options = _profile_options()
  kwargs = {"profiler_options": options} if options is not None else {}
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=perfetto, **kwargs):
    traced_s = run(steps)
  return Measured(train_step, setup.mesh, untraced_s, traced_s)


def profile(config: Config, *, steps: int = 5, warmup: int = 3, name: str = "run",
            overrides: tuple[str, ...] = (), trace_dir: pathlib.Path | None = None) -> dict:
  """Runs, traces and classifies ``steps`` train steps of ``config``;
  ``trace_dir`` keeps the trace (default: a temporary directory).

  Returns:
    the report :func:`write_report` writes: the :func:`breakdown`, the
    measurements, MFU and the environment.
  """
  if steps < 1 or warmup < 0:
    raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
  with _trace_directory(trace_dir) as directory:
    measured = run_steps(config, steps=steps, warmup=warmup, trace_dir=directory,
                         perfetto=trace_dir is not None)
    events = op_events(read_trace(directory))
    module, instructions, computations = parse_hlo(measured.compiled.as_text())
    classifier = Classifier(instructions, computations)
    cross_check = xla_instruction_profile(directory, classifier)
  result = breakdown(events, classifier, module, steps=steps, wall_s=measured.traced_s)
  devices = list(measured.mesh.devices.flat)
  tokens_per_step = config.train.batch_size * config.train.seq_len
  untraced_step_s = measured.untraced_s / steps
  flops_per_token = flops.training_flops_per_token(config)
  tokens_per_s = tokens_per_step / untraced_step_s
  peak = device_peak_tflops(config, devices[0])
  return {
      "config": name,
      "overrides": list(overrides),
      "steps": steps,
      "warmup": warmup,
      "untraced_step_ms": untraced_step_s * 1e3,
      "tokens_per_step": tokens_per_step,
      "tokens_per_s": tokens_per_s,
      "mfu": flops.mfu(tokens_per_s / len(devices), flops_per_token, peak),
      "peak_tflops": peak,
      **result,
      "classification": classifier.rules(),
      "xla_instruction_profile": cross_check,
      "hlo_module": module,
      "environment": {
          "jax": jax.__version__,
          "jaxlib": _jaxlib_version(),
          "python": platform.python_version(),
          "backend": jax.default_backend(),
          "device_kind": devices[0].device_kind,
          "device_count": len(devices),
          "process_count": jax.process_count(),
          "mesh": dict(measured.mesh.shape),
          "transport": config.moe.transport,
          # which kernels the compiled step launches: moe_cupy_* (CuPy), moe_peer_* (peer exchange)
          "transport_kernel_scopes": classifier.kernel_scopes,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          # names the code where git_commit cannot (benchmarks/index.py --trace)
          "source_digest": common.source_digest(_REPO),
      },
      "git_commit": common.git_commit(_REPO),
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "config_yaml": config_to_yaml(config),
  }


def _jaxlib_version() -> str | None:
  try:
    import jaxlib  # noqa: PLC0415
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


@contextlib.contextmanager
def _trace_directory(path: pathlib.Path | None):
  """``path`` (created and kept), or a temporary directory removed afterwards."""
  if path is not None:
    path.mkdir(parents=True, exist_ok=True)
    yield path
    return
  with tempfile.TemporaryDirectory(prefix="profile_step-") as temporary:
    yield pathlib.Path(temporary)


# --- the report ----------------------------------------------------------------------------------

def _ms(value: float) -> str:
  return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def markdown(report: dict) -> str:
  """The report as markdown: a header, the breakdown table, notes, top ops."""
  env, rows = report["environment"], report["rows"]
  step, busy = report["step_ms"], report["busy_ms"]
  mfu = "" if report["mfu"] is None else f", MFU {report['mfu']:.1%} (untraced)"
  lines = [
      f"# Step profile: {report['config']} on {env['device_count']} x {env['device_kind']}",
      "",
      f"- overrides: {' '.join(report['overrides']) or 'none'}",
      f"- mesh {' x '.join(f'{k}={v}' for k, v in env['mesh'].items())}, "
      f"transport {env['transport']} ("
      f"{', '.join(env['transport_kernel_scopes']) or 'pure JAX: no moe_cupy_* / moe_peer_* launch'}"
      f"), {report['steps']} traced steps after "
      f"{report['warmup']} warm-up steps",
      f"- jax {env['jax']}, {env['backend']}, commit {report['git_commit']}, {report['date']}",
      f"- step {_ms(step)} ms traced, {_ms(report['untraced_step_ms'])} ms untraced "
      f"({report['tokens_per_s']:,.0f} tokens/s{mfu}); device busy {_ms(busy)} ms "
      f"({busy / step:.1%} of the traced step)",
      "",
      "| category | ms / step | share of step | forward ms | backward ms | op time ms |",
      "|---|---:|---:|---:|---:|---:|",
  ]
  for category in (*CATEGORIES, IDLE):
    row = rows[category]
    passes = ([_ms(row[FORWARD]), _ms(row[BACKWARD]), _ms(row["op_ms"])]
              if category != IDLE else ["", "", ""])
    lines.append(f"| {category} | {_ms(row['ms'])} | {row['share']:.1%} | " + " | ".join(passes)
                 + " |")
  total = sum(row["ms"] for row in rows.values())
  lines += [f"| **step** | **{_ms(total)}** | **{total / step:.1%}** | | | |", ""]
  unmapped = sum(report["unmapped_ms"].values())
  inferred = sum(report["inferred_ms"].values())
  listed = lambda values: ", ".join(f"{key} {_ms(ms)} ms" for key, ms in values.items())
  notes = [
      "ms / step: per device (the mean over devices); where ops of one device overlap (other "
      "streams or threads) each gets an equal part of the overlap, so the rows add up to the "
      "busy time and, with idle, to the step. op time: the ops' own time, overlaps counted in "
      "full. The rest of a row's forward + backward runs outside the gradient (update) or "
      "is unmapped.",
      "remat recompute recomputes: " + (listed(report["remat_recomputes"]) or "nothing"),
      f"unmapped (in other): {_ms(unmapped)} ms / step ({unmapped / max(busy, 1e-12):.1%} of "
      "busy)" + (": " + listed(report["unmapped_ms"]) if unmapped else ""),
      f"classified by a neighbour's op_name (the op had none): {_ms(inferred)} ms / step"
      + (": " + listed(report["inferred_ms"]) if inferred else ""),
  ]
  device_busy = report["device_busy_ms"]
  if len(device_busy) > 1:
    notes.append(f"busy per device: {_ms(min(device_busy.values()))} to "
                 f"{_ms(max(device_busy.values()))} ms / step")
  if rows[IDLE]["ms"] < 0:
    notes.append("busy exceeds the wall time: device and host clocks disagree in this trace")
  cross_check = report.get("xla_instruction_profile")
  if cross_check:
    notes.append("XLA's per-instruction profile (cross-check, shares of its total): " + ", ".join(
        f"{c} {share:.1%}" for c, share in cross_check["share_by_category"].items()))
  lines += [f"- {note}" for note in notes]
  lines += ["- classified by:"] + [f"  - {category}: {how}"
                                   for category, how in report["classification"].items()]
  lines += ["", f"## Top {len(report['top_ops'])} ops", "",
            "| op | ms / step | events / step | category | pass | kind | op_name |",
            "|---|---:|---:|---|---|---|---|"]
  for op in report["top_ops"]:
    kind = op["target"] or op["opcode"] or ", ".join(op["kernels"])
    op_name = op["op_name"]
    if len(op_name) > 120:
      op_name = "..." + op_name[-117:]
    lines.append(f"| {op['op']} | {_ms(op['ms'])} | {op['events_per_step']:g} | {op['category']} "
                 f"| {op['pass']} | {kind} | `{op_name}` |")
  return "\n".join(lines) + "\n"


def report_stem(report: dict) -> str:
  """``profile-<config>-<device kind>-<N>dev``."""
  env = report["environment"]
  kind = re.sub(r"[^a-z0-9]+", "-", env["device_kind"].lower()).strip("-")
  return f"profile-{report['config']}-{kind}-{env['device_count']}dev"


def write_report(report: dict, out_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """Writes ``<stem>.md`` and ``<stem>.json`` into ``out_dir``; returns their paths."""
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = report_stem(report)
  md_path, json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
  md_path.write_text(markdown(report))
  json_path.write_text(json.dumps(report, indent=2) + "\n")
  return md_path, json_path


def parse_args(argv=None) -> tuple[Config, argparse.Namespace, str, list[str]]:
  """``(config, flags, name, overrides)`` from the command line."""
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      usage="%(prog)s [-h] [CONFIG.yaml] [key=value ...] [--steps N] [--warmup N] "
            "[--out DIR] [--trace-dir DIR]",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("args", nargs="*", metavar="CONFIG.yaml key=value",
                      help="a config file (default configs/tiny.yaml) and overrides, as "
                           "examples/pretrain.py takes them")
  parser.add_argument("--steps", type=int, default=5, help="steps timed and traced (default 5)")
  parser.add_argument("--warmup", type=int, default=3, help="steps run first (default 3)")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                      help="where the .md and .json go (default runs/profile/, ignored by git)")
  parser.add_argument("--keep-command-buffers", action="store_true",
                      help="keep XLA's command buffers (CUDA graphs) on: their kernels are "
                           "then not attributed to ops (turned off by default)")
  parser.add_argument("--trace-dir", type=pathlib.Path, default=None,
                      help="keep the raw trace here (default: a temporary directory)")
  args = parser.parse_intermixed_args(argv)
  if args.steps < 1:
    parser.error(f"--steps={args.steps} must be >= 1")
  if args.warmup < 0:
    parser.error(f"--warmup={args.warmup} must be >= 0")
  try:
    config_path, overrides = split_config_path(args.args)
    config = load_config(config_path, overrides)
  except (ValueError, FileNotFoundError) as error:
    parser.error(str(error))
  return config, args, pathlib.Path(config_path or DEFAULT_CONFIG).stem, overrides


def main(argv=None) -> int:
  config, args, name, overrides = parse_args(argv)
  request_cpu_devices()  # before JAX starts its backends
  if not args.keep_command_buffers:
    turn_command_buffers_off()
  distributed.initialize_from_env()  # before any JAX computation (moe_ep.launch jobs)
  try:
    config.mesh_shape(jax.device_count())
  except ValueError as error:
    print(f"profile_step.py: error: {error}", file=sys.stderr)
    return 2
  report = profile(config, steps=args.steps, warmup=args.warmup, name=name,
                   overrides=tuple(overrides), trace_dir=args.trace_dir)
  if jax.process_index() == 0:
    md_path, json_path = write_report(report, args.out)
    print(markdown(report), end="")
    print(f"wrote {md_path} and {json_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
