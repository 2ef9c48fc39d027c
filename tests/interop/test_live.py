"""The interop layers against transformers live, where torch and
transformers are installed (CI has neither: the committed fixtures stand
in): fresh random models of every family, from other seeds than the
fixtures, written by transformers and loaded through the checkpoint
directory. In a venv with torch, transformers and moe_ep's dependencies::

  VENV/bin/pip install -e . --no-deps
  VENV/bin/pytest tests/interop/test_live.py

(``pytest``, not ``python -m pytest``: from the repository root the latter
puts the root on ``sys.path``, where ``kernels/`` hides the ``kernels``
package that transformers imports.)"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import make_fixtures  # noqa: E402 - needs torch
from hf_fixtures import FAMILIES, reference  # noqa: E402
from moe_ep.interop import load_checkpoint  # noqa: E402

# float32 on both sides (see test_convert.py's REL_TOL).
REL_TOL = 1e-5


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("seed", [11, 12])
def test_fresh_transformers_models_match_through_their_checkpoint(tmp_path, model_type, seed):
  directory = make_fixtures.write(tmp_path, model_type, seed)
  loaded = load_checkpoint(directory, dtype="float32", transport="xla")
  for i, (x, want) in reference(model_type, tmp_path).items():
    y, _ = loaded.layers[i](x)
    err = np.abs(np.asarray(y) - want).max()
    assert err <= REL_TOL * np.abs(want).max(), (err, np.abs(want).max())
