"""moe_ep.interop.families: each family's config.json onto MoEConfig, and
which decoder layers are MoE, against the rules of transformers' modeling
code (written out here per family, not read from the module)."""

import json
import pathlib

import pytest

from moe_ep.interop import SUPPORTED, HFInteropError, config_from_hf, moe_layer_indices

FIXTURES = pathlib.Path(__file__).with_name("fixtures")


def fixture_config(model_type: str) -> dict:
  return json.loads((FIXTURES / model_type / "config.json").read_text())


# (model_type, the MoEConfig fields transformers' block implies for the fixture's config)
EXPECTED = {
    "mixtral": dict(ffn_size=12, num_experts=4, score_function="softmax", normalize_top_k=True,
                    num_shared_experts=0, num_groups=None, use_expert_bias=False),
    "qwen2_moe": dict(ffn_size=8, num_experts=6, normalize_top_k=False, num_shared_experts=1,
                      shared_ffn_size=20, shared_expert_gate=True),
    "qwen3_moe": dict(ffn_size=8, num_experts=8, normalize_top_k=True, num_shared_experts=0),
    "olmoe": dict(ffn_size=8, num_experts=8, normalize_top_k=False),
    "deepseek_v2": dict(ffn_size=8, num_experts=8, score_function="softmax",
                        normalize_top_k=False, routed_scaling=1.5, num_groups=2, group_top_k=1,
                        group_score="max", num_shared_experts=2, use_expert_bias=False),
    "deepseek_v3": dict(ffn_size=8, num_experts=8, score_function="sigmoid",
                        normalize_top_k=True, routed_scaling=2.5, num_groups=4, group_top_k=2,
                        group_score="top2_sum", num_shared_experts=1, use_expert_bias=True),
}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_config_from_hf_maps_each_family_as_transformers_routes_it(model_type):
  config = config_from_hf(fixture_config(model_type))
  assert (config.hidden_size, config.top_k, config.activation) == (16, 2, "swiglu")
  for field, value in EXPECTED[model_type].items():
    assert getattr(config, field) == value, field


def test_the_expert_count_is_read_under_each_of_its_names():
  """The hub's Qwen3 configs say num_experts, transformers 5 writes num_local_experts."""
  base = fixture_config("qwen3_moe")
  count = base.pop("num_local_experts")
  assert config_from_hf({**base, "num_experts": count}).num_experts == count
  assert config_from_hf({**base, "num_local_experts": count}).num_experts == count


def test_deepseek_v2_greedy_and_one_group_route_without_groups():
  base = fixture_config("deepseek_v2")
  assert config_from_hf({**base, "topk_method": "greedy"}).num_groups is None
  assert config_from_hf({**base, "n_group": 1, "topk_group": 1}).num_groups is None


@pytest.mark.parametrize("model_type", ["phimoe", "granitemoe", "llama", None])
def test_other_families_are_refused_in_one_line_listing_the_supported(model_type):
  with pytest.raises(HFInteropError) as error:
    config_from_hf({"model_type": model_type, "hidden_size": 16})
  message = str(error.value)
  assert "\n" not in message and repr(model_type) in message
  assert all(name in message for name in SUPPORTED)


@pytest.mark.parametrize("change, words", [
    ({"hidden_act": "gelu"}, ("hidden_act='gelu'",)),
    ({"topk_method": "noaux_tc", "scoring_func": "softmax"}, ("scoring_func='softmax'",)),
    ({"mlp_bias": True}, ("mlp_bias",)),
])
def test_settings_the_layer_cannot_express_are_refused(change, words):
  with pytest.raises(HFInteropError, match="deepseek_v3") as error:
    config_from_hf({**fixture_config("deepseek_v3"), **change})
  assert all(word in str(error.value) for word in words)


def test_a_missing_size_is_named():
  config = fixture_config("mixtral")
  del config["intermediate_size"]
  with pytest.raises(HFInteropError, match="mixtral config has no 'intermediate_size'"):
    config_from_hf(config)


def test_overrides_reach_moeconfig_but_not_the_family_math():
  config = config_from_hf(fixture_config("olmoe"), param_dtype="bfloat16", capacity_factor=2.0)
  assert (config.param_dtype, config.capacity_factor) == ("bfloat16", 2.0)
  for field in ("normalize_top_k", "num_groups", "group_score", "shared_expert_gate"):
    with pytest.raises(HFInteropError, match=f"overrides \\['{field}'\\] would change"):
      config_from_hf(fixture_config("olmoe"), **{field: None})


@pytest.mark.parametrize("config, moe, dense", [
    # Qwen: MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers.
    ({"model_type": "qwen2_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2,
      "mlp_only_layers": [3]}, [1, 5], [0, 2, 3, 4]),
    ({"model_type": "qwen3_moe", "num_hidden_layers": 3, "mlp_only_layers": [0]}, [1, 2], [0]),
    # DeepSeek: i >= first_k_dense_replace (and i % moe_layer_freq == 0 where given).
    ({"model_type": "deepseek_v3", "num_hidden_layers": 5, "first_k_dense_replace": 3},
     [3, 4], [0, 1, 2]),
    ({"model_type": "deepseek_v2", "num_hidden_layers": 5, "first_k_dense_replace": 1,
      "moe_layer_freq": 2}, [2, 4], [0, 1, 3]),
    ({"model_type": "mixtral", "num_hidden_layers": 2}, [0, 1], []),
    ({"model_type": "olmoe", "num_hidden_layers": 2}, [0, 1], []),
])
def test_moe_layer_indices_follow_each_familys_layer_rule(config, moe, dense):
  assert moe_layer_indices(config) == (moe, dense)
