"""The README's "Using the layer" example runs as printed (8 CPU devices)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import background

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]


def readme_block(section: str) -> str:
  text = (REPO / "README.md").read_text()
  body = text[text.index(f"## {section}"):]
  return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def run_using_the_layer():
  # conftest's XLA_FLAGS: 8 CPU devices (and its compile settings).
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", readme_block("Using the layer")], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)


def background_jobs(item) -> dict:
  return {"readme": run_using_the_layer}


def test_using_the_layer_example_trains_and_prints_a_finite_loss():
  result = background.result("readme", run_using_the_layer)
  assert result.returncode == 0, result.stderr[-3000:]
  loss, dropped = result.stdout.split()[:2]
  assert 0 < float(loss) < 10 and float(dropped) == 0.0, result.stdout
