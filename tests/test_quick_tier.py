"""The quick tier's list (conftest.QUICK) names test files and tests that exist."""

import pathlib
import re

import conftest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_every_quick_entry_names_an_existing_file_and_test():
  for path, prefixes in conftest.QUICK.items():
    text = (REPO / path).read_text()
    tests = re.findall(r"^def (test_\w+)", text, re.M)
    assert tests, path
    for prefix in prefixes or ():
      assert any(name.startswith(prefix) for name in tests), (path, prefix)
