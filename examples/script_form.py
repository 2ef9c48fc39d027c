"""``python examples/pretrain.py`` as well as ``python -m examples.pretrain``.

Run as a file, a script's own folder (``examples/``) is ``sys.path[0]``, so
``from examples import ...`` finds no package, and the folder's modules
(``data``, ``model``, ``progress``...) would shadow any installed ones of
those names. Each command starts with

    if not __package__:  # run as a file: python examples/NAME.py
      import script_form
      script_form.checkout_first()

which puts the checkout's root in that place instead: the same imports as
``python -m examples.NAME`` from the root, this checkout's ``moe_ep`` first.
"""

from __future__ import annotations

import pathlib
import sys

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent


def checkout_first() -> None:
  """Replaces the examples folder at the head of ``sys.path`` with the checkout."""
  sys.path[0] = str(CHECKOUT)
