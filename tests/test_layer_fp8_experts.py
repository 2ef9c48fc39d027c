"""The layer with FP8 expert GEMMs (MoEConfig.expert_precision="fp8"): its
gradients against finite differences of the layer on the dequantized
weights, the FP8 dispatch feeding the first GEMM, an EP mesh, remat and the
call-time refusal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_mesh
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig, fp8_blocks, layer_core
from moe_ep.experts import fp8 as fp8_experts

HIDDEN, FFN, EXPERTS, TOP_K = 32, 48, 8, 2


def config(**overrides) -> MoEConfig:
  base = dict(hidden_size=HIDDEN, ffn_size=FFN, num_experts=EXPERTS, top_k=TOP_K,
              dtype="bfloat16", transport="xla", score_function="sigmoid",
              expert_precision="fp8")
  return MoEConfig(**{**base, **overrides})


def tokens(seed=0, shape=(4, 40)):
  return np.random.default_rng(seed).normal(size=(*shape, HIDDEN)).astype(np.float32)


def loss_fn(layer, probe):
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y.astype(jnp.float32) * probe), y

  return params, loss


def value_and_grads(layer, x, probe):
  params, loss = loss_fn(layer, probe)
  return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)


def shifted(params, name: str, delta):
  """``params`` with ``delta`` added to the parameter ``name``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, v: v + delta if path[0].key == name else v, params)


def test_gradients_are_those_of_the_layer_on_dequantized_weights_by_finite_differences():
  """Straight through: the FP8 layer's gradients (x, router, w_in, w_out)
  against the gradient of the same layer computing in float32 on the FP8
  weights' dequantized values (the weights' quantization simulated), which
  central differences in float32 confirm along random directions. Every
  expert routed (top_k = num_experts): the layer is then smooth, where a
  top-k switch would break the differences.

  Tolerances: the differences agree to 1e-3 of the gradient's norm (eps =
  1e-3: float32 rounding of the loss over eps and eps**2 curvature, measured
  3e-4). The FP8 gradients are within 0.1 normwise: the activations and
  cotangents the straight-through gradient leaves out are quantized too,
  each e4m3 rounding off by at most 2**-4 of a value (0.036 RMS), about six
  of them on a gradient's way (measured 0.048-0.058)."""
  x = tokens()
  probe = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
  smooth = dict(num_experts=4, top_k=4)
  layer = ExpertParallelMoE(config(**smooth), rngs=nnx.Rngs(0))
  (_, _), (grads, x_grad) = value_and_grads(layer, x, probe)

  reference = ExpertParallelMoE(config(dtype="float32", expert_precision=None,
                                       expert_layout="grouped", **smooth), rngs=nnx.Rngs(0))
  for key in ("w_in", "w_out"):
    weights = getattr(reference, key)
    weights[...] = fp8_experts.dequantize_weights(fp8_experts.quantize_weights(weights[...]))
  x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # the FP8 layer's input
  (_, _), (reference_grads, reference_x_grad) = value_and_grads(reference, x_bf16, probe)
  params, reference_loss = loss_fn(reference, probe)
  loss = jax.jit(lambda p, x: reference_loss(p, x)[0])
  rng = np.random.default_rng(2)
  eps = 1e-3
  for name in ("x", "router", "w_in", "w_out"):
    got, want = ((x_grad, reference_x_grad) if name == "x" else
                 (grads[name][...], reference_grads[name][...]))
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    direction = rng.normal(size=want.shape).astype(np.float32)
    if name == "x":
      plus, minus = (loss(params, x_bf16 + s * eps * direction) for s in (1, -1))
    else:
      plus, minus = (loss(shifted(params, name, s * eps * direction), x_bf16) for s in (1, -1))
    numeric = float(plus - minus) / (2 * eps)
    assert abs(np.sum(want * direction) - numeric) <= 1e-3 * np.linalg.norm(want), name
    assert np.linalg.norm(got - want) <= 0.1 * np.linalg.norm(want), name


def test_fp8_dispatch_feeds_the_first_gemm_bit_for_bit(monkeypatch):
  """With FP8 dispatch the bank reads the dispatched codes and scales (no
  row quantization of its input in the forward), and the layer's output and
  gradients are bit for bit those of the bank requantizing the dequantized
  rows: the feed changes no value, only the passes."""
  x, probe = tokens(), tokens(1)
  cfg = config(dispatch_dtype="float8_e4m3fn")
  quantized_rows = []
  quantize_rows = fp8_blocks.quantize_rows
  monkeypatch.setattr(fp8_blocks, "quantize_rows",
                      lambda v: quantized_rows.append(v.shape) or quantize_rows(v))
  layer = ExpertParallelMoE(cfg, rngs=nnx.Rngs(0))
  jax.make_jaxpr(lambda x: layer(x)[0])(x)
  # The dispatch's of the tokens and the activation's: none of the bank's input rows.
  num_tokens = x.shape[0] * x.shape[1]
  assert quantized_rows == [(num_tokens, HIDDEN), (quantized_rows[1][0], FFN)], quantized_rows
  fed = value_and_grads(layer, x, probe)
  monkeypatch.setattr(layer_core, "_fp8_dispatch_feed", lambda config: False)
  requantized = value_and_grads(ExpertParallelMoE(cfg, rngs=nnx.Rngs(0)), x, probe)
  for got, want in zip(jax.tree.leaves(fed), jax.tree.leaves(requantized)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dispatch_dtype", [None, "float8_e4m3fn"])
def test_ep_mesh_gives_the_one_device_layer(dispatch_dtype):
  """dp=2 x ep=4: each row meets the same codes and weights as on one
  device, in the same order, so the outputs are bit for bit the same;
  gradients sum over other groupings of rows (float32 sums in other orders,
  128-row column blocks that differ only in e4m3's subnormal range): 2**-10
  normwise (measured 2e-7)."""
  x, probe = tokens(), tokens(1)
  results = [value_and_grads(ExpertParallelMoE(config(dispatch_dtype=dispatch_dtype),
                                               mesh=make_mesh(shape, ("dp", "ep")),
                                               rngs=nnx.Rngs(0)), x, probe)
             for shape in ((1, 1), (2, 4))]
  ((_, y_one), grads_one), ((_, y_ep), grads_ep) = results
  y_one, y_ep = np.asarray(y_one, np.float32), np.asarray(y_ep, np.float32)
  np.testing.assert_array_equal(y_ep, y_one)
  for got, want in zip(jax.tree.leaves(grads_ep), jax.tree.leaves(grads_one)):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= 2 ** -10 * np.linalg.norm(want)


@pytest.mark.parametrize("save", [("dispatch",), ("dispatch", "expert_fp8", "expert_weights",
                                                  "expert_hidden")])
def test_remat_saving_the_fp8_names_changes_no_value(save):
  """The layer's body under remat (saving the dispatch, and the FP8 codes,
  the quantized weights and the hidden rows) gives the gradients of the
  layer without remat bit for bit."""
  x, probe = tokens(), tokens(1)
  cfg = config(dispatch_dtype="float8_e4m3fn")
  plain = value_and_grads(ExpertParallelMoE(cfg, rngs=nnx.Rngs(0)), x, probe)
  remat = RematConfig(save=save, apply=True)
  rematted = value_and_grads(ExpertParallelMoE(config(dispatch_dtype="float8_e4m3fn",
                                                      remat=remat), rngs=nnx.Rngs(0)), x, probe)
  (loss_remat, y_remat), _ = rematted
  (loss_plain, y_plain), _ = plain
  y_remat, y_plain = np.asarray(y_remat, np.float32), np.asarray(y_plain, np.float32)
  rows_apart = np.abs(y_remat - y_plain).reshape(-1, HIDDEN).max(axis=-1)
  where = (f"loss {float(loss_remat)!r} under remat, {float(loss_plain)!r} without; y differs in "
           f"{int((rows_apart > 0).sum())} of {rows_apart.size} rows, by up to "
           f"{float(rows_apart.max()):.3g}")
  for got, want in zip(jax.tree.leaves(rematted), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                  err_msg=where)


def test_a_float32_compute_dtype_is_refused_at_call_time():
  layer = ExpertParallelMoE(config(dtype=None), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"expert_precision='fp8'.*MoEConfig\.dtype"):
    layer(jnp.asarray(tokens()))
  y, _ = layer(jnp.asarray(tokens(), jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
