"""examples/train_config.py: YAML maps 1:1 onto the config dataclasses;
unknown keys, invalid or non-finite values, duplicate keys and bad YAML fail
naming the key (and the file and line); resuming refuses model changes."""

import dataclasses
import re

import pytest
import yaml

from tiny_run import REPO, TINY_YAML
from examples.train_config import (Config, ConfigError, MeshConfig, TrainConfig,
                                   apply_overrides, config_from_dict, config_to_yaml,
                                   load_config, resume_changes, split_config_path)
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
    (["model.d_model=128", "moe.hidden_size=64"],
     r"MoEConfig.hidden_size=64 must equal ModelConfig.d_model=128: set moe.hidden_size=128, "
     r"or leave moe.hidden_size out \(it follows model.d_model\)"),
    (["model.num_layers=3", "model.moe_every=2"],
     r"ModelConfig.num_layers=3 must be a multiple of moe_every=2"),
    (["moe.top_k=9"], r"MoEConfig.top_k=9 must be <= num_experts=8"),
    (["model.vocab_size=128", "data.path=x.txt"], r"vocab_size=128 must be >= 256"),
    (["model.attention=flash"],
     r"ModelConfig.attention='flash' must be one of \('auto', 'xla', 'cudnn'\)"),
    (["model.attention=cudnn"], r"ModelConfig.attention='cudnn' needs dtype bfloat16 or "
                                r"float16 \(cuDNN flash attention\), got dtype='float32'"),
    (["model.attention=cudnn", "model.dtype=bfloat16", "model.num_heads=16"],
     r"ModelConfig.attention='cudnn' needs a head size .* multiple of 8 .* got 4"),
    (["model.dtype=floaty"], r"ModelConfig.dtype='floaty' is not a dtype name"),
    (["model.remat_policy=dots"], r"ModelConfig.remat_policy='dots' must be one of \('moe', "),
    (["train.peak_tflops=0"], r"TrainConfig.peak_tflops=0 must be a finite number > 0"),
    (["train.peak_tflops=fast"], r"TrainConfig.peak_tflops='fast' must be a finite number > 0"),
    (["train.skip_nonfinite=-1"], r"TrainConfig.skip_nonfinite=-1 must be an integer >= 0"),
    (["train.learning_rate=-1e-9"], r"TrainConfig.learning_rate=-1e-09 must be a finite number"),
])
def test_invalid_values_name_the_field_and_the_rule(overrides, message):
  with pytest.raises(ValueError, match=message):
    load_config(TINY_YAML, overrides)


# (config, devices) -> the automatic (dp, ep): ep is the largest divisor of the
# device count that divides num_experts (tiny: 8 experts, batch 32;
# small_gpu: 32 experts, batch 64; h200: 8 experts, batch 8).
AUTO_MESHES = [
    ("tiny.yaml", 1, (1, 1)), ("tiny.yaml", 2, (1, 2)), ("tiny.yaml", 4, (1, 4)),
    ("tiny.yaml", 8, (1, 8)), ("tiny.yaml", 16, (2, 8)),
    ("small_gpu.yaml", 1, (1, 1)), ("small_gpu.yaml", 2, (1, 2)),
    ("small_gpu.yaml", 4, (1, 4)), ("small_gpu.yaml", 8, (1, 8)),
    ("h200.yaml", 1, (1, 1)), ("h200.yaml", 2, (1, 2)), ("h200.yaml", 8, (1, 8)),
]


@pytest.mark.parametrize("name, devices, shape", AUTO_MESHES)
def test_config_files_mesh_fits_any_device_count_that_splits_the_batch(name, devices, shape):
  config = load_config(REPO / "configs" / name)
  assert config.mesh.chosen == "auto"
  assert config.mesh_shape(devices) == shape


def test_auto_mesh_puts_the_experts_largest_common_divisor_on_ep():
  assert MeshConfig().shape(6, num_experts=8, batch_size=48) == (3, 2)
  assert MeshConfig().shape(12, num_experts=32, batch_size=48) == (3, 4)
  assert MeshConfig().shape(3, num_experts=8, batch_size=48) == (3, 1)


def test_mesh_fills_the_devices_left_by_the_given_axis():
  sizes = dict(num_experts=8, batch_size=32)
  assert MeshConfig(dp=2).shape(8, **sizes) == (2, 4)
  assert MeshConfig(ep=4).shape(8, **sizes) == (2, 4)
  assert MeshConfig(dp=2, ep=4).shape(8, **sizes) == (2, 4)
  assert (MeshConfig(dp=2).chosen, MeshConfig(ep=4).chosen, MeshConfig(dp=2, ep=4).chosen) == (
      "ep auto", "dp auto", "")


XLA_HINT = "XLA_FLAGS=--xla_force_host_platform_device_count=N"
AUTO_HINT = "mesh.dp=null mesh.ep=null"


@pytest.mark.parametrize("mesh, devices, experts, batch, message, hints", [
    (MeshConfig(dp=2, ep=4), 2, 8, 32, r"MeshConfig dp=2 ep=4 does not tile the 2 devices",
     [AUTO_HINT, XLA_HINT]),
    (MeshConfig(dp=3), 8, 8, 32, r"MeshConfig dp=3 ep=None does not tile the 8 devices",
     [AUTO_HINT, XLA_HINT]),
    (MeshConfig(), 3, 8, 32, r"TrainConfig.batch_size=32 must be divisible by the 3 devices",
     ["set train.batch_size to a multiple of 3", XLA_HINT]),
    (MeshConfig(ep=16), 16, 8, 32,
     r"MoEConfig.num_experts=8 must be divisible by the mesh's ep=16", [AUTO_HINT]),
])
def test_mesh_that_does_not_fit_names_the_rule_and_the_way_out(mesh, devices, experts, batch,
                                                                message, hints):
  with pytest.raises(ValueError, match=message) as error:
    mesh.shape(devices, num_experts=experts, batch_size=batch)
  for hint in hints:
    assert hint in str(error.value)


@pytest.mark.parametrize("steps, warmup, used", [
    (1000, 50, 50), (51, 50, 50), (50, 50, 5), (30, 50, 3), (5, 50, 0), (1, 0, 0)])
def test_warmup_not_shorter_than_the_run_becomes_a_tenth_of_it(steps, warmup, used):
  assert TrainConfig(steps=steps, warmup_steps=warmup).warmup_steps_used == used


def test_config_file_and_overrides_come_in_any_order():
  assert split_config_path(["a=1", "x.yaml", "b=2"]) == ("x.yaml", ["a=1", "b=2"])
  assert split_config_path(["a=1"]) == (None, ["a=1"])
  with pytest.raises(ValueError, match="give one sweep file, got 2: x.yaml y.yaml"):
    split_config_path(["x.yaml", "y.yaml"], what="sweep file")


def test_overrides_leave_the_input_dict_unchanged():
  data = {"moe": {"top_k": 2}}
  assert apply_overrides(data, ["moe.top_k=4"]) == {"moe": {"top_k": 4}}
  assert data == {"moe": {"top_k": 2}}
  assert isinstance(config_from_dict({}), Config)


@pytest.mark.parametrize("field", ["learning_rate", "weight_decay", "grad_clip_norm",
                                   "peak_tflops"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_refused_naming_the_field(field, value):
  with pytest.raises(ValueError, match=rf"TrainConfig\.{field}=-?(nan|inf) must be a finite"):
    load_config(TINY_YAML, [f"train.{field}={value}"])
  with pytest.raises(ValueError, match=r"ModelConfig\.rope_base=-?(nan|inf) must be a finite"):
    load_config(TINY_YAML, [f"model.rope_base={value}"])


def test_the_smallest_legal_values_are_accepted():
  config = load_config(TINY_YAML, ["train.learning_rate=0", "train.weight_decay=0",
                                   "train.grad_clip_norm=0", "train.skip_nonfinite=0",
                                   "train.warmup_steps=0", "train.checkpoint_every=0"])
  assert (config.train.learning_rate, config.train.skip_nonfinite) == (0, 0)


@pytest.mark.parametrize("text, value", [
    ("1e-3", 0.001), ("5E+4", 50000.0), ("2.5e3", 2500.0), ("-1e-2", -0.01), (".5e1", 5.0),
    ("0.001", 0.001), ("1000", 1000), ("0x10", 16), ("1e", "1e"), ("e5", "e5")])
def test_numbers_read_as_yaml_1_2_reads_them(text, value, tmp_path):
  key = "train.learning_rate" if isinstance(value, float) else "data.path"
  parsed = apply_overrides({}, [f"{key}={text}"])[key.split(".")[0]][key.split(".")[1]]
  assert parsed == value and type(parsed) is type(value)
  path = tmp_path / "c.yaml"
  path.write_text(f"train:\n  learning_rate: {text}\n")
  if isinstance(value, float) and value >= 0:
    assert load_config(path).train.learning_rate == value


def write(tmp_path, text: str, name: str = "c.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return path


@pytest.mark.parametrize("text, message", [
    ("train:\n  steps: 5\n  seq_len: [64\n", "line 4, column 1: expected ',' or ']'"),
    ("train:\n  steps: 5\n key: 1\n", "line 3, column 2: "),
    ("train:\n  steps: 5\n  seq_len: 8\n  steps: 7\n", "line 4, column 3: duplicate key 'steps'"),
    ("moe:\n  top_k: 1\nmoe:\n  top_k: 2\n", "line 3, column 1: duplicate key 'moe'"),
])
def test_bad_yaml_and_keys_given_twice_name_the_file_and_line(tmp_path, text, message):
  path = write(tmp_path, text)
  with pytest.raises(ConfigError, match=f"^{re.escape(f'{path}, {message}')}"):
    load_config(path)


def test_the_same_key_in_two_mappings_is_fine(tmp_path):
  config = load_config(write(tmp_path, "train:\n  seed: 5\ndata:\n  num_topics: 5\n"))
  assert (config.train.seed, config.data.num_topics) == (5, 5)


def test_a_config_path_that_is_no_yaml_file_is_named(tmp_path):
  with pytest.raises(ConfigError, match=rf"^{tmp_path} is a directory, not a YAML file$"):
    load_config(tmp_path)
  with pytest.raises(ConfigError, match=rf"^cannot read {tmp_path}/nope.yaml: No such file"):
    load_config(tmp_path / "nope.yaml")
  (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
  with pytest.raises(ConfigError, match=r"bin.yaml is not a text \(UTF-8\) file"):
    load_config(tmp_path / "bin.yaml")
  with pytest.raises(ValueError, match=r"must hold a mapping of sections, got list"):
    load_config(write(tmp_path, "- 1\n"))


@pytest.mark.parametrize("text, overrides, message", [
    ("moe: 5\n", [], r"config\.moe must be a mapping of MoEConfig keys, got 5"),
    ("moe:\n", [], r"config\.moe must be a mapping of MoEConfig keys, got None"),
    ("train: [1, 2]\n", [], r"config\.train must be a mapping of TrainConfig keys"),
    ("moe:\n  top_k: 2\n", [], r"config\.moe needs ffn_size, num_experts"),
    ("", ["moe=5"], r"override 'moe=5': moe is a section; set its keys \(moe\.<key>=value\)"),
    ("", ["moe.remat=[]"], r"override 'moe.remat=\[\]': moe\.remat is a section"),
    ("moe: null\n", ["moe.top_k=2"], r"override 'moe.top_k=2': moe is not a section"),
])
def test_a_section_given_as_a_value_is_refused_by_name(tmp_path, text, overrides, message):
  with pytest.raises(ValueError, match=message):
    load_config(write(tmp_path, text), overrides)


def test_overrides_fill_a_section_the_file_does_not_have(tmp_path):
  path = write(tmp_path, "train:\n  steps: 5\n")
  config = load_config(path, ["data.num_topics=7", "mesh.ep=2"])
  assert (config.train.steps, config.data.num_topics, config.mesh.ep) == (5, 7, 2)
  # MoEConfig has no default sizes: a moe section begun by an override needs them.
  with pytest.raises(ValueError, match=r"config\.moe needs ffn_size, num_experts"):
    load_config(path, ["moe.top_k=2"])


def changed(config: Config, **sections) -> Config:
  """``config`` with ``section={field: value}`` replaced."""
  return dataclasses.replace(config, **{
      name: dataclasses.replace(getattr(config, name), **fields)
      for name, fields in sections.items()})


def test_resume_refuses_changes_to_the_parameters_or_the_computation():
  saved = load_config(TINY_YAML)
  new = changed(saved, model={"num_layers": 4, "dtype": "bfloat16"},
                moe={"top_k": 1, "capacity_factor": None, "aux_loss_coeff": 0.5})
  refused, allowed = resume_changes(saved, new)
  assert refused == ["model.num_layers 2 -> 4", "model.dtype 'float32' -> 'bfloat16'",
                     "moe.top_k 2 -> 1", "moe.aux_loss_coeff 0.001 -> 0.5",
                     "moe.capacity_factor 1.25 -> None"]
  assert allowed == []


def test_resume_allows_schedule_data_mesh_and_execution_changes():
  saved = load_config(TINY_YAML)
  new = changed(saved, train={"steps": 2000, "learning_rate": 1e-3, "run_dir": "elsewhere"},
                data={"path": "corpus.txt"}, mesh={"ep": 4},
                model={"remat_blocks": True, "attention": "xla"},
                moe={"transport": "xla", "remat": dataclasses.replace(saved.moe.remat, save=())})
  refused, allowed = resume_changes(saved, new)
  assert refused == []
  assert allowed == ["model.remat_blocks False -> True", "model.attention 'auto' -> 'xla'",
                     "moe.transport 'auto' -> 'xla'", "moe.remat.save ['dispatch'] -> []",
                     "train.steps 1000 -> 2000", "train.learning_rate 0.003 -> 0.001",
                     "data.path None -> 'corpus.txt'", "mesh.ep None -> 4"]
  assert resume_changes(saved, saved) == ([], [])


def test_moe_hidden_size_follows_d_model_unless_set(tmp_path):
  assert load_config(TINY_YAML, ["model.d_model=128"]).moe.hidden_size == 128
  assert load_config(TINY_YAML).moe.hidden_size == load_config(TINY_YAML).model.d_model == 64
  # Without a moe section, the default experts follow d_model too.
  assert load_config(write(tmp_path, "model:\n  d_model: 96\n")).moe.hidden_size == 96
  explicit = write(tmp_path, "model:\n  d_model: 64\nmoe:\n  hidden_size: 64\n  ffn_size: 8\n"
                             "  num_experts: 8\n  top_k: 2\n")
  assert load_config(explicit, ["model.d_model=64"]).moe.hidden_size == 64
  with pytest.raises(ValueError, match=r"set moe.hidden_size=32, or leave moe.hidden_size out"):
    load_config(explicit, ["model.d_model=32"])


def test_the_printed_config_reads_back_as_the_same_config():
  from examples.pretrain import describe_config
  config = load_config(TINY_YAML, ["moe.capacity_factor=null", "train.run_dir=runs/x"])
  text = describe_config(config)
  assert all(len(line) <= 100 for line in text.splitlines()), text
  # Every key=value, given back as an override of its section, rebuilds the config.
  overrides, section = [], None
  for line in text.splitlines()[1:]:
    head, _, rest = line.strip().partition(": ")
    if rest and head in ("model", "moe", "train", "data", "mesh"):
      section, line = head, rest
    overrides += [f"{section}.{item}" for item in line.split()]
  assert len(overrides) > 50 and load_config(TINY_YAML, overrides) == config


@pytest.mark.parametrize("section, fields", [
    ("moe", {"transport": "xla"}),
    ("moe", {"exchange": "all_to_all"}),
    ("moe", {"exchange": "peer"}),
    ("moe", {"remat": RematConfig(save=("router",), apply=True)}),
    ("model", {"remat_blocks": True}),
    ("model", {"attention": "xla"}),
    ("model", {"remat_policy": "full"}),
])
def test_each_execution_choice_may_change_on_resume(section, fields):
  """The same arithmetic on other kernels, another exchange, or other
  values saved for the backward pass: each on its own is allowed and
  listed, never refused."""
  saved = load_config(TINY_YAML)
  current = {name: getattr(getattr(saved, section), name) for name in fields}
  assert current != fields, "the change must change something"
  refused, allowed = resume_changes(saved, changed(saved, **{section: fields}))
  assert refused == []
  # "moe.remat.save ['dispatch'] -> ['router']": the field is its first two parts.
  changed_fields = {".".join(line.split()[0].split(".")[:2]) for line in allowed}
  assert changed_fields == {f"{section}.{name}" for name in fields}
