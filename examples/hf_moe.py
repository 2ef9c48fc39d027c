"""Loads a Hugging Face MoE checkpoint's MoE layers onto a mesh and checks them.

  python -m examples.hf_moe DIR [--ep N] [--stacked] [--dtype bfloat16]

One line per MoE layer found (its block, experts, parameters, and where DIR
holds ``moe_reference.safetensors`` as tests/interop/make_fixtures.py writes
it, the max |difference| of the layer's output against transformers'), then
the totals. A bad directory, config or tensor is one line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

if not __package__:  # run as a file: python examples/hf_moe.py (examples/script_form.py)
  import script_form
  script_form.checkout_first()

REFERENCE_FILE = "moe_reference.safetensors"


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("directory", type=pathlib.Path, help="a Hugging Face checkpoint directory")
  parser.add_argument("--ep", type=int, default=None,
                      help="EP axis size (default: the largest that divides the expert count "
                      "and the device count)")
  parser.add_argument("--stacked", action="store_true",
                      help="load the MoE layers stacked (nnx.vmap, a leading [L] axis)")
  parser.add_argument("--dtype", default="float32",
                      help="the layers' compute dtype (float32, bfloat16)")
  return parser.parse_args(argv)


def _mesh(num_experts: int, ep: int | None):
  import jax  # noqa: PLC0415 - after request_cpu_devices
  import numpy as np  # noqa: PLC0415
  devices = jax.devices()
  if ep is None:
    ep = math.gcd(num_experts, len(devices))
  if ep < 1 or len(devices) % ep or num_experts % ep:
    raise ValueError(f"--ep {ep} must divide the device count {len(devices)} and the expert "
                     f"count {num_experts}")
  return jax.sharding.Mesh(np.array(devices).reshape(len(devices) // ep, ep), ("dp", "ep"))


def run(args: argparse.Namespace) -> list[str]:
  """The report's lines."""
  import jax  # noqa: PLC0415 - after request_cpu_devices
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from safetensors import safe_open  # noqa: PLC0415

  from moe_ep import interop  # noqa: PLC0415

  probe = interop.CheckpointDir(args.directory)  # a bad directory fails before any mesh
  config = interop.config_from_hf(probe.config)
  mesh = _mesh(config.num_experts, args.ep)
  loaded = interop.load_checkpoint(args.directory, mesh=mesh, stacked=args.stacked,
                                   dtype=args.dtype)
  reference_path = args.directory / REFERENCE_FILE
  reference = safe_open(reference_path, framework="numpy") if reference_path.is_file() else None
  model_type = probe.config["model_type"]
  lines, worst = [], None
  for position, (layer_index, prefix) in enumerate(zip(loaded.moe_layers, loaded.prefixes)):
    layer = loaded.layers if args.stacked else loaded.layers[layer_index]
    params = interop.layer_params(layer, position if args.stacked else None)
    count = sum(value.size for value in params.values())
    line = (f"layer {layer_index}: {model_type} {prefix}, {config.num_experts} experts "
            f"{config.hidden_size}->{config.ffn_size}, top-{config.top_k}, "
            f"{count:,} parameters")
    name = f"layers.{layer_index}.input"
    if reference is not None and name in reference.keys():
      x = reference.get_tensor(name)
      if args.stacked:
        graphdef, state = nnx.split(layer)
        y, _ = nnx.merge(graphdef, jax.tree.map(lambda v, p=position: v[p], state))(x)
      else:
        y, _ = layer(x)
      want = reference.get_tensor(f"layers.{layer_index}.output")
      diff = float(np.abs(np.asarray(y, np.float32) - want).max())
      worst = diff if worst is None else max(worst, diff)
      line += f", max |diff| vs transformers {diff:.2e} (max |y| {np.abs(want).max():.2f})"
    lines.append(line)
  total = sum(value.size for i in range(len(loaded.moe_layers)) for value in
              interop.layer_params(loaded.layers if args.stacked else
                                   loaded.layers[loaded.moe_layers[i]],
                                   i if args.stacked else None).values())
  dense = ", ".join(map(str, loaded.dense_layers)) or "none"
  summary = (f"{len(loaded.moe_layers)} MoE layers ({'stacked' if args.stacked else 'one each'}),"
             f" dense layers skipped: {dense}; {total:,} parameters on a "
             f"dp={mesh.shape['dp']} x ep={mesh.shape['ep']} mesh; "
             f"{len(loaded.checkpoint.reads)} tensor reads")
  if worst is not None:
    summary += f"; max |diff| vs transformers {worst:.2e}"
  return lines + [summary]


def main(argv: list[str] | None = None) -> int:
  from examples import mesh as device_mesh  # noqa: PLC0415
  device_mesh.request_cpu_devices()  # before JAX starts its backends
  args = parse_args(sys.argv[1:] if argv is None else list(argv))
  from moe_ep.interop import HFInteropError  # noqa: PLC0415
  try:
    lines = run(args)
  except (HFInteropError, ValueError, OSError) as error:  # HFInteropError: input; OSError: files
    print(f"hf_moe: error: {error}", file=sys.stderr, flush=True)
    return 2
  for line in lines:
    print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
