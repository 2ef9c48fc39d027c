"""FP8 dispatch (``dispatch(wire_dtype="float8_e4m3fn")``,
``MoEConfig.dispatch_dtype``): the slabs against the plain dispatch, within
e4m3's error bound and bit for bit against a NumPy quantize-dequantize of the
plain slabs; the integers and weights bitwise equal; the straight-through
backward; remat; the layer against a dense reference; the CUDA lowering; and
on GPUs the CuPy path against pure JAX bit for bit."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import cpu_compiler_options, custom_call_scopes, make_mesh
from moe_ep import ExpertParallelMoE, MoEConfig, RematConfig
from benchmarks import hlo
from moe_ep.config import from_dict
from moe_ep.transport import NAMED_SCOPES, dispatch, expert_capacity_for, fp8
from reference import make_routing
from test_fp8 import reference_dequantize, reference_quantize

# jax.ad_checkpoint.saved_residuals is public only in newer JAX.
saved_residuals = getattr(jax.ad_checkpoint, "saved_residuals", None)
if saved_residuals is None:
  from jax._src.ad_checkpoint import saved_residuals

FP8 = "float8_e4m3fn"
HIDDEN = 200  # two scale blocks, the second one short (72 channels)
NUM_EXPERTS, TOP_K = 16, 3
TOKENS = 13  # per rank
ROWS = f"{NAMED_SCOPES['dispatch']}/exchange_rows"


def problem(seed: int, ep_size: int, dtype):
  """Rows of very different magnitudes (so scales differ per row), a zero
  row, balanced routing, and a cotangent for the slabs and the weights."""
  rng = np.random.default_rng(seed)
  magnitude = 10.0 ** rng.uniform(-3, 3, (ep_size * TOKENS, 1))
  tokens = (rng.normal(size=(ep_size * TOKENS, HIDDEN)) * magnitude).astype(np.float32)
  tokens[1] = 0.0
  idx = make_routing("balanced", rng, ep_size, TOKENS, TOP_K, NUM_EXPERTS).reshape(-1, TOP_K)
  weights = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
  return jnp.asarray(tokens, dtype), idx, weights


def slab_shape(ep_size: int) -> tuple[int, int]:
  """``[E, C]``: the global ``[R * L, C]`` of the dropless slabs."""
  return NUM_EXPERTS, expert_capacity_for(TOKENS, TOP_K, NUM_EXPERTS, ep_size)


@functools.cache
def dispatch_with_grads(ep_size: int, wire_dtype, backend_name: str = "xla",
                        exchange: str = "all_to_all", devices: str = "xla",
                        checkpoint_name: str | None = None):
  """jit of ``(tokens, idx, weights, slab_cotangent, weight_cotangent) ->
  (Dispatched, token_grad, weight_grad)`` on a 1 x ``ep_size`` mesh of
  ``devices`` ("xla": CPUs, "cupy": GPUs); the loss is linear in the slabs
  and weights, so its gradient is the dispatch's VJP of the cotangents.
  With ``checkpoint_name`` the FP8 path dequantizes named FP8 slabs."""
  mesh = make_mesh((1, ep_size), ("dp", "ep"), devices)
  axis = "ep" if ep_size > 1 else None
  capacity = slab_shape(ep_size)[1]

  def body(tokens, idx, weights):
    return dispatch(tokens, idx, weights, num_experts=NUM_EXPERTS, expert_capacity=capacity,
                    axis_name=axis, transport=backend_name, exchange=exchange, mesh=mesh,
                    wire_dtype=wire_dtype, checkpoint_name=checkpoint_name)

  spec = P(("dp", "ep"))
  sharded = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)

  def loss(tokens, weights, idx, slab_cotangent, weight_cotangent):
    out = sharded(tokens, idx, weights)
    value = (jnp.vdot(out.tokens.astype(jnp.float32), slab_cotangent)
             + jnp.vdot(out.weights, weight_cotangent))
    return value, out

  @functools.partial(jax.jit,
                     compiler_options=cpu_compiler_options() if devices == "xla" else None)
  def run(tokens, idx, weights, slab_cotangent, weight_cotangent):
    (_, out), (token_grad, weight_grad) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(tokens, weights, idx, slab_cotangent,
                                            weight_cotangent)
    return out, token_grad, weight_grad

  return run


def arguments(seed: int, ep_size: int, dtype):
  """``(tokens, idx, weights, slab_cotangent, weight_cotangent)``."""
  rng = np.random.default_rng(seed + 1)
  return (*problem(seed, ep_size, dtype),
          rng.normal(size=slab_shape(ep_size) + (HIDDEN,)).astype(np.float32),
          rng.normal(size=slab_shape(ep_size)).astype(np.float32))


@functools.cache
def run_both(ep_size: int, dtype):
  """The plain and the FP8 dispatch of one problem, with the same cotangents."""
  args = arguments(0, ep_size, dtype)
  return dispatch_with_grads(ep_size, None)(*args), dispatch_with_grads(ep_size, FP8)(*args)


def block_scales(rows: np.ndarray) -> np.ndarray:
  """``[N, H]`` per-channel scale ``2**ceil(log2(amax / 448))`` of each
  channel's 128-block (floored at 2**-116), from float64 logs."""
  blocks = -(-HIDDEN // 128)
  padded = np.zeros((rows.shape[0], blocks * 128))
  padded[:, :HIDDEN] = np.abs(rows)
  amax = padded.reshape(rows.shape[0], blocks, 128).max(axis=2)
  with np.errstate(divide="ignore"):
    exponent = np.maximum(np.ceil(np.log2(amax / 448.0)), -116)
  return np.repeat(np.exp2(exponent), 128, axis=1)[:, :HIDDEN]


CASES = [(1, jnp.float32), (4, jnp.bfloat16)]


@pytest.mark.parametrize("ep_size, dtype", CASES)
def test_fp8_slabs_are_the_plain_slabs_quantized_once(ep_size, dtype):
  """The plain dispatch copies token rows exactly, and FP8 quantizes per row,
  so each FP8 slab row is its plain slab row quantized and dequantized: bit
  for bit the NumPy reference of part 1, and within part 1's bound
  ``|x - deq| <= 2**-4 |x| + 2**-10 scale`` (plus half an ulp of the output
  dtype: 2**-9 |deq| for bfloat16). Empty slab rows stay exact zeros."""
  (plain, _, _), (fp8_out, _, _) = run_both(ep_size, dtype)
  plain_rows = np.asarray(plain.tokens, np.float32).reshape(-1, HIDDEN)
  got = np.asarray(fp8_out.tokens)
  assert got.dtype == dtype and got.shape == plain.tokens.shape

  codes, scales = reference_quantize(plain_rows)
  want = reference_dequantize(codes, scales, dtype).reshape(got.shape)
  np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))

  got_rows = got.astype(np.float64).reshape(-1, HIDDEN)
  exact = plain_rows.astype(np.float64)
  output_rounding = 2.0 ** -9 if dtype == jnp.bfloat16 else 0.0
  bound = (2.0 ** -4 * np.abs(exact) + 2.0 ** -10 * block_scales(exact)
           + output_rounding * np.abs(got_rows))
  error = np.abs(got_rows - exact)
  assert (error <= bound).all(), np.max(error / bound)
  nonzero = exact != 0
  assert (error[nonzero] / np.abs(exact[nonzero])).max() > 2.0 ** -6  # FP8 really ran
  empty = ~np.asarray(plain.tokens, np.float32).reshape(-1, HIDDEN).any(axis=1)
  assert empty.any() and not got_rows[empty].any()


@pytest.mark.parametrize("ep_size, dtype", CASES)
def test_fp8_leaves_handle_counts_demand_and_weights_bitwise_unchanged(ep_size, dtype):
  (plain, _, _), (fp8_out, _, _) = run_both(ep_size, dtype)
  for field in ("weights", "counts", "demand"):
    np.testing.assert_array_equal(np.asarray(getattr(fp8_out, field)),
                                  np.asarray(getattr(plain, field)), err_msg=field)
  for name, got, want in zip(plain.handle._fields, fp8_out.handle, plain.handle):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
  assert int(np.asarray(plain.counts).sum()) == ep_size * TOKENS * TOP_K  # dropless


@pytest.mark.parametrize("ep_size, dtype", CASES)
def test_token_gradient_is_straight_through(ep_size, dtype):
  """The backward never sees the quantization: for the same slab cotangent
  the tokens' and weights' gradients are bit for bit those of the plain
  dispatch (differentiating through the rounding would give zeros)."""
  (_, plain_tokens, plain_weights), (_, fp8_tokens, fp8_weights) = run_both(ep_size, dtype)
  assert fp8_tokens.dtype == dtype
  np.testing.assert_array_equal(np.asarray(fp8_tokens, np.float32),
                                np.asarray(plain_tokens, np.float32))
  np.testing.assert_array_equal(np.asarray(fp8_weights), np.asarray(plain_weights))
  assert np.abs(np.asarray(fp8_tokens, np.float32)).min(axis=1).max() > 0


@pytest.mark.parametrize("ep_size, dtype", CASES)
def test_named_fp8_slabs_dequantize_to_the_fused_receive_bitwise(ep_size, dtype):
  """With a checkpoint_name the receiver expands FP8 slabs (the residual remat
  can save) and a pass of their own dequantizes them; without one the
  dequantize is fused into the receive. Slabs, handle, weights and gradients
  are the same bits."""
  args = arguments(2, ep_size, dtype)
  fused = dispatch_with_grads(ep_size, FP8)(*args)
  named = dispatch_with_grads(ep_size, FP8, checkpoint_name="moe.dispatch")(*args)
  for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(fused)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


@functools.cache
def grouped_dispatch(ep_size: int, wire_dtype, fp8_rows: bool):
  """jit of ``(tokens, idx, weights, cotangent [R * M, H]) -> (Dispatched,
  token_grad)`` into the grouped layout on a 1 x ``ep_size`` CPU mesh."""
  from moe_ep.row_groups import grouped_rows_for  # noqa: PLC0415
  mesh = make_mesh((1, ep_size), ("dp", "ep"))
  axis = "ep" if ep_size > 1 else None
  rows = grouped_rows_for(TOKENS, TOP_K, NUM_EXPERTS, ep_size)

  def body(tokens, idx, weights):
    return dispatch(tokens, idx, weights, num_experts=NUM_EXPERTS,
                    expert_capacity=slab_shape(ep_size)[1], axis_name=axis, transport="xla",
                    exchange="all_to_all", wire_dtype=wire_dtype, grouped_rows=rows,
                    fp8_rows=fp8_rows)

  sharded = jax.shard_map(body, mesh=mesh, in_specs=P(("dp", "ep")), out_specs=P(("dp", "ep")))

  def loss(tokens, idx, weights, cotangent):
    out = sharded(tokens, idx, weights)
    return jnp.vdot(out.tokens.astype(jnp.float32), cotangent), out

  return jax.jit(lambda t, i, w, c: jax.grad(loss, has_aux=True)(t, i, w, c)[::-1]), rows


@pytest.mark.parametrize("ep_size", [1, 4])
def test_grouped_fp8_rows_are_the_wire_codes_and_scales(ep_size):
  """``fp8_rows=True``: the grouped rows come back as they crossed, the
  codes and scales of each plain grouped row quantized (NumPy reference),
  zero on rows no member fills; the dequantized rows, their gradient and
  everything else are bit for bit the FP8 dispatch's without them."""
  tokens, idx, weights = problem(3, ep_size, jnp.bfloat16)
  plain_run, rows = grouped_dispatch(ep_size, None, False)
  cotangent = np.random.default_rng(4).normal(size=(ep_size * rows, HIDDEN)).astype(np.float32)
  (plain, _), (fp8_out, fp8_grad), (fed, fed_grad) = (
      grouped_dispatch(ep_size, wire, fed)[0](tokens, idx, weights, cotangent)
      for wire, fed in ((None, False), (FP8, False), (FP8, True)))
  assert fp8_out.fp8_tokens is None
  for a, b in zip(jax.tree.leaves((fed.tokens, fed.weights, fed.handle, fed.counts, fed_grad)),
                  jax.tree.leaves((fp8_out.tokens, fp8_out.weights, fp8_out.handle,
                                   fp8_out.counts, fp8_grad))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  codes, scales = fed.fp8_tokens
  assert codes.dtype == jnp.float8_e4m3fn and codes.shape == (ep_size * rows, HIDDEN)
  assert scales.dtype == jnp.float32 and scales.shape == (ep_size * rows, 2)
  want_codes, want_scales = reference_quantize(np.asarray(plain.tokens, np.float32))
  filled = np.asarray(plain.handle.slab_row) >= 0
  np.testing.assert_array_equal(np.asarray(codes).view(np.uint8)[filled], want_codes[filled])
  np.testing.assert_array_equal(np.asarray(scales)[filled], want_scales[filled])
  assert not np.asarray(codes).view(np.uint8)[~filled].any()
  assert not np.asarray(scales)[~filled].any() and (~filled).any()


def test_fp8_rows_need_an_fp8_wire_into_the_grouped_layout():
  tokens, idx, weights = problem(0, 1, jnp.bfloat16)
  call = functools.partial(dispatch, tokens, idx, weights, num_experts=NUM_EXPERTS,
                           expert_capacity=8, fp8_rows=True)
  with pytest.raises(ValueError, match=r"fp8_rows=True .* needs wire_dtype='float8_e4m3fn' "
                                       r"and grouped_rows"):
    call(grouped_rows=256)
  with pytest.raises(ValueError, match=r"grouped_rows=None"):
    call(wire_dtype=FP8)


def test_bad_wire_dtype_and_tokens_are_named():
  tokens, idx, weights = problem(0, 1, jnp.float32)
  call = functools.partial(dispatch, num_experts=NUM_EXPERTS, expert_capacity=8)
  with pytest.raises(ValueError, match=r"wire_dtype='float16' must be None or one of "
                                       r"\('float8_e4m3fn',\)"):
    call(tokens, idx, weights, wire_dtype="float16")
  with pytest.raises(ValueError, match=r"tokens dtype int32 must be one of "):
    call(tokens.astype(jnp.int32), idx, weights, wire_dtype=FP8)


# --- the config ------------------------------------------------------------------

BASE = dict(hidden_size=16, ffn_size=24, num_experts=8, top_k=2)


def test_config_dispatch_dtype_is_validated_by_name(monkeypatch):
  assert MoEConfig(**BASE).dispatch_dtype is None
  assert MoEConfig(**BASE, dispatch_dtype=jnp.float8_e4m3fn).dispatch_dtype == FP8
  assert from_dict(MoEConfig, {**BASE, "dispatch_dtype": FP8}).dispatch_dtype == FP8
  names = [f.name for f in dataclasses.fields(MoEConfig)]
  assert names.index("dispatch_dtype") > names.index("return_aux")  # appended: positions kept
  for bad in ("bfloat16", "float8_e5m2", "fp8", 8):
    with pytest.raises(ValueError, match=rf"MoEConfig.dispatch_dtype={bad!r} must be None or "):
      MoEConfig(**BASE, dispatch_dtype=bad)
  monkeypatch.delattr(jnp, "float8_e4m3fn")
  with pytest.raises(ValueError, match=r"MoEConfig.dispatch_dtype='float8_e4m3fn' needs a JAX "
                                       r"with jnp.float8_e4m3fn"):
    MoEConfig(**BASE, dispatch_dtype=FP8)


# --- the layer ---------------------------------------------------------------------


def layer_and_params(mesh, **overrides):
  config = MoEConfig(**BASE, dtype="float32", transport="xla", dispatch_dtype=FP8, **overrides)
  layer = ExpertParallelMoE(config, mesh=mesh, rngs=nnx.Rngs(0))
  params = {key: np.asarray(value)
            for key, value in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}
  return layer, params


def dense_layer(params, x, expert_x, top_k):
  """Softmax top-k routing of ``x``, normalised; every expert applied to
  ``expert_x`` (swiglu), each token's chosen outputs weighted and summed:
  ``[N, H]`` float64."""
  logits = x @ params["router"].astype(np.float64)
  scores = np.exp(logits - logits.max(-1, keepdims=True))
  scores /= scores.sum(-1, keepdims=True)
  idx = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
  weights = np.take_along_axis(scores, idx, axis=-1)
  weights /= weights.sum(-1, keepdims=True)
  gate, up = np.split(np.einsum("nh,ehf->enf", expert_x, params["w_in"].astype(np.float64)),
                      2, axis=-1)
  every = np.einsum("enf,efh->enh", gate / (1 + np.exp(-gate)) * up,
                    params["w_out"].astype(np.float64))
  rows = np.arange(x.shape[0])
  return sum(weights[:, k, None] * every[idx[:, k], rows] for k in range(top_k))


def test_layer_with_fp8_dispatch_matches_dense_reference():
  """float32 compute on a 2x4 mesh. The experts see exactly the tokens
  quantized once (the router sees them unquantized): against that dense
  reference only float32 rounding of differently ordered sums differs
  (rtol/atol 1e-5, as tests/test_layer.py). Against the unquantized dense
  layer the error is FP8's: each expert input is off by at most 2**-4 of
  itself (typically ~2**-6), and two GEMMs with random-sign weights keep that
  relative order, so the output is within 2**-4 of the output scale (max
  and rms), and measurably off (FP8 ran)."""
  layer, params = layer_and_params(make_mesh((2, 4), ("dp", "ep")))
  x = np.random.default_rng(3).normal(size=(8, 6, BASE["hidden_size"])).astype(np.float32)
  graphdef, state = nnx.split(layer)
  y, aux = jax.jit(lambda state, v: nnx.merge(graphdef, state)(v),
                   compiler_options=cpu_compiler_options())(state, x)
  tokens = x.reshape(-1, BASE["hidden_size"])
  codes, scales = reference_quantize(tokens)
  quantized = reference_dequantize(codes, scales, np.float32).astype(np.float64)
  got = np.asarray(y, np.float64).reshape(tokens.shape)
  top_k = BASE["top_k"]
  np.testing.assert_allclose(got, dense_layer(params, tokens.astype(np.float64), quantized, top_k),
                             rtol=1e-5, atol=1e-5)
  exact = dense_layer(params, tokens.astype(np.float64), tokens.astype(np.float64), top_k)
  error = np.abs(got - exact)
  assert error.max() <= 2.0 ** -4 * np.abs(exact).max(), error.max()
  assert np.sqrt((error ** 2).mean()) <= 2.0 ** -4 * np.sqrt((exact ** 2).mean())
  assert error.max() > 1e-4 * np.abs(exact).max()
  assert float(aux.dropped_fraction) == 0.0


def test_saved_dispatch_runs_one_forward_fp8_row_exchange():
  """With save=("dispatch",) backward does not re-run the dispatch row
  exchange (one, as without FP8; two when nothing is saved), the rows cross
  as uint8 wire rows of fp8.wire_bytes(H) bytes, and both policies give the
  same loss and gradients."""
  layer, _ = layer_and_params(make_mesh((1, 4), ("dp", "ep")))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  x = np.random.default_rng(4).normal(size=(4, 6, BASE["hidden_size"])).astype(np.float32)

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(y ** 2) + aux.aux_loss

  def compiled(policy):
    step = jax.jit(jax.value_and_grad(jax.checkpoint(loss, policy=policy)),
                   compiler_options=cpu_compiler_options())
    return step.lower(params, x).compile().as_text(), step(params, x)

  text_saved, saved = compiled(RematConfig(save=("dispatch",)).policy())
  text_nothing, nothing = compiled(jax.checkpoint_policies.nothing_saveable)
  assert hlo.count(text_saved, scope=ROWS) == 1
  assert hlo.count(text_nothing, scope=ROWS) == 2
  row_exchanges = [line for op, name, line in hlo.collectives(text_saved)
                   if op == "all-to-all" and ROWS in name]
  width = fp8.wire_bytes(BASE["hidden_size"])
  assert re.search(rf"u8\[[\d,]*,{width}\]", row_exchanges[0]), row_exchanges[0]
  for got, want in zip(jax.tree.leaves(saved), jax.tree.leaves(nothing)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  # What the policy keeps of the tokens is the FP8 slab (codes and scales,
  # [E, C, W] uint8 over all ranks), not the float32 [E, C, H] slab.
  residuals = [shape for shape, source in saved_residuals(
      jax.checkpoint(loss, policy=RematConfig(save=("dispatch",)).policy()), params, x)
               if not source.startswith("from the argument")]  # parameters and x
  fp8_slabs = [r for r in residuals if r.dtype == jnp.uint8]
  assert len(fp8_slabs) == 1 and fp8_slabs[0].shape[-1] == width, residuals
  assert fp8_slabs[0].shape[0] == BASE["num_experts"], residuals
  slab_rows = fp8_slabs[0].size // width  # E * C
  assert not [r for r in residuals if r.dtype == jnp.float32
              and r.size >= slab_rows * BASE["hidden_size"]], residuals


# --- the CUDA lowering (any machine) and the GPU ---------------------------------


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_cuda_lowering_fuses_quantize_and_dequantize_into_the_row_passes(pretend_cupy,
                                                                         ep_size, named):
  """backend "auto" lowered for CUDA: the forward dispatch moves rows with one
  fused quantize-pack and one fused unpack-dequantize kernel (no plain
  expand_rows), and any row exchange carries uint8. With a checkpoint name
  the receive is a plain expand of the uint8 rows into the FP8 slabs, which
  the unpack-dequantize kernel then dequantizes row for row."""
  tokens, idx, weights = problem(0, ep_size, jnp.bfloat16)
  mesh = make_mesh((ep_size,), ("ep",))
  body = lambda x, i, w: dispatch(
      x, i, w, num_experts=NUM_EXPERTS, expert_capacity=64,
      axis_name="ep" if ep_size > 1 else None, wire_dtype=FP8,
      checkpoint_name="moe.dispatch" if named else None).tokens
  fn = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
  text = jax.jit(fn).trace(tokens, idx, weights).lower(
      lowering_platforms=("cuda",)).as_text(debug_info=True)
  names = re.findall(r'loc\("([^"]*moe_cupy_\w+)/buffer_callback', text)
  kernels = sorted(re.search(r"moe_cupy_\w+$", name).group(0) for name in set(names))
  receive = (["moe_cupy_expand_rows", "moe_cupy_fp8_unpack_dequantize_expand"] if named
             else ["moe_cupy_fp8_unpack_dequantize_expand"])
  assert kernels == sorted(["moe_cupy_fp8_quantize_pack", *receive, "moe_cupy_route",
                            "moe_cupy_slab_layout"])
  exchanges = re.findall(r'"stablehlo.all_to_all"\(.*', text)
  assert len(exchanges) == (2 if ep_size > 1 else 0)  # metadata, rows
  if ep_size > 1:
    assert any(f"x{fp8.wire_bytes(HIDDEN)}xui8>" in line for line in exchanges), exchanges


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["all_to_all", "auto"])  # auto: peer where it runs
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_cupy_fp8_dispatch_equals_pure_jax_bitwise(ep_size, dtype, exchange):
  """On a 1xR GPU mesh: the kernels' slabs, integers and gradients are bit
  for bit the pure-JAX FP8 path's (both on the GPUs)."""
  args = arguments(5, ep_size, dtype)
  got = dispatch_with_grads(ep_size, FP8, "cupy", exchange, devices="cupy")(*args)
  # backend "xla" on the same GPUs: the pure-JAX FP8 path, XLA's all_to_all.
  want = dispatch_with_grads(ep_size, FP8, "xla", "all_to_all", devices="cupy")(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


@pytest.mark.gpu
@pytest.mark.parametrize("ep_size", [1, 2])
def test_cupy_named_fp8_slabs_equal_the_fused_receive_bitwise(ep_size):
  """On the GPUs: the named path (kernel expand of the uint8 rows into FP8
  slabs, XLA's dequantize) gives the fused unpack-dequantize kernel's bits."""
  args = arguments(6, ep_size, jnp.bfloat16)
  fused = dispatch_with_grads(ep_size, FP8, "cupy", "auto", devices="cupy")(*args)
  named = dispatch_with_grads(ep_size, FP8, "cupy", "auto", devices="cupy",
                              checkpoint_name="moe.dispatch")(*args)
  for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(fused)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


# --- the peer path's fused quantize (kernels/peer_dispatch.cu peer_dispatch_fp8_*) ---


def fp8_slabs_fn(mesh, backend: str, exchange: str, capacity: int, send_capacity: int):
  """Per rank: ``(x, idx, weights) -> (FP8 slabs [L, C, W] uint8, filled
  [L, C] bool)``, what the layer's named FP8 dispatch produces and saves (the
  routing, then ``_rows_to_fp8_slabs``) and which of its rows a member fills
  (the others are padding, whose bytes are undefined on the peer path)."""
  from moe_ep.transport import ops, row_paths
  from moe_ep.transport.plan import plan_dispatch

  def per_rank(x, idx, weights):
    plan = plan_dispatch(num_experts=NUM_EXPERTS, ep_size=mesh.shape["ep"],
                         expert_capacity=capacity, send_capacity=send_capacity,
                         top_k=idx.shape[1], hidden=x.shape[-1], row_dtype=x.dtype,
                         axis_name="ep", transport=backend, exchange=exchange, mesh=mesh,
                         wire_dtype=FP8, checkpoint_name="moe.dispatch")
    idx, weights = ops.merge_duplicate_routes(
        ops.valid_ids(idx, NUM_EXPERTS), weights)
    handle = row_paths.routing(plan, idx, weights)[0]
    filled = (handle.slab_row >= 0) & (handle.slab_row < handle.send_token.size)
    return row_paths.rows_to_fp8_slabs(plan, x, handle), filled
  return per_rank


def fp8_slabs_problem(seed: int, ranks: int, steps: int, tokens: int, hidden: int, dtype):
  """``(x [steps, R*T, H], idx, weights)``: per step, rows of magnitudes over
  the dtype's range with a NaN block, an inf block, a zero row, float32
  subnormals, one value far above its block's others and a NaN in the last
  channel (a short last block whose lanes past the row are poisoned too),
  and skewed routes."""
  rng = np.random.default_rng(seed)
  span = 3 if dtype == jnp.float16 else 30  # float16 tops out at 65504
  magnitude = 10.0 ** rng.uniform(-span, span, (steps, ranks * tokens, 1))
  x = (rng.normal(size=(steps, ranks * tokens, hidden)) * magnitude).astype(np.float32)
  x[:, 0, 5] = np.nan
  x[:, 1, 300] = np.inf
  x[:, 2, :] = 0.0
  x[:, 3, 200:260] = 1e-40  # float32 subnormals (narrower dtypes: 0, both paths alike)
  x[:, 4, 0] = 6e4 * 10.0 ** rng.uniform(-span, 0)
  x[:, 4, 1:128] = 1e-3  # its block's others round to e4m3 zero or subnormals
  x[:, 5, hidden - 1] = np.nan
  idx = np.stack([make_routing("skewed", rng, ranks, tokens, TOP_K,
                               NUM_EXPERTS).reshape(-1, TOP_K) for _ in range(steps)])
  weights = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
  return x.astype(dtype), idx, weights


def scanned_fp8_slabs(mesh, backend: str, exchange: str, capacity: int, send_capacity: int,
                      problem):
  """The FP8 slabs of every step of ``problem`` and which rows are filled
  (:func:`fp8_slabs_fn`), one scan over the steps."""
  per_rank = fp8_slabs_fn(mesh, backend, exchange, capacity, send_capacity)
  body = lambda carry, step: (carry, per_rank(*step))
  spec = P(None, "ep")
  return tuple(np.asarray(a) for a in jax.jit(jax.shard_map(
      lambda *xs: jax.lax.scan(body, None, xs)[1], mesh=mesh, in_specs=spec,
      out_specs=spec))(*problem))


@pytest.mark.parametrize("hidden, quantize_in_peer_kernel", [(208, True), (200, False)])
def test_peer_fp8_slabs_lower_to_one_fused_quantizing_callback(monkeypatch, pretend_cupy, hidden,
                                                               quantize_in_peer_kernel):
  """On the peer path (its checks stubbed on CPU devices) lowered for CUDA,
  with H % 16 == 0 the FP8 slabs come out of the one fused row callback
  (uint8 rows of W bytes), with no quantize pass, row pass or all_to_all
  of rows; with H % 16 != 0 a quantize pass feeds the fused byte rows."""
  from moe_ep.transport.peer import reachability
  monkeypatch.setattr(reachability, "unsupported_reason", lambda mesh, axis: None)
  mesh = make_mesh((4,), ("ep",))
  rng = np.random.default_rng(0)
  x = jnp.ones((4 * TOKENS, hidden), jnp.bfloat16)
  idx = make_routing("balanced", rng, 4, TOKENS, TOP_K, NUM_EXPERTS).reshape(-1, TOP_K)
  weights = jnp.ones(idx.shape, jnp.float32)
  fn = jax.shard_map(fp8_slabs_fn(mesh, "auto", "peer", 16, TOKENS), mesh=mesh,
                     in_specs=P("ep"), out_specs=P("ep"))
  text = jax.jit(fn).trace(x, idx, weights).lower(
      lowering_platforms=("cuda",)).as_text(debug_info=True)
  scopes = [name for _, name in custom_call_scopes(text)]
  row_calls = [s for s in scopes if "exchange_rows" in s]
  assert len(row_calls) == 1 and "moe_peer_exchange" in row_calls[0], scopes
  assert not any("expand_rows" in s for s in scopes), scopes
  assert any("fp8_quantize_pack" in s for s in scopes) != quantize_in_peer_kernel, scopes
  slab_rows = (NUM_EXPERTS // 4) * 16  # L * C
  assert re.search(rf"custom_call @\w+\(.*-> tensor<{slab_rows}x{fp8.wire_bytes(hidden)}xui8>",
                   text), "the fused callback returns the FP8 slab rows"
  assert "all_to_all" not in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_peer_fp8_slabs_off_cuda_are_the_all_to_all_bytes(monkeypatch, dtype):
  """On CPU devices the peer path's FP8 dispatch runs its other branch (the
  quantize, XLA's all_to_all, the expand): the same bytes as
  exchange="all_to_all", over 3 scan steps on 4 ranks with drops."""
  from moe_ep.transport.peer import reachability
  monkeypatch.setattr(reachability, "unsupported_reason", lambda mesh, axis: None)
  mesh = make_mesh((4,), ("ep",))
  problem = fp8_slabs_problem(3, 4, 3, 32, 1040, dtype)
  (got, got_filled), (want, want_filled) = (scanned_fp8_slabs(mesh, "xla", exchange, 8, 24, problem)
                                            for exchange in ("peer", "all_to_all"))
  assert got.shape[-1] == fp8.wire_bytes(1040) and (want != 0).any()
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got_filled, want_filled)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, hidden, tokens, grid", [
    (jnp.bfloat16, 1040, 64, None), (jnp.float32, 1040, 64, None),
    (jnp.bfloat16, 4112, 8, None), (jnp.float32, 4112, 8, None),
    (jnp.float16, 7168, 64, (8, 2)), (jnp.bfloat16, 7168, 64, (8, 2))])
def test_peer_quantizing_dispatch_gives_the_pure_jax_fp8_slabs_bitwise(dtype, hidden, tokens,
                                                                       grid):
  """Two GPUs: the FP8 slabs the peer kernel quantizes as it sends (and as
  it places this rank's own rows) are, on every row a member fills, byte for
  byte the pure-JAX quantize's carried by XLA's all_to_all, over 6 scan steps of fresh rows and routes
  (drops: capacity factor 1.0 and a binding send capacity; the rows of
  fp8_slabs_problem). H = 1040: 65 code vectors, the last quantize step and
  scale block short; H = 4112 with 8 tokens: rows split into one-step
  segments; H = 7168 on 8 blocks of which 2 send (``grid``): senders take
  7-step units (a batch of 4, then 3) and own rows 4 + 4 + 4 + 2 steps."""
  from conftest import devices_for
  from moe_ep.transport import peer
  devices = devices_for("cupy", 2)
  mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
  capacity = expert_capacity_for(tokens, TOP_K, NUM_EXPERTS, 2, 1.0)
  send_capacity = max(1, (tokens * 3) // 4)
  problem = fp8_slabs_problem(hidden + tokens, 2, 6, tokens, hidden, dtype)
  if grid is not None:
    peer.configure(row_blocks=grid[0], send_blocks=grid[1])
  try:
    got, got_filled = scanned_fp8_slabs(mesh, "cupy", "peer", capacity, send_capacity, problem)
  finally:
    peer.configure()
  peer.raise_if_failed()
  want, filled = scanned_fp8_slabs(mesh, "xla", "all_to_all", capacity, send_capacity, problem)
  assert got.shape == want.shape and got.shape[-1] == fp8.wire_bytes(hidden)
  np.testing.assert_array_equal(got_filled, filled)
  # the padding rows' bytes are undefined on the peer path (the dequantize
  # zeroes them): compare the rows a member fills
  np.testing.assert_array_equal(got[filled], want[filled])
  assert filled.sum() > 0 and (~filled).sum() > 0  # rows were moved, and padding exists
