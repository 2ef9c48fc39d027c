"""examples/plots.py: metrics.png's panels hold the records' numbers (its
data is checked through the figure's lines, not its pixels)."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from tiny_run import REPO  # noqa: F401  (puts the repository on sys.path)
from examples import plots

STEPS = 12


def records(eval_every=4):
  rng = np.random.default_rng(0)
  out = []
  for step in range(1, STEPS + 1):
    ce = 4.0 - 0.1 * step
    out.append({"step": step, "ce_loss": ce, "loss": ce + 1e-3, "aux_loss": 1e-3 * step,
                "dropped_fraction": 0.01 * step, "learning_rate": 1e-3 * step,
                "grad_norm": float(rng.random()), "tokens_per_s": 1000.0 + step,
                "expert_load": rng.dirichlet(np.ones(8), size=2).tolist()})
    if eval_every and step % eval_every == 0:
      out[-1]["eval_loss"] = ce + 0.2
  return out


def line_data(ax):
  return [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
          for line in ax.get_lines()]


def test_every_panel_plots_its_key_of_every_record():
  runs = records()
  fig, axes = plots.run_figure(runs, loss_floor=1.0)
  try:
    steps = list(range(1, STEPS + 1))
    for key, _, _ in plots.SCALAR_PANELS:
      (_, xs, ys), = line_data(axes[key])
      have = [r for r in runs if key in r]
      assert xs == [r["step"] for r in have] and ys == [r[key] for r in have], key
    assert [x for _, x, _ in line_data(axes["eval_loss"])] == [[4, 8, 12]]
    assert axes["expert_load"].images[0].get_array().shape == (8, STEPS)
    np.testing.assert_allclose(axes["expert_load"].images[0].get_array(),
                               np.array([r["expert_load"] for r in runs]).mean(1).T)
    loss_lines = {label: (xs, ys) for label, xs, ys in line_data(axes["loss"])}
    assert loss_lines["cross-entropy"] == (steps, [r["ce_loss"] for r in runs])
    assert loss_lines["total (with aux losses)"] == (steps, [r["loss"] for r in runs])
    assert loss_lines["held-out"] == ([4, 8, 12], [r["eval_loss"] for r in runs[3::4]])
  finally:
    plt.close(fig)


def test_the_total_loss_is_drawn_over_the_cross_entropy_in_another_style():
  # Where the aux losses are small the two curves coincide: the total goes
  # on top, dashed and narrower, so both stay visible.
  fig, axes = plots.run_figure(records())
  try:
    by_label = {line.get_label(): (z, line) for z, line in enumerate(axes["loss"].get_lines())}
    (ce_order, ce), (total_order, total) = by_label["cross-entropy"], by_label[
        "total (with aux losses)"]
    assert total_order > ce_order and total.get_zorder() >= ce.get_zorder()
    assert total.get_linestyle() == "--" and ce.get_linestyle() == "-"
    assert total.get_linewidth() < ce.get_linewidth()
  finally:
    plt.close(fig)


@pytest.mark.parametrize("eval_every", [0])
def test_a_run_without_eval_or_older_records_still_plots(tmp_path, eval_every):
  old = [{k: v for k, v in r.items() if k not in ("learning_rate", "aux_loss")}
         for r in records(eval_every)]
  plots.plot_run(old, tmp_path / "metrics.png")
  assert (tmp_path / "metrics.png").stat().st_size > 0
  fig, axes = plots.run_figure(old)
  try:
    assert not axes["learning_rate"].get_lines() and not axes["eval_loss"].get_lines()
  finally:
    plt.close(fig)
