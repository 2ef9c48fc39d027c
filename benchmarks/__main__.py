"""``python -m benchmarks``: runs the benchmarks and writes one JSON
result per benchmark (see ``--help``)."""

from __future__ import annotations

import argparse
import importlib
import pathlib

import jax

from moe_ep import distributed
from moe_ep.experts import grouped
from benchmarks import common

BENCHMARKS = {
    "transport": "P1: dispatch+combine round trip vs sort-based permute (one device)",
    "experts": "P3: expert bank TFLOP/s vs dense matmul; P3-grouped: grouped vs slabs vs ragged_dot",
    "layer": "P4: whole layer forward+backward MFU (one device)",
    "models": "P3/P4 on public MoE models' shapes (Qwen3, OLMoE, Mixtral, DeepSeek, gpt-oss) "
              "vs a dense SwiGLU chain",
    "overhead": "host overhead per buffer_callback, with and without command buffers",
    "ep": "P2: dispatch/combine bandwidth across this process's GPUs",
    "remat": "remat variants: compiled dispatch exchanges, memory_analysis() and time",
    "timeline": "where one dispatch's and decode round trip's device time goes, kernel by kernel",
    "loopback": "P2's peer row kernels at EP=2/4/8 on one GPU: their own memory work, no link",
    "fp8_gemms": "the FP8 expert GEMMs' TFLOP/s beside the bf16 kernels, per tile config "
                 "(Hopper)",
    "router": "the router's top-k (arg-max passes vs lax.top_k) and its fwd+bwd (one device)",
    "fp8_passes": "the FP8 bank's passes outside its GEMMs: one kernel each vs XLA passes "
                  "(one device)",
}
# Tiny shapes that run anywhere (CPU included) to check the programs themselves.
SMOKE = {
    "transport": dict(tokens=256, hidden=64, num_experts=8, top_k=2, backends=("xla",), iters=2,
                      copy_bytes=1 << 20),
    "experts": dict(shapes=((64, 32, 4),), total_rows=128, iters=2, matmul_size=128,
                    grouped_shapes=(((256, 2, 64, 32, 4), {}),)),
    "layer": dict(hidden=64, ffn=32, num_experts=4, top_k=2, tokens=256, seq=64,
                  backend="xla", iters=2, matmul_size=128),
    "models": dict(shapes={"tiny": (256, 2, 64, 48, 4)}, iters=2, rounds=2, backend="xla"),
    "ep": dict(token_counts=(64,), expert_counts=(8,), hidden=32, backend="xla", iters=2),
    "remat": dict(hidden=64, ffn=64, num_experts=8, batch=8, seq=16, num_layers=2, backend="xla",
                  iters=2),
    "timeline": dict(tokens=64, num_experts=8, decode_tokens=16, decode_experts=16, hidden=32,
                     backend="xla", calls=3),
    "fp8_gemms": dict(shapes={"tiny": (128, 2, 256, 128)}, iters=1, rounds=1),
    "router": dict(shapes={"tiny": (64, 16, 4, None, None), "tiny_groups": (64, 16, 4, 4, 2)},
                   iters=2, rounds=2, repeats=2),
    "fp8_passes": dict(shapes={"tiny": (256, 2, 64, 48, 4)}, iters=2, rounds=2),
}

# Benchmarks of the CuPy kernels themselves: no CPU version, --smoke included.
CUPY_ONLY = ("overhead", "loopback")
# Benchmarks of the Hopper kernels themselves (Mosaic GPU): likewise.
HOPPER_ONLY = ("fp8_gemms",)


def missing_requirement(name: str, smoke: bool) -> str | None:
  """What benchmark ``name`` needs that this machine lacks (None: it can run):
  the CuPy kernels' benchmarks need a CUDA GPU and CuPy; the others' full
  shapes need a GPU (their ``--smoke`` shapes run anywhere)."""
  on_gpu = jax.default_backend() == "gpu"
  if name in HOPPER_ONLY:
    if not grouped.hopper_available():
      return (f"a GPU of compute capability 9.0 (H100, H200) for its Hopper kernels (JAX's "
              f"backend here is {jax.default_backend()!r})")
    return None
  if name in CUPY_ONLY:
    if not on_gpu:
      return (f"a CUDA GPU and CuPy (it times the CuPy kernels; JAX's backend here is "
              f"{jax.default_backend()!r})")
    try:
      import cupy  # noqa: F401, PLC0415  (only whether it imports)
    except ImportError:
      return "CuPy (pip install -e '.[cuda12]' or '.[cuda13]')"
    return None
  if not smoke and not on_gpu:
    return (f"a GPU for its full-size shapes (JAX's backend here is {jax.default_backend()!r}; "
            "--smoke runs tiny shapes on any device)")
  return None


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks",
      description="Runs moe_ep's benchmarks: each writes one JSON result (device, versions,\n"
                  "XLA flags, shapes, every timing) and prints a summary and where it wrote.",
      epilog="benchmarks:\n" + "\n".join(f"  {k:10} {v}" for k, v in BENCHMARKS.items()),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("names", nargs="*", metavar="NAME",
                      help="benchmarks to run (listed below), or all (the default)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes that run anywhere, CPU included, to check the programs; "
                           "results are named <name>-smoke-<time>.json")
  parser.add_argument("--out", type=pathlib.Path, default=common.RESULTS_DIR, metavar="DIR",
                      help=f"folder the JSON results are written to (default: {common.RESULTS_DIR}/"
                           f", which git ignores)")
  parser.add_argument("--model", action="append", default=[], metavar="SHAPE",
                      help="models: time only this model's shape (repeatable; default all: "
                           "qwen3_30b_a3b, olmoe_1b_7b, mixtral_8x7b, mixtral_8x22b, "
                           "deepseek_v2_lite, gpt_oss_20b, phi_3_5_moe, deepseek_v3), so that a run fits "
                           "a time limit")
  parser.add_argument("--bank-option", action="append", default=None, metavar="SUFFIX",
                      help="models: time the banks with only these of their options beside the "
                           "defaults (repeatable; default all: _align64, _cluster2, "
                           "_align64_cluster2, _tile_by_tile, _wgrad_tile_by_tile, _fp8; none: no "
                           "option)")
  args = parser.parse_args(argv)
  distributed.initialize_from_env()  # a no-op unless started by moe_ep.launch
  unknown = sorted(set(args.names) - set(BENCHMARKS) - {"all"})
  if unknown:
    parser.error(f"unknown benchmark {unknown[0]!r}; choose from {[*BENCHMARKS, 'all']}")
  names = list(BENCHMARKS) if not args.names or "all" in args.names else args.names
  for name in names:
    missing = missing_requirement(name, args.smoke)
    if missing is not None:
      if jax.process_index() == 0:
        print(f"{name}: skipped: needs {missing}", flush=True)
      continue
    module = importlib.import_module(f"benchmarks.{name}")
    options = dict(SMOKE.get(name, {})) if args.smoke else {}
    if name == "models" and args.model:
      shapes = options.get("shapes", module.SHAPES)
      unknown_shapes = sorted(set(args.model) - set(shapes))
      if unknown_shapes:
        parser.error(f"unknown --model {unknown_shapes[0]!r}; choose from {list(shapes)}")
      options["shapes"] = {shape: shapes[shape] for shape in args.model}
    if name == "models" and args.bank_option is not None:
      chosen = [o for o in args.bank_option if o != "none"]
      unknown_options = sorted(set(chosen) - set(module.BANK_OPTIONS))
      if unknown_options:
        parser.error(f"unknown --bank-option {unknown_options[0]!r}; choose from "
                     f"{[*module.BANK_OPTIONS, 'none']}")
      options["bank_options"] = {o: module.BANK_OPTIONS[o] for o in chosen}
    result_name, path = name + ("-smoke" if args.smoke else ""), None
    if name == "models" and jax.process_index() == 0:
      def save_partial(partial):  # each finished shape survives a time limit
        nonlocal path
        path = common.write_result(result_name, partial, args.out, path)
      options["on_shape"] = save_partial
    result = module.run(**options)
    if jax.process_index() == 0:
      path = common.write_result(result_name, result, args.out, path)
      print(module.summary(result))
      print(f"wrote {path}")


if __name__ == "__main__":
  main()
