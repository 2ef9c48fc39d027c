"""Which exchange carries the rows (XLA's all_to_all or direct peer stores),
and that the layer's results do not depend on it: the peer exchange moves the
same bytes, so every value and gradient downstream is bitwise equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import devices_for, gpu_devices, make_mesh
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from moe_ep.bench import hlo
from moe_ep.transport import NAMED_SCOPES, _resolve_exchange

ROWS = f"{NAMED_SCOPES['dispatch']}/exchange_rows"


def test_auto_takes_all_to_all_where_peer_cannot_run():
  cpu = make_mesh((2, 4), ("dp", "ep"))
  assert _resolve_exchange("auto", "auto", "ep", 4, cpu) == "all_to_all"  # CPU devices
  assert _resolve_exchange("auto", "cupy", "ep", 4, None) == "all_to_all"  # no mesh
  assert _resolve_exchange("peer", "cupy", "ep", 1, cpu) == "all_to_all"  # one rank
  if gpu_devices() and len(gpu_devices()) >= 2:
    gpus = jax.sharding.Mesh(np.array(gpu_devices()[:2]), ("ep",))
    assert _resolve_exchange("auto", "xla", "ep", 2, gpus) == "all_to_all"  # pure JAX asked


def test_peer_where_it_cannot_run_is_an_error_naming_why():
  cpu = make_mesh((2, 4), ("dp", "ep"))
  with pytest.raises(ValueError, match="exchange='peer' cannot run on this mesh: the mesh "
                                       "has non-GPU devices"):
    _resolve_exchange("peer", "auto", "ep", 4, cpu)
  with pytest.raises(ValueError, match="exchange='peer' needs mesh="):
    _resolve_exchange("peer", "cupy", "ep", 4, None)
  with pytest.raises(ValueError, match="exchange='ring' is not one of"):
    _resolve_exchange("ring", "cupy", "ep", 4, cpu)
  with pytest.raises(ValueError, match=r"MoEConfig.exchange='ring' must be one of"):
    MoEConfig(hidden_size=8, ffn_size=8, num_experts=4, top_k=2, exchange="ring")


def _value_and_grad(exchange: str, mesh, policy=None):
  config = MoEConfig(hidden_size=64, ffn_size=96, num_experts=8, top_k=2, dtype="bfloat16",
                     score_function="sigmoid", aux_loss_coeff=1e-2, capacity_factor=1.0,
                     transport="cupy", exchange=exchange)
  layer = ExpertParallelMoE(config, mesh=mesh, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y.astype(jnp.float32) ** 2) + aux.aux_loss, (y, aux)

  if policy is not None:
    loss = jax.checkpoint(loss, policy=policy)
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64, 64)), jnp.bfloat16)
  return step.lower(params, x).compile().as_text(), step(params, x)


@pytest.mark.gpu
def test_layer_on_the_peer_exchange_is_bitwise_the_all_to_all_layer():
  """Forward, aux, drops (capacity 1.0) and every gradient, bitwise; the
  compiled peer program issues no all_to_all of rows, one forward row
  exchange, and saving "dispatch" still spares the backward re-dispatch."""
  devices = devices_for("cupy", 2)
  mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
  text_peer, peer = _value_and_grad("peer", mesh)
  text_a2a, a2a = _value_and_grad("all_to_all", mesh)
  for got, want in zip(jax.tree.leaves(peer), jax.tree.leaves(a2a)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert "moe_peer_exchange" in text_peer and "moe_peer_exchange" not in text_a2a
  assert not any("all-to-all" in line for *_, line in hlo.collectives(text_peer)
                 if "moe_peer_exchange" not in line)
  assert hlo.count(text_peer, scope=ROWS) == hlo.count(text_a2a, scope=ROWS) == 1
  saved = RematConfig(save=("dispatch",)).policy()
  text_saved, _ = _value_and_grad("peer", mesh, saved)
  text_nothing, _ = _value_and_grad("peer", mesh, jax.checkpoint_policies.nothing_saveable)
  assert hlo.count(text_saved, scope=ROWS) == 1
  assert hlo.count(text_nothing, scope=ROWS) == 2
