"""MoEConfig / RematConfig validation and their dict (YAML) mapping."""

import jax
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
    (dict(capacity_factor=0.0), r"MoEConfig.capacity_factor=0.0 must be a number > 0"),
    (dict(expert_capacity=0), r"MoEConfig.expert_capacity=0 must be an integer >= 1"),
    (dict(dtype="float17"), r"MoEConfig.dtype='float17' is not a dtype name"),
    (dict(batch_axes=("dp", "ep")), r"MoEConfig.batch_axes=\('dp', 'ep'\) must not contain"),
])
def test_bad_moe_config_names_field_and_rule(overrides, message):
  with pytest.raises(ValueError, match=message):
    MoEConfig(**{**BASE, **overrides})


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
