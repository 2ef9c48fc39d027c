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
import statistics
import textwrap
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples import flops, plots
from examples import mesh as device_mesh
from examples.checkpoints import RunCheckpoints, SavesFailing, abstract_like
from examples.metrics_log import (MetricsLog, require_wandb, tensorboard_writer,
                                  wandb_run)
from examples.run_dir import (check_resumed_config, choose_run_dir, latest_link,
                              link_latest, run_configs, write_run_config)
from examples.run_lock import lock_run_dir, release_all, release_run_dir
from examples.data import make_corpus
from examples.model import TransformerLM
from examples.progress import ProgressReporter
from examples.run_control import (FINITE_METRICS, SIGNAL_EXIT_CODES, Interrupted,
                                  NonFiniteStep, StopRequests, is_finite)
from examples.train_config import (DEFAULT_CONFIG, MESH_AXES, Config, ConfigError,
                                   DataConfig, TrainConfig, load_config, split_config_path)
from moe_ep.config import to_dict
import moe_ep
from moe_ep import MoEAux, distributed, launch

# The batch is split over every device: data parallel over dp and ep alike.
BATCH_SPEC = P(MESH_AXES)
# Records averaged for the summary's final loss (one batch's loss is noisy).
FINAL_LOSS_WINDOW = 10


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


def make_mesh(config: Config, devices=None) -> jax.sharding.Mesh:
  """The ``("dp", "ep")`` mesh over all (global) devices, shaped by
  :meth:`Config.mesh_shape` (errors say how to fit another device count),
  ``ep`` inside a node and ``dp`` across nodes (:mod:`examples.mesh`)."""
  return device_mesh.make_mesh(config, devices)


def make_schedule(train: TrainConfig) -> optax.Schedule:
  """Step -> learning rate: linear warm-up, then cosine decay to
  ``learning_rate * final_lr_fraction`` at ``train.steps``."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps_used,
      decay_steps=train.steps, end_value=train.learning_rate * train.final_lr_fraction)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
  """AdamW with :func:`make_schedule`'s rate, decaying matrices only."""
  schedule = make_schedule(train)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=train.weight_decay,
                      mask=decay_mask)
  if train.grad_clip_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(train.grad_clip_norm), adamw)


@dataclasses.dataclass
class Setup:
  """The static pieces of a run: mesh, graph definitions, shardings."""

  mesh: jax.sharding.Mesh
  model_def: nnx.GraphDef
  optimizer_def: nnx.GraphDef
  abstract_state: dict  # {"model", "optimizer"}: jax.ShapeDtypeStruct leaves, sharded
  shardings: dict
  batch_sharding: NamedSharding
  create: Callable[[], dict]  # a fresh state, placed with `shardings`


def make_setup(config: Config, mesh: jax.sharding.Mesh) -> Setup:
  """Traces the model and optimizer abstractly to get their structure and
  shardings; nothing is allocated until ``setup.create()``."""
  tx = make_optimizer(config.train)

  def create_modules():
    # The MoE layers take the ambient mesh (jax.set_mesh) for their experts.
    model = TransformerLM(config, rngs=nnx.Rngs(config.train.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)  # ExpertBias is not a Param

  graph_defs = {}

  def create_state():
    model, optimizer = create_modules()
    graph_defs["model"], model_state = nnx.split(model)
    graph_defs["optimizer"], optimizer_state = nnx.split(optimizer)
    return {"model": model_state, "optimizer": optimizer_state}

  # jax.eval_shape, not nnx.eval_shape: flax 0.12's nnx.eval_shape fails under
  # jax.set_mesh for variables without a sharding annotation.
  with jax.set_mesh(mesh):
    state = jax.eval_shape(create_state)
  model_def, optimizer_def = graph_defs["model"], graph_defs["optimizer"]
  # Partition specs come from the parameters' metadata (experts over "ep");
  # everything else is replicated.
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                           nnx.get_partition_spec(state),
                           is_leaf=lambda x: isinstance(x, P))
  create = jax.jit(create_state, out_shardings=shardings)

  def create_on_mesh():
    with jax.set_mesh(mesh):
      return create()

  return Setup(mesh, model_def, optimizer_def, abstract_like(state, shardings), shardings,
               NamedSharding(mesh, BATCH_SPEC), create_on_mesh)


def make_train_step(config: Config, setup: Setup):
  """``step(state, tokens [B, S + 1]) -> (state, metrics)``, not yet jitted."""

  def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    with jax.named_scope("loss"):
      ce_loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce_loss + moe_ep.total_aux_loss(model), ce_loss

  def step(state, tokens):
    # The merged modules update the state's variables in place: a step that
    # may be skipped keeps its input in new variables.
    kept = jax.tree.map(lambda value: value, state) if config.train.skip_nonfinite else None
    model = nnx.merge(setup.model_def, state["model"])
    optimizer = nnx.merge(setup.optimizer_def, state["optimizer"])
    (loss, ce_loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
    with jax.named_scope("optimizer"):  # scopes: profiles attribute time by them
      optimizer.update(model, grads)
    with jax.named_scope("expert_bias"):
      moe_ep.update_expert_biases(model)
    aux = _stacked_aux(moe_ep.collect_aux(model))
    nnx.pop(model, moe_ep.SownAux)  # the state keeps the structure it was created with
    routes = jnp.maximum(aux.tokens_per_expert.sum(axis=-1, keepdims=True), 1)
    metrics = {
        "loss": loss, "ce_loss": ce_loss,
        "aux_loss": aux.aux_loss.sum(), "z_loss": aux.z_loss.sum(),
        "dropped_fraction": aux.dropped_fraction.mean(),
        "expert_load": aux.tokens_per_expert / routes,  # [num_moe_layers, E]
        "grad_norm": optax.tree.norm(grads),
        "param_norm": optax.tree.norm(nnx.state(model, nnx.Param)),
    }
    new_state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    if config.train.skip_nonfinite:
      new_state = _kept_if_finite(metrics, new_state, kept)
    return new_state, metrics

  return step


def _kept_if_finite(metrics: dict, new_state: dict, old_state: dict) -> dict:
  """``new_state`` where the step's :data:`FINITE_METRICS` are finite, else
  ``old_state``: the step is skipped, expert biases and optimizer count included."""
  finite = functools.reduce(jnp.logical_and, [jnp.isfinite(metrics[key])
                                              for key in FINITE_METRICS])
  return jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, old_state)


def _stacked_aux(per_layer: dict) -> MoEAux:
  """Every MoE layer's aux with a leading ``[num_moe_layers]`` axis (a scanned
  stack already has it; a list of layers is stacked in model order)."""
  fields = [aux if aux.dropped_fraction.ndim else jax.tree.map(lambda v: v[None], aux)
            for aux in per_layer.values()]
  return jax.tree.map(lambda *values: jnp.concatenate(values), *fields)


def compile_train_step(config: Config, setup: Setup):
  """The train step compiled for the run's shardings (the state is donated)."""
  step = jax.jit(make_train_step(config, setup),
                 in_shardings=(setup.shardings, setup.batch_sharding),
                 out_shardings=(setup.shardings, NamedSharding(setup.mesh, P())),
                 donate_argnums=0)
  train = config.train
  tokens = jax.ShapeDtypeStruct((train.batch_size, train.seq_len + 1), jnp.int32,
                                sharding=setup.batch_sharding)
  return step.lower(setup.abstract_state, tokens).compile()


def program_config(config: Config) -> Config:
  """``config`` with the fields that do not change the compiled program
  (where outputs go, how often, which data, the MFU peak) set to their defaults."""
  train = dataclasses.replace(config.train, run_dir=TrainConfig.run_dir,
                              checkpoint_every=TrainConfig.checkpoint_every,
                              log_every=TrainConfig.log_every,
                              eval_every=TrainConfig.eval_every,
                              eval_batches=TrainConfig.eval_batches,
                              tensorboard=TrainConfig.tensorboard,
                              wandb_project=TrainConfig.wandb_project,
                              peak_tflops=TrainConfig.peak_tflops)
  return dataclasses.replace(config, train=train, data=DataConfig())


@functools.lru_cache(maxsize=4)
def build_program(config: Config, devices: tuple) -> tuple[Setup, object]:
  """The setup and compiled train step of ``config`` on ``devices``.

  Compiling is most of a short run's time; a process that trains the same
  program again (a resumed run, a repeated sweep variant, tests) reuses it.
  """
  setup = make_setup(config, make_mesh(config, list(devices)))
  return setup, compile_train_step(config, setup)


def peak_memory_bytes(compiled) -> int:
  """Per-device memory of the compiled step from XLA's memory analysis:
  temporaries + arguments + outputs - donated aliases, or the reported peak
  where that is larger (the CPU backend's reported peak leaves out temporaries)."""
  stats = compiled.memory_analysis()
  buffers = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
             + stats.output_size_in_bytes - stats.alias_size_in_bytes)
  return int(max(buffers, getattr(stats, "peak_memory_in_bytes", 0)))


def global_batch(corpus, step: int, *, sharding: NamedSharding, shape: tuple) -> jax.Array:
  """Step ``step``'s ``[B, S + 1]`` batch, each process making only its own rows."""
  indices = sharding.addressable_devices_indices_map(shape).values()
  start = min(index[0].start or 0 for index in indices)
  stop = max(shape[0] if index[0].stop is None else index[0].stop for index in indices)
  return jax.make_array_from_process_local_data(sharding, corpus.rows(step, start, stop), shape)


def _host(metrics: dict) -> dict:
  """Replicated device metrics -> plain Python numbers and lists."""
  return {key: np.asarray(value.addressable_data(0)).tolist() for key, value in metrics.items()}


def _read_records(path: pathlib.Path, up_to_step: int) -> list[dict]:
  if not path.exists():
    return []
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [r for r in records if r["step"] <= up_to_step]


def device_peak_tflops(config: Config, device) -> float | None:
  """The peak MFU is reported against: ``train.peak_tflops``, else the
  dense bf16 peak of ``device``'s kind (None where unknown, e.g. CPUs)."""
  if config.train.peak_tflops is not None:
    return config.train.peak_tflops
  return flops.device_peak_tflops(device.device_kind)


def _si(value: float) -> str:
  """``2.75e9`` -> ``"2.75 G"``, ``940032`` -> ``"940 k"``."""
  for exponent, prefix in ((12, "T"), (9, "G"), (6, "M"), (3, "k")):
    if value >= 10**exponent:
      return f"{value / 10**exponent:.3g} {prefix}"
  return f"{value:.3g} "


def parameter_count(abstract_state: dict) -> int:
  """Parameters (``nnx.Param`` elements) of the model in a :class:`Setup`'s state."""
  params = nnx.filter_state(abstract_state["model"], nnx.Param)
  return sum(leaf.size for leaf in jax.tree.leaves(params))


def peak_rank_load(records: list[dict], num_experts: int) -> dict[str, float]:
  """``{R: load}`` for every EP size ``R > 1`` that divides ``num_experts``:
  the largest share of the routes that one rank's experts (a contiguous
  block of ``E / R``) received in any step and layer, times ``R``. The
  balanced load is 1; with the whole batch in one EP group (dp = 1) it is the
  smallest ``moe.receive_factor`` that would have kept every route of this
  run on the grouped layout (the buffer's alignment rows add headroom)."""
  load = np.asarray([r["expert_load"] for r in records], np.float64)  # [steps, layers, E]
  return {str(ranks): float(load.reshape(*load.shape[:2], ranks, -1).sum(-1).max() * ranks)
          for ranks in range(2, num_experts + 1) if num_experts % ranks == 0}


def summarize(records: list[dict], *, config: Config, mesh, compile_s: float, wall_s: float,
              peak_memory: int, interrupted: bool = False,
              nonfinite_step: int | None = None, previous: list[dict] = ()) -> dict:
  """The run's headline numbers (step times exclude compilation).

  Throughput: ``tokens_per_s`` (global, from the median step),
  ``flops_per_token`` (:func:`examples.flops.training_flops_per_token`),
  ``model_tflops_per_device`` (the model TFLOP/s each device achieves),
  ``peak_tflops`` (:func:`device_peak_tflops`), ``mfu`` (their ratio; None
  where the peak is unknown and ``train.peak_tflops`` unset) and ``device_kind``.
  ``peak_rank_load`` is :func:`peak_rank_load`. The final losses average
  the last finite steps (None: there is none);
  ``skipped_steps`` counts the steps ``train.skip_nonfinite`` skipped and
  ``nonfinite_step`` is the step that stopped the run (None: none did).
  ``eval_loss`` is the newest held-out loss of the run (``previous``: a
  resumed run's earlier records) and ``eval_step`` its step (None: no eval).
  """
  step_times = [r["step_time_s"] for r in records[1:]] or [r["step_time_s"] for r in records]
  median_step = statistics.median(step_times)
  last = [r for r in records if is_finite(r)][-FINAL_LOSS_WINDOW:]
  evals = [r for r in [*previous, *records] if r.get("eval_loss") is not None]
  tokens_per_s = config.train.batch_size * config.train.seq_len / median_step
  flops_per_token = flops.training_flops_per_token(config)
  device = mesh.devices.flat[0]
  peak = device_peak_tflops(config, device)
  return {
      "steps": records[-1]["step"],
      "steps_this_run": len(records),
      "interrupted": interrupted,
      "nonfinite_step": nonfinite_step,
      "skipped_steps": sum(r.get("skipped", False) for r in records),
      "final_loss": statistics.fmean(r["ce_loss"] for r in last) if last else None,
      "final_total_loss": statistics.fmean(r["loss"] for r in last) if last else None,
      "eval_loss": evals[-1]["eval_loss"] if evals else None,
      "eval_step": evals[-1]["step"] if evals else None,
      "dropped_fraction": statistics.fmean(r["dropped_fraction"] for r in records),
      "peak_rank_load": peak_rank_load(records, config.moe.num_experts),
      "median_step_s": median_step,
      "tokens_per_s": tokens_per_s,
      "flops_per_token": flops_per_token,
      "model_tflops_per_device": tokens_per_s / mesh.size * flops_per_token / 1e12,
      "mfu": flops.mfu(tokens_per_s / mesh.size, flops_per_token, peak),
      "peak_tflops": peak,
      "device_kind": device.device_kind,
      "compile_s": compile_s,
      "wall_s": wall_s,
      "peak_memory_bytes": peak_memory,
      "mesh": dict(mesh.shape),
      "processes": jax.process_count(),
      "backend": jax.default_backend(),
  }


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


def compile_eval_step(setup: Setup, batch_shape: tuple):
  """``eval_step(state, tokens [B, S + 1]) -> mean cross-entropy``, compiled
  (the state is read, not donated; the model's variables are left as they were)."""

  def eval_loss(state, tokens):
    model = nnx.merge(setup.model_def, state["model"])
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  step = jax.jit(eval_loss, in_shardings=(setup.shardings, setup.batch_sharding),
                 out_shardings=NamedSharding(setup.mesh, P()))
  tokens = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=setup.batch_sharding)
  return step.lower(setup.abstract_state, tokens).compile()


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


@dataclasses.dataclass
class Run:
  """A run once set up, between :func:`start_run`, :func:`train_loop` and
  :func:`finish_run`."""

  config: Config
  run_dir: pathlib.Path
  name: str
  created: bool  # a new run directory (the -latest link moves once a step is done)
  is_main: bool
  devices: list
  setup: Setup
  train_step: object
  compile_s: float
  corpus: object
  eval_corpus: object | None
  eval_step: object | None  # compiled at the first evaluation
  checkpoints: RunCheckpoints | None
  state: dict
  start: int
  end: int
  previous: list  # the resumed run's records up to `start`
  flops_per_token: float
  peak: float | None
  wall_start: float
  say: Callable
  notice: Callable


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
  return Run(config, run_dir, name, created, is_main, devices, setup, train_step, compile_s,
             corpus, eval_corpus, None, checkpoints, state, start, end, previous,
             flops_per_token, peak, wall_start, say, notice)


def evaluate(run: Run, state) -> float:
  """Mean held-out cross-entropy over ``train.eval_batches`` fixed batches
  (the eval step is compiled on the first call: a run too short to evaluate
  does not compile it)."""
  train_config = run.config.train
  shape = (train_config.batch_size, train_config.seq_len + 1)
  if run.eval_step is None:
    run.eval_step = compile_eval_step(run.setup, shape)
  batches = (global_batch(run.eval_corpus, k, sharding=run.setup.batch_sharding, shape=shape)
             for k in range(train_config.eval_batches))
  losses = [run.eval_step(state, batch) for batch in batches]
  return float(np.mean([np.asarray(loss.addressable_data(0)) for loss in losses]))


@dataclasses.dataclass
class LoopResult:
  """What :func:`train_loop` leaves: the records of its steps, the state,
  how it ended."""

  records: list
  state: dict
  state_step: int
  checkpoint_step: int | None
  stopped_by: str | None = None
  nonfinite: dict | None = None


def train_loop(run: Run, *, progress: bool, log: MetricsLog | None) -> LoopResult:
  """Runs steps ``run.start..run.end``: each one's record is logged (with the
  held-out loss every ``train.eval_every`` steps) and checkpointed every
  ``train.checkpoint_every``; a signal or a non-finite step ends it early."""
  train_config, setup = run.config.train, run.setup
  every = train_config.checkpoint_every
  batch_shape = (train_config.batch_size, train_config.seq_len + 1)
  make_batch = functools.partial(global_batch, run.corpus, sharding=setup.batch_sharding,
                                 shape=batch_shape)
  tokens_per_step = train_config.batch_size * train_config.seq_len
  schedule = make_schedule(train_config)
  # A resumed run starts from a checkpoint (of a step > 0).
  out = LoopResult([], run.state, run.start, run.start or None)
  nonfinite_in_row = 0
  reporter = ProgressReporter(total=run.end, start=run.start, enabled=progress and run.is_main,
                              log_every=train_config.log_every)
  with reporter, StopRequests() as stop_requests:
    try:
      batch = make_batch(run.start)
      tick = time.perf_counter()
      for step in range(run.start, run.end):
        out.state, metrics = run.train_step(out.state, batch)
        out.state_step = step + 1
        # The next batch is made while the device runs this step (dispatch is
        # asynchronous); a Ctrl-C meanwhile stops the run once this step is
        # recorded.
        interrupt = None
        if step + 1 < run.end:
          try:
            batch = make_batch(step + 1)
          except KeyboardInterrupt as error:
            interrupt = error
        record = {"step": step + 1, **_host(metrics)}
        now = time.perf_counter()
        record["step_time_s"] = now - tick
        record["tokens_per_s"] = tokens_per_step / record["step_time_s"]
        record["mfu"] = flops.mfu(record["tokens_per_s"] / len(run.devices),
                                  run.flops_per_token, run.peak)
        record["learning_rate"] = float(schedule(step))  # the rate of this step's update
        nonfinite_in_row = 0 if is_finite(record) else nonfinite_in_row + 1
        if nonfinite_in_row:
          record["skipped"] = nonfinite_in_row <= train_config.skip_nonfinite
        if run.eval_corpus is not None and (step + 1) % train_config.eval_every == 0:
          record["eval_loss"] = evaluate(run, out.state)
          reporter.note(f"step {step + 1}: held-out loss {record['eval_loss']:.4f}")
        tick = time.perf_counter()  # an eval's time is not the next step's
        out.records.append(record)
        if log is not None:
          log.write(record)
        if nonfinite_in_row > train_config.skip_nonfinite:
          out.nonfinite = record
          break
        if run.created and run.is_main and len(out.records) == 1:
          link_latest(run.run_dir, run.name)  # the run has started
        if run.checkpoints and ((step + 1) % every == 0 or step + 1 == run.end):
          if run.checkpoints.save(step + 1, out.state, data_step=step + 1):
            out.checkpoint_step = step + 1
        reporter.update(record)
        if interrupt is not None:
          raise interrupt
        out.stopped_by = stop_requests.stop_after(step + 1)
        if out.stopped_by:
          break
    except KeyboardInterrupt:
      if jax.process_count() > 1:
        raise  # the processes may be at different steps: no collective save
      out.stopped_by = "SIGINT"
  return out


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
