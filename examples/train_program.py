"""The training program of ``examples/pretrain.py``: the mesh, the optimizer
and its schedule, the model and optimizer state (traced abstractly, then
created sharded), and the compiled train and eval steps.

:func:`build_program` is what :mod:`examples.pretrain` trains and
:mod:`examples.profile_step` profiles: one program for one config.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples import mesh as device_mesh
from examples.checkpoints import abstract_like
from examples.model import TransformerLM
from examples.run_control import FINITE_METRICS
from examples.train_config import MESH_AXES, Config, DataConfig, TrainConfig
import moe_ep
from moe_ep import MoEAux

# The batch is split over every device: data parallel over dp and ep alike.
BATCH_SPEC = P(MESH_AXES)


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
                      mask=decay_mask, mu_dtype=train.adam_mu_dtype)
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


def parameter_count(abstract_state: dict) -> int:
  """Parameters (``nnx.Param`` elements) of the model in a :class:`Setup`'s state."""
  params = nnx.filter_state(abstract_state["model"], nnx.Param)
  return sum(leaf.size for leaf in jax.tree.leaves(params))


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

