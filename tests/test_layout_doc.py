"""docs/layout.md against the tree: every module of moe_ep/ and every file of
kernels/ is named in its tree, and every folder and file the tree names
exists.

How the tree reads (the code block of docs/layout.md): a line's first words,
up to two spaces, name one or more entries (``router.py, model_aux.py``) of
the folder its indentation sits in (two spaces a level; a name ending in
``/`` opens a folder); the rest, and every line indented to the description
column, describes them. A file name in a description (``fp8.py``, a path
``kernels/rows.cu``) names a file of the entry's folder (a folder entry's own
files), or, with a ``/``, of the repository's root; a glob (``kernels/*.cu``)
must match a file but names none. A package's ``__init__.py`` is named by its
folder.
"""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
LAYOUT = REPO / "docs" / "layout.md"
# The folders whose every file the tree must name, and the files that count.
COVERED = {"moe_ep": ("*.py",), "kernels": ("*.py", "*.cu", "*.cuh")}
FILE_NAME = re.compile(r"[\w*./-]+\.(?:py|cuh|cu|yaml)\b")
DESCRIPTION_COLUMN = 20  # a line indented this far continues the entry above


def tree_lines(text: str) -> list[str]:
  """The lines of the layout's first code block."""
  match = re.search(r"^```\n(.*?)^```", text, re.S | re.M)
  assert match, "docs/layout.md has no ``` block holding the tree"
  return match.group(1).splitlines()


def named_paths(text: str) -> tuple[set[str], list[str]]:
  """(the repository paths the tree names, its names that match no path)."""
  named, missing = set(), []
  folders: list[str] = []  # the open folder at each level
  context = ""  # the folder a description's names belong to

  def resolve(name: str, folder: str, is_entry: bool) -> None:
    candidates = [f"{folder}{name}"]
    if "/" in name.rstrip("/") and not is_entry:
      candidates.append(name)  # a path from the repository's root
    for candidate in candidates:
      matches = [p for p in REPO.glob(candidate.rstrip("/"))
                 if p.is_dir() == candidate.endswith("/") or "*" in candidate]
      if matches:
        if "*" not in candidate:  # a glob says the files exist, not what each holds
          named.update(p.relative_to(REPO).as_posix() for p in matches)
        return
    missing.append(candidates[0])

  for line in tree_lines(text):
    if not line.strip():
      continue
    indent = len(line) - len(line.lstrip())
    if indent >= DESCRIPTION_COLUMN:
      description = line
    else:
      names, _, description = line.strip().partition("  ")
      level = indent // 2
      del folders[level:]
      parent = "".join(folders)
      entries = [name.strip() for name in names.split(",")]
      for name in entries:
        resolve(name, parent, is_entry=True)
      if len(entries) == 1 and entries[0].endswith("/"):
        folders.append(entries[0])
        context = parent + entries[0]
      else:
        context = parent
    for name in FILE_NAME.findall(description):
      resolve(name, context, is_entry=False)
  return named, missing


def test_every_name_in_the_tree_exists():
  _, missing = named_paths(LAYOUT.read_text())
  assert not missing, f"docs/layout.md names what is not in the tree: {missing}"


def test_every_module_of_the_package_and_the_kernels_is_in_the_tree():
  named, _ = named_paths(LAYOUT.read_text())
  unnamed = []
  for folder, patterns in COVERED.items():
    for pattern in patterns:
      for path in sorted((REPO / folder).rglob(pattern)):
        relative = path.relative_to(REPO)
        if path.name == "__init__.py":
          relative = relative.parent  # named by its folder
        if relative.as_posix() not in named:
          unnamed.append(relative.as_posix())
  assert not unnamed, f"docs/layout.md's tree does not name {unnamed}"


def test_the_reading_finds_a_missing_module_and_a_stale_name():
  """The reading itself: a module dropped from a description and an entry
  for a file that is gone are both found."""
  text = LAYOUT.read_text()
  named, missing = named_paths(text)
  assert {"moe_ep/transport/launch_geometry.py", "moe_ep/experts/hopper_wgrad.py",
          "moe_ep/transport/peer/rows.py", "kernels/peer.cuh", "moe_ep/transport"} <= named
  assert not missing
  dropped, _ = named_paths(text.replace("hopper_wgrad.py (the grouped", "(the grouped"))
  assert "moe_ep/experts/hopper_wgrad.py" not in dropped
  stale = text.replace("    scopes.py   ", "    scopes.py, gone.py   ")
  assert named_paths(stale)[1] == ["moe_ep/transport/gone.py"]
