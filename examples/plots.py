"""PNG plots of runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


# (key, title, y label) of the one-line panels of run_figure after the loss panel.
SCALAR_PANELS = (
    ("eval_loss", "held-out loss", "cross-entropy (nats / token)"),
    ("dropped_fraction", "dropped routes", "fraction"),
    ("learning_rate", "learning rate", "rate"),
    ("grad_norm", "gradient norm (before clipping)", "global L2 norm"),
    ("tokens_per_s", "throughput", "tokens / s"),
    ("aux_loss", "load-balancing loss (summed over MoE layers)", "loss"),
)


def run_figure(records: list[dict], *, loss_floor: float | None = None):
  """The figure of :func:`plot_run`: ``(figure, {panel name: axes})``.

  Panels: ``"loss"`` (total and cross-entropy: the total dashed on top, so
  both show where the auxiliary losses are small, with the held-out loss as
  points where there is one), one per :data:`SCALAR_PANELS` key (a record
  without the key leaves it out of that line; ``eval_loss`` is plotted at
  the steps that have one) and ``"expert_load"``.
  """
  steps = np.array([r["step"] for r in records])
  load = np.array([r["expert_load"] for r in records]).mean(axis=1)  # [steps, E]
  num_experts = load.shape[1]
  fig, grid = plt.subplots(2, 4, figsize=(20, 8))
  axes = dict(zip(["loss", *(key for key, _, _ in SCALAR_PANELS), "expert_load"], grid.flat))
  loss_ax = axes["loss"]
  loss_ax.plot(steps, [r["ce_loss"] for r in records], label="cross-entropy", linewidth=2.5,
               alpha=0.6)
  loss_ax.plot(steps, [r["loss"] for r in records], label="total (with aux losses)",
               linestyle="--", linewidth=1.2, color="black")
  evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
  if evals:
    loss_ax.plot(*zip(*evals), "o", color="tab:red", label="held-out")
  if loss_floor is not None:
    loss_ax.axhline(loss_floor, color="gray", linestyle=":", label="corpus entropy")
  loss_ax.set(xlabel="step", ylabel="nats / token", title="training loss")
  loss_ax.legend()
  for key, title, ylabel in SCALAR_PANELS:
    ax = axes[key]
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
      ax.plot(*zip(*points), "o-" if key == "eval_loss" else "-")
    else:
      ax.text(0.5, 0.5, "not recorded" if key != "eval_loss" else "no eval (train.eval_every)",
              ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
  load_ax = axes["expert_load"]
  image = load_ax.imshow(load.T, aspect="auto", origin="lower", cmap="viridis",
                         extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_experts - 0.5),
                         interpolation="nearest")
  load_ax.set(xlabel="step", ylabel="expert",
              title=f"share of routes per expert\n(mean over MoE layers; balanced = "
                    f"{1 / num_experts:.3f})")
  fig.colorbar(image, ax=load_ax)
  fig.tight_layout()
  return fig, axes


def plot_run(records: list[dict], path, *, loss_floor: float | None = None) -> None:
  """Writes :func:`run_figure` of metrics records to ``path`` (a PNG).

  Each record holds ``step``, ``loss``, ``ce_loss``, ``expert_load
  [num_moe_layers][E]`` (each layer's share of routes per expert) and,
  where recorded, the :data:`SCALAR_PANELS` keys.
  """
  fig, _ = run_figure(records, loss_floor=loss_floor)
  fig.savefig(path, dpi=90)
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
