"""Writes the Hugging Face fixtures the interop tests read: one tiny random
model per family, built and saved by transformers itself, and its sparse MoE
blocks' outputs on random inputs.

Needs torch and transformers (not moe_ep's dependencies: a separate venv)::

  /work/wt/_hfenv/bin/python tests/interop/make_fixtures.py [OUT_DIR]

Each ``OUT_DIR/<model_type>/`` is a checkpoint directory as
``save_pretrained`` writes it (``config.json``, sharded ``model-*.safetensors``
with ``model.safetensors.index.json``: the per-expert keys of the hub's
checkpoints, which transformers writes back from its fused in-memory layout)
plus ``moe_reference.safetensors`` (``layers.{i}.input [B, S, H]`` and
``layers.{i}.output`` of every MoE block ``i``, float32) and, for the fused
families, ``moe_fused.safetensors`` (the blocks' tensors as current
transformers holds them in memory: ``experts.gate_up_proj``, ...).
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import transformers
from safetensors.torch import save_file

# Tiny shapes: H 16, expert widths 8-12, 4-8 experts, top-2, 12 tokens; all
# fixtures together stay far below 2 MB.
_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=32,
                  max_position_embeddings=64, tie_word_embeddings=False)
_DEEPSEEK_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
                           max_position_embeddings=64, kv_lora_rank=8, q_lora_rank=None,
                           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
CONFIGS = {
    "mixtral": dict(hidden_size=16, intermediate_size=12, num_local_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=2, **_ATTENTION),
    "qwen2_moe": dict(hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                      shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2,
                      norm_topk_prob=False, num_hidden_layers=2, mlp_only_layers=[0],
                      **_ATTENTION),
    "qwen3_moe": dict(hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      num_hidden_layers=2, decoder_sparse_step=2, **_ATTENTION),
    "olmoe": dict(hidden_size=16, intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=False, num_hidden_layers=1, **_ATTENTION),
    "deepseek_v2": dict(hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                        # top-k > topk_group, where V2's rule limits the choice
                        topk_method="group_limited_greedy", n_group=2, topk_group=1,
                        routed_scaling_factor=1.5, first_k_dense_replace=1,
                        num_hidden_layers=2, **_DEEPSEEK_ATTENTION),
    "deepseek_v3": dict(hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        norm_topk_prob=True, first_k_dense_replace=1, num_hidden_layers=2,
                        **_DEEPSEEK_ATTENTION),
}
FUSED = ("qwen3_moe", "deepseek_v3")  # also written in the fused in-memory layout
BATCH, SEQ = 2, 6
SHARD_SIZE = "8KB"  # several shards per model, so the index file is exercised


def moe_blocks(model) -> dict[int, torch.nn.Module]:
  """``{layer index: sparse MoE block}`` of a causal LM (blocks have a router ``gate``)."""
  return {i: layer.mlp for i, layer in enumerate(model.model.layers)
          if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")}


def build(model_type: str, seed: int = 0):
  """A random float32 model of ``model_type`` and its MoE blocks' reference
  inputs and outputs (``layers.{i}.input``/``output``)."""
  torch.manual_seed(seed)
  config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
  model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.normal_(0.0, 0.4)  # routers far from uniform, experts of unit-ish gain
    for block in moe_blocks(model).values():
      bias = getattr(block.gate, "e_score_correction_bias", None)
      if bias is not None:  # large enough to change which experts and groups are chosen
        bias.copy_(0.3 * torch.randn(bias.shape))
  reference = {}
  with torch.no_grad():
    for i, block in moe_blocks(model).items():
      x = torch.randn(BATCH, SEQ, config.hidden_size)
      reference[f"layers.{i}.input"] = x
      reference[f"layers.{i}.output"] = block(x).contiguous()
  return model, reference


def v2_group_rules_disagree(model, reference) -> bool:
  """Whether some reference token's best group by its best expert (V2's
  ``group_limited_greedy``) is not its best by the sum of its two best
  (V3's rule): a fixture where they never disagree could not tell them apart."""
  for i, block in moe_blocks(model).items():
    x = reference[f"layers.{i}.input"].reshape(-1, model.config.hidden_size)
    scores = torch.softmax(x @ block.gate.weight.T, dim=-1)
    grouped = scores.view(x.shape[0], model.config.n_group, -1)
    by_max = grouped.max(dim=-1).values.argmax(dim=-1)
    by_top2 = grouped.topk(2, dim=-1).values.sum(dim=-1).argmax(dim=-1)
    if bool((by_max != by_top2).any()):
      return True
  return False


def write(out: pathlib.Path, model_type: str, seed: int = 0) -> pathlib.Path:
  """Writes ``out/<model_type>/`` (see the module docstring) from ``seed``;
  returns it. DeepSeek-V2's seed is the first from ``seed`` on whose tokens
  tell its group rule from V3's."""
  model, reference = build(model_type, seed)
  while model_type == "deepseek_v2" and not v2_group_rules_disagree(model, reference):
    seed += 1
    model, reference = build(model_type, seed)
  directory = out / model_type
  model.save_pretrained(directory, max_shard_size=SHARD_SIZE)
  save_file(reference, directory / "moe_reference.safetensors")
  if model_type in FUSED:
    state = model.state_dict()
    fused = {name: tensor.contiguous() for name, tensor in state.items()
             if any(name.startswith(f"model.layers.{i}.mlp.") for i in moe_blocks(model))}
    save_file(fused, directory / "moe_fused.safetensors")
  for extra in ("generation_config.json",):  # not read; keeps the fixtures small
    (directory / extra).unlink(missing_ok=True)
  return directory


def main(argv: list[str]) -> int:
  out = pathlib.Path(argv[0] if argv else pathlib.Path(__file__).parent / "fixtures")
  out.mkdir(parents=True, exist_ok=True)
  for model_type in CONFIGS:
    directory = write(out, model_type)
    size = sum(f.stat().st_size for f in directory.iterdir())
    shards = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    print(f"{directory}: {len(set(shards.values()))} shards, {size / 1024:.0f} KiB "
          f"(transformers {transformers.__version__}, torch {torch.__version__})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
