"""examples/flops.py: the formula's matmul parameters are the built model's,
its forward FLOPs are the traced program's matmul FLOPs and the gradient does
exactly twice the forward's again, the remat policies recompute what they
say, the H200 config is what its header states, the peak table and MFU.

The reference counts read the model: its ``nnx.Param`` arrays, and the
``dot_general`` equations of the traced jaxpr (XLA's ``cost_analysis`` is no
reference here: it counts a scanned layer's body once, not once per layer).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.extend import core

from tiny_run import REPO, TINY_YAML
from examples import flops
from examples.model import TransformerLM
from examples.train_program import make_mesh, make_setup, parameter_count
from examples.train_config import load_config

BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
VARIANTS = {
    "tiny": [],
    "dense blocks between": ["model.moe_every=2", "model.num_layers=4"],
    "shared expert, gelu, top-3": ["moe.num_shared_experts=1", "moe.activation=gelu",
                                   "moe.top_k=3"],
    "python loop": ["model.scan_layers=false"],
}


def tiny(*overrides):
  """tiny.yaml at ``[BATCH, SEQ]``, without the layer's own remat, with
  expert slabs of exactly ``TOKENS * top_k / num_experts`` rows: the expert
  GEMMs then do exactly the ``top_k`` routes per token the formula counts
  (a capacity factor's padding rows are work the formula leaves out)."""
  config = load_config(TINY_YAML, [f"train.batch_size={BATCH}", f"train.seq_len={SEQ}",
                                   "moe.remat.apply=false", *overrides])
  moe = config.moe
  return dataclasses.replace(config, moe=dataclasses.replace(
      moe, expert_capacity=TOKENS * moe.top_k // moe.num_experts))


def build(config):
  """``(graphdef, state, mesh)`` of the model on one device (no exchange)."""
  mesh = make_mesh(config, jax.devices()[:1])
  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(TransformerLM(config, rngs=nnx.Rngs(0)))
  return graphdef, state, mesh


def dot_flops(jaxpr) -> int:
  """``2 * M * N * K`` summed over the ``dot_general`` equations of ``jaxpr``
  and every jaxpr nested in it (a scan's body times its length)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += (2 * math.prod(eqn.outvars[0].aval.shape)
                * math.prod(lhs[axis] for axis in contracting))
    if eqn.primitive.name == "while":
      raise NotImplementedError("a while loop's trip count is not static")
    repeats = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
        if isinstance(sub, core.Jaxpr):
          total += repeats * dot_flops(sub)
  return total


def program_dot_flops(config, *, gradient: bool) -> int:
  """Matmul FLOPs of the traced forward pass (or of the cross-entropy's
  gradient with respect to every parameter) on ``[BATCH, SEQ]`` tokens."""
  graphdef, state, mesh = build(config)
  tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)

  def loss(state, tokens):
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens[:, :-1])

  function = jax.grad(loss, allow_int=True) if gradient else forward
  with jax.set_mesh(mesh):
    return dot_flops(jax.make_jaxpr(function)(state, tokens).jaxpr)


def forward_flops(config) -> float:
  """The formula's forward matmul FLOPs of ``TOKENS`` tokens, attention
  uncausal: the XLA path computes every score and masks half."""
  params = sum(flops.matmul_params_per_token(config).values())
  return TOKENS * (2 * params + flops.attention_flops_per_token(config, causal=False))


# Which kind of matmul weight a parameter is, by the module that owns it.
OWNER_KINDS = {"qkv": "attention", "out": "attention", "router": "router",
               "shared_w_in": "shared_experts", "shared_w_out": "shared_experts",
               "unembed": "unembed", "embedding": None, "scale": None}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_matmul_params_per_token_are_the_built_models_parameters(overrides):
  config = tiny(*overrides)
  _, state, _ = build(config)
  counted = dict.fromkeys(flops.matmul_params_per_token(config), 0)
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.filter_state(state, nnx.Param)):
    names = [key.key for key in path if isinstance(getattr(key, "key", None), str)]
    owner = names[-2] if names[-1] == "kernel" else names[-1]
    if owner in ("w_in", "w_out"):
      kind = "experts" if "moe" in names else "dense_mlp"
    else:
      kind = OWNER_KINDS[owner]  # a KeyError: a parameter this test does not know
    if kind == "experts":  # a token uses top_k of the num_experts experts
      counted[kind] += leaf.size * config.moe.top_k // config.moe.num_experts
    elif kind is not None:
      counted[kind] += leaf.size
  assert flops.matmul_params_per_token(config) == counted


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_forward_flops_are_the_traced_programs_matmul_flops(overrides):
  config = tiny(*overrides)
  assert program_dot_flops(config, gradient=False) == forward_flops(config)


# (model overrides, the matmul FLOPs the backward pass recomputes).
REMAT_CASES = {
    "no remat": ([], lambda config, per: 0),
    # The blocks recompute all their matmuls; the unembedding is outside them.
    "full": (["model.remat_blocks=true", "model.remat_policy=full"],
             lambda config, per: forward_flops(config) - 2 * TOKENS * per["unembed"]),
    # Saving the dispatched rows spares the exchange, not a matmul.
    "moe": (["model.remat_blocks=true", "model.remat_policy=moe"],
            lambda config, per: forward_flops(config) - 2 * TOKENS * per["unembed"]),
    # Matmuls without batch dimensions are saved; attention's scores and
    # values and the expert GEMMs (batched over experts) recompute.
    "save_dots": (["model.remat_blocks=true", "model.remat_policy=save_dots"],
                  lambda config, per: TOKENS * (
                      flops.attention_flops_per_token(config, causal=False)
                      + 2 * per["experts"])),
    # XLA's attention has no fused forward to save: as save_dots.
    "save_dots_attention": (["model.remat_blocks=true", "model.remat_policy=save_dots_attention"],
                            lambda config, per: TOKENS * (
                                flops.attention_flops_per_token(config, causal=False)
                                + 2 * per["experts"])),
}


@pytest.mark.parametrize("overrides, recomputed", REMAT_CASES.values(), ids=REMAT_CASES.keys())
def test_gradient_does_twice_the_forward_matmuls_plus_what_remat_recomputes(overrides,
                                                                             recomputed):
  # 6 N + 3 A: each forward matmul has two backward ones of its size.
  config = tiny(*overrides)
  per = flops.matmul_params_per_token(config)
  assert (program_dot_flops(config, gradient=True)
          == 3 * forward_flops(config) + recomputed(config, per))


def test_training_flops_are_six_per_active_parameter_plus_causal_attention():
  config = tiny()
  params = sum(flops.matmul_params_per_token(config).values())
  attention = flops.attention_flops_per_token(config, causal=False)
  assert flops.attention_flops_per_token(config) == attention / 2
  assert flops.training_flops_per_token(config) == 6 * params + 3 * attention / 2


def test_h200_config_builds_with_the_sizes_its_header_states():
  config = load_config(REPO / "configs" / "h200.yaml")
  setup = make_setup(config, make_mesh(config, jax.devices()[:1]))  # abstract: no memory
  active = sum(flops.matmul_params_per_token(config).values())
  assert round(parameter_count(setup.abstract_state) / 1e9, 2) == 2.75
  assert round(active / 1e9, 2) == 0.87
  assert round(flops.training_flops_per_token(config) / 1e9, 2) == 5.84
  assert config.train.batch_size * config.train.seq_len == 32768
  assert config.moe.num_experts % 8 == 0 and config.model.attention == "cudnn"


def test_cudnn_attention_off_gpu_fails_when_traced_naming_the_field():
  if jax.default_backend() == "gpu":
    pytest.skip("cuDNN attention runs here")
  config = tiny("model.attention=cudnn", "model.dtype=bfloat16")
  graphdef, state, mesh = build(config)  # building needs no GPU (h200.yaml on CPU)
  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match=r"ModelConfig.attention='cudnn' needs a CUDA GPU.*'cpu'"):
    jax.eval_shape(lambda state: nnx.merge(graphdef, state)(jnp.zeros((BATCH, SEQ), jnp.int32)),
                   state)


@pytest.mark.parametrize("device_kind, peak", [
    ("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.5), ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L40S", 362.05), ("NVIDIA B200", 2250.0),
    ("NVIDIA GB200", 2500.0), ("cpu", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_table_matches_device_kinds_most_specific_first(device_kind, peak):
  assert flops.device_peak_tflops(device_kind) == peak


def test_mfu_is_model_flops_per_second_over_the_peak():
  # 40,000 tokens/s of 5 GFLOP each = 200 TFLOP/s, a fifth of a 1000 TFLOP/s peak.
  assert flops.mfu(40_000, 5e9, 1000.0) == pytest.approx(0.2)
  assert flops.mfu(40_000, 5e9, None) is None


def test_mfu_prints_one_decimal_and_small_values_by_two_digits():
  assert flops.format_mfu(0.4823) == "48.2%"
  assert flops.format_mfu(0.0100) == "1.0%"
  assert flops.format_mfu(0.000253) == "0.025%"  # not "0.0%" for a tiny model on an H200
