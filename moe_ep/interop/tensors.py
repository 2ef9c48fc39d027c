"""One MoE block's Hugging Face tensors in the layer's layout, and back.

The layer holds ``router [H, E]``, ``w_in [E, H, 2F]`` (gate columns, then
up), ``w_out [E, F, H]``, and optionally ``expert_bias [E]``,
``shared_w_in [H, 2F_s]``, ``shared_w_out [F_s, H]``, ``shared_gate [H, 1]``.
Checkpoints hold ``torch.nn.Linear`` weights ``[out, in]``, per expert
(``experts.{j}.gate_proj.weight [F, H]``, ...) or fused as current
transformers keeps them (``experts.gate_up_proj [E, 2F, H]``, gate rows
first; ``experts.down_proj [E, H, F]``). Values of ``tensors`` are NumPy
arrays or anything sliced like one with a shape (safetensors' lazy slices):
only the experts asked for are read.
"""

from __future__ import annotations

from typing import Mapping

import ml_dtypes  # noqa: F401 - registers bfloat16, which safetensors' NumPy reader then returns
import numpy as np

from moe_ep.config import MoEConfig
from moe_ep.interop.families import Family, HFInteropError

LAYOUTS = ("per_expert", "fused")


def _shape(value) -> tuple[int, ...]:
  shape = getattr(value, "shape", None)
  return tuple(value.get_shape() if shape is None else shape)


def _dtype_name(value) -> str:
  dtype = getattr(value, "dtype", None)
  return str(value.get_dtype() if dtype is None else dtype)


def detect_layout(tensors: Mapping, prefix: str) -> str:
  """``"fused"`` where ``{prefix}.experts.gate_up_proj`` exists, else ``"per_expert"``."""
  return "fused" if f"{prefix}.experts.gate_up_proj" in tensors else "per_expert"


class BlockTensors:
  """Reads one MoE block's tensors as the layer's parameters.

  Args:
    family, config: the block's :class:`Family` and :class:`~moe_ep.MoEConfig`.
    tensors: names -> arrays (or lazy slices).
    prefix: the block's module path, e.g. ``"model.layers.3.mlp"``.
    layout: ``"per_expert"``, ``"fused"`` or ``"auto"`` (:func:`detect_layout`).
  """

  def __init__(self, family: Family, config: MoEConfig, tensors: Mapping, prefix: str,
               layout: str = "auto"):
    if layout == "auto":
      layout = detect_layout(tensors, prefix)
    if layout not in LAYOUTS:
      raise HFInteropError(f"layout={layout!r} must be 'auto' or one of {LAYOUTS}")
    self.family, self.config, self.tensors, self.prefix, self.layout = (
        family, config, tensors, prefix, layout)

  def names(self) -> list[str]:
    """Every tensor name the block needs (per-expert names for every expert)."""
    return [name for key in self.param_shapes() for name in self._sources(key)]

  def param_shapes(self) -> dict[str, tuple[int, ...]]:
    """The layer's parameters this block fills, with their shapes."""
    c = self.config
    hidden, ffn, experts, shared = c.hidden_size, c.ffn_size, c.num_experts, c.shared_width
    shapes = {"router": (hidden, experts), "w_in": (experts, hidden, 2 * ffn),
              "w_out": (experts, ffn, hidden)}
    if c.use_expert_bias:
      shapes["expert_bias"] = (experts,)
    if shared:
      shapes.update(shared_w_in=(hidden, 2 * shared), shared_w_out=(shared, hidden))
    if c.shared_expert_gate:
      shapes["shared_gate"] = (hidden, 1)
    return shapes

  # --- names and expected shapes of the checkpoint's tensors -------------------

  def _expert_name(self, expert: int, projection: int) -> str:
    return f"{self.prefix}.experts.{expert}.{self.family.expert_names[projection]}.weight"

  def _shared_name(self, projection: str) -> str:
    return f"{self.prefix}.{self.family.shared_prefix}.{projection}.weight"

  def _sources(self, key: str, experts: range | None = None) -> dict[str, tuple[int, ...]]:
    """``{tensor name: expected shape}`` that parameter ``key`` is read from
    (``experts``: those of ``w_in``/``w_out``, default all)."""
    c = self.config
    hidden, ffn, shared = c.hidden_size, c.ffn_size, c.shared_width
    experts = range(c.num_experts) if experts is None else experts
    p = self.prefix
    if key == "router":
      return {f"{p}.gate.weight": (c.num_experts, hidden)}
    if key == "expert_bias":
      return {f"{p}.gate.e_score_correction_bias": (c.num_experts,)}
    if key == "shared_gate":
      return {f"{p}.shared_expert_gate.weight": (1, hidden)}
    if key == "shared_w_in":
      return {self._shared_name("gate_proj"): (shared, hidden),
              self._shared_name("up_proj"): (shared, hidden)}
    if key == "shared_w_out":
      return {self._shared_name("down_proj"): (hidden, shared)}
    if self.layout == "fused":
      if key == "w_in":
        return {f"{p}.experts.gate_up_proj": (c.num_experts, 2 * ffn, hidden)}
      return {f"{p}.experts.down_proj": (c.num_experts, hidden, ffn)}
    if key == "w_in":
      return {self._expert_name(j, i): (ffn, hidden) for j in experts for i in (0, 1)}
    return {self._expert_name(j, 2): (hidden, ffn) for j in experts}

  def _tensor(self, name: str, expected: tuple[int, ...]):
    if name not in self.tensors:
      raise HFInteropError(f"missing tensor {name!r} of the {self.family.model_type} MoE block "
                           f"at prefix {self.prefix!r} ({self.layout} layout)")
    value = self.tensors[name]
    dtype = _dtype_name(value)
    if f"{name}_scale_inv" in self.tensors or "F8" in dtype.upper() or "float8" in dtype:
      raise HFInteropError(
          f"tensor {name!r} is FP8 (dtype {dtype}, block scales in {name}_scale_inv), which "
          "safetensors' NumPy reader cannot read: convert the checkpoint to bfloat16 first "
          "(DeepSeek-V3's inference/fp8_cast_bf16.py)")
    found = _shape(value)
    if found != tuple(expected):
      raise HFInteropError(f"tensor {name!r} has shape {list(found)}, expected "
                           f"{list(expected)} for the {self.family.model_type} config")
    return value

  def _read(self, name: str, expected: tuple[int, ...], index=slice(None)) -> np.ndarray:
    return np.asarray(self._tensor(name, expected)[index])

  def check(self) -> None:
    """Raises :class:`HFInteropError` for the first missing or misshapen tensor
    (reading no data)."""
    for key in self.param_shapes():
      for name, expected in self._sources(key).items():
        self._tensor(name, expected)

  # --- reading in the layer's layout ------------------------------------------

  def read(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Parameter ``key``'s block ``index`` (global slices, as
    ``jax.make_array_from_callback`` asks), in the checkpoint's dtype; of
    ``w_in``/``w_out`` only the experts of ``index[0]`` are read."""
    shape = self.param_shapes()[key]
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    if key in ("w_in", "w_out"):
      experts = range(*index[0].indices(shape[0]))
      return self._read_experts(key, experts)[(slice(None),) + index[1:]]
    sources = self._sources(key)
    parts = [self._read(name, expected).T for name, expected in sources.items()]
    return (np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])[index]

  def _read_experts(self, key: str, experts: range) -> np.ndarray:
    """``[len(experts), H, 2F]`` (``w_in``) or ``[len(experts), F, H]`` (``w_out``)."""
    if self.layout == "fused":
      (name, expected), = self._sources(key).items()
      stacked = self._read(name, expected, slice(experts.start, experts.stop, experts.step))
      return stacked.transpose(0, 2, 1)
    sources = self._sources(key, experts)
    parts = [self._read(name, expected).T for name, expected in sources.items()]
    if key == "w_in":  # gate then up per expert
      parts = [np.concatenate(parts[i:i + 2], axis=1) for i in range(0, len(parts), 2)]
    return np.stack(parts)


def block_to_hf(family: Family, config: MoEConfig, params: Mapping[str, np.ndarray], prefix: str,
                layout: str) -> dict[str, np.ndarray]:
  """The inverse of :class:`BlockTensors`: the layer's ``params`` (host
  arrays) as the checkpoint's tensors of ``layout``."""
  if layout not in LAYOUTS:
    raise HFInteropError(f"layout={layout!r} must be one of {LAYOUTS}")
  names = BlockTensors(family, config, {}, prefix, layout)
  out: dict[str, np.ndarray] = {}
  ffn, shared = config.ffn_size, config.shared_width
  for key, value in params.items():
    value = np.asarray(value)
    sources = list(names._sources(key))
    if key in ("w_in", "w_out") and layout == "fused":
      out[sources[0]] = value.transpose(0, 2, 1)
    elif key == "w_in":
      for j in range(config.num_experts):
        out[sources[2 * j]] = value[j, :, :ffn].T
        out[sources[2 * j + 1]] = value[j, :, ffn:].T
    elif key == "w_out":
      for j in range(config.num_experts):
        out[sources[j]] = value[j].T
    elif key == "shared_w_in":
      out[sources[0]], out[sources[1]] = value[:, :shared].T, value[:, shared:].T
    else:  # router, expert_bias, shared_w_out, shared_gate: one transposed (or 1-D) tensor
      out[sources[0]] = value.T
  return {name: np.ascontiguousarray(value) for name, value in out.items()}
