"""Model FLOPs per token, device peaks and MFU, counted the standard way.

Training FLOPs per token are 3 x the forward pass's (the backward pass does
two matmuls per forward one, one for the input gradient and one for the
weight gradient):

    6 * N_active + 3 * A

as PaLM (Chowdhery et al. 2022, arXiv:2204.02311, appendix B: ``6N + 12LHQT``)
and MaxText (``calculate_tflops_training_per_device`` in
``src/maxtext/utils/maxtext_utils.py``) count them:

- ``N_active`` (:func:`matmul_params_per_token`): the weights a token is
  multiplied by: attention qkv and output projections, dense SwiGLU MLPs,
  the MoE router, the ``top_k`` routed experts' input (gate and up for
  gated activations) and output matrices, shared experts, and the
  unembedding. The embedding lookup is a gather, not a matmul: not counted.
  Experts count ``top_k`` per token whatever the capacity factor: the padding
  rows of the capacity slabs are compute the model does not need.
- ``A`` (:func:`attention_flops_per_token`): the forward FLOPs of the scores
  ``Q K^T`` and the weighted values ``P V``: ``2 * 2 * S * D`` per token and
  layer for ``S`` keys and ``D = heads * head_dim``, halved for the causal
  mask. MaxText halves since 2025 (following Megatron-LM and NeMo) because
  flash attention skips the masked upper triangle; PaLM's ``12LHQT`` does not
  halve. Halving is the convention that compares with published MaxText and
  Megatron MFU figures (and does not credit the XLA path's masked-out
  half as useful work). ``S**2 / 2``, as MaxText, not the exact ``S(S+1)/2``.

Nothing else counts: no remat recompute, no norms, softmax or other
elementwise work, no optimizer.

MFU = tokens/s per device x FLOPs per token / the device's dense bf16 peak
(:data:`PEAK_BF16_TFLOPS`), whatever dtype the model computes in, as MaxText
and Megatron report it.
"""

from __future__ import annotations

from examples.train_config import Config

# Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, matched in
# order against jax.devices()[0].device_kind (case-insensitive substrings;
# the more specific names first). From NVIDIA's datasheets, which quote the
# sparse figure (twice these) with "1/2 lower without sparsity":
# H100 SXM 1,979 (Hopper whitepaper, dense: 989.4), H100 PCIe 1,513, H100 NVL
# and H200 NVL 1,671; H200 SXM and GH200 have the H100 SXM's compute;
# A100 (SXM and PCIe) 312 dense; L40S 362.05 dense (733 sparse);
# HGX B200 4.5 PFLOPS sparse per GPU at 1,000 W, GB200 5 PFLOPS at 1,200 W.
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H100", 989.4),
    ("H200", 989.4),  # also GH200
    ("A100", 312.0),
    ("L40S", 362.05),
)


def device_peak_tflops(device_kind: str) -> float | None:
  """The dense bf16 peak of a ``jax.Device.device_kind``, None where unknown
  (CPUs, GPUs missing from :data:`PEAK_BF16_TFLOPS`).

  >>> device_peak_tflops("NVIDIA H200"), device_peak_tflops("NVIDIA H100 PCIe")
  (989.4, 756.0)
  >>> device_peak_tflops("cpu") is None
  True
  """
  kind = device_kind.lower()
  for name, peak in PEAK_BF16_TFLOPS:
    if name.lower() in kind:
      return peak
  return None


def matmul_params_per_token(config: Config) -> dict[str, int]:
  """Weights each token is multiplied by in one forward pass, by kind:
  ``attention``, ``dense_mlp``, ``router``, ``experts`` (``top_k`` of them),
  ``shared_experts``, ``unembed``. Their sum is ``N_active``.

  >>> from examples.train_config import load_config
  >>> matmul_params_per_token(load_config())["experts"]  # tiny.yaml: 2 x top-2 x 3 x 64 x 128
  98304
  """
  model, moe = config.model, config.moe
  width, moe_layers = model.d_model, model.num_moe_layers
  expert_matrices = (moe.num_input_projections + 1) * width * moe.ffn_size  # gate, up, down
  return {
      "attention": model.num_layers * 4 * width * width,  # qkv [D, 3D] and out [D, D]
      "dense_mlp": (model.num_layers - moe_layers) * 3 * width * model.mlp_size,
      "router": moe_layers * width * moe.num_experts,
      "experts": moe_layers * moe.top_k * expert_matrices,
      "shared_experts": (moe_layers * (moe.num_input_projections + 1) * width * moe.shared_width
                         + moe_layers * width * moe.shared_expert_gate),
      "unembed": width * model.vocab_size,
  }


def attention_flops_per_token(config: Config, *, causal: bool = True) -> float:
  """Forward FLOPs per token of attention's ``Q K^T`` and ``P V`` over all
  layers: ``num_layers * 4 * seq_len * d_model``, halved when ``causal``."""
  model = config.model
  full = model.num_layers * 4 * config.train.seq_len * model.d_model
  return full / 2 if causal else float(full)


def training_flops_per_token(config: Config) -> float:
  """Model FLOPs of one training step per token: ``6 * N_active + 3 * A``
  (forward and backward, causal attention halved, no remat recompute)."""
  return (6 * sum(matmul_params_per_token(config).values())
          + 3 * attention_flops_per_token(config))


def mfu(tokens_per_s_per_device: float, flops_per_token: float,
        peak_tflops: float | None) -> float | None:
  """Model FLOPs utilisation: the share of ``peak_tflops`` (TFLOP/s per
  device) that ``tokens_per_s_per_device`` tokens of ``flops_per_token``
  model FLOPs each use; None where the peak is unknown.

  >>> mfu(50_000, 6e9, 1000.0)
  0.3
  """
  if peak_tflops is None:
    return None
  return tokens_per_s_per_device * flops_per_token / (peak_tflops * 1e12)


def format_mfu(value: float) -> str:
  """``0.482`` -> ``"48.2%"``; below 1% two significant digits, so a tiny
  model on a big GPU does not read as zero: ``0.000253`` -> ``"0.025%"``."""
  return f"{value:.1%}" if value >= 0.01 else f"{100 * value:.2g}%"
