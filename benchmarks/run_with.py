"""Runs a module as ``python -m`` would, with module-level settings changed
first: for timing a setting that is not yet a default, e.g.

    python benchmarks/run_with.py moe_ep.experts.hopper.CHAIN_TILES=True \\
        -m examples.pretrain configs/h200.yaml train.batch_size=12
"""

import ast
import importlib
import runpy
import sys


def main(argv: list[str]) -> None:
  if "-m" not in argv or argv.index("-m") + 1 >= len(argv):
    sys.exit("usage: run_with.py [package.module.NAME=VALUE ...] -m MODULE [ARGS ...]")
  split = argv.index("-m")
  for setting in argv[:split]:
    target, _, value = setting.partition("=")
    module_name, _, name = target.rpartition(".")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
      sys.exit(f"run_with.py: {module_name} has no setting {name!r}")
    setattr(module, name, ast.literal_eval(value))
  sys.argv = [argv[split + 1], *argv[split + 2:]]
  runpy.run_module(argv[split + 1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main(sys.argv[1:])
