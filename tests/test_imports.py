"""The package's import graph: no cycle between modules (module-level and
function-level imports alike), and the cheap modules stay cheap: the
configuration and the options it shares with the transport import without
the transport, the peer package and the kernel sources without the
differentiable operations."""

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("moe_ep", "examples")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
  """Every module of the project's packages -> the project's modules it
  imports anywhere in its text. ``from a import b`` counts as importing
  ``a.b`` where that is a module, else ``a`` (a package face's names); a
  package's own ``__init__`` running first is Python's, not an edge."""
  files = {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
  graph = {}
  for name, path in files.items():
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        edges |= {alias.name for alias in node.names if alias.name in files}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for alias in node.names:
          target = f"{node.module}.{alias.name}"
          if target in files:
            edges.add(target)
          elif node.module in files:
            edges.add(node.module)
    graph[name] = edges - {name}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_no_module_imports_itself_through_others():
  graph = import_graph()
  assert "moe_ep.transport.ops" in graph and "moe_ep.transport.peer.rows" in graph
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("module, kept_out", [
    ("moe_ep.config", ("moe_ep.transport", "moe_ep.layer")),
    ("moe_ep.transport.kernel_source", ("moe_ep.transport.ops", "jax")),
    ("moe_ep.transport.peer", ("moe_ep.transport.ops", "moe_ep.transport.row_paths",
                               "moe_ep.layer")),
])
def test_importing_a_module_leaves_the_core_unloaded(module, kept_out):
  check = (f"import sys, {module}; "
           f"print([m for m in {kept_out!r} if m in sys.modules])")
  result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("face", ["moe_ep", "moe_ep.transport", "moe_ep.interop"])
def test_a_lazy_face_states_its_exports_as_imports(face):
  """A face that loads its names on first use (moe_ep.lazy) lists the same
  names, from the same modules, as imports under ``TYPE_CHECKING``: what a
  reader or a static tool follows is what runs."""
  import importlib
  path = REPO / pathlib.Path(*face.split(".")) / "__init__.py"
  block = next(node for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
  stated = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
  package = importlib.import_module(face)
  assert sorted(stated) == sorted(package.__all__)
  for name, module in stated.items():
    assert getattr(package, name) is getattr(importlib.import_module(module), name), name
