"""The kernels are found in a source checkout and in an installed wheel."""

import importlib.metadata
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from moe_ep.transport import kernel_source

REPO = pathlib.Path(__file__).resolve().parents[2]
# What the wheel is built from: pyproject.toml names README.md, the packages
# and the kernels' folder.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "moe_ep", "kernels")


def test_source_checkout_finds_kernels_with_line_directives():
  assert kernel_source.kernel_dir() == REPO / "kernels"
  text = kernel_source.source("rows.cu")
  assert f'#line 1 "{REPO / "kernels" / "rows.cu"}"' in text
  assert '#include "common.cuh"' in text and "expand_rows_v16" in text
  assert f"-I{REPO / 'kernels'}" in kernel_source.compile_options()


def test_every_include_names_a_shipped_header_and_every_header_is_guarded():
  folder = kernel_source.kernel_dir()
  headers = {path.name for path in folder.glob("*.cuh")}
  for path in sorted(folder.glob("*.cu*")):
    included = re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)
    assert set(included) <= headers, (path.name, set(included) - headers)
    if path.suffix == ".cu":
      assert included and included[0] == kernel_source.COMMON_HEADER, path.name
  for name in headers:
    guard = "MOE_EP_" + name.replace(".", "_").upper()
    assert f"#ifndef {guard}\n#define {guard}\n" in (folder / name).read_text(), name


def test_a_changed_header_changes_the_source_text(tmp_path, monkeypatch):
  """CuPy caches compiled modules by their source text: a header edit must
  change every kernel file's text."""
  for path in kernel_source.kernel_dir().iterdir():
    if path.suffix in (".cu", ".cuh"):
      (tmp_path / path.name).write_text(path.read_text())
  monkeypatch.setattr(kernel_source, "kernel_dir", lambda: tmp_path)
  before = {name: kernel_source.source(name) for name in kernel_source.KERNEL_FILES}
  (tmp_path / "peer_rows.cuh").write_text((tmp_path / "peer_rows.cuh").read_text() + "\n")
  after = {name: kernel_source.source(name) for name in kernel_source.KERNEL_FILES}
  assert all(before[name] != after[name] for name in kernel_source.KERNEL_FILES)


def offline_build_missing() -> str | None:
  """Why this machine cannot build the wheel without a package index
  (``pip wheel --no-build-isolation`` uses the installed setuptools), or None."""
  if importlib.util.find_spec("setuptools") is None:
    return "needs setuptools installed to build the wheel offline (--no-build-isolation)"
  version = importlib.metadata.version("setuptools")
  major_minor = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
  if major_minor < (64, 0):
    return f"needs setuptools>=64 (pyproject.toml's build requirement), have {version}"
  # setuptools < 70.1 builds wheels with the separate `wheel` package.
  if major_minor < (70, 1) and importlib.util.find_spec("wheel") is None:
    return f"setuptools {version} needs the `wheel` package to build a wheel offline"
  return None


def test_installed_wheel_ships_and_finds_kernels(tmp_path):
  if reason := offline_build_missing():
    pytest.skip(reason)
  # A copy, so the build leaves no build/ folder in the checkout (whose stale
  # files a later build would ship).
  source = tmp_path / "source"
  source.mkdir()
  for name in WHEEL_SOURCES:
    if (REPO / name).is_dir():
      shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy2(REPO / name, source / name)
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-q", "-w", str(tmp_path / "dist"), str(source)],
                 check=True, timeout=300)
  (wheel,) = (tmp_path / "dist").glob("moe_ep-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  assert {"moe_ep/transport/cupy_backend.py", "moe_ep/transport/peer/__init__.py",
          "moe_ep/kernels/layout.cu", "moe_ep/kernels/peer.cuh"} <= names
  # What measures stays in the checkout.
  assert not [name for name in names if name.startswith("benchmarks/")]
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  check = ("from moe_ep.transport import kernel_source as k; "
           "print(k.kernel_dir()); assert 'route_rank' in k.source('layout.cu')")
  result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          timeout=120)
  assert result.returncode == 0, result.stderr
  assert pathlib.Path(result.stdout.strip()) == site / "moe_ep" / "kernels"
