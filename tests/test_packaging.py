"""pyproject.toml's extras against the tests: `pip install -e ".[examples,test]"`
(README's install, and CI's) gives every package a test imports, so no test
is skipped there for a missing extra, and a missing one fails loudly."""

import ast
import importlib.metadata
import pathlib

import pytest
from packaging.requirements import Requirement

# Python 3.11's; CI's and the GPU machines' Python has it.
tomllib = pytest.importorskip("tomllib")

REPO = pathlib.Path(__file__).resolve().parents[1]
EXTRAS = ("examples", "test")  # the README's and CI's install


def extra_requirements(extra: str | None) -> list[Requirement]:
  """The requirements of ``extra`` (None: the package's own dependencies)."""
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  texts = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
  return [Requirement(text) for text in texts]


def test_the_test_extra_holds_every_example_requirement():
  """`pip install -e .[test]` alone also runs the examples' tests."""
  test = {r.name.lower(): r.specifier for r in extra_requirements("test")}
  for requirement in extra_requirements("examples"):
    assert test.get(requirement.name.lower()) == requirement.specifier, (
        f"the test extra needs {requirement} (the examples extra's)")


@pytest.mark.parametrize("extra", EXTRAS)
def test_every_requirement_of_the_extras_is_installed_at_its_bound(extra):
  """Where the install missed one, this fails instead of its tests skipping."""
  for requirement in extra_requirements(extra):
    try:
      version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
      pytest.fail(f"{requirement} ({extra} extra) is not installed: "
                  "pip install -e '.[examples,test]'")
    assert requirement.specifier.contains(version, prereleases=True), (
        f"{requirement.name} {version} is installed; the {extra} extra needs {requirement}")


def skipped_imports(path: pathlib.Path) -> set[str]:
  """The modules ``path`` hands to ``pytest.importorskip``."""
  return {node.args[0].value for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
          and node.args and isinstance(node.args[0], ast.Constant)}


def test_no_test_skips_for_a_package_that_an_extra_installs():
  """A declared package is imported plainly: absent, the test fails, never skips."""
  declared = {r.name.lower() for extra in (None, *EXTRAS) for r in extra_requirements(extra)}
  # Top-level module -> the installed distributions that provide it.
  providers = importlib.metadata.packages_distributions()
  offenders = []
  for path in sorted((REPO / "tests").rglob("*.py")):
    for module in skipped_imports(path):
      top = module.split(".")[0]
      dists = {d.lower() for d in providers.get(top, ())} | {top.lower()}
      if dists & declared:
        offenders.append(f"{path.relative_to(REPO)}: importorskip({module!r})")
  assert not offenders, offenders
