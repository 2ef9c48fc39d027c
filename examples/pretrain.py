"""Pretrains a small Mixture-of-Experts language model with moe_ep.

    python examples/pretrain.py                          # configs/tiny.yaml, 8 virtual CPU devices
    python examples/pretrain.py configs/small_gpu.yaml train.steps=2000 moe.top_k=4
    python examples/pretrain.py --data some.txt          # byte-level on a text file
    python examples/pretrain.py --resume                 # continue from run_dir's latest checkpoint
    python -m moe_ep.launch --num-processes 2 --cpu-devices-per-process 4 -- \\
        python examples/pretrain.py

Writes into ``train.run_dir``: ``config.yaml``, Orbax ``checkpoints/``,
``metrics.jsonl`` (one line per step), ``metrics.png`` (loss curve and
per-expert load) and ``summary.json``.
"""

from __future__ import annotations

import os
import pathlib
import sys

# `python examples/pretrain.py` puts examples/ on sys.path, not the repository.
_REPO = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# Eight virtual CPU devices give the ("dp", "ep") mesh on a machine without
# accelerators. This must happen before JAX starts; it is skipped where
# JAX_PLATFORMS asks for GPUs and leaves a count already set (moe_ep.launch
# sets one per process) alone.
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")
if (not any(p in os.environ.get("JAX_PLATFORMS", "") for p in _GPU_PLATFORMS)
    and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from examples import plots  # noqa: E402
from examples.checkpoints import RunCheckpoints, abstract_like  # noqa: E402
from examples.data import make_corpus  # noqa: E402
from examples.model import TransformerLM  # noqa: E402
from examples.progress import ProgressReporter  # noqa: E402
from examples.train_config import (MESH_AXES, Config, DataConfig, TrainConfig,  # noqa: E402
                                   config_to_yaml, load_config)
from moe_ep import distributed  # noqa: E402

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
  """

  records: list[dict]
  summary: dict
  state: dict


def make_mesh(config: Config, devices=None) -> jax.sharding.Mesh:
  """The ``("dp", "ep")`` mesh over all (global) devices."""
  devices = jax.devices() if devices is None else devices
  dp, ep = config.mesh.shape(len(devices))
  if config.train.batch_size % (dp * ep):
    raise ValueError(f"TrainConfig.batch_size={config.train.batch_size} must be divisible "
                     f"by the {dp * ep} devices of the mesh dp={dp} x ep={ep}")
  if config.moe.num_experts % ep:
    raise ValueError(f"MoEConfig.num_experts={config.moe.num_experts} must be divisible "
                     f"by the mesh's ep={ep}")
  # Not jax.make_mesh: its Explicit axis types change how shard_map takes in_specs.
  return jax.sharding.Mesh(np.array(devices).reshape(dp, ep), MESH_AXES)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
  """AdamW with linear warm-up and cosine decay, decaying matrices only."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps,
      decay_steps=train.steps, end_value=train.learning_rate * train.final_lr_fraction)
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
    model = TransformerLM(config, mesh, rngs=nnx.Rngs(config.train.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)  # ExpertBias is not a Param

  def create_state():
    model, optimizer = create_modules()
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}

  model, optimizer = nnx.eval_shape(create_modules)
  model_def, model_state = nnx.split(model)
  optimizer_def, optimizer_state = nnx.split(optimizer)
  state = {"model": model_state, "optimizer": optimizer_state}
  # Partition specs come from the parameters' metadata (experts over "ep");
  # everything else is replicated.
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                           nnx.get_partition_spec(state),
                           is_leaf=lambda x: isinstance(x, P))
  return Setup(mesh, model_def, optimizer_def, abstract_like(state, shardings), shardings,
               NamedSharding(mesh, BATCH_SPEC),
               jax.jit(create_state, out_shardings=shardings))


def make_train_step(config: Config, setup: Setup):
  """``step(state, tokens [B, S + 1]) -> (state, metrics)``, not yet jitted."""
  use_expert_bias = config.moe.use_expert_bias

  def loss_fn(model, tokens):
    logits, aux = model(tokens[:, :-1])
    ce_loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss = ce_loss + aux.aux_loss.sum() + aux.z_loss.sum()
    return loss, (ce_loss, aux)

  def step(state, tokens):
    model = nnx.merge(setup.model_def, state["model"])
    optimizer = nnx.merge(setup.optimizer_def, state["optimizer"])
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
    (loss, (ce_loss, aux)), grads = grad_fn(model, tokens)
    optimizer.update(model, grads)
    if use_expert_bias:
      model.update_expert_bias(aux)
    routes = jnp.maximum(aux.tokens_per_expert.sum(axis=-1, keepdims=True), 1)
    metrics = {
        "loss": loss, "ce_loss": ce_loss,
        "aux_loss": aux.aux_loss.sum(), "z_loss": aux.z_loss.sum(),
        "dropped_fraction": aux.dropped_fraction.mean(),
        "expert_load": aux.tokens_per_expert / routes,  # [num_moe_layers, E]
        "grad_norm": optax.tree.norm(grads),
    }
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}, metrics

  return step


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
  (where outputs go, how often, which data) set to their defaults."""
  train = dataclasses.replace(config.train, run_dir=TrainConfig.run_dir,
                              checkpoint_every=TrainConfig.checkpoint_every,
                              log_every=TrainConfig.log_every)
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


def global_batch(corpus, step: int, sharding: NamedSharding, shape: tuple) -> jax.Array:
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


def summarize(records: list[dict], *, config: Config, mesh, compile_s: float, wall_s: float,
              peak_memory: int) -> dict:
  """The run's headline numbers (step times exclude compilation)."""
  step_times = [r["step_time_s"] for r in records[1:]] or [r["step_time_s"] for r in records]
  median_step = statistics.median(step_times)
  last = records[-FINAL_LOSS_WINDOW:]
  return {
      "steps": records[-1]["step"],
      "steps_this_run": len(records),
      "final_loss": statistics.fmean(r["ce_loss"] for r in last),
      "final_total_loss": statistics.fmean(r["loss"] for r in last),
      "dropped_fraction": statistics.fmean(r["dropped_fraction"] for r in records),
      "median_step_s": median_step,
      "tokens_per_s": config.train.batch_size * config.train.seq_len / median_step,
      "compile_s": compile_s,
      "wall_s": wall_s,
      "peak_memory_bytes": peak_memory,
      "mesh": dict(mesh.shape),
      "processes": jax.process_count(),
      "backend": jax.default_backend(),
  }


def train(config: Config, *, resume: bool = False, stop_at: int | None = None,
          progress: bool = True) -> RunResult:
  """Runs (or resumes) training as ``config`` says.

  Args:
    config: the run.
    resume: continue from the latest checkpoint in ``run_dir/checkpoints``;
      without it, the run starts over and deletes any checkpoints there.
    stop_at: leave after this step count (and checkpoint there), as a run
      cut short by a job time limit would; ``--resume`` continues it.
    progress: show the progress bar (process 0 only).
  """
  wall_start = time.perf_counter()
  train_config = config.train
  run_dir = pathlib.Path(train_config.run_dir)
  is_main = jax.process_index() == 0
  corpus = make_corpus(config)
  compile_start = time.perf_counter()
  setup, train_step = build_program(program_config(config), tuple(jax.devices()))
  compile_s = time.perf_counter() - compile_start
  mesh = setup.mesh

  every = train_config.checkpoint_every
  checkpoints = RunCheckpoints(run_dir / "checkpoints") if every else None
  start = 0
  if resume:
    latest = checkpoints.latest_step() if checkpoints else None
    if latest is None:
      raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    state, start = checkpoints.restore(latest, setup.abstract_state)
  else:
    if checkpoints and (deleted := checkpoints.delete_all()) and is_main:
      print(f"starting over: deleted the checkpoints of steps {deleted} in "
            f"{checkpoints.directory} (use --resume to continue them)", flush=True)
    state = setup.create()
  end = train_config.steps if stop_at is None else min(stop_at, train_config.steps)
  if start >= end:
    raise ValueError(f"the checkpoint is at step {start}, the run ends at {end}: "
                     "raise train.steps to train further")

  metrics_path = run_dir / "metrics.jsonl"
  previous = _read_records(metrics_path, start) if resume else []
  if is_main:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(config))
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in previous))
  batch_shape = (train_config.batch_size, train_config.seq_len + 1)
  tokens_per_step = train_config.batch_size * train_config.seq_len

  records = []
  reporter = ProgressReporter(total=end, start=start, enabled=progress and is_main,
                              log_every=train_config.log_every,
                              header=f"{corpus.describe()}; mesh {dict(mesh.shape)} on "
                                     f"{len(mesh.devices.flat)} {jax.default_backend()} devices")
  with reporter, contextlib.ExitStack() as files:
    metrics_file = files.enter_context(metrics_path.open("a")) if is_main else None
    tick = time.perf_counter()
    for step in range(start, end):
      state, metrics = train_step(state, global_batch(corpus, step, setup.batch_sharding,
                                                      batch_shape))
      record = {"step": step + 1, **_host(metrics)}
      now = time.perf_counter()
      record["step_time_s"], tick = now - tick, now
      record["tokens_per_s"] = tokens_per_step / record["step_time_s"]
      records.append(record)
      if metrics_file:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
      if checkpoints and ((step + 1) % every == 0 or step + 1 == end):
        checkpoints.save(step + 1, state, data_step=step + 1)
      reporter.update(record)
  if checkpoints:
    checkpoints.close()

  summary = summarize(records, config=config, mesh=mesh, compile_s=compile_s,
                      wall_s=time.perf_counter() - wall_start,
                      peak_memory=peak_memory_bytes(train_step))
  if is_main:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plots.plot_run(previous + records, run_dir / "metrics.png",
                   loss_floor=getattr(corpus, "entropy_floor", None))
  return RunResult(records, summary, state)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      usage="%(prog)s [-h] [--data PATH] [--resume] [CONFIG.yaml] [key=value ...]",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Overrides use dotted keys of the YAML sections: model., moe., train., data., "
             "mesh. (e.g. moe.top_k=4 train.steps=50 moe.capacity_factor=null).")
  parser.add_argument("args", nargs="*", metavar="CONFIG.yaml key=value",
                      help="a config file (default configs/tiny.yaml), then overrides")
  parser.add_argument("--data", metavar="PATH", help="train byte-level on this text file "
                      "(same as data.path=PATH)")
  parser.add_argument("--resume", action="store_true",
                      help="continue from the latest checkpoint in train.run_dir")
  args = parser.parse_args(argv)
  config_path = None
  if args.args and "=" not in args.args[0]:
    config_path, *overrides = args.args
  else:
    overrides = list(args.args)
  if args.data:
    overrides.append(f"data.path={json.dumps(args.data)}")
  try:
    return load_config(config_path, overrides), args.resume
  except (ValueError, FileNotFoundError) as error:
    parser.error(str(error))


def main(argv=None) -> int:
  distributed.initialize_from_env()  # before any JAX computation
  config, resume = parse_args(argv)
  result = train(config, resume=resume)
  if jax.process_index() == 0:
    summary = result.summary
    print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.3f} "
          f"(mean of the last {min(FINAL_LOSS_WINDOW, summary['steps_this_run'])}), {summary['tokens_per_s']:,.0f} tokens/s, "
          f"wall {summary['wall_s']:.0f} s (compile {summary['compile_s']:.0f} s); "
          f"outputs in {config.train.run_dir}/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
