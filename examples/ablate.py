"""Runs a sweep of pretraining variants and tabulates them.

    python -m examples.ablate configs/ablations/remat.yaml
    python -m examples.ablate train.steps=20 configs/ablations/capacity.yaml
    python -m examples.ablate configs/ablations/remat.yaml --processes 2  # 2-process jobs

A sweep file names a base config, overrides for every variant, and the
variants: a mapping ``name: {dotted.key: value}`` and/or a ``grid`` of
``dotted.key: [values]`` (the variants are every mapping entry times every
grid point). Each variant trains for the same steps; the output directory
(``runs/ablations/<sweep name>-<YYYYmmdd-HHMMSS>`` unless ``--out`` names one;
``runs/ablations/<sweep name>-latest`` links the newest) gets ``results.md``
(a markdown table), ``results.csv``, ``loss_curves.png`` and one run
directory per variant. Overrides (``key=value``) go anywhere on the command
line and apply to every variant.
"""

from __future__ import annotations

import pathlib
import sys

import argparse
import csv
import dataclasses
import itertools
import json
import shlex
import subprocess

if not __package__:  # run as a file: python examples/ablate.py (examples/script_form.py)
  import script_form
  script_form.checkout_first()

from examples import plots, pretrain
from examples.mesh import CPU_DEVICES, request_cpu_devices
from examples.run_control import SIGNAL_EXIT_CODES, Interrupted, NonFiniteStep
from examples.run_dir import RUNS_ROOT, held_steps, link_latest, new_run_dir
from examples.train_config import (Config, ConfigError, load_config, read_yaml,
                                   split_config_path)
from moe_ep import launch
import jax

# How a child process or a launched job runs a variant (from this directory).
PRETRAIN_COMMAND = ("-m", "examples.pretrain")
# name -> (header, format) of the table's columns, in order; a None value
# (no MFU without a known device peak) shows as NOT_AVAILABLE.
COLUMNS = {
    "variant": ("variant", "{}"),
    "median_step_ms": ("step time (ms, median)", "{:.1f}"),
    "peak_memory_mib": ("peak memory / device (MiB)", "{:.2f}"),
    "final_loss": ("final loss", "{:.3f}"),
    "dropped_fraction": ("dropped fraction", "{:.2%}"),
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "mfu": ("MFU", "{:.1%}"),
    "compile_s": ("compile (s)", "{:.1f}"),
    "timed_steps": ("timed steps", "{:.0f}"),
}
NOT_AVAILABLE = "n/a"
# Step times (and tokens/s, MFU) from fewer timed steps are flagged: on a
# shared CPU a 20-step run's median moved from 125.6 to 225.6 ms between two
# runs of the same variant.
MIN_TIMED_STEPS = 50
TOO_FEW = " (too few)"


def _cell(row: dict, key: str) -> str:
  value = row[key]
  if value is None:
    return NOT_AVAILABLE
  text = COLUMNS[key][1].format(value)
  return text + TOO_FEW if key == "timed_steps" and value < MIN_TIMED_STEPS else text


def timing_note(rows: list[dict]) -> str | None:
  """The line under a table whose timings come from too few steps (None: none do)."""
  if all(row["timed_steps"] >= MIN_TIMED_STEPS for row in rows):
    return None
  return (f"note: step time, tokens/s and MFU marked{TOO_FEW} come from fewer than "
          f"{MIN_TIMED_STEPS} timed steps (every step after the first): at that length they "
          f"are noise; train.steps={MIN_TIMED_STEPS + 1} or more for timings to compare")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A sweep file.

  Attributes:
    name: the file's stem, the default output folder name.
    base: the base config (a path relative to the sweep file).
    overrides: ``{dotted.key: value}`` applied to every variant.
    variants: ``{name: {dotted.key: value}}`` (may be empty).
    grid: ``{dotted.key: [values]}``, crossed with the variants.
  """

  name: str
  base: pathlib.Path
  overrides: dict
  variants: dict
  grid: dict

  @classmethod
  def load(cls, path) -> Sweep:
    """Reads a sweep file; any problem raises ConfigError naming the file and key."""
    path = pathlib.Path(path)
    data = read_yaml(path)
    data = {} if data is None else data
    if not isinstance(data, dict):
      raise ConfigError(f"{path} must hold a mapping (base, overrides, variants, grid), "
                        f"got {type(data).__name__}")
    known = {"base", "overrides", "variants", "grid"}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
      raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known: {sorted(known)})")
    if not isinstance(data.get("base"), str):
      raise ConfigError(f"{path}: needs a 'base' config file, got {data.get('base')!r}")
    sections = {key: data.get(key) or {} for key in ("overrides", "variants", "grid")}
    for key, section in sections.items():
      if not isinstance(section, dict):
        raise ConfigError(f"{path}: {key} must be a mapping, got {section!r}")
    for name, settings in sections["variants"].items():
      if not isinstance(name, str):
        raise ConfigError(f"{path}: variant name {name!r} must be a string")
      if settings is not None and not isinstance(settings, dict):
        raise ConfigError(f"{path}: variants.{name} must be a mapping of dotted.key: value "
                          f"(or empty), got {settings!r}")
    for key, values in sections["grid"].items():
      if not isinstance(values, list) or not values:
        raise ConfigError(f"{path}: grid.{key} must be a non-empty list of values")
    return cls(name=path.stem, base=(path.parent / data["base"]).resolve(), **sections)

  def variant_overrides(self) -> dict[str, list[str]]:
    """``{variant name: ["dotted.key=value", ...]}``, sweep overrides first.

    A name joins the variant's name and its grid point, e.g.
    ``save_dispatch,capacity_factor=1.25``.
    """
    out = {}
    for (name, settings), point in itertools.product(
        self.variants.items() or [(None, {})], itertools.product(*self.grid.values())):
      grid_settings = dict(zip(self.grid, point))
      label = ",".join([name] * (name is not None) + [
          f"{key.rsplit('.', 1)[-1]}={json.dumps(value)}" for key, value in grid_settings.items()])
      merged = {**self.overrides, **(settings or {}), **grid_settings}
      out[label or "base"] = [f"{key}={json.dumps(value)}" for key, value in merged.items()]
    return out


@dataclasses.dataclass
class VariantResult:
  name: str
  summary: dict
  records: list[dict]

  def row(self) -> dict:
    summary = self.summary
    return {
        "variant": self.name,
        "median_step_ms": 1e3 * summary["median_step_s"],
        "peak_memory_mib": summary["peak_memory_bytes"] / 2**20,
        "final_loss": summary["final_loss"],
        "dropped_fraction": summary["dropped_fraction"],
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary.get("mfu"),  # absent from older summaries
        "compile_s": summary["compile_s"],
        # The median step time leaves out the first step (it compiles).
        "timed_steps": max(summary["steps_this_run"] - 1, 1),
    }


def _read_run(run_dir: pathlib.Path) -> tuple[dict, list[dict]]:
  summary = json.loads((run_dir / "summary.json").read_text())
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return summary, records


def cpu_devices_per_process(processes: int) -> int:
  """CPU devices each process of a ``processes``-process CPU job gets (the 8
  devices of a one-process run, split)."""
  return max(1, CPU_DEVICES // processes)


def job_device_count(processes: int, gpus_per_process: int | None) -> int:
  """The devices a variant trains on: this process's, or the launched job's."""
  if processes == 1:
    return jax.device_count()
  return processes * (gpus_per_process or cpu_devices_per_process(processes))


def run_variant(name: str, config: Config, overrides: list[str], *, base: pathlib.Path,
                subprocess_run: bool = False, processes: int = 1,
                gpus_per_process: int | None = None, timeout_s: float | None = None,
                progress: bool = False) -> VariantResult:
  """Trains one variant: in this process (the default), in a child process,
  or as a ``processes``-process job through :func:`moe_ep.launch.launch`;
  ``progress``: its progress shows (its steps; a child's whole output)."""
  run_dir = pathlib.Path(config.train.run_dir)
  if processes == 1 and not subprocess_run:
    result = pretrain.train(config, progress=progress, announce=False)
    return VariantResult(name, result.summary, result.records)
  command = [sys.executable, *PRETRAIN_COMMAND, str(base), *overrides,
             f"train.run_dir={json.dumps(str(run_dir))}"]
  if processes == 1:
    subprocess.run(command, check=True, timeout=timeout_s,
                   stdout=None if progress else subprocess.DEVNULL)
  else:
    cpu_devices = None if gpus_per_process else cpu_devices_per_process(processes)
    launch.launch(command, processes, timeout_s=timeout_s, cpu_devices_per_process=cpu_devices,
                  gpus_per_process=gpus_per_process, echo=progress)
  return VariantResult(name, *_read_run(run_dir))


def markdown_table(rows: list[dict]) -> str:
  lines = ["| " + " | ".join(header for header, _ in COLUMNS.values()) + " |",
           "|" + "|".join("---" if key == "variant" else "---:" for key in COLUMNS) + "|"]
  for row in rows:
    lines.append("| " + " | ".join(_cell(row, key) for key in COLUMNS) + " |")
  return "\n".join(lines) + "\n"


def write_results(results: list[VariantResult], out_dir: pathlib.Path, title: str) -> None:
  """``results.md``, ``results.csv`` and ``loss_curves.png`` in ``out_dir``."""
  rows = [result.row() for result in results]
  note = timing_note(rows)
  (out_dir / "results.md").write_text(f"{title}\n\n{markdown_table(rows)}"
                                      + (f"\n{note}\n" if note else ""))
  with (out_dir / "results.csv").open("w", newline="") as file:
    writer = csv.DictWriter(file, fieldnames=list(COLUMNS))
    writer.writeheader()
    writer.writerows(rows)
  curves = {r.name: ([x["step"] for x in r.records], [x["ce_loss"] for x in r.records])
            for r in results}
  plots.plot_loss_curves(curves, out_dir / "loss_curves.png", title)


def ablate(sweep_path, extra_overrides=(), *, out_dir=None, subprocess_run: bool = False,
           processes: int = 1, gpus_per_process: int | None = None,
           echo: bool = True) -> list[VariantResult]:
  """Runs every variant of the sweep file and writes the results; returns them.

  ``out_dir`` None: a new ``runs/ablations/<sweep name>-<YYYYmmdd-HHMMSS>``.
  An ``out_dir`` that holds an earlier sweep's runs is refused
  (FileExistsError) before anything trains.
  """
  sweep = Sweep.load(sweep_path)
  variants = {}
  devices = job_device_count(processes, gpus_per_process)
  for name, overrides in sweep.variant_overrides().items():
    overrides = [*overrides, *extra_overrides]
    try:  # every variant is checked, on the devices it will get, before any trains
      config = load_config(sweep.base, overrides)
      config.mesh_shape(devices)
      if config.data.path is not None:  # a missing data file, before the first variant trains
        pretrain.open_corpus(config)
    except ValueError as error:
      raise ConfigError(f"sweep {sweep_path}, variant {name!r}: {error}") from None
    variants[name] = (config, overrides)
  created = out_dir is None
  if created:
    out_dir = new_run_dir(sweep.name, root=RUNS_ROOT / "ablations")
  out_dir = pathlib.Path(out_dir)
  for name, (config, overrides) in variants.items():
    run_dir = out_dir / name.replace("/", "_")
    if held := held_steps(run_dir):
      raise FileExistsError(f"{run_dir} holds a run (steps {held[0]}-{held[1]}) of an earlier "
                            "sweep: choose another --out")
    config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                   run_dir=str(run_dir)))
    variants[name] = (config, overrides)
  out_dir.mkdir(parents=True, exist_ok=True)

  results = []
  for index, (name, (config, overrides)) in enumerate(variants.items()):
    if echo:
      where = (f"as a {processes}-process job" if processes > 1 else
               "in a child process" if subprocess_run else "in this process")
      print(f"variant {index + 1}/{len(variants)}: {name} ({config.train.steps} steps, "
            f"{where}; run dir {config.train.run_dir})", flush=True)
    result = run_variant(name, config, overrides, base=sweep.base, subprocess_run=subprocess_run,
                         processes=processes, gpus_per_process=gpus_per_process, progress=echo)
    results.append(result)
    if created and len(results) == 1:
      link_latest(out_dir, sweep.name, root=RUNS_ROOT / "ablations")
    if echo:
      row = result.row()
      print(f"{name}: " + ", ".join(f"{COLUMNS[key][0]} {_cell(row, key)}"
                                    for key in list(COLUMNS)[1:]), flush=True)
  first = next(iter(variants.values()))[0]
  summary = results[0].summary
  mesh = " x ".join(f"{axis}={size}" for axis, size in summary["mesh"].items())
  title = (f"Sweep {sweep.name}: {first.train.steps} steps per variant, "
           f"{summary['processes']} process(es), {summary['backend']} mesh {mesh}")
  write_results(results, out_dir, title)
  if echo:
    rows = [r.row() for r in results]
    note = timing_note(rows)
    print(f"{title}\n\n{markdown_table(rows)}" + (f"{note}\n" if note else "")
          + f"written to {out_dir}/")
  return results


def parse_args(argv=None) -> argparse.Namespace:
  """The command line; ``sweep`` and ``overrides`` come from words in any
  order (a word with ``=`` is an override)."""
  parser = argparse.ArgumentParser(
      prog="ablate.py", description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      usage="%(prog)s [-h] [--out DIR] [--subprocess] [--processes N] [--gpus-per-process N] "
            "SWEEP.yaml [key=value ...]")
  parser.add_argument("words", nargs="+", metavar="SWEEP.yaml key=value",
                      help="a sweep file, e.g. configs/ablations/remat.yaml, and overrides "
                           "applied to every variant after the sweep's own, in any order")
  parser.add_argument("--out", help="output folder (default: a new "
                                    "runs/ablations/<sweep name>-<YYYYmmdd-HHMMSS>)")
  parser.add_argument("--subprocess", action="store_true",
                      help="train each variant in a fresh process (default: in this one)")
  parser.add_argument("--processes", type=int, default=1,
                      help="train each variant as a job of this many processes "
                           "(moe_ep.launch; on CPU the 8 devices are split between them)")
  parser.add_argument("--gpus-per-process", type=int,
                      help="with --processes on GPUs: GPUs each process uses")
  args = parser.parse_intermixed_args(argv)
  if args.processes < 1:
    parser.error(f"--processes={args.processes} must be >= 1")
  try:
    args.sweep, args.overrides = split_config_path(args.words, what="sweep file")
  except ValueError as error:
    parser.error(str(error))
  if args.sweep is None:
    parser.error("give a sweep file, e.g. configs/ablations/remat.yaml")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  request_cpu_devices()  # before JAX starts its backends
  try:
    ablate(args.sweep, args.overrides, out_dir=args.out, subprocess_run=args.subprocess,
           processes=args.processes, gpus_per_process=args.gpus_per_process)
  except (ConfigError, FileExistsError) as error:  # the sweep file, a variant, --out
    print(f"ablate.py: error: {error}", file=sys.stderr)
    return 2
  except launch.LaunchStopped as stopped:  # a signal, passed to the variant's job
    print(f"ablate.py: the sweep stopped: {stopped}", file=sys.stderr, flush=True)
    return stopped.exit_code
  # A variant that failed to train: its own one line (in-process), or its
  # job's report (its last output).
  except (NonFiniteStep, launch.LaunchError) as error:
    print(f"ablate.py: error: a variant failed: {error}", file=sys.stderr)
    return 1
  except subprocess.CalledProcessError as error:
    print(f"ablate.py: error: a variant failed: {shlex.join(error.cmd)} exited with "
          f"{error.returncode}", file=sys.stderr)
    return 1
  except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM during an in-process variant
    print("interrupted: the sweep stopped; the finished variants' runs are in its folder",
          flush=True)
    return SIGNAL_EXIT_CODES[stop.signal_name if isinstance(stop, Interrupted) else "SIGINT"]
  return 0


if __name__ == "__main__":
  sys.exit(main())
