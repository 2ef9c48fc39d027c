"""Static configuration: frozen dataclasses validated on construction, and
their 1:1 mapping to and from plain dicts (YAML).

Validation messages name the field and the rule, e.g.
``MoEConfig.top_k=9 must be <= num_experts=8``; the validators (:func:`fail`,
:func:`check_int`, :func:`check_number`, :func:`check_bool`,
:func:`check_choice`) serve every config dataclass, the examples' too.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_ep.activations import ACTIVATIONS, input_projections
from moe_ep.options import CHECKPOINT_FIELDS, EXCHANGES, TOKEN_DTYPES, TRANSPORTS, check_wire_dtype
from moe_ep.row_groups import GROUP_ALIGN, GROUP_ALIGNS

SCORE_FUNCTIONS = ("softmax", "sigmoid")
# Floating dtypes the layer computes exactly; float64 is refused (see _check_dtype).
DTYPES = TOKEN_DTYPES  # the layer computes in what the transport moves exactly
# Where the expert bank's rows sit (MoEConfig.expert_layout).
EXPERT_LAYOUTS = ("auto", "slabs", "grouped")
# The expert GEMMs' precision (MoEConfig.expert_precision): None, the compute dtype.
EXPERT_PRECISIONS = (None, "fp8")
# Sizes the FP8 bank takes: multiples of 16 (16-byte FP8 rows for the kernels' bulk copies).
FP8_SIZE_MULTIPLE = 16
# How group-limited routing scores a group (MoEConfig.group_score): DeepSeek-V3's
# sum of its two best experts, or DeepSeek-V2's best expert.
GROUP_SCORES = ("top2_sum", "max")

# Checkpoint-name groups of RematConfig.save, each expanding to named values.
REMAT_GROUPS = {
    "router": ("router.scores", "router.topk_idx", "router.topk_weights"),
    "dispatch": tuple(f"dispatch.{field}" for field in CHECKPOINT_FIELDS),
    "combine": ("combine.output",),
    "expert_hidden": ("expert_hidden",),
    "expert_output": ("expert_output",),
    "expert_weights": ("expert_weights",),
    "expert_fp8": ("expert_fp8.input", "expert_fp8.hidden"),
}
REMAT_NAMES = tuple(name for group in REMAT_GROUPS.values() for name in group)


_UNSET = object()


def fail(obj, field: str, rule: str, value=_UNSET):
  """ValueError ``"<Class>.<field>=<value> <rule>"`` (``value``: the field's own)."""
  value = getattr(obj, field) if value is _UNSET else value
  raise ValueError(f"{type(obj).__name__}.{field}={value!r} {rule}")


def _is_bool(value) -> bool:
  return isinstance(value, (bool, np.bool_))


def check_int(obj, field: str, minimum: int, optional: bool = False) -> None:
  """Python and NumPy integers (not bools) >= minimum, stored as Python int
  (``optional``: None too)."""
  value = getattr(obj, field)
  if optional and value is None:
    return
  try:
    number = None if _is_bool(value) else operator.index(value)
  except TypeError:
    number = None
  if number is None or number < minimum:
    fail(obj, field, f"must be an integer >= {minimum}")
  object.__setattr__(obj, field, number)


def check_number(obj, field: str, minimum: float, strict: bool = False,
                 optional: bool = False) -> None:
  """Finite Python or NumPy reals (not bools) >= minimum (``strict``: >),
  stored as Python float (``optional``: None too)."""
  value = getattr(obj, field)
  if optional and value is None:
    return
  ok = (isinstance(value, (int, float, np.integer, np.floating)) and not _is_bool(value)
        and math.isfinite(value) and (value > minimum if strict else value >= minimum))
  if not ok:
    fail(obj, field, f"must be a finite number {'>' if strict else '>='} {minimum}")
  object.__setattr__(obj, field, float(value))


def check_bool(obj, field: str) -> None:
  """A real bool (NumPy's included, stored as bool): strings like "False"
  would be truthy."""
  value = getattr(obj, field)
  if not _is_bool(value):
    fail(obj, field, "must be a bool (True or False)")
  object.__setattr__(obj, field, bool(value))


def _check_dtype(obj, field: str, allow_none: bool) -> None:
  """A dtype name in :data:`DTYPES`, stored as its canonical name."""
  value = getattr(obj, field)
  if value is None:
    if not allow_none:
      fail(obj, field, f"must be one of {DTYPES}")
    return
  try:
    name = jnp.dtype(value).name
  except (TypeError, ValueError):
    fail(obj, field, "is not a dtype name")
  if name == "float64":
    fail(obj, field, "is refused: the transport sums and routing weights are float32, so "
         "float64 would silently lose precision; use float32")
  if name not in DTYPES:
    fail(obj, field,
         f"must be one of the floating dtypes the layer computes exactly, {DTYPES}; got {name}")
  object.__setattr__(obj, field, name)


def check_choice(obj, field: str, choices) -> None:
  value = getattr(obj, field)
  try:
    known = value in choices
  except TypeError:  # an unhashable value (a YAML mapping or list) is no choice
    known = False
  if not known:
    fail(obj, field, f"must be one of {tuple(choices)}")


def _as_tuple_of_str(obj, field: str) -> None:
  """A string or an iterable of strings, stored as a tuple of strings."""
  value = getattr(obj, field)
  if isinstance(value, str):
    value = (value,)
  try:
    value = tuple(value)
  except TypeError:
    fail(obj, field, "must be a string or a sequence of strings")
  if not all(isinstance(entry, str) for entry in value):
    fail(obj, field, "must be a string or a sequence of strings", value)
  object.__setattr__(obj, field, value)


@dataclasses.dataclass(frozen=True)
class RematConfig:
  """Which of the layer's named values a remat policy saves.

  Names are always attached with ``jax.ad_checkpoint.checkpoint_name`` as
  ``f"{prefix}.{name}"``. ``save`` lists groups (``"router"``,
  ``"dispatch"``, ``"combine"``, ``"expert_hidden"``, ``"expert_output"``,
  ``"expert_weights"``, ``"expert_fp8"``)
  or single names (``"dispatch.tokens"``, ``"dispatch.weights"``,
  ``"dispatch.handle"``, ``"dispatch.counts"``, ``"router.scores"``, ...).
  With ``apply=True`` the layer checkpoints its own body with :meth:`policy`;
  with ``apply=False`` a user's ``jax.checkpoint(..., policy=remat.policy())``
  does the same.

  Saving ``"dispatch"`` means backward never re-runs the dispatch exchange.
  Saving ``"combine"`` as well (the combined output, ``[T, H]`` per layer)
  also spares the combine exchange when something after the layer inside the
  same checkpoint needs the layer's output in its backward pass. Saving
  ``"expert_hidden"`` means backward recomputes no expert GEMM: it holds the
  activation's input (``2F`` values a routed row for gated activations),
  and where the grouped kernels fuse the activation its output too (``3F``).
  Saving ``"expert_weights"`` (the experts' weights in the compute dtype, one
  copy of this shard's ``w_in`` and ``w_out``, 2 bytes a parameter in bf16)
  spares backward's recomputation the cast from ``param_dtype``, a pass over
  the float32 expert weights per layer.

  With ``MoEConfig.expert_precision="fp8"`` (:mod:`moe_ep.experts.fp8`),
  ``"expert_weights"`` names the weights quantized once per step (e4m3 codes,
  their transpose and the 128x128 block scales: 2 bytes a parameter), and
  ``"expert_fp8"`` the weight gradients' residuals, the column-wise FP8 codes
  and scales of each GEMM's input (``"expert_fp8.input"``, ``H`` bytes a
  routed row, and ``"expert_fp8.hidden"``, ``F``: half the bf16 rows).
  Saving ``"expert_hidden"`` still spares backward both GEMMs;
  ``"expert_fp8"`` with it also the quantization of the activation, and with
  ``"dispatch"`` (whose ``"dispatch.tokens"`` is then the FP8 wire rows
  under an FP8 dispatch) that of the expert input.

  >>> RematConfig(save=("dispatch",)).names
  ('moe.dispatch.tokens', 'moe.dispatch.weights', 'moe.dispatch.handle', 'moe.dispatch.counts')
  """

  save: tuple[str, ...] = ("dispatch",)
  prefix: str = "moe"
  apply: bool = False

  def __post_init__(self):
    _as_tuple_of_str(self, "save")
    for entry in self.save:
      if entry not in REMAT_GROUPS and entry not in REMAT_NAMES:
        fail(self, "save", f"contains unknown name {entry!r}; known groups "
             f"{tuple(REMAT_GROUPS)} and names {REMAT_NAMES}")
    if not isinstance(self.prefix, str) or not self.prefix:
      fail(self, "prefix", "must be a non-empty string")
    check_bool(self, "apply")

  @property
  def names(self) -> tuple[str, ...]:
    """The full checkpoint names saved, in a fixed order, without repeats."""
    chosen = []
    for entry in self.save:
      for name in REMAT_GROUPS.get(entry, (entry,)):
        if name not in chosen:
          chosen.append(name)
    return tuple(f"{self.prefix}.{name}" for name in chosen)

  def name(self, value_name: str) -> str:
    """The checkpoint name the layer attaches to ``value_name``."""
    return f"{self.prefix}.{value_name}"

  def policy(self):
    """A ``jax.checkpoint`` policy saving exactly :attr:`names`."""
    return jax.checkpoint_policies.save_only_these_names(*self.names)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Configuration of :class:`~moe_ep.ExpertParallelMoE`.

  Integer fields take Python or NumPy integers (stored as ``int``; bools are
  refused), float fields finite Python or NumPy reals (stored as ``float``),
  bool fields only real bools (``"False"`` is refused, not read as truthy).

  Attributes:
    hidden_size: ``H``, the model width.
    ffn_size: ``F``, each expert's hidden width.
    num_experts: ``E`` routed experts; divisible by the EP axis size.
    top_k: ``K`` experts per token.
    score_function: ``"softmax"`` or ``"sigmoid"`` router scores.
    normalize_top_k: divide the K selected scores by their sum.
    routed_scaling: multiplies the routing weights after normalisation.
    num_groups, group_top_k: DeepSeek-style group-limited routing: experts
      form ``num_groups`` equal groups and a token picks its K experts inside
      its best ``group_top_k`` groups (a group scores the sum of its two best
      experts). Both None, or both set.
    use_expert_bias: add a learned-by-update (not by gradient) bias to the
      scores used for selection only (auxiliary-loss-free balancing).
    expert_bias_update_rate: step of :meth:`ExpertParallelMoE.update_expert_bias`.
    aux_loss_coeff: load-balancing loss coefficient (Switch style, global batch).
    z_loss_coeff: router z-loss coefficient.
    activation: ``"swiglu"``, ``"geglu"`` or ``"gelu"``.
    num_shared_experts: always-on experts, one dense MLP of width
      ``num_shared_experts * ffn_size`` (or ``shared_ffn_size``).
    capacity_factor: None = dropless; a float sizes both the expert slabs and
      the per-destination send chunks (see ``expert_capacity_for``).
    expert_capacity: rows per expert slab; overrides the factor's slab size.
      Values above the dropless bound are clamped to it by ``dispatch``.
    ep_axis: the mesh axis experts are sharded over.
    batch_axes: other mesh axes that shard the batch (absent ones are ignored).
    dtype: compute dtype of the tokens through dispatch, experts and combine:
      ``"bfloat16"``, ``"float16"`` or ``"float32"``; None (the default) means
      the input's dtype. float64 is refused: routing weights and the
      transport's sums are float32.
    param_dtype: parameter dtype, one of the same three.
    transport: dispatch/combine backend: ``"auto"``, ``"xla"`` or ``"cupy"``.
    exchange: how rows cross between GPUs: ``"auto"`` (direct NVLink peer
      stores where every pair of the EP group has peer access on one host and
      the kernels run, else XLA's ``all_to_all``), ``"all_to_all"`` or
      ``"peer"`` (an error where it cannot run).
    remat: the :class:`RematConfig`.
    return_aux: True: the layer returns ``(y, MoEAux)``; False: it returns
      ``y`` and sows the ``MoEAux`` as an ``nnx.Intermediate``.
    dispatch_dtype: None (the dispatch moves rows in ``dtype``) or
      ``"float8_e4m3fn"``: rows cross as e4m3 codes with one power-of-two
      scale per 128 channels (about half the bytes of bfloat16) and are
      dequantized into the ``dtype`` slabs the experts read; the combine and
      every gradient stay in ``dtype`` (straight-through). Needs a JAX with
      ``jnp.float8_e4m3fn``, and with the CuPy kernels a GPU of compute
      capability 8.9+ (``transport="xla"`` runs it in pure JAX anywhere).
    expert_layout: where the expert bank's rows sit: ``"slabs"``, ``[L, C,
      H]`` of capacity ``C`` each (batched GEMMs: padding costs FLOPs, so
      dropless ``C = R * T`` is slow); ``"grouped"``, each local expert's
      rows contiguous in one ``[M, H]`` buffer (grouped GEMMs over the rows
      routed, plus at most 127 padding rows per expert: dropless at the cost
      of the routed rows); ``"auto"`` (the default), grouped wherever its
      Hopper kernels run (a GPU of compute capability 9.0, 16-bit ``dtype``,
      ``hidden_size`` and ``ffn_size`` multiples of 8), slabs elsewhere (on
      a GPU with a warning, once).
      ``capacity_factor`` still caps each expert in either layout.
    receive_factor: grouped layout across EP ranks: None sizes each rank's
      buffer for the worst case, ``R * T * min(K, L)`` rows; a float for
      ``receive_factor * T * K`` rows (the balanced load times the factor),
      whose overflow is dropped and counted in ``MoEAux.dropped_fraction``.
      One rank always holds every routed row.
    expert_precision: None (the expert GEMMs run in ``dtype``) or ``"fp8"``:
      the grouped bank's three GEMMs in block-scaled float8_e4m3fn as
      DeepSeek-V3 trains them (activations per row and 128 channels,
      weights per 128x128 block, power-of-two float32 scales, float32
      accumulation, bf16 outputs; master weights keep ``param_dtype``,
      quantized once per step): :mod:`moe_ep.experts.fp8`, docs/fp8.md.
      Needs the grouped layout (``"auto"`` then means grouped),
      ``dtype="bfloat16"`` (or None with bfloat16 inputs), ``hidden_size``
      and ``ffn_size`` multiples of 16, and on a GPU compute capability 9.0;
      CPUs run its pure-JAX reference. With ``dispatch_dtype="float8_e4m3fn"``
      the dispatched codes and scales feed the first GEMM as they crossed.
    group_score: how group-limited routing scores a group: ``"top2_sum"``
      (the default, DeepSeek-V3's ``noaux_tc``: the sum of its two best
      selection scores) or ``"max"`` (DeepSeek-V2's
      ``group_limited_greedy``: its best one).
    shared_ffn_size: the shared experts' MLP width; None (the default) means
      ``num_shared_experts * ffn_size``. Needs ``num_shared_experts >= 1``
      (Qwen2-MoE's ``shared_expert_intermediate_size``).
    shared_expert_gate: scale the shared experts' output per token by
      ``sigmoid(x @ shared_gate)``, a learned ``[H, 1]`` parameter
      (Qwen2-MoE). Needs ``num_shared_experts >= 1``.
    group_align: grouped layout: each expert's rows start at a multiple of
      it, 128 (whole row tiles of the grouped GEMMs, the default) or 64 (half
      tiles: at most 63 padding rows per expert, not 127; measured no faster
      on one H200, docs/grouped.md). The FP8 bank needs 128.
  """

  hidden_size: int
  ffn_size: int
  num_experts: int
  top_k: int
  score_function: str = "softmax"
  normalize_top_k: bool = True
  routed_scaling: float = 1.0
  num_groups: int | None = None
  group_top_k: int | None = None
  use_expert_bias: bool = False
  expert_bias_update_rate: float = 1e-3
  aux_loss_coeff: float = 0.0
  z_loss_coeff: float = 0.0
  activation: str = "swiglu"
  num_shared_experts: int = 0
  capacity_factor: float | None = None
  expert_capacity: int | None = None
  ep_axis: str = "ep"
  batch_axes: tuple[str, ...] = ("dp",)
  dtype: str | None = None
  param_dtype: str = "float32"
  transport: str = "auto"
  exchange: str = "auto"
  remat: RematConfig = dataclasses.field(default_factory=RematConfig)
  return_aux: bool = True
  dispatch_dtype: str | None = None
  expert_layout: str = "auto"
  receive_factor: float | None = None
  expert_precision: str | None = None
  group_score: str = "top2_sum"
  shared_ffn_size: int | None = None
  shared_expert_gate: bool = False
  group_align: int = GROUP_ALIGN

  def __post_init__(self):
    cls = type(self)
    for field in ("hidden_size", "ffn_size", "num_experts", "top_k"):
      check_int(self, field, 1)
    if self.top_k > self.num_experts:
      fail(self, "top_k", f"must be <= num_experts={self.num_experts}")
    for field in ("normalize_top_k", "use_expert_bias", "return_aux"):
      check_bool(self, field)
    check_choice(self, "score_function", SCORE_FUNCTIONS)
    check_choice(self, "activation", ACTIVATIONS)
    check_choice(self, "transport", TRANSPORTS)
    check_choice(self, "exchange", EXCHANGES)
    check_number(self, "routed_scaling", 0.0, strict=True)
    for field in ("expert_bias_update_rate", "aux_loss_coeff", "z_loss_coeff"):
      check_number(self, field, 0.0)
    check_int(self, "num_shared_experts", 0)
    if self.capacity_factor is not None:
      check_number(self, "capacity_factor", 0.0, strict=True)
    if self.expert_capacity is not None:
      check_int(self, "expert_capacity", 1)
    check_choice(self, "expert_layout", EXPERT_LAYOUTS)
    if self.receive_factor is not None:
      check_number(self, "receive_factor", 0.0, strict=True)
    check_int(self, "group_align", 1)
    check_choice(self, "group_align", GROUP_ALIGNS)
    self._check_groups()
    self._check_shared()
    if not isinstance(self.ep_axis, str) or not self.ep_axis:
      fail(self, "ep_axis", "must be a non-empty string")
    _as_tuple_of_str(self, "batch_axes")
    if self.ep_axis in self.batch_axes:
      fail(self, "batch_axes", f"must not contain ep_axis={self.ep_axis!r}")
    # None must not reach jnp.dtype, which reads it as float64.
    _check_dtype(self, "dtype", allow_none=True)
    _check_dtype(self, "param_dtype", allow_none=False)
    if isinstance(self.remat, dict):
      object.__setattr__(self, "remat", from_dict(RematConfig, self.remat, "remat"))
    if not isinstance(self.remat, RematConfig):
      fail(self, "remat", "must be a RematConfig")
    object.__setattr__(self, "dispatch_dtype",
                       check_wire_dtype(self.dispatch_dtype, f"{cls.__name__}.dispatch_dtype"))
    self._check_expert_precision()

  def _check_expert_precision(self):
    check_choice(self, "expert_precision", EXPERT_PRECISIONS)
    if self.expert_precision is None:
      return
    if self.expert_layout == "slabs":
      fail(self, "expert_precision", "runs the grouped bank's GEMMs: it needs "
           "expert_layout='grouped' or 'auto' (then grouped), not expert_layout='slabs'")
    if self.dtype not in (None, "bfloat16"):
      fail(self, "expert_precision", f"computes in bfloat16: it needs dtype='bfloat16' or None "
           f"(bfloat16 inputs), not dtype={self.dtype!r}")
    if self.group_align != GROUP_ALIGN:
      fail(self, "expert_precision", f"needs groups on whole {GROUP_ALIGN}-row tiles (its weight "
           f"gradient's 128-row scale blocks): group_align={GROUP_ALIGN}, not "
           f"group_align={self.group_align}")
    for field in ("hidden_size", "ffn_size"):
      if getattr(self, field) % FP8_SIZE_MULTIPLE:
        fail(self, "expert_precision", f"needs {field} a multiple of {FP8_SIZE_MULTIPLE} "
             f"(16-byte FP8 rows); got {field}={getattr(self, field)}")

  def _check_groups(self):
    check_choice(self, "group_score", GROUP_SCORES)
    if (self.num_groups is None) != (self.group_top_k is None):
      fail(self, "num_groups",
           f"and group_top_k={self.group_top_k!r} must both be set or both be None")
    if self.num_groups is None:
      return
    check_int(self, "num_groups", 1)
    check_int(self, "group_top_k", 1)
    if self.num_experts % self.num_groups:
      fail(self, "num_groups", f"must divide num_experts={self.num_experts}")
    if self.group_top_k > self.num_groups:
      fail(self, "group_top_k", f"must be <= num_groups={self.num_groups}")
    selectable = self.group_top_k * (self.num_experts // self.num_groups)
    if self.top_k > selectable:
      fail(self, "top_k", f"must be <= group_top_k * experts per group = {selectable}")

  def _check_shared(self):
    check_int(self, "shared_ffn_size", 1, optional=True)
    check_bool(self, "shared_expert_gate")
    for field in ("shared_ffn_size", "shared_expert_gate"):
      if getattr(self, field) not in (None, False) and not self.num_shared_experts:
        fail(self, field, "needs num_shared_experts >= 1 (it shapes the shared experts)")

  @property
  def shared_width(self) -> int:
    """``F_s``, the shared experts' MLP width (0 without shared experts)."""
    if self.shared_ffn_size is not None:
      return self.shared_ffn_size
    return self.num_shared_experts * self.ffn_size

  @property
  def num_input_projections(self) -> int:
    """2 for gated activations (gate and up), 1 otherwise."""
    return input_projections(self.activation)


# --- dict/YAML mapping ---------------------------------------------------------


def _field_types(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def from_dict(cls, data: dict | None, path: str | None = None):
  """Builds dataclass ``cls`` from a plain dict, recursing into nested
  dataclass fields. Unknown keys raise ValueError naming the key and path."""
  path = path or cls.__name__
  data = dict(data or {})
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields), key=str)  # YAML keys may mix types
  if unknown:
    raise ValueError(f"unknown key {path}.{unknown[0]} (known: {sorted(fields)})")
  missing = [name for name, field in fields.items() if name not in data
             and field.default is dataclasses.MISSING
             and field.default_factory is dataclasses.MISSING]
  if missing:
    raise ValueError(f"{path} needs {', '.join(missing)} (no default)")
  types = _field_types(cls)
  kwargs = {}
  for name, value in data.items():
    field_type = types[name]
    if dataclasses.is_dataclass(field_type) and isinstance(value, dict):
      value = from_dict(field_type, value, f"{path}.{name}")
    elif isinstance(value, list):
      value = tuple(value)
    kwargs[name] = value
  return cls(**kwargs)


def to_dict(config) -> dict:
  """Inverse of :func:`from_dict`: nested plain dicts, tuples as lists."""
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      value = to_dict(value)
    elif isinstance(value, tuple):
      value = list(value)
    out[field.name] = value
  return out
