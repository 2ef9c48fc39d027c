"""The headline numbers of a run (``summary.json``): throughput, MFU,
losses, drops and the expert load per EP size, from its per-step records."""

from __future__ import annotations

import statistics

import jax
import numpy as np

from examples import flops
from examples.run_control import is_finite
from examples.train_config import Config

# Records averaged for the summary's final loss (one batch's loss is noisy).
FINAL_LOSS_WINDOW = 10


def device_peak_tflops(config: Config, device) -> float | None:
  """The peak MFU is reported against: ``train.peak_tflops``, else the
  dense bf16 peak of ``device``'s kind (None where unknown, e.g. CPUs)."""
  if config.train.peak_tflops is not None:
    return config.train.peak_tflops
  return flops.device_peak_tflops(device.device_kind)


def peak_rank_load(records: list[dict], num_experts: int) -> dict[str, float]:
  """``{R: load}`` for every EP size ``R > 1`` that divides ``num_experts``:
  the largest share of the routes that one rank's experts (a contiguous
  block of ``E / R``) received in any step and layer, times ``R``. The
  balanced load is 1; with the whole batch in one EP group (dp = 1) it is the
  smallest ``moe.receive_factor`` that would have kept every route of this
  run on the grouped layout (the buffer's alignment rows add headroom)."""
  load = np.asarray([r["expert_load"] for r in records], np.float64)  # [steps, layers, E]
  return {str(ranks): float(load.reshape(*load.shape[:2], ranks, -1).sum(-1).max() * ranks)
          for ranks in range(2, num_experts + 1) if num_experts % ranks == 0}


def summarize(records: list[dict], *, config: Config, mesh, compile_s: float, wall_s: float,
              peak_memory: int, interrupted: bool = False,
              nonfinite_step: int | None = None, previous: list[dict] = ()) -> dict:
  """The run's headline numbers (step times exclude compilation).

  Throughput: ``tokens_per_s`` (global, from the median step),
  ``flops_per_token`` (:func:`examples.flops.training_flops_per_token`),
  ``model_tflops_per_device`` (the model TFLOP/s each device achieves),
  ``peak_tflops`` (:func:`device_peak_tflops`), ``mfu`` (their ratio; None
  where the peak is unknown and ``train.peak_tflops`` unset) and ``device_kind``.
  ``peak_rank_load`` is :func:`peak_rank_load`. The final losses average
  the last finite steps (None: there is none);
  ``skipped_steps`` counts the steps ``train.skip_nonfinite`` skipped and
  ``nonfinite_step`` is the step that stopped the run (None: none did).
  ``eval_loss`` is the newest held-out loss of the run (``previous``: a
  resumed run's earlier records) and ``eval_step`` its step (None: no eval).
  """
  step_times = [r["step_time_s"] for r in records[1:]] or [r["step_time_s"] for r in records]
  median_step = statistics.median(step_times)
  last = [r for r in records if is_finite(r)][-FINAL_LOSS_WINDOW:]
  evals = [r for r in [*previous, *records] if r.get("eval_loss") is not None]
  tokens_per_s = config.train.batch_size * config.train.seq_len / median_step
  flops_per_token = flops.training_flops_per_token(config)
  device = mesh.devices.flat[0]
  peak = device_peak_tflops(config, device)
  return {
      "steps": records[-1]["step"],
      "steps_this_run": len(records),
      "interrupted": interrupted,
      "nonfinite_step": nonfinite_step,
      "skipped_steps": sum(r.get("skipped", False) for r in records),
      "final_loss": statistics.fmean(r["ce_loss"] for r in last) if last else None,
      "final_total_loss": statistics.fmean(r["loss"] for r in last) if last else None,
      "eval_loss": evals[-1]["eval_loss"] if evals else None,
      "eval_step": evals[-1]["step"] if evals else None,
      "dropped_fraction": statistics.fmean(r["dropped_fraction"] for r in records),
      "peak_rank_load": peak_rank_load(records, config.moe.num_experts),
      "median_step_s": median_step,
      "tokens_per_s": tokens_per_s,
      "flops_per_token": flops_per_token,
      "model_tflops_per_device": tokens_per_s / mesh.size * flops_per_token / 1e12,
      "mfu": flops.mfu(tokens_per_s / mesh.size, flops_per_token, peak),
      "peak_tflops": peak,
      "device_kind": device.device_kind,
      "compile_s": compile_s,
      "wall_s": wall_s,
      "peak_memory_bytes": peak_memory,
      "mesh": dict(mesh.shape),
      "processes": jax.process_count(),
      "backend": jax.default_backend(),
  }

