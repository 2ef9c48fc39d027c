"""Configuration of a pretraining run: frozen dataclasses that YAML maps onto
1:1, and MaxText-style ``key=value`` command-line overrides.

A YAML file has one section per dataclass (``model``, ``moe``, ``train``,
``data``, ``mesh``); ``moe`` is :class:`moe_ep.MoEConfig` itself. Unknown keys
are errors naming the key, in the file and in overrides alike; so are a key
given twice in one mapping and YAML syntax errors (with the file and line).
Numbers read as YAML 1.2 reads them (``1e-3`` is a float, not a string):

>>> load_config("configs/tiny.yaml", ["moe.top_k=4", "train.steps=500"]).moe.top_k
4
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
import re
import typing

import jax.numpy as jnp
import yaml

from moe_ep import MoEConfig
# One set of validators for both configs: MoEConfig's, so every field error
# reads the same ("ModelConfig.d_model=0 must be an integer >= 1").
from moe_ep.config import (check_bool, check_choice, check_int, check_number, fail, from_dict,
                           to_dict)

MESH_AXES = ("dp", "ep")
# ModelConfig.attention -> jax.nn.dot_product_attention(implementation=...).
ATTENTION_IMPLEMENTATIONS = {"auto": None, "xla": "xla", "cudnn": "cudnn"}
# ModelConfig.remat_policy values (examples/model.py maps them to policies).
REMAT_POLICIES = ("moe", "save_dots", "save_dots_attention", "full")
# DataConfig.token_dtype values: the widths of token ids in shard files.
TOKEN_DTYPES = ("uint16", "uint32")
DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


class ConfigError(ValueError):
  """A config file, override or run setting that cannot be used; the message
  is the one line a command line prints (it names the file, key or field)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The decoder-only transformer around the MoE layers.

  Attributes:
    vocab_size: tokens in the vocabulary (byte-level data needs >= 256).
    d_model: model width; ``moe.hidden_size`` follows it unless set explicitly.
    num_layers: transformer blocks.
    num_heads: attention heads; ``d_model / num_heads`` is even (RoPE).
    mlp_size: hidden width of the dense FFN blocks.
    moe_every: every ``moe_every``-th block has an MoE FFN, the others a
      dense one (1: all blocks are MoE); divides ``num_layers``.
    scan_layers: stack the repeating blocks and run them with ``nnx.scan``
      (one compiled body whatever the depth) instead of a Python loop.
    remat_blocks: checkpoint each repeating unit (``jax.checkpoint``) with
      the policy ``remat_policy`` names; False: no rematerialisation.
    remat_policy: what a checkpointed unit saves for the backward pass (the
      rest is recomputed); ignored without ``remat_blocks``:
      ``"moe"``: only the MoE's named values ``moe.remat.save`` lists (e.g.
      the dispatched rows: attention, dense FFNs and experts recompute);
      ``"save_dots"``: those and every matmul output without batch
      dimensions (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``:
      the qkv, output and dense-MLP projections and the router; not the
      attention scores or the expert GEMMs, batched over experts; MaxText's
      ``minimal``); ``"save_dots_attention"``: those and cuDNN flash
      attention's outputs (the attended values and the softmax statistics,
      what its backward reads: ``T * D`` bf16 and ``T * heads`` float32 a
      layer), so the backward runs no attention forward again; with XLA
      attention the same as ``"save_dots"``; ``"full"``: nothing, everything
      is recomputed (``nothing_saveable``, the dispatch exchange included).
    rope_base: rotary position embedding base.
    dtype: compute dtype of attention and dense layers (``moe.dtype`` for the MoE).
    attention: ``jax.nn.dot_product_attention``'s implementation:
      ``"auto"`` (JAX chooses; XLA in JAX 0.10), ``"xla"`` or ``"cudnn"``
      (cuDNN flash attention: CUDA GPUs only, ``dtype`` bfloat16 or float16,
      head size ``d_model / num_heads`` a multiple of 8 and <= 256).
  """

  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_size: int = 256
  moe_every: int = 1
  scan_layers: bool = True
  remat_blocks: bool = False
  remat_policy: str = "moe"
  rope_base: float = 10000.0
  dtype: str = "float32"
  attention: str = "auto"

  def __post_init__(self):
    for field in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_size", "moe_every"):
      check_int(self, field, 1)
    if self.d_model % (2 * self.num_heads):
      fail(self, "d_model", f"must be a multiple of 2 * num_heads={self.num_heads} "
            "(an even head size for rotary embeddings)")
    if self.num_layers % self.moe_every:
      fail(self, "num_layers", f"must be a multiple of moe_every={self.moe_every}")
    for field in ("scan_layers", "remat_blocks"):
      check_bool(self, field)
    check_number(self, "rope_base", 1.0)
    check_choice(self, "remat_policy", REMAT_POLICIES)
    try:
      dtype = jnp.dtype(self.dtype).name
    except TypeError:
      fail(self, "dtype", "is not a dtype name")
    check_choice(self, "attention", ATTENTION_IMPLEMENTATIONS)
    if self.attention == "cudnn":
      if dtype not in ("bfloat16", "float16"):
        fail(self, "attention", "needs dtype bfloat16 or float16 (cuDNN flash "
              f"attention), got dtype={self.dtype!r}")
      if self.head_dim % 8 or self.head_dim > 256:
        fail(self, "attention", "needs a head size d_model / num_heads that is a "
              f"multiple of 8 and <= 256 (cuDNN flash attention), got {self.head_dim}")

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers // self.moe_every

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def attention_implementation(self) -> str | None:
    """The ``implementation=`` argument of ``jax.nn.dot_product_attention``."""
    return ATTENTION_IMPLEMENTATIONS[self.attention]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The optimisation and the run's bookkeeping.

  Attributes:
    seed: parameter initialisation and the data stream (a pure function of
      ``(seed, step)``).
    steps: optimizer steps of the whole run.
    batch_size: global sequences per step; divisible by the mesh's devices.
    seq_len: tokens per sequence (the model sees ``seq_len``, predicts the next).
    learning_rate: AdamW peak rate, reached after ``warmup_steps`` of linear
      warm-up, then cosine decay to ``learning_rate * final_lr_fraction``.
    warmup_steps: linear warm-up steps; a run of ``steps <= warmup_steps``
      (a short trial run) warms up over ``steps // 10`` instead, see
      :attr:`warmup_steps_used`.
    weight_decay: AdamW decoupled decay of matrices (not norm scales).
    grad_clip_norm: clip the global gradient norm to this (None: no clipping).
    adam_mu_dtype: the dtype of AdamW's first moment ("bfloat16" halves its
      bytes, optax's ``mu_dtype``; the second moment stays float32); None:
      the parameters' dtype.
    skip_nonfinite: a step whose loss, gradient norm or updated parameters
      are not finite (NaN or inf) stops the run, unsaved, naming the step;
      with N > 0 up to N such steps in a row are skipped instead (their
      update discarded, the model and optimizer state left as they were;
      counted in ``summary.json``) and the run stops at the N+1-th.
    checkpoint_every: save an Orbax checkpoint every this many steps and at
      the end (0: never).
    log_every: print a plain progress line every this many steps when the
      output is not a terminal (logs of multi-process jobs, CI).
    eval_every: every this many steps, the mean cross-entropy over
      ``eval_batches`` held-out batches (``data.eval_path``), the same batches
      each time, goes into the metrics as ``eval_loss`` (0: no eval).
    eval_batches: held-out batches per evaluation.
    tensorboard: also write the metrics as TensorBoard event files into the
      run directory (needs ``tensorboardX``; without it, one line says so).
    wandb_project: also log to this Weights & Biases project (needs
      ``wandb``; None: no W&B).
    peak_tflops: the per-device peak (TFLOP/s) that MFU is reported
      against; None: the dense bf16 peak of the device kind from
      ``examples/flops.py``'s table (no MFU where the kind is unknown, e.g.
      on CPU).
    run_dir: config.yaml, checkpoints, metrics.jsonl, TensorBoard events,
      metrics.png and summary.json go here. None: a new folder per run,
      ``runs/<config name>-<YYYYmmdd-HHMMSS>``, with ``runs/<config name>-latest``
      linking the newest (``examples/pretrain.py`` chooses it).
  """

  seed: int = 0
  steps: int = 300
  batch_size: int = 32
  seq_len: int = 64
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.1
  grad_clip_norm: float | None = 1.0
  adam_mu_dtype: str | None = None
  skip_nonfinite: int = 0
  checkpoint_every: int = 100
  log_every: int = 25
  eval_every: int = 0
  eval_batches: int = 4
  tensorboard: bool = True
  wandb_project: str | None = None
  peak_tflops: float | None = None
  run_dir: str | None = None

  def __post_init__(self):
    check_int(self, "seed", 0)
    for field in ("steps", "batch_size", "seq_len", "log_every", "eval_batches"):
      check_int(self, field, 1)
    for field in ("warmup_steps", "skip_nonfinite", "checkpoint_every", "eval_every"):
      check_int(self, field, 0)
    check_bool(self, "tensorboard")
    if self.wandb_project is not None and (not isinstance(self.wandb_project, str)
                                           or not self.wandb_project):
      fail(self, "wandb_project", "must be a project name or null")
    check_number(self, "learning_rate", 0.0)
    check_number(self, "weight_decay", 0.0)
    check_number(self, "grad_clip_norm", 0.0, optional=True)
    check_choice(self, "adam_mu_dtype", (None, "float32", "bfloat16"))
    peak = self.peak_tflops
    if peak is not None and (not isinstance(peak, (int, float)) or isinstance(peak, bool)
                             or not 0 < peak < math.inf):
      fail(self, "peak_tflops", "must be a finite number > 0 (TFLOP/s per device) or null")
    check_number(self, "final_lr_fraction", 0.0)  # refuses text, lists, mappings, bools
    if self.final_lr_fraction > 1.0:
      fail(self, "final_lr_fraction", "must be in [0, 1]")
    if self.run_dir is not None and (not isinstance(self.run_dir, str) or not self.run_dir):
      fail(self, "run_dir", "must be a non-empty path or null")

  @property
  def warmup_steps_used(self) -> int:
    """``warmup_steps``, or ``steps // 10`` where the run is not longer than
    the warm-up (``train.steps=30`` on a config made for 1000 steps)."""
    return self.warmup_steps if self.warmup_steps < self.steps else self.steps // 10


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the tokens come from.

  Attributes:
    path: None for the built-in synthetic corpus; a text file, trained on
      byte-level (vocabulary 256); or token shards read through Grain
      (``examples/token_data.py``): a ``.bin`` file of flat little-endian
      token ids (nanoGPT/MaxText style), a glob of them, or a directory
      whose ``train*.bin`` files are the training shards (and ``val*.bin``
      the held-out ones), as ``examples/tokenize_text.py`` writes them.
    eval_path: held-out data for ``train.eval_every``, in the same form as
      ``path`` (None: a shard directory's ``val*.bin``; the synthetic corpus
      holds out its own sequences; a text file needs one).
    token_dtype: ``"uint16"`` or ``"uint32"``: the width of the ids in token
      shards (None: from the ``tokens.json`` beside them, else uint16).
    num_topics: synthetic corpus: each sequence follows one of this many
      hidden Markov chains, so the model must infer the chain from context.
    successors: synthetic corpus: tokens that can follow a given token.
  """

  path: str | None = None
  eval_path: str | None = None
  token_dtype: str | None = None
  num_topics: int = 4
  successors: int = 4

  def __post_init__(self):
    for field in ("path", "eval_path"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, str) or not value):
        fail(self, field, "must be a file path or null")
    check_choice(self, "token_dtype", (None, *TOKEN_DTYPES))
    check_int(self, "num_topics", 1)
    check_int(self, "successors", 1)

  @property
  def is_byte_text(self) -> bool:
    """Whether ``path`` is a text file trained on byte-level (not token shards)."""
    return self.path is not None and not is_token_shards(self.path)


def is_token_shards(path: str) -> bool:
  """Whether a ``data.path`` names token shards (a ``.bin`` file, a glob or a
  directory) rather than a text file."""
  return (path.endswith(".bin") or any(c in path for c in "*?[")
          or pathlib.Path(path).is_dir())


# How to get another device count, for the errors of MeshConfig.shape.
_CPU_DEVICES_HINT = "on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N sets the devices"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The ``("dp", "ep")`` device mesh; ``dp * ep`` is the device count.

  Attributes:
    dp: data-parallel size (None: the devices left after ``ep``).
    ep: expert-parallel size (None: the devices left after ``dp``). With
      both None the mesh adapts to the devices present: ``ep`` is the largest
      divisor of the devices of one node that also divides
      ``moe.num_experts``, and ``dp`` the rest (across nodes; see
      ``examples/mesh.py``). An ``ep`` larger than a node spans nodes.
  """

  dp: int | None = None
  ep: int | None = None

  def __post_init__(self):
    check_int(self, "dp", 1, optional=True)
    check_int(self, "ep", 1, optional=True)

  def shape(self, num_devices: int, *, num_experts: int, batch_size: int,
            devices_per_node: int | None = None) -> tuple[int, int]:
    """``(dp, ep)`` over ``num_devices`` devices for ``num_experts`` experts
    and a global batch of ``batch_size`` sequences (split over all devices);
    ``devices_per_node`` (None: all on one) bounds the automatic ``ep``.

    >>> MeshConfig().shape(8, num_experts=8, batch_size=32)
    (1, 8)
    >>> MeshConfig().shape(6, num_experts=8, batch_size=48)
    (3, 2)
    >>> MeshConfig().shape(16, num_experts=64, batch_size=32, devices_per_node=8)
    (2, 8)
    """
    if batch_size % num_devices:
      raise ValueError(
          f"TrainConfig.batch_size={batch_size} must be divisible by the {num_devices} "
          f"devices (every device takes an equal share of the batch): set train.batch_size "
          f"to a multiple of {num_devices}, or use another device count ({_CPU_DEVICES_HINT})")
    dp, ep = self.dp, self.ep
    if dp is None and ep is None:
      node = num_devices if devices_per_node is None else devices_per_node
      ep = max(d for d in range(1, node + 1)
               if node % d == 0 and num_devices % d == 0 and num_experts % d == 0)
    if ep is None:
      ep = num_devices // dp
    elif dp is None:
      dp = num_devices // ep
    if dp * ep != num_devices:
      raise ValueError(
          f"MeshConfig dp={self.dp} ep={self.ep} does not tile the {num_devices} devices "
          f"(dp * ep must equal the device count): set mesh.dp=... mesh.ep=... to sizes "
          f"whose product is {num_devices}, or mesh.dp=null mesh.ep=null to fit any device "
          f"count ({_CPU_DEVICES_HINT})")
    if num_experts % ep:
      raise ValueError(
          f"MoEConfig.num_experts={num_experts} must be divisible by the mesh's ep={ep}: "
          f"set mesh.ep to a divisor of {num_experts} that divides {num_devices}, or "
          "mesh.dp=null mesh.ep=null to choose one")
    return dp, ep

  @property
  def chosen(self) -> str:
    """Which sizes :meth:`shape` chooses: ``"auto"``, ``"ep auto"``, ``"dp auto"`` or ``""``."""
    axes = [axis for axis in MESH_AXES if getattr(self, axis) is None]
    return "auto" if len(axes) == 2 else f"{axes[0]} auto" if axes else ""


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run: one section per YAML mapping."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  moe: MoEConfig = dataclasses.field(
      default_factory=lambda: MoEConfig(hidden_size=64, ffn_size=128, num_experts=8, top_k=2))
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      section_type = typing.get_type_hints(Config)[field.name]
      if not isinstance(getattr(self, field.name), section_type):
        raise ValueError(f"config.{field.name} must be a mapping of {section_type.__name__} "
                         f"keys, got {getattr(self, field.name)!r}")
    if self.moe.hidden_size != self.model.d_model:
      raise ValueError(f"MoEConfig.hidden_size={self.moe.hidden_size} must equal "
                       f"ModelConfig.d_model={self.model.d_model}: set "
                       f"moe.hidden_size={self.model.d_model}, or leave moe.hidden_size out "
                       "(it follows model.d_model)")
    if self.moe.ep_axis != "ep" or not set(self.moe.batch_axes) <= set(MESH_AXES):
      raise ValueError(f"MoEConfig.ep_axis={self.moe.ep_axis!r} and batch_axes="
                       f"{self.moe.batch_axes!r} must name the mesh axes {MESH_AXES}")
    if self.data.path is None and self.model.vocab_size < 2 * self.data.successors:
      raise ValueError(f"ModelConfig.vocab_size={self.model.vocab_size} must be >= 2 * "
                       f"DataConfig.successors={self.data.successors} for the synthetic corpus")
    if self.data.is_byte_text and self.model.vocab_size < 256:
      raise ValueError(f"ModelConfig.vocab_size={self.model.vocab_size} must be >= 256 "
                       "for byte-level data")

  def mesh_shape(self, num_devices: int, devices_per_node: int | None = None) -> tuple[int, int]:
    """``(dp, ep)`` of this run on ``num_devices`` devices (:meth:`MeshConfig.shape`)."""
    return self.mesh.shape(num_devices, num_experts=self.moe.num_experts,
                           batch_size=self.train.batch_size, devices_per_node=devices_per_node)


# --- YAML and overrides --------------------------------------------------------

# YAML 1.2 floats with an exponent ("1e-3", "5E+4", "2.5e3"), which PyYAML's
# YAML 1.1 rules read as strings.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


class _ConfigLoader(yaml.SafeLoader):
  """PyYAML's safe loader, refusing a key given twice in one mapping."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if isinstance(key, typing.Hashable) and key in seen:
        raise yaml.constructor.ConstructorError(problem=f"duplicate key {key!r}",
                                                problem_mark=key_node.start_mark)
      seen.add(key)
    return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT,
                                    list("-+.0123456789"))


def parse_yaml(text: str, where: str, lines: bool = True):
  """``text`` read as YAML (:class:`_ConfigLoader`); a syntax error or a
  duplicate key raises :class:`ConfigError` naming ``where`` (and the line
  and column where ``lines``)."""
  try:
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)
  except yaml.YAMLError as error:
    mark = getattr(error, "problem_mark", None)
    if lines and mark is not None:
      where = f"{where}, line {mark.line + 1}, column {mark.column + 1}"
    context = getattr(error, "context", None)
    problem = getattr(error, "problem", None) or str(error)
    raise ConfigError(f"{where}: {problem}" + (f" ({context})" if context else "")) from None


def read_yaml(path):
  """The YAML file at ``path``; an unreadable file or bad YAML raises
  :class:`ConfigError` naming the file (and the line)."""
  path = pathlib.Path(path)
  try:
    text = path.read_text()
  except IsADirectoryError:
    raise ConfigError(f"{path} is a directory, not a YAML file") from None
  except UnicodeDecodeError:
    raise ConfigError(f"{path} is not a text (UTF-8) file") from None
  except OSError as error:
    raise ConfigError(f"cannot read {path}: {error.strerror}") from None
  return parse_yaml(text, str(path))


def _section_type(cls, key: str, dotted: str):
  """The type of field ``key`` of dataclass ``cls``; errors name ``dotted``."""
  fields = {f.name for f in dataclasses.fields(cls)}
  if key not in fields:
    raise ValueError(f"unknown key {dotted!r} (known keys here: {sorted(fields)})")
  return typing.get_type_hints(cls)[key]


def parse_override(text: str) -> tuple[str, object]:
  """``"moe.top_k=4"`` -> ``("moe.top_k", 4)``; the value is parsed as YAML."""
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise ValueError(f"override {text!r} must look like section.key=value")
  return key.strip(), parse_yaml(value, f"override {text!r}", lines=False)


def apply_overrides(data: dict, overrides) -> dict:
  """Returns ``data`` (nested dicts) with each dotted ``key=value`` set.

  Every key is checked against the dataclasses first, so a typo fails with
  its dotted name instead of being silently added.
  """
  data = copy.deepcopy(data)
  for text in overrides:
    key, value = parse_override(text)
    parts = key.split(".")
    cls, node = Config, data
    for depth, part in enumerate(parts):
      dotted = ".".join(parts[:depth + 1])
      field_type = _section_type(cls, part, dotted)
      if depth == len(parts) - 1:
        if dataclasses.is_dataclass(field_type) and not isinstance(value, dict):
          raise ValueError(f"override {text!r}: {dotted} is a section; set its keys "
                           f"({dotted}.<key>=value)")
        node[part] = value
      elif dataclasses.is_dataclass(field_type):
        cls = field_type
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
          raise ValueError(f"override {text!r}: {dotted} is not a section")
      else:
        raise ValueError(f"override {text!r}: {dotted} is a value, not a section")
  return data


def config_from_dict(data: dict | None) -> Config:
  """Builds a :class:`Config`; unknown keys raise naming ``config.section.key``.
  ``moe.hidden_size`` left out follows ``model.d_model``."""
  data = dict(data or {})
  model = data.get("model") if isinstance(data.get("model"), dict) else {}
  default_moe = {k: v for k, v in to_dict(Config().moe).items() if k != "hidden_size"}
  moe = data.get("moe", default_moe if "d_model" in model else None)
  if isinstance(moe, dict) and "hidden_size" not in moe:
    data["moe"] = {**moe, "hidden_size": model.get("d_model", ModelConfig.d_model)}
  return from_dict(Config, data, "config")


def split_config_path(args, what: str = "config file") -> tuple[str | None, list[str]]:
  """Command-line words -> ``(file or None, overrides)``: a word with ``=``
  is an override, any other the file (``what`` names it in errors); in any order.

  >>> split_config_path(["train.steps=20", "configs/tiny.yaml", "moe.top_k=4"])
  ('configs/tiny.yaml', ['train.steps=20', 'moe.top_k=4'])
  """
  paths = [arg for arg in args if "=" not in arg]
  if len(paths) > 1:
    raise ValueError(f"give one {what}, got {len(paths)}: {' '.join(paths)} "
                     "(overrides look like section.key=value)")
  return (paths[0] if paths else None), [arg for arg in args if "=" in arg]


def load_config(path=None, overrides=()) -> Config:
  """Reads a YAML config (default ``configs/tiny.yaml``) and applies overrides."""
  path = pathlib.Path(path or DEFAULT_CONFIG)
  data = read_yaml(path)
  if data is None:
    data = {}
  if not isinstance(data, dict):
    raise ValueError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
  return config_from_dict(apply_overrides(data, overrides))


def config_to_yaml(config: Config) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False)


# --- resuming ------------------------------------------------------------------

# What a resumed run may change: the training schedule and bookkeeping
# (train.*), the data, the mesh, and the execution choices below (the same
# arithmetic on other kernels, or with other values saved for the backward
# pass). Every other model and moe field changes the parameters or what the
# step computes, so a run's checkpoints do not continue under it.
RESUMABLE = ("train.", "data.", "mesh.", "model.remat_blocks", "model.remat_policy",
             "model.attention", "moe.transport", "moe.exchange", "moe.remat")


def _flat(data: dict, prefix: str = "") -> dict:
  """Nested dicts -> ``{"section.key": value}``."""
  flat = {}
  for key, value in data.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def resume_changes(saved: Config, new: Config) -> tuple[list[str], list[str]]:
  """``(refused, allowed)``: each field where ``new`` differs from the
  ``saved`` config of the run it resumes, as ``"moe.top_k 2 -> 4"``
  (``train.run_dir`` aside). Refused: fields that change the parameters or
  the computation; allowed: those :data:`RESUMABLE` names."""
  before, after = _flat(to_dict(saved)), _flat(to_dict(new))
  refused, allowed = [], []
  for key in after:
    if key != "train.run_dir" and before.get(key) != after[key]:
      change = f"{key} {before.get(key)!r} -> {after[key]!r}"
      resumable = any(key == name or key.startswith(name.rstrip(".") + ".") for name in RESUMABLE)
      (allowed if resumable else refused).append(change)
  return refused, allowed
