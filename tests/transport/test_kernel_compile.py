"""Every kernels/*.cu compiles for sm_90 with the machine's nvcc and the
options the CuPy path gives NVRTC, defining every kernel Python launches
from it; compile errors name the file and line."""

import re
import shutil
import subprocess

import pytest

from moe_ep.experts import fp8_passes
from moe_ep.transport import cupy_backend
from moe_ep.transport import kernel_source
from moe_ep.transport.peer import kernels as peer_kernels

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def nvcc(source_text: str, workdir) -> subprocess.CompletedProcess:
  path = workdir / "unit.cu"
  path.write_text(source_text)
  return subprocess.run(
      [NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", *kernel_source.compile_options(),
       "-o", str(workdir / "unit.cubin"), str(path)],
      capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kernel_file", kernel_source.KERNEL_FILES)
def test_kernel_file_compiles_for_sm90_without_spills(kernel_file, tmp_path):
  result = nvcc(kernel_source.source(kernel_file), tmp_path)
  assert result.returncode == 0, result.stderr
  assert "error" not in result.stderr.lower()
  spills = [line for line in result.stderr.splitlines()
            if "spill" in line and " 0 bytes spill stores, 0 bytes spill loads" not in line]
  assert not spills, spills
  entries = set(re.findall(r"Compiling entry function '(\w+)'", result.stderr))
  (launched,) = [f.kernels for f in (*cupy_backend.KERNEL_FILES, cupy_backend.FP8,
                                     *peer_kernels.KERNEL_FILES, fp8_passes.KERNELS)
                 if f.name == kernel_file]
  assert set(launched) <= entries, set(launched) - entries


def test_compile_error_names_kernel_file_and_line(tmp_path, monkeypatch):
  kernels = tmp_path / "kernels"
  kernels.mkdir()
  real = kernel_source.kernel_dir()
  (kernels / kernel_source.COMMON_HEADER).write_text((real / kernel_source.COMMON_HEADER).read_text())
  (kernels / "rows.cu").write_text("// line 1\n__global__ void broken() { undefined_name; }\n")
  monkeypatch.setattr(kernel_source, "kernel_dir", lambda: kernels)
  result = nvcc(kernel_source.source("rows.cu"), tmp_path)
  assert result.returncode != 0
  assert f"{kernels / 'rows.cu'}(2)" in result.stderr, result.stderr
