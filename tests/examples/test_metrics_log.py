"""examples/metrics_log.py's optional TensorBoard writer: off when not asked
for, and one line saying how to get it when tensorboardX is missing."""

import sys

from tiny_run import REPO  # noqa: F401  (puts the repository on sys.path)
from examples.metrics_log import tensorboard_writer


def test_without_tensorboardx_the_run_gets_one_note_naming_the_fix(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
  writer, note = tensorboard_writer(tmp_path, True)
  assert writer is None
  assert note == ("note: no TensorBoard events: tensorboardX is not installed "
                  "(pip install tensorboardX, or train.tensorboard=false to silence this)")
  assert list(tmp_path.iterdir()) == []


def test_not_asked_for_means_no_writer_and_no_note(tmp_path):
  assert tensorboard_writer(tmp_path, False) == (None, None)
  assert list(tmp_path.iterdir()) == []
