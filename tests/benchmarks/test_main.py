"""``python -m benchmarks``: a benchmark this machine cannot run says what
it needs in one line, writes no result and exits 0 (never a crash on CPU)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import __main__ as bench_main

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="checks the CPU behaviour")


@pytest.mark.parametrize("args, skipped", [
    (["overhead"], ["overhead"]),
    (["overhead", "loopback", "--smoke"], ["overhead", "loopback"]),
    (["transport", "layer"], ["transport", "layer"]),  # full-size shapes
    (["fp8_gemms", "--smoke"], ["fp8_gemms"]),  # the Hopper kernels themselves
])
def test_a_benchmark_that_cannot_run_here_is_one_skipped_line_and_no_result(
    tmp_path, capsys, args, skipped):
  bench_main.main([*args, "--out", str(tmp_path / "results")])
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(": skipped: needs ")[0] for line in lines] == skipped, lines
  assert all(": skipped: needs " in line for line in lines)
  assert not (tmp_path / "results").exists()


def test_the_command_line_exits_0_for_a_missing_gpu(tmp_path):
  done = subprocess.run([sys.executable, "-m", "benchmarks", "overhead", "loopback",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.count("skipped: needs a CUDA GPU and CuPy") == 2
  assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_models_times_only_the_shapes_named_and_refuses_an_unknown_one(tmp_path, capsys):
  bench_main.main(["models", "--smoke", "--model", "tiny", "--out", str(tmp_path)])
  (result,) = tmp_path.iterdir()
  assert list(json.loads(result.read_text())["models"]) == ["tiny"]
  with pytest.raises(SystemExit) as exit_info:
    bench_main.main(["models", "--smoke", "--model", "bogus", "--out", str(tmp_path)])
  assert exit_info.value.code == 2
  assert "unknown --model 'bogus'" in capsys.readouterr().err


def test_models_times_only_the_bank_options_named_and_refuses_an_unknown_one(tmp_path, capsys):
  bench_main.main(["models", "--smoke", "--bank-option", "_cluster2", "--out", str(tmp_path)])
  (result,) = tmp_path.iterdir()
  (shape,) = json.loads(result.read_text())["models"].values()
  assert sorted(m for m in shape["methods"] if m.startswith("grouped_zipf")) == [
      "grouped_zipf", "grouped_zipf_cluster2", "grouped_zipf_unfused"]
  with pytest.raises(SystemExit) as exit_info:
    bench_main.main(["models", "--smoke", "--bank-option", "_bogus", "--out", str(tmp_path)])
  assert exit_info.value.code == 2
  assert "unknown --bank-option '_bogus'" in capsys.readouterr().err


def test_models_leaves_each_finished_shape_behind_as_it_goes(tmp_path):
  """A run cut off after its first shape still wrote that shape: the result
  file is rewritten after each shape, marked partial until the last."""
  from benchmarks import common, models  # noqa: PLC0415
  shapes = {"first": (256, 2, 64, 40, 4), "second": (128, 2, 64, 40, 4)}
  written = []

  def save(partial):
    written.append(common.write_result("models-smoke", partial, tmp_path,
                                       written[-1] if written else None))

  result = models.run(shapes=shapes, iters=1, rounds=1, layers=False, backend="xla",
                      on_shape=save)
  (path,) = set(written)
  saved = json.loads(path.read_text())
  assert saved["partial"] is True and list(saved["models"]) == ["first"]
  assert list(result["models"]) == ["first", "second"] and "partial" not in result


def test_the_fp8_gemms_program_reports_each_kernel_of_each_config(monkeypatch):
  """The program's bookkeeping on CPU, its Hopper kernels stood in for by the
  pure-JAX products of the same math: every kernel of every config timed,
  TFLOP/s from the product's FLOPs, and the forward's agreement with bf16
  on the same codes (unit scales: exact products, float32 sums) near 0."""
  from benchmarks import fp8_gemms
  from moe_ep.experts import fp8, hopper, hopper_fp8, hopper_wgrad, grouped
  monkeypatch.setattr(hopper, "grouped_matmul", lambda a, b, t: grouped.grouped_matmul(
      a, b, grouped.group_tiles(jnp.bincount(t, length=b.shape[0]) * 128, a.shape[0]), "xla"))
  monkeypatch.setattr(hopper_wgrad, "grouped_matmul_wgrad", lambda a, g, s, c, n: jnp.zeros(
      (n, a.shape[1], g.shape[1]), a.dtype))
  monkeypatch.setattr(hopper_fp8, "grouped_matmul_fp8",
                      lambda *x, config=None: fp8.grouped_matmul_fp8(*x))
  monkeypatch.setattr(hopper_fp8, "grouped_matmul_fp8_wgrad",
                      lambda *x, config=None: fp8.grouped_matmul_fp8_wgrad(*x))
  result = fp8_gemms.run(shapes={"tiny": (128, 2, 256, 128)}, iters=1, rounds=1)
  shape = result["shapes"]["tiny"]
  names = ["forward_bf16", "wgrad_bf16"] + [f"{kind}_fp8_{config}" for config in
                                            fp8_gemms.CONFIGS for kind in ("forward", "wgrad")]
  assert sorted(shape["kernels"]) == sorted(names)
  for timing in shape["kernels"].values():
    assert timing["tflops"] == pytest.approx(2 * 256 * 256 * 128 / timing["median_ms"] / 1e9)
  assert shape["forward_max_error_vs_bf16"] <= 2 ** -8  # one bf16 rounding apart
  assert "tiny" in fp8_gemms.summary(result)
