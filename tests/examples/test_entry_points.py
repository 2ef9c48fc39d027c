"""The example commands set up their devices in main(): importing them
changes no environment (ablate.py and profile_step.py import pretrain for
its functions, not for a side effect)."""

import os
import subprocess
import sys

import pytest

from tiny_run import REPO
from examples import mesh


def test_importing_the_examples_leaves_xla_flags_alone():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  code = ("import os, examples.pretrain, examples.ablate, examples.profile_step; "
          "print(repr(os.environ.get('XLA_FLAGS')))")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=REPO, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == "None"


@pytest.mark.parametrize("env, expected", [
    ({}, "--xla_force_host_platform_device_count=8"),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/x"},
     "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
     "--xla_force_host_platform_device_count=4"),  # moe_ep.launch's per-process count
    ({"JAX_PLATFORMS": "cuda"}, None),  # GPUs asked for: no virtual CPU devices
])
def test_request_cpu_devices_adds_eight_unless_set_or_on_gpus(monkeypatch, env, expected):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  mesh.request_cpu_devices()
  assert os.environ.get("XLA_FLAGS") == expected
