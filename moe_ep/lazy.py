"""Package faces that re-export their submodules' names on first use (PEP
562), so that importing one submodule (``moe_ep.config``,
``moe_ep.transport.kernel_source``) does not import every other."""

from __future__ import annotations

import importlib


def exports(package: str, modules: dict[str, tuple[str, ...]]):
  """``(__all__, __getattr__, __dir__)`` for package ``package`` that
  re-exports, for each submodule in ``modules`` (or module of a dotted path
  outside it), the names listed for it:
  each imported on first use and then kept."""
  namespace = importlib.import_module(package).__dict__
  names = {name: module for module, exported in modules.items() for name in exported}

  def module_path(module: str) -> str:  # a submodule, or a whole dotted path
    return module if "." in module else f"{package}.{module}"

  def getattr_(name: str):
    module = names.get(name)
    if module is None:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_path(module)), name)
    namespace[name] = value
    return value

  def dir_():
    return sorted(set(namespace) | set(names))

  return sorted(names), getattr_, dir_
