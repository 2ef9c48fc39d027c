"""The Hugging Face MoE families: their ``config.json`` mapped onto
:class:`~moe_ep.MoEConfig`, their tensor names, and which decoder layers are
MoE. The routing rules follow transformers' implementation of each family
(docs/interop.md gives them per family).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_ep.config import MoEConfig


class HFInteropError(ValueError):
  """A checkpoint or config that cannot be mapped, with what to fix (one line)."""


@dataclasses.dataclass(frozen=True)
class Family:
  """Tensor names of one family's sparse MoE block, relative to its prefix.

  Attributes:
    model_type: ``config.json``'s ``model_type``.
    block_names: the MoE block's module names under ``model.layers.{i}``
      that checkpoints use (the first is transformers' current one).
    expert_names: per-expert projection names ``(gate, up, down)``.
    shared_prefix: the shared experts' module name, or None.
  """

  model_type: str
  block_names: tuple[str, ...]
  expert_names: tuple[str, str, str]
  shared_prefix: str | None = None


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
FAMILIES = {
    "mixtral": Family("mixtral", ("block_sparse_moe", "mlp"), ("w1", "w3", "w2")),
    "qwen2_moe": Family("qwen2_moe", ("mlp",), _GATE_UP_DOWN, "shared_expert"),
    "qwen3_moe": Family("qwen3_moe", ("mlp",), _GATE_UP_DOWN),
    "olmoe": Family("olmoe", ("mlp",), _GATE_UP_DOWN),
    "deepseek_v2": Family("deepseek_v2", ("mlp",), _GATE_UP_DOWN, "shared_experts"),
    "deepseek_v3": Family("deepseek_v3", ("mlp",), _GATE_UP_DOWN, "shared_experts"),
}
SUPPORTED = tuple(FAMILIES)
# Families with a router that is no softmax/sigmoid top-k (PhiMoE's
# sparsemixer) or experts laid out otherwise (GraniteMoE's input_linear):
# refused, not approximated.
# The MoEConfig fields a family's config decides: overrides may not set them.
FAMILY_FIELDS = ("hidden_size", "ffn_size", "num_experts", "top_k", "score_function",
                 "normalize_top_k", "routed_scaling", "num_groups", "group_top_k", "group_score",
                 "use_expert_bias", "activation", "num_shared_experts", "shared_ffn_size",
                 "shared_expert_gate")
_REFUSED = {"phimoe": "its sparsemixer router is not a top-k of softmax or sigmoid scores",
            "granitemoe": "its experts (input_linear/output_linear) are not mapped yet"}


def family_of(hf_config: dict) -> Family:
  """The :class:`Family` of ``hf_config`` (its ``model_type``)."""
  model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
  if model_type in FAMILIES:
    return FAMILIES[model_type]
  why = f" ({_REFUSED[model_type]})" if model_type in _REFUSED else ""
  raise HFInteropError(f"model_type={model_type!r} is not supported{why}; supported: "
                       f"{', '.join(SUPPORTED)}")


# The expert count's names: config.json files of the hub and of transformers'
# own save_pretrained spell it differently (its attribute_map aliases).
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")


def _get(hf_config: dict, key: str | tuple[str, ...], default: Any = dataclasses.MISSING):
  """``hf_config[key]`` (``key``: a name or its aliases, the first present wins)."""
  for name in (key,) if isinstance(key, str) else key:
    if hf_config.get(name) is not None:
      return hf_config[name]
  if default is dataclasses.MISSING:
    raise HFInteropError(f"{hf_config.get('model_type')} config has no {key!r}, which it needs")
  return default


def _refuse_unless(ok: bool, hf_config: dict, rule: str) -> None:
  if not ok:
    raise HFInteropError(f"{hf_config.get('model_type')} config: {rule}")


def config_from_hf(hf_config: dict, **overrides) -> MoEConfig:
  """The :class:`~moe_ep.MoEConfig` of one MoE layer of ``hf_config``.

  Absent keys take transformers' defaults for the family where it has one;
  the sizes must be present. ``overrides`` are further ``MoEConfig`` fields
  (``dtype``, ``param_dtype``, ``capacity_factor``, ``transport``, ...),
  never the ones that define the family's math.

  >>> config_from_hf({"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 8,
  ...                 "num_local_experts": 4, "num_experts_per_tok": 2}).normalize_top_k
  True

  Raises:
    HFInteropError: an unsupported ``model_type`` (the message lists the
      supported ones), a missing size, or a setting the layer cannot express.
  """
  family = family_of(hf_config)
  model_type = family.model_type
  act = _get(hf_config, "hidden_act", "silu")
  _refuse_unless(act == "silu", hf_config,
                 f"hidden_act={act!r} is not supported (the layer's swiglu is silu(gate) * up)")
  fields: dict[str, Any] = dict(hidden_size=_get(hf_config, "hidden_size"),
                                top_k=_get(hf_config, "num_experts_per_tok"),
                                activation="swiglu")
  if model_type == "mixtral":
    fields.update(ffn_size=_get(hf_config, "intermediate_size"),
                  num_experts=_get(hf_config, _EXPERT_COUNT), normalize_top_k=True)
  elif model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
    ffn_key = "intermediate_size" if model_type == "olmoe" else "moe_intermediate_size"
    fields.update(ffn_size=_get(hf_config, ffn_key), num_experts=_get(hf_config, _EXPERT_COUNT),
                  normalize_top_k=bool(_get(hf_config, "norm_topk_prob", False)))
    shared = _get(hf_config, "shared_expert_intermediate_size", 0) if (
        model_type == "qwen2_moe") else 0
    if shared:
      fields.update(num_shared_experts=1, shared_ffn_size=shared, shared_expert_gate=True)
  else:
    fields.update(_deepseek_fields(hf_config))
  fixed = sorted(set(overrides) & set(FAMILY_FIELDS))
  if fixed:
    raise HFInteropError(f"overrides {fixed} would change the {model_type} layer's routing or "
                         "shapes, which come from its config.json")
  try:
    return MoEConfig(**fields, **overrides)
  except (TypeError, ValueError) as error:
    raise HFInteropError(f"{model_type} config does not map onto MoEConfig: {error}") from None


def _deepseek_fields(hf_config: dict) -> dict:
  """DeepSeek-V2 (softmax, V2's group rule, scaling, no normalisation: the
  transformers implementation ignores ``norm_topk_prob``) and DeepSeek-V3
  (sigmoid, correction bias, the top-2-sum group rule, ``norm_topk_prob``,
  scaling)."""
  model_type = hf_config["model_type"]
  v3 = model_type == "deepseek_v3"
  _refuse_unless(not _get(hf_config, "mlp_bias", False), hf_config,
                 "mlp_bias=True is not supported (the experts have no biases)")
  fields = dict(ffn_size=_get(hf_config, "moe_intermediate_size"),
                num_experts=_get(hf_config, _EXPERT_COUNT),
                routed_scaling=float(_get(hf_config, "routed_scaling_factor", 2.5 if v3 else 1.0)),
                num_shared_experts=int(_get(hf_config, "n_shared_experts", 1 if v3 else 2)))
  method = _get(hf_config, "topk_method", "noaux_tc" if v3 else "greedy")
  scoring = _get(hf_config, "scoring_func", "sigmoid" if v3 else "softmax")
  if v3:
    _refuse_unless(method == "noaux_tc" and scoring == "sigmoid", hf_config,
                   f"topk_method={method!r}, scoring_func={scoring!r}: transformers' "
                   "DeepSeek-V3 computes noaux_tc with sigmoid scores only")
    groups = int(_get(hf_config, "n_group", 8))
    fields.update(score_function="sigmoid", use_expert_bias=True, group_score="top2_sum",
                  normalize_top_k=bool(_get(hf_config, "norm_topk_prob", True)))
  else:
    _refuse_unless(method in ("greedy", "group_limited_greedy") and scoring == "softmax",
                   hf_config, f"topk_method={method!r}, scoring_func={scoring!r}: DeepSeek-V2 "
                   "routes greedy or group_limited_greedy over softmax scores")
    groups = int(_get(hf_config, "n_group", 1)) if method == "group_limited_greedy" else 1
    fields.update(score_function="softmax", group_score="max", normalize_top_k=False)
  if groups > 1:  # one group limits nothing
    fields.update(num_groups=groups, group_top_k=int(_get(hf_config, "topk_group")))
  return fields


def moe_layer_indices(hf_config: dict) -> tuple[list[int], list[int]]:
  """``(moe_layers, dense_layers)``: the decoder layers whose MLP is the
  family's sparse MoE block, and the others, as transformers builds them
  (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``, DeepSeek's
  ``first_k_dense_replace``, and its ``moe_layer_freq`` where given)."""
  family = family_of(hf_config)
  count = int(_get(hf_config, "num_hidden_layers"))
  if family.model_type in ("qwen2_moe", "qwen3_moe"):
    only_dense = set(_get(hf_config, "mlp_only_layers", []) or [])
    step = int(_get(hf_config, "decoder_sparse_step", 1))
    is_moe = lambda i: i not in only_dense and (i + 1) % step == 0
  elif family.model_type.startswith("deepseek"):
    first = int(_get(hf_config, "first_k_dense_replace", 3 if family.model_type.endswith("3")
                     else 0))
    freq = int(_get(hf_config, "moe_layer_freq", 1))
    is_moe = lambda i: i >= first and i % freq == 0
  else:
    is_moe = lambda i: True
  moe = [i for i in range(count) if is_moe(i)]
  return moe, [i for i in range(count) if not is_moe(i)]
