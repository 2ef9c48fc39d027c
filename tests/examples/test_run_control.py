"""examples/run_control.py (one process): SIGINT and SIGTERM ask the loop to
stop after the step in progress, a second Ctrl-C interrupts at once, the
handlers are restored; a step is finite only if all its guarded metrics are.
(Several processes: tests/multiprocess/test_pretrain_signals.py.)"""

import signal

import pytest

import tiny_run  # noqa: F401  (puts the repository on sys.path)
from examples.run_control import FINITE_METRICS, SIGNAL_EXIT_CODES, StopRequests, is_finite


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_stops_after_the_step_and_the_handlers_are_restored(signum):
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  with StopRequests() as requests:
    assert requests.stop_after(1) is None
    signal.raise_signal(signum)
    assert requests.stop_after(2) == signal.Signals(signum).name
  assert {s: signal.getsignal(s) for s in before} == before
  assert SIGNAL_EXIT_CODES[signal.Signals(signum).name] == 128 + signum


def test_a_second_ctrl_c_interrupts_at_once():
  with StopRequests():
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("metric", FINITE_METRICS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_step_is_finite_only_if_every_guarded_metric_is(metric, value):
  record = {"loss": 2.0, "grad_norm": 0.5, "param_norm": 40.0, "ce_loss": float("nan")}
  assert is_finite(record)  # ce_loss is not guarded: loss holds it
  assert not is_finite({**record, metric: value})
