"""examples/progress.py: the progress bar fits an 80-column terminal whole."""

import io
import re

from rich.console import Console

from tiny_run import REPO  # noqa: F401  (puts the repository on sys.path)
from examples.progress import ProgressReporter, bar_numbers

# Numbers at their widest: five-digit step counts, a two-digit loss, 123M
# tokens/s, an MFU and a dropped fraction over 10%.
WIDE_RECORD = {"step": 99_999, "ce_loss": 12.3456, "loss": 12.4, "tokens_per_s": 123_456_789.0,
               "mfu": 0.4567, "dropped_fraction": 0.1234}


def test_the_bar_fits_80_columns_without_cutting_a_field():
  out = io.StringIO()
  console = Console(file=out, width=80, force_terminal=True, color_system=None)
  with ProgressReporter(total=100_000, start=0, enabled=True, log_every=1,
                        console=console) as reporter:
    reporter.update(WIDE_RECORD)
    reporter.bar.refresh()
  text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
  lines = [line for line in re.split(r"[\r\n]", text) if line.strip()]
  shown = [line for line in lines if "99999/100000" in line]
  assert shown, lines
  for line in shown:
    assert console.measure(line).maximum <= 80 and "\u2026" not in line, line
    assert bar_numbers(WIDE_RECORD) in line and "eta" in line, line


def test_bar_numbers_name_the_cross_entropy_throughput_mfu_and_drops():
  assert bar_numbers(WIDE_RECORD) == "ce 12.346 | 123M tok/s | MFU 45.7% | drop 12.3%"
  assert bar_numbers({**WIDE_RECORD, "mfu": None, "tokens_per_s": 41_200.0}) == (
      "ce 12.346 | 41.2k tok/s | drop 12.3%")
