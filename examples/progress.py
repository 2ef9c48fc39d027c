"""Training progress on the console: a rich progress bar on a terminal, a
plain line every ``log_every`` steps otherwise (logs, CI, launched jobs)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from examples import flops


def progress_line(record: dict) -> str:
  """``loss 2.314 | ce 2.301 | 41,200 tok/s | MFU 38.2% | dropped 1.2%`` from a
  metrics record (the MFU where the record has one: a known device peak)."""
  mfu = (f"MFU {flops.format_mfu(record['mfu'])} | " if record.get("mfu") is not None
         else "")
  return (f"loss {record['loss']:.3f} | ce {record['ce_loss']:.3f} | "
          f"{record['tokens_per_s']:,.0f} tok/s | {mfu}dropped {record['dropped_fraction']:.1%}")


def _short(value: float) -> str:
  """``41200`` -> ``"41.2k"``: three significant digits."""
  for exponent, suffix in ((9, "G"), (6, "M"), (3, "k")):
    if value >= 10**exponent:
      return f"{value / 10**exponent:.3g}{suffix}"
  return f"{value:.3g}"


def bar_numbers(record: dict) -> str:
  """The progress bar's numbers, short enough that the bar fits 80 columns:
  ``ce 2.301 | 41.2k tok/s | MFU 38.2% | drop 1.2%``."""
  mfu = (f" | MFU {flops.format_mfu(record['mfu'])}" if record.get("mfu") is not None else "")
  return (f"ce {record['ce_loss']:.3f} | {_short(record['tokens_per_s'])} tok/s{mfu} | "
          f"drop {record['dropped_fraction']:.1%}")


class ProgressReporter:
  """Context manager showing steps ``start..total`` with each record's numbers.

  Args:
    total: the step count the run ends at.
    start: the step count it starts from (a resumed run starts mid-way).
    enabled: False for silence (tests, processes other than 0).
    log_every: plain-line period when the console is not a terminal.
    header: printed once when the run starts (None: nothing).
    console: where the bar goes (None: rich's console on stdout).
  """

  def __init__(self, *, total: int, start: int, enabled: bool, log_every: int,
               header: str | None = None, console: Console | None = None):
    self.total, self.start, self.enabled = total, start, enabled
    self.log_every, self.header = log_every, header
    self.console = console or Console()
    self.bar = None
    self.started = time.perf_counter()

  def __enter__(self):
    if not self.enabled:
      return self
    if self.header is not None:
      print(self.header, flush=True)
    self.started = time.perf_counter()
    if self.console.is_terminal:
      # 80 columns at the widest (six-digit steps, MFU, two-digit losses):
      # "99999/100000 ━━━━━━ ce 12.346 | 123M tok/s | MFU 45.7% | drop 12.3% eta 12:34".
      self.bar = Progress(MofNCompleteColumn(), BarColumn(bar_width=6),
                          TextColumn("{task.fields[numbers]}"), TextColumn("eta"),
                          TimeRemainingColumn(compact=True), console=self.console)
      self.bar.start()
      self.task = self.bar.add_task("train", total=self.total, completed=self.start,
                                    numbers="compiled, first step...")
    return self

  def update(self, record: dict) -> None:
    if not self.enabled:
      return
    step = record["step"]
    if self.bar is not None:
      self.bar.update(self.task, completed=step, numbers=bar_numbers(record))
    elif step % self.log_every == 0 or step == self.total:
      elapsed = time.perf_counter() - self.started
      print(f"step {step}/{self.total} | {progress_line(record)} | {elapsed:.0f}s", flush=True)

  def note(self, line: str) -> None:
    """Prints ``line`` above the bar (or as a plain line)."""
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.console.print(line, highlight=False, soft_wrap=True)
    else:
      print(line, flush=True)

  def __exit__(self, *exc):
    if self.bar is not None:
      self.bar.stop()
    return False
