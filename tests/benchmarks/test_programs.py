"""The benchmark programs run (``python -m benchmarks --smoke``: tiny shapes,
pure-JAX transport, the 8 CPU devices) and what they report holds: FP8
dispatch leaves routing alone, the remat variants re-run the dispatch
exchange exactly when they should, and every path agrees bitwise. A program
that breaks is found here rather than on the GPU machine."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

import background

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
PROGRAMS = ("transport", "experts", "layer", "models", "ep", "remat", "timeline", "router",
            "fp8_passes")


def run_smoke() -> tuple[subprocess.CompletedProcess, dict]:
  """All smoke benchmarks in one process; ``(process, {name: result JSON})``."""
  out = pathlib.Path(tempfile.mkdtemp(prefix="bench-smoke-"))
  # conftest's XLA_FLAGS: 8 CPU devices (and its compile settings).
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  process = subprocess.run([sys.executable, "-m", "benchmarks", *PROGRAMS, "--smoke",
                            "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=900)
  results = {path.name.split("-smoke-")[0]: json.loads(path.read_text())
             for path in out.glob("*-smoke-*.json")}
  return process, results


def background_jobs(item) -> dict:
  return {"bench-smoke": run_smoke}


@pytest.fixture(scope="module")
def smoke():
  process, results = background.result("bench-smoke", run_smoke)
  assert process.returncode == 0, process.stderr[-3000:]
  assert sorted(results) == sorted(PROGRAMS)
  assert process.stdout.count("\nwrote ") == len(PROGRAMS)  # it says where each went
  return results


def test_help_names_the_command_and_each_option():
  result = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("usage: python -m benchmarks ")
  assert "--smoke" in result.stdout and "tiny shapes" in result.stdout
  assert "--out DIR" in result.stdout and "runs/bench/" in result.stdout
  for name in ("transport", "experts", "layer", "ep", "loopback"):
    assert f"\n  {name} " in result.stdout


def test_every_program_writes_its_environment_and_summary(smoke):
  for name, result in smoke.items():
    assert result["benchmark"] == f"{name}-smoke"
    assert result["environment"]["device_count"] == 8, name


def test_fp8_dispatch_leaves_routing_and_drops_unchanged_in_the_layer(smoke):
  variants = smoke["layer"]["variants"]
  # The router sees the unquantized tokens: the same routes, the same drops.
  assert variants["ep1_cf1.0_fp8"]["dropped_fraction"] == variants["ep1_cf1.0"]["dropped_fraction"]
  assert variants["ep1_cf1.0_fp8"]["dispatch_dtype"] == "float8_e4m3fn"


def test_the_layer_runs_dropless_on_the_grouped_layout_dropping_nothing(smoke):
  variants = smoke["layer"]["variants"]
  # On CPU "auto" is the slab layout; the dropless variant asks for grouped.
  assert variants["ep1_cf1.0"]["expert_layout"] == "slabs"
  assert variants["ep1_cf1.0"]["dropped_fraction"] > 0  # the smoke shapes overflow at 1.0
  dropless = variants["ep1_dropless"]
  assert (dropless["expert_layout"], dropless["capacity_factor"]) == ("grouped", None)
  assert dropless["dropped_fraction"] == 0.0


def test_remat_variants_rerun_the_dispatch_exchange_only_when_nothing_is_saved(smoke):
  variants = smoke["remat"]["variants"]
  assert smoke["remat"]["shapes"]["mesh"]["ep"] > 1
  for name in ("no_checkpoint", "save_dispatch", "save_dispatch_fp8"):
    assert variants[name]["forward_row_exchanges"] == 1, name
  assert variants["nothing_saveable"]["forward_row_exchanges"] == 2
  # Saving the dispatch keeps less than saving everything.
  assert variants["save_dispatch"]["temp_size_in_bytes"] < variants["no_checkpoint"]["temp_size_in_bytes"]


def test_the_router_benchmark_times_both_top_k_on_the_same_indices(smoke):
  for name, shape in smoke["router"]["shapes"].items():
    assert shape["same_indices"], name
    assert set(shape["kernels"]) == {"top_k_passes", "top_k_lax", "router_fwd_bwd"}
    assert all(timing["median_ms"] > 0 for timing in shape["kernels"].values()), name


def test_the_fp8_passes_benchmark_times_each_pass_where_it_can_run(smoke):
  """Every pass as XLA passes; as its kernel only where CuPy and a GPU are
  (never on this CPU run), each with the bytes it moves per second."""
  result = smoke["fp8_passes"]
  assert result["kernels"] is False
  (shape,) = result["shapes"].values()
  assert set(shape["passes"]) == {"activation_xla", "activation_grad_xla", "weights_xla"}
  assert all(timing["gbps"] > 0 for timing in shape["passes"].values())


def test_ep_cases_agree_bitwise_and_time_fp8(smoke):
  result = smoke["ep"]
  assert result["ep_size"] == 8
  for case in result["cases"]:
    timings = case["all_to_all"]
    assert timings["bitwise_equal_to_all_to_all"]
    assert timings["fp8_bitwise_equal_to_all_to_all"]
    # The named receive (FP8 slabs dequantized by XLA) gives the fused one's bits.
    assert timings["dispatch_fp8_named"]["same_slabs_as_fused"]
    assert timings["dispatch_fp8"]["speedup_vs_bf16"] > 0
  # Every part of the decode round trip is timed on its own.
  decode = result["decode"]["all_to_all"]
  assert set(decode) == {"round_trip_us", "rows_round_trip_us", "routing_us",
                         "dispatch_rows_us", "combine_rows_us"}
  assert all(value > 0 for value in decode.values()), decode


def test_the_timeline_splits_each_program_into_its_calls_and_shows_the_exchange(smoke):
  """On the pure-JAX path each call of the dispatch and of the decode round
  trip runs XLA's all_to_all (rows, and metadata); the FP8 slabs' program
  too. Each traced call is its own group, in order, starting at 0, with the
  same ops as the others (one program)."""
  for name, calls in smoke["timeline"]["programs"].items():
    assert len(calls) == 3, name
    assert len({len(call["events"]) for call in calls}) == 1, name
    for call in calls:
      starts = [e["start_us"] for e in call["events"]]
      assert starts[0] == 0 and starts == sorted(starts), name
      assert all(e["us"] >= 0 for e in call["events"]) and call["span_us"] > 0, name
      names = [e["name"] for e in call["events"]]
      assert any(n.startswith("all-to-all") for n in names), (name, names)


def test_model_shapes_take_each_bank_ratio_round_by_round_beside_the_chain(smoke):
  """The banks' and the layers' fractions of the dense chain are medians of
  per-round ratios (recomputed here from the rounds' own times), and every
  variant ran in each round; the layers record what they dropped (nothing
  dropless)."""
  import statistics
  (shape,) = smoke["models"]["models"].values()
  methods = shape["methods"]
  dense = methods["dense"]["samples_ms"]
  banks = [name for name in methods if name.startswith("grouped_")]
  assert sorted(banks) == sorted(f"grouped_{load}{suffix}" for load in ("zipf", "skewed")
                                 for suffix in ("", "_unfused", "_align64", "_cluster2",
                                                "_align64_cluster2", "_tile_by_tile",
                                                "_wgrad_tile_by_tile", "_fp8"))  # F < 2H: fused
  layers = ["layer_dropless", "layer_cf1.0_slabs"]
  for name in ["dense", *banks, *layers]:
    method = methods[name]
    assert len(method["samples_ms"]) == len(dense) == 2
    ratios = [d / m for d, m in zip(dense, method["samples_ms"])]
    assert method["of_dense_rounds"] == pytest.approx(ratios, abs=6e-5)  # stored to 4 places
    assert method["of_dense"] == statistics.median(method["of_dense_rounds"])
  assert methods["layer_dropless"]["dropped_fraction"] == 0.0
  assert 0.0 <= methods["layer_cf1.0_slabs"]["dropped_fraction"] < 1.0
