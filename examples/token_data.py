"""Token shards read through Grain: flat files of token ids, as nanoGPT's and
MaxText's preprocessing write them (``uint16`` or ``uint32``, little-endian,
one document after another), memory-mapped.

A shard set is cut into windows of ``seq_len + 1`` tokens (stride
``seq_len``, never across a shard's end). Grain's ``MapDataset`` shuffles the
windows (a new order each epoch) and repeats them; element ``g`` of the
stream is global row ``g % batch_size`` of step ``g // batch_size``. Every
process reads only the elements of its own rows, so processes read disjoint
windows, and the stream is a pure function of ``(seed, step, row)``: the
loader's position is the step the checkpoint records (``data_step``), a
resumed run reads exactly the batches the uninterrupted one would have, and
the batches do not depend on how many processes share them.

Grain is optional (the ``examples`` extra); without it, token shards are
refused with one line that says how to install it.
"""

from __future__ import annotations

import glob
import json
import pathlib

import numpy as np

# Written beside the shards by examples/tokenize_text.py.
META_FILE = "tokens.json"
DEFAULT_TOKEN_DTYPE = "uint16"


def _grain():
  try:
    import grain  # noqa: PLC0415  (optional: only token shards need it)
  except ImportError:
    raise ValueError("token shards are read with Grain, which is not installed: "
                     "pip install grain (or pip install -e '.[examples]')") from None
  return grain


def shard_paths(path: str, split: str = "train") -> list[pathlib.Path]:
  """The shard files ``path`` names, in order: the file itself, the files a
  glob matches, or a directory's ``<split>*.bin`` (for ``"train"``: every
  ``.bin`` but ``val*.bin`` where none is named ``train*``). Empty where none."""
  location = pathlib.Path(path)
  if location.is_dir():
    files = sorted(location.glob(f"{split}*.bin"))
    if not files and split == "train":
      files = sorted(f for f in location.glob("*.bin") if not f.name.startswith("val"))
    return files
  if any(c in path for c in "*?["):
    return [pathlib.Path(f) for f in sorted(glob.glob(path))]
  return [location]


def read_meta(paths: list[pathlib.Path]) -> dict:
  """The ``tokens.json`` beside the first shard ({} where there is none)."""
  meta = paths[0].parent / META_FILE
  return json.loads(meta.read_text()) if meta.exists() else {}


class TokenWindows:
  """Grain random-access source: window ``i`` is ``[seq_len + 1]`` int32 ids.

  >>> import tempfile
  >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.bin"
  >>> np.arange(10, dtype=np.uint16).tofile(path)
  >>> windows = TokenWindows([path], seq_len=4, token_dtype="uint16")
  >>> len(windows), windows[1].tolist()
  (2, [4, 5, 6, 7, 8])
  """

  def __init__(self, paths: list[pathlib.Path], *, seq_len: int, token_dtype: str):
    self.paths, self.seq_len = list(paths), seq_len
    self.tokens = [np.memmap(p, dtype=np.dtype(token_dtype).newbyteorder("<"), mode="r")
                   if p.stat().st_size else np.zeros(0, token_dtype) for p in self.paths]
    per_shard = [max(0, (t.size - 1) // seq_len) for t in self.tokens]
    self.first_window = np.concatenate([[0], np.cumsum(per_shard)])  # [shards + 1]
    self.num_tokens = sum(t.size for t in self.tokens)

  def __len__(self) -> int:
    return int(self.first_window[-1])

  def __getitem__(self, index: int) -> np.ndarray:
    shard = int(np.searchsorted(self.first_window, index, side="right")) - 1
    start = (int(index) - int(self.first_window[shard])) * self.seq_len
    return np.asarray(self.tokens[shard][start:start + self.seq_len + 1], np.int32)

  def __repr__(self) -> str:  # Grain logs the source
    return f"TokenWindows({len(self.paths)} shards, seq_len={self.seq_len})"


class TokenShardCorpus:
  """Batches of windows of token shards, through a Grain ``MapDataset``.

  Args:
    path: ``data.path`` (or ``data.eval_path``): a ``.bin`` file, a glob or
      a directory.
    split: a directory's shards to read: ``"train"`` or ``"val"``.
    seq_len: tokens per sequence (windows hold ``seq_len + 1``).
    batch_size: global rows per step.
    seed: the shuffle's seed.
    token_dtype: id width (None: ``tokens.json``'s, else uint16).
    vocab_size: the model's vocabulary; a larger id is refused.
  Raises:
    ValueError: no shards, too few tokens, ids beyond ``vocab_size``, a
      ``token_dtype`` other than ``tokens.json``'s, or Grain not installed.
  """

  def __init__(self, path: str, *, split: str = "train", seq_len: int, batch_size: int,
               seed: int, token_dtype: str | None, vocab_size: int):
    paths = shard_paths(path, split)
    if not paths:
      raise ValueError(f"no {split}*.bin (or other .bin) token shards found in {path}")
    for shard in paths:
      if not shard.is_file():
        raise ValueError(f"{shard} is not a token shard file")
    meta = read_meta(paths)
    if token_dtype is not None and meta.get("dtype", token_dtype) != token_dtype:
      raise ValueError(f"data.token_dtype={token_dtype!r} but {META_FILE} beside the shards "
                       f"says {meta['dtype']!r}")
    self.token_dtype = token_dtype or meta.get("dtype", DEFAULT_TOKEN_DTYPE)
    for shard in paths:
      if shard.stat().st_size % np.dtype(self.token_dtype).itemsize:
        raise ValueError(f"{shard} is {shard.stat().st_size} bytes: not a whole number of "
                         f"{self.token_dtype} ids (set data.token_dtype)")
    self.windows = TokenWindows(paths, seq_len=seq_len, token_dtype=self.token_dtype)
    if not len(self.windows):
      raise ValueError(f"{path} holds {self.windows.num_tokens} tokens; each shard needs at "
                       f"least train.seq_len + 1 = {seq_len + 1}")
    # The vocabulary the tokenizer wrote (tokens.json), else the ids present.
    used = meta.get("vocab_size") or 1 + max(int(t.max()) for t in self.windows.tokens if t.size)
    if used > vocab_size:
      raise ValueError(f"the shards' ids need a vocabulary of {used}: set "
                       f"model.vocab_size>={used} (it is {vocab_size})")
    self.path, self.split, self.meta = path, split, meta
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
    # The data's own faults are named first: they need no Grain to find.
    self.dataset = _grain().MapDataset.source(self.windows).shuffle(seed=seed).repeat()

  def rows(self, step: int, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of step ``step``'s batch: ``[stop - start, seq_len + 1]`` int32."""
    first = step * self.batch_size
    return np.stack([self.dataset[first + row] for row in range(start, stop)])

  def describe(self) -> str:
    tokenizer = f", tokenizer {self.meta['tokenizer']}" if "tokenizer" in self.meta else ""
    return (f"token shards: {self.path} ({len(self.windows.paths)} {self.split} file"
            f"{'s' * (len(self.windows.paths) != 1)}, {self.windows.num_tokens:,} "
            f"{self.token_dtype} tokens{tokenizer}; read through Grain)")
