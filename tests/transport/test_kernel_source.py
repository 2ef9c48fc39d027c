"""The kernels are found in a source checkout and in an installed wheel."""

import pathlib
import subprocess
import sys
import zipfile

from moe_ep.transport import kernel_source

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_source_checkout_finds_kernels_with_line_directives():
  assert kernel_source.kernel_dir() == REPO / "kernels"
  text = kernel_source.source("rows.cu")
  assert f'#line 1 "{REPO / "kernels" / "common.cuh"}"' in text
  assert f'#line 1 "{REPO / "kernels" / "rows.cu"}"' in text
  assert "expand_rows_v16" in text


def test_installed_wheel_ships_and_finds_kernels(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                  "-q", "-w", str(tmp_path / "dist"), str(REPO)], check=True, timeout=300)
  (wheel,) = (tmp_path / "dist").glob("moe_ep-*.whl")
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  check = ("from moe_ep.transport import kernel_source as k; "
           "print(k.kernel_dir()); assert 'route_rank' in k.source('layout.cu')")
  result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          timeout=120)
  assert result.returncode == 0, result.stderr
  assert pathlib.Path(result.stdout.strip()) == site / "moe_ep" / "kernels"
