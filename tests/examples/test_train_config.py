"""examples/train_config.py: YAML maps 1:1 onto the config dataclasses, and
unknown keys or invalid values fail naming the key."""


import pytest
import yaml

from tiny_run import REPO, TINY_YAML
from examples.train_config import (Config, MeshConfig, apply_overrides, config_from_dict,
                                   config_to_yaml, load_config)
from moe_ep import RematConfig
from moe_ep.config import to_dict

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_files_round_trip_through_dicts_and_yaml(path):
  config = load_config(path)
  assert config_from_dict(to_dict(config)) == config
  assert config_from_dict(yaml.safe_load(config_to_yaml(config))) == config
  # Every key of the file is a field: the file maps 1:1 onto the dataclasses.
  assert config_from_dict(yaml.safe_load(path.read_text())) == config


def test_overrides_set_dotted_keys_with_yaml_values():
  config = load_config(TINY_YAML, ["moe.top_k=4", "train.steps=80", "moe.capacity_factor=null",
                                   "moe.remat.save=[]", "moe.remat.apply=false",
                                   "data.path=corpus.txt"])
  assert config.moe.top_k == 4 and config.train.steps == 80
  assert config.moe.capacity_factor is None
  assert config.moe.remat == RematConfig(save=(), apply=False)
  assert config.data.path == "corpus.txt"


@pytest.mark.parametrize("override, named", [
    ("moe.top_kk=4", "moe.top_kk"),
    ("trian.steps=5", "trian"),
    ("moe.remat.sav=[]", "moe.remat.sav"),
    ("train.steps.more=1", "train.steps"),
    ("steps", "section.key=value"),
])
def test_bad_override_is_an_error_naming_the_key(override, named):
  with pytest.raises(ValueError, match=named.replace(".", r"\.")):
    load_config(TINY_YAML, [override])


def test_unknown_yaml_key_is_an_error_naming_it(tmp_path):
  data = yaml.safe_load(TINY_YAML.read_text())
  data["model"]["d_modle"] = 64
  path = tmp_path / "typo.yaml"
  path.write_text(yaml.safe_dump(data))
  with pytest.raises(ValueError, match=r"config\.model\.d_modle"):
    load_config(path)
  data["model"].pop("d_modle")
  data["moe"]["remat"]["saev"] = []
  path.write_text(yaml.safe_dump(data))
  with pytest.raises(ValueError, match=r"config\.moe\.remat\.saev"):
    load_config(path)


@pytest.mark.parametrize("overrides, message", [
    (["model.d_model=128"], r"MoEConfig.hidden_size=64 must equal ModelConfig.d_model=128"),
    (["train.steps=20", "train.warmup_steps=20"], r"TrainConfig.warmup_steps=20 must be < steps=20"),
    (["model.num_layers=3", "model.moe_every=2"],
     r"ModelConfig.num_layers=3 must be a multiple of moe_every=2"),
    (["moe.top_k=9"], r"MoEConfig.top_k=9 must be <= num_experts=8"),
    (["model.vocab_size=128", "data.path=x.txt"], r"vocab_size=128 must be >= 256"),
])
def test_invalid_values_name_the_field_and_the_rule(overrides, message):
  with pytest.raises(ValueError, match=message):
    load_config(TINY_YAML, overrides)


def test_mesh_fills_the_devices_and_rejects_a_shape_that_does_not_tile():
  assert MeshConfig().shape(8) == (1, 8)
  assert MeshConfig(dp=2).shape(8) == (2, 4)
  assert MeshConfig(ep=4).shape(8) == (2, 4)
  with pytest.raises(ValueError, match="dp=3 ep=None does not tile the 8 devices"):
    MeshConfig(dp=3).shape(8)


def test_overrides_leave_the_input_dict_unchanged():
  data = {"moe": {"top_k": 2}}
  assert apply_overrides(data, ["moe.top_k=4"]) == {"moe": {"top_k": 4}}
  assert data == {"moe": {"top_k": 2}}
  assert isinstance(config_from_dict({}), Config)
