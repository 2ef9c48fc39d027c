"""The example commands set up their devices in main(): importing them
changes no environment (ablate.py and profile_step.py import pretrain for
its functions, not for a side effect)."""

import os
import pathlib
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



# Every command of examples/ (a module with a __main__ block): a new one is
# held to the script form by being found here.
COMMANDS = sorted(p.stem for p in (REPO / "examples").glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def test_the_commands_found_include_the_four_known():
  assert {"pretrain", "ablate", "tokenize_text", "profile_step"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_runs_as_a_file_from_any_folder(command, tmp_path):
  """``python examples/NAME.py`` as other projects' READMEs write it, not
  only ``python -m examples.NAME`` from the root."""
  done = subprocess.run([sys.executable, str(REPO / "examples" / f"{command}.py"), "--help"],
                        capture_output=True, text=True, cwd=tmp_path, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith(f"usage: {command}.py")


def test_a_command_run_as_a_file_imports_this_checkouts_packages(tmp_path):
  """The examples folder at the head of sys.path (where Python puts a file's
  folder) gives way to the checkout, whose moe_ep comes before any installed
  one, and examples/data.py no longer shadows a top-level ``data``."""
  code = ("import importlib.util, sys; sys.path[0] = sys.argv[1]; import script_form; "
          "script_form.checkout_first(); import examples, moe_ep; "
          "print(examples.__file__, moe_ep.__file__, importlib.util.find_spec('data'))")
  done = subprocess.run([sys.executable, "-c", code, str(REPO / "examples")],
                        capture_output=True, text=True, cwd=tmp_path, timeout=120)
  assert done.returncode == 0, done.stderr
  examples_file, moe_ep_file, data_spec = done.stdout.split()
  assert pathlib.Path(examples_file) == REPO / "examples" / "__init__.py"
  assert pathlib.Path(moe_ep_file) == REPO / "moe_ep" / "__init__.py"
  assert data_spec == "None"
