"""README.md and docs/ hold each section once: no heading repeats inside the
section above it (an edit that appends a document's sections a second time
is caught here)."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def repeated_headings(text: str) -> list[str]:
  """Headings that occur twice under the same chain of parent headings
  (fenced code skipped)."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  parents, seen, repeated = [], set(), []
  for level, title in re.findall(r"^(#+) (.+?)\s*$", text, re.M):
    parents = parents[:len(level) - 1] + [""] * (len(level) - 1 - len(parents))
    path = (*parents, title)
    if path in seen:
      repeated.append(" > ".join(p for p in path if p))
    seen.add(path)
    parents = parents + [title]
  return repeated


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_no_section_is_there_twice(path):
  assert repeated_headings(path.read_text()) == []


def test_the_check_finds_a_section_appended_twice():
  once = "# A\n## The format\nx\n# B\n## The format\ny\n"
  assert repeated_headings(once) == []
  assert repeated_headings(once + "# A\n## The format\n") == ["A", "A > The format"]
  assert repeated_headings("# A\n```\n# not a heading\n# not a heading\n```\n") == []
