"""PNG plots of runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_run(records: list[dict], path, *, loss_floor: float | None = None) -> None:
  """Loss curve and per-expert load over time from metrics records.

  Each record holds ``step``, ``loss``, ``ce_loss`` and ``expert_load
  [num_moe_layers][E]`` (each layer's share of routes per expert).
  """
  steps = np.array([r["step"] for r in records])
  load = np.array([r["expert_load"] for r in records]).mean(axis=1)  # [steps, E]
  num_experts = load.shape[1]
  fig, (loss_ax, load_ax) = plt.subplots(1, 2, figsize=(12, 4.2))
  loss_ax.plot(steps, [r["loss"] for r in records], label="total loss")
  loss_ax.plot(steps, [r["ce_loss"] for r in records], label="cross-entropy", alpha=0.8)
  if loss_floor is not None:
    loss_ax.axhline(loss_floor, color="gray", linestyle="--", label="corpus entropy")
  loss_ax.set(xlabel="step", ylabel="nats / token", title="training loss")
  loss_ax.legend()
  image = load_ax.imshow(load.T, aspect="auto", origin="lower", cmap="viridis",
                         extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_experts - 0.5),
                         interpolation="nearest")
  load_ax.set(xlabel="step", ylabel="expert",
              title=f"share of routes per expert (mean over MoE layers; balanced = "
                    f"{1 / num_experts:.3f})")
  fig.colorbar(image, ax=load_ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_loss_curves(curves: dict[str, tuple[list, list]], path, title: str) -> None:
  """One cross-entropy curve per variant: ``{name: (steps, losses)}``."""
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for name, (steps, losses) in curves.items():
    ax.plot(steps, losses, label=name)
  ax.set(xlabel="step", ylabel="cross-entropy (nats / token)", title=title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
