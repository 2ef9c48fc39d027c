"""Every bound of MoEConfig (and of the peer exchanges' Settings) at its edge:
the edge value itself and its neighbours on both sides, each against the rule
the docstrings state, written out here independently of the validators."""

import math

import pytest

from moe_ep import MoEConfig, RematConfig
from moe_ep.transport.peer.settings import MAX_TIMEOUT_S, Settings

BASE = dict(hidden_size=8, ffn_size=16, num_experts=8, top_k=2)
GROUPS = dict(num_groups=4, group_top_k=2)  # 2 experts per group, 4 selectable
TINY = 1e-6  # a real neighbour of a real bound


def _cases():
  """``(overrides, accepted)``: each bound's edge and the values one step
  either side (1 for integers, 1 and TINY for reals)."""
  cases = []
  for field in ("hidden_size", "ffn_size"):  # integers >= 1
    cases += [({field: value}, value >= 1) for value in (0, 1, 2)]
  cases += [({"num_experts": value, "top_k": 1}, value >= 1) for value in (0, 1, 2)]
  cases += [({"top_k": value}, value >= 1) for value in (0, 1)]
  # top_k <= num_experts, at num_experts = 8.
  cases += [({"top_k": value}, value <= 8) for value in (7, 8, 9)]
  # Strictly positive reals.
  for field in ("routed_scaling", "capacity_factor", "receive_factor"):
    cases += [({field: value}, value > 0) for value in (-1.0, -TINY, 0.0, TINY, 1.0)]
  # Non-negative reals.
  for field in ("expert_bias_update_rate", "aux_loss_coeff", "z_loss_coeff"):
    cases += [({field: value}, value >= 0) for value in (-1.0, -TINY, 0.0, TINY, 1.0)]
  cases += [({"num_shared_experts": value}, value >= 0) for value in (-1, 0, 1)]
  cases += [({"expert_capacity": value}, value >= 1) for value in (0, 1, 2)]
  # Groups: 1 <= group_top_k <= num_groups, num_groups | E and >= 1, and
  # top_k <= group_top_k * E / num_groups.
  cases += [({**GROUPS, "group_top_k": value}, 1 <= value <= 4) for value in (0, 1, 3, 4, 5)]
  cases += [({"num_groups": value, "group_top_k": 1},
             value >= 1 and 8 % value == 0 and 2 <= 8 // value)  # top_k = 2 <= 8 / groups
            for value in (0, 1, 2, 3, 4, 5, 7, 8, 9)]
  cases += [({**GROUPS, "top_k": value}, value <= 2 * 2) for value in (3, 4, 5)]
  cases += [({"num_groups": 8, "group_top_k": 8, "top_k": value}, value <= 8)
            for value in (7, 8, 9)]
  return cases


def _name(case):
  overrides, accepted = case
  return ",".join(f"{k}={v}" for k, v in overrides.items()) + ("-ok" if accepted else "-refused")


@pytest.mark.parametrize("overrides, accepted", _cases(), ids=map(_name, _cases()))
def test_moe_config_bound_at_its_edge(overrides, accepted):
  if accepted:
    config = MoEConfig(**{**BASE, **overrides})
    for field, value in overrides.items():
      assert getattr(config, field) == value
    return
  # The message names a field the case changed (or top_k, the field a
  # group bound limits) and its rule.
  named = "|".join(sorted(set(overrides) | {"top_k"}))
  with pytest.raises(ValueError, match=rf"MoEConfig\.({named})=.* (must|is)"):
    MoEConfig(**{**BASE, **overrides})


@pytest.mark.parametrize("field, least", [("blocks_per_peer", 1), ("row_blocks", 2),
                                          ("send_blocks", 1)])
def test_peer_settings_block_counts_at_their_edge(field, least):
  for value in (least - 1, least, least + 1):
    if value >= least:
      assert getattr(Settings(**{field: value}), field) == value
    else:
      with pytest.raises(ValueError, match=rf"{field}={value} must be an integer >= {least}"):
        Settings(**{field: value})


def test_peer_settings_send_blocks_below_row_blocks_at_the_edge():
  for send in (7, 8, 9):
    if send < 8:
      assert Settings(row_blocks=8, send_blocks=send).send_blocks == send
    else:
      with pytest.raises(ValueError, match=rf"send_blocks={send} must be below row_blocks=8"):
        Settings(row_blocks=8, send_blocks=send)


def test_peer_timeout_at_its_edges():
  for seconds in (-1.0, 0.0, TINY, 1.0, MAX_TIMEOUT_S - 1, MAX_TIMEOUT_S, MAX_TIMEOUT_S + 1,
                  math.inf, math.nan):
    if 0 < seconds <= MAX_TIMEOUT_S:
      assert Settings(timeout_s=seconds).wait_bound_s() == seconds
    else:
      with pytest.raises(ValueError, match=r"timeout_s=.* must be in \(0, 86400\] seconds"):
        Settings(timeout_s=seconds)


@pytest.mark.parametrize("batch_axes", ["ep", ("ep",), ("ep", "dp"), ("dp", "ep"),
                                        ("dp", "fsdp", "ep")])
def test_the_ep_axis_is_refused_wherever_it_sits_in_batch_axes(batch_axes):
  with pytest.raises(ValueError, match=r"MoEConfig\.batch_axes=.* must not contain ep_axis='ep'"):
    MoEConfig(**BASE, batch_axes=batch_axes)
  # The rule follows ep_axis, not the name "ep".
  assert MoEConfig(**BASE, batch_axes=batch_axes, ep_axis="experts").ep_axis == "experts"


def test_remat_prefix_must_be_a_non_empty_string():
  for prefix in ("", None, 3):
    with pytest.raises(ValueError, match=r"RematConfig\.prefix=.* must be a non-empty string"):
      RematConfig(prefix=prefix)
  assert RematConfig(prefix="m").names[0] == "m.dispatch.tokens"


def test_remat_names_hold_each_name_once_in_first_mention_order():
  # A group and a name of it, the same group twice: each name once, in the
  # order the entries first mention it (written out by hand).
  remat = RematConfig(save=("dispatch.handle", "dispatch", "router", "dispatch"))
  assert remat.names == ("moe.dispatch.handle", "moe.dispatch.tokens", "moe.dispatch.weights",
                         "moe.dispatch.counts", "moe.router.scores", "moe.router.topk_idx",
                         "moe.router.topk_weights")
