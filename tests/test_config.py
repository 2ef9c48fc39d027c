"""MoEConfig / RematConfig validation and their dict (YAML) mapping."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_mesh
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from moe_ep.config import from_dict, to_dict

BASE = dict(hidden_size=8, ffn_size=16, num_experts=8, top_k=2)


@pytest.mark.parametrize("overrides, message", [
    (dict(top_k=9), r"MoEConfig.top_k=9 must be <= num_experts=8"),
    (dict(num_experts=0), r"MoEConfig.num_experts=0 must be an integer >= 1"),
    (dict(score_function="relu"), r"MoEConfig.score_function='relu' must be one of"),
    (dict(activation="tanh"), r"MoEConfig.activation='tanh' must be one of"),
    (dict(transport="nccl"), r"MoEConfig.transport='nccl' must be one of"),
    (dict(num_groups=3, group_top_k=1), r"MoEConfig.num_groups=3 must divide num_experts=8"),
    (dict(num_groups=4), r"num_groups=4 and group_top_k=None must both be set"),
    (dict(num_groups=4, group_top_k=5), r"MoEConfig.group_top_k=5 must be <= num_groups=4"),
    (dict(num_groups=4, group_top_k=1, top_k=3),
     r"MoEConfig.top_k=3 must be <= group_top_k \* experts per group = 2"),
    (dict(num_groups=4, group_top_k=2, group_score="sum"),
     r"MoEConfig.group_score='sum' must be one of \('top2_sum', 'max'\)"),
    (dict(group_score="max3"), r"MoEConfig.group_score='max3' must be one of"),
    (dict(shared_ffn_size=32), r"MoEConfig.shared_ffn_size=32 needs num_shared_experts >= 1"),
    (dict(num_shared_experts=1, shared_ffn_size=0),
     r"MoEConfig.shared_ffn_size=0 must be an integer >= 1"),
    (dict(shared_expert_gate=True),
     r"MoEConfig.shared_expert_gate=True needs num_shared_experts >= 1"),
    (dict(num_shared_experts=1, shared_expert_gate="yes"),
     r"MoEConfig.shared_expert_gate='yes' must be a bool"),
    (dict(capacity_factor=0.0), r"MoEConfig.capacity_factor=0.0 must be a finite number > 0"),
    (dict(expert_capacity=0), r"MoEConfig.expert_capacity=0 must be an integer >= 1"),
    (dict(dtype="float17"), r"MoEConfig.dtype='float17' is not a dtype name"),
    (dict(batch_axes=("dp", "ep")), r"MoEConfig.batch_axes=\('dp', 'ep'\) must not contain"),
    # Bools must be real bools: "False" would be truthy.
    (dict(use_expert_bias="False"), r"MoEConfig.use_expert_bias='False' must be a bool"),
    (dict(normalize_top_k=1), r"MoEConfig.normalize_top_k=1 must be a bool"),
    (dict(return_aux="yes"), r"MoEConfig.return_aux='yes' must be a bool"),
    # Floats must be finite.
    (dict(routed_scaling=float("inf")), r"MoEConfig.routed_scaling=inf must be a finite number"),
    (dict(routed_scaling=float("nan")), r"MoEConfig.routed_scaling=nan must be a finite number"),
    (dict(capacity_factor=float("inf")), r"MoEConfig.capacity_factor=inf must be a finite number"),
    (dict(aux_loss_coeff=float("nan")), r"MoEConfig.aux_loss_coeff=nan must be a finite number"),
    (dict(z_loss_coeff=np.float32("inf")), r"MoEConfig.z_loss_coeff=.*inf.* must be a finite"),
    (dict(expert_bias_update_rate=float("inf")),
     r"MoEConfig.expert_bias_update_rate=inf must be a finite number >= 0"),
    (dict(routed_scaling="1.0"), r"MoEConfig.routed_scaling='1.0' must be a finite number"),
    (dict(aux_loss_coeff=True), r"MoEConfig.aux_loss_coeff=True must be a finite number"),
    # Integers: NumPy ones are fine (below), bools and floats are not.
    (dict(top_k=True), r"MoEConfig.top_k=True must be an integer >= 1"),
    (dict(hidden_size=np.bool_(True)), r"MoEConfig.hidden_size=.*True.* must be an integer"),
    (dict(ffn_size=16.0), r"MoEConfig.ffn_size=16.0 must be an integer >= 1"),
    # dtypes: floating ones the layer computes exactly.
    (dict(dtype="float64"), r"MoEConfig.dtype='float64' is refused: the transport sums and "
     r"routing weights are float32, so float64 would silently lose precision; use float32"),
    (dict(param_dtype="float64"), r"MoEConfig.param_dtype='float64' is refused: .*use float32"),
    (dict(dtype="int32"), r"MoEConfig.dtype='int32' must be one of the floating dtypes .*"
     r"\('bfloat16', 'float16', 'float32'\); got int32"),
    (dict(dtype="bool"), r"MoEConfig.dtype='bool' must be one of the floating dtypes"),
    (dict(dtype="complex64"), r"MoEConfig.dtype='complex64' must be one of the floating"),
    (dict(dtype="float8_e4m3fn"), r"MoEConfig.dtype='float8_e4m3fn' must be one of the floating"),
    (dict(param_dtype="int8"), r"MoEConfig.param_dtype='int8' must be one of the floating"),
    (dict(param_dtype=None), r"MoEConfig.param_dtype=None must be one of"),
    (dict(ep_axis=""), r"MoEConfig.ep_axis='' must be a non-empty string"),
    (dict(batch_axes=("dp", 3)), r"MoEConfig.batch_axes=\('dp', 3\) must be a string or a "
     r"sequence of strings"),
    # FP8 expert GEMMs: the grouped bank, bf16, sizes of 16.
    (dict(expert_precision="fp16"), r"MoEConfig.expert_precision='fp16' must be one of "
     r"\(None, 'fp8'\)"),
    (dict(expert_precision="fp8", expert_layout="slabs"),
     r"MoEConfig.expert_precision='fp8' .* not expert_layout='slabs'"),
    (dict(expert_precision="fp8", dtype="float32"),
     r"MoEConfig.expert_precision='fp8' computes in bfloat16: it needs dtype='bfloat16' or None"),
    (dict(expert_precision="fp8", hidden_size=24),
     r"MoEConfig.expert_precision='fp8' needs hidden_size a multiple of 16"),
    (dict(expert_precision="fp8", hidden_size=16, ffn_size=24),
     r"MoEConfig.expert_precision='fp8' needs ffn_size a multiple of 16"),
    # The grouped layout's alignment: whole or half row tiles; FP8 on whole ones.
    (dict(group_align=32), r"MoEConfig.group_align=32 must be one of \(128, 64\)"),
    (dict(group_align=True), r"MoEConfig.group_align=True must be an integer >= 1"),
    (dict(expert_precision="fp8", hidden_size=16, group_align=64),
     r"MoEConfig.expert_precision='fp8' needs groups on whole 128-row tiles .*not group_align=64"),
])
def test_bad_moe_config_names_field_and_rule(overrides, message):
  with pytest.raises(ValueError, match=message):
    MoEConfig(**{**BASE, **overrides})


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers():
  config = MoEConfig(hidden_size=np.int64(8), ffn_size=np.int32(16), num_experts=np.int64(8),
                     top_k=np.int16(2), num_groups=np.int64(4), group_top_k=np.int64(2),
                     num_shared_experts=np.int64(1), expert_capacity=np.int64(32),
                     routed_scaling=np.float32(0.5), capacity_factor=np.float64(1.25),
                     aux_loss_coeff=np.float32(0.0), normalize_top_k=np.bool_(False))
  for field in ("hidden_size", "ffn_size", "num_experts", "top_k", "num_groups", "group_top_k",
                "num_shared_experts", "expert_capacity"):
    assert type(getattr(config, field)) is int, field
  assert (config.hidden_size, config.num_groups, config.expert_capacity) == (8, 4, 32)
  for field in ("routed_scaling", "capacity_factor", "aux_loss_coeff"):
    assert type(getattr(config, field)) is float, field
  assert (config.routed_scaling, config.capacity_factor) == (0.5, 1.25)
  assert config.normalize_top_k is False
  # Equal to the same config written with Python numbers, so it hashes and
  # compares as a static argument should.
  plain = MoEConfig(hidden_size=8, ffn_size=16, num_experts=8, top_k=2, num_groups=4,
                    group_top_k=2, num_shared_experts=1, expert_capacity=32,
                    routed_scaling=0.5, capacity_factor=1.25, normalize_top_k=False)
  assert config == plain and hash(config) == hash(plain)


def test_dtype_none_means_the_input_dtype_and_names_are_canonical():
  config = MoEConfig(**BASE)
  assert config.dtype is None  # the default: the layer computes in x's dtype
  assert config.return_aux is True
  assert config.param_dtype == "float32"
  assert MoEConfig(**BASE, dtype=jnp.bfloat16).dtype == "bfloat16"
  assert MoEConfig(**BASE, dtype=np.dtype("float16"), param_dtype="bfloat16").dtype == "float16"
  # The four sizes stay the leading (positional) fields.
  assert [f.name for f in dataclasses.fields(MoEConfig)][:4] == [
      "hidden_size", "ffn_size", "num_experts", "top_k"]


def test_remat_config_bad_inputs():
  with pytest.raises(ValueError, match=r"RematConfig.apply='False' must be a bool"):
    RematConfig(apply="False")
  with pytest.raises(ValueError, match=r"RematConfig.save=3 must be a string or a sequence"):
    RematConfig(save=3)
  with pytest.raises(ValueError, match=r"RematConfig.save=\(\['router'\],\) must be a string"):
    RematConfig(save=(["router"],))
  assert RematConfig(apply=np.bool_(True)).apply is True


def test_experts_not_divisible_by_ep_size():
  mesh = make_mesh((2, 4), ("dp", "ep"))
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by the ep axis size 4"):
    ExpertParallelMoE(MoEConfig(**{**BASE, "num_experts": 6}), mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="ep_axis='expert' is not an axis of the mesh"):
    ExpertParallelMoE(MoEConfig(**{**BASE, "ep_axis": "expert"}), mesh=mesh, rngs=nnx.Rngs(0))


def test_remat_config_names_and_policy():
  remat = RematConfig(save=("dispatch", "expert_hidden"), prefix="layer3")
  assert remat.names == ("layer3.dispatch.tokens", "layer3.dispatch.weights",
                         "layer3.dispatch.handle", "layer3.dispatch.counts",
                         "layer3.expert_hidden")
  assert RematConfig(save=("dispatch.tokens", "dispatch.weights")).names == (
      "moe.dispatch.tokens", "moe.dispatch.weights")
  assert RematConfig(save=()).names == ()
  # The policy saves exactly the named values it lists.
  def named(name):
    jaxpr = jax.make_jaxpr(lambda v: jax.ad_checkpoint.checkpoint_name(v, name))(np.ones(2))
    (eqn,) = jaxpr.eqns
    return remat.policy()(eqn.primitive, *eqn.invars, **eqn.params)
  assert named("layer3.expert_hidden")
  assert named("layer3.dispatch.handle")
  assert not named("layer3.router.scores")
  assert not named("moe.dispatch.handle")


def test_unknown_remat_name_is_an_error():
  with pytest.raises(ValueError, match=r"RematConfig.save=.*unknown name 'dispatch.handles'"):
    RematConfig(save=("dispatch.handles",))


def test_dict_round_trip_and_unknown_keys():
  config = MoEConfig(**BASE, capacity_factor=1.25, remat=RematConfig(save=["router"], apply=True))
  data = to_dict(config)
  assert data["remat"] == {"save": ["router"], "prefix": "moe", "apply": True}
  assert from_dict(MoEConfig, data) == config
  with pytest.raises(ValueError, match=r"unknown key MoEConfig.num_expert "):
    from_dict(MoEConfig, {**BASE, "num_expert": 3})
  with pytest.raises(ValueError, match=r"unknown key MoEConfig.remat.policy"):
    from_dict(MoEConfig, {**BASE, "remat": {"policy": "x"}})


def test_yaml_dtype_null_and_names():
  import yaml  # noqa: PLC0415
  data = yaml.safe_load("""
hidden_size: 8
ffn_size: 16
num_experts: 8
top_k: 2
dtype: null
return_aux: false
""")
  config = from_dict(MoEConfig, data)
  assert config.dtype is None and config.return_aux is False
  assert from_dict(MoEConfig, to_dict(config)) == config
  for name in ("float32", "bfloat16"):
    assert from_dict(MoEConfig, {**data, "dtype": name}).dtype == name
  with pytest.raises(ValueError, match=r"MoEConfig.return_aux='no' must be a bool"):
    from_dict(MoEConfig, {**data, "return_aux": "no"})


def test_expert_precision_is_appended_and_round_trips():
  """Appended after the fields before it, so positional construction keeps
  them; None by default."""
  names = [f.name for f in dataclasses.fields(MoEConfig)]
  assert names.index("expert_precision") > names.index("receive_factor")
  assert MoEConfig(**BASE).expert_precision is None
  config = MoEConfig(**{**BASE, "hidden_size": 16}, expert_precision="fp8", dtype="bfloat16")
  assert from_dict(MoEConfig, to_dict(config)) == config


def test_group_align_is_appended_and_round_trips():
  """The last field (positional construction keeps the fields before it);
  whole row tiles by default, half tiles from YAML as from Python."""
  names = [f.name for f in dataclasses.fields(MoEConfig)]
  assert names[-1] == "group_align"
  assert MoEConfig(**BASE).group_align == 128
  config = MoEConfig(**BASE, group_align=np.int64(64))
  assert type(config.group_align) is int and from_dict(MoEConfig, to_dict(config)) == config
