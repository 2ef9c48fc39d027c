"""moe_ep.transport.peer.settings: the environment variables behind the
peer exchanges' settings, each empty, blank, set and malformed, and the
explicit setting winning over each."""

import pytest

from moe_ep.transport.peer.settings import (DEFAULT_TIMEOUT_S, DISPATCH_LAYOUT_ENV, MAX_TIMEOUT_S,
                                            TIMEOUT_ENV, Settings)


@pytest.mark.parametrize("env, want", [
    (None, DEFAULT_TIMEOUT_S), ("", DEFAULT_TIMEOUT_S), ("  ", DEFAULT_TIMEOUT_S),
    ("2.5", 2.5), (" 7 ", 7.0), (str(MAX_TIMEOUT_S), MAX_TIMEOUT_S),
    ("soon", "must be a number of seconds"), ("0", r"must be in \(0, 86400\]"),
    ("-3", r"must be in \(0, 86400\]"), ("nan", r"must be in \(0, 86400\]"),
    (str(MAX_TIMEOUT_S + 1), r"must be in \(0, 86400\]"),
])
def test_timeout_variable_empty_set_or_malformed(monkeypatch, env, want):
  if env is None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
  else:
    monkeypatch.setenv(TIMEOUT_ENV, env)
  assert Settings(timeout_s=4.0).wait_bound_s() == 4.0  # the explicit setting wins
  if isinstance(want, str):
    with pytest.raises(ValueError, match=rf"^{TIMEOUT_ENV}={env!r} {want}"):
      Settings().wait_bound_s()
  else:
    assert Settings().wait_bound_s() == want


@pytest.mark.parametrize("env, want", [
    (None, False), ("", False), (" ", False), ("0", False), ("1", True), (" 1\n", True),
    ("yes", False), ("true", False),  # only "1" turns it on
])
def test_dispatch_layout_variable_empty_set_or_malformed(monkeypatch, env, want):
  if env is None:
    monkeypatch.delenv(DISPATCH_LAYOUT_ENV, raising=False)
  else:
    monkeypatch.setenv(DISPATCH_LAYOUT_ENV, env)
  assert Settings().dispatch_layout_on() is want
  for explicit in (True, False):
    assert Settings(dispatch_layout=explicit).dispatch_layout_on() is explicit
