"""Turns text files into token shards for ``data.path`` (nanoGPT/MaxText style).

    python -m examples.tokenize_text corpus.txt data/corpus                    # UTF-8 bytes
    python -m examples.tokenize_text corpus.txt data/corpus --tokenizer tokenizer.json
    python -m examples.tokenize_text a.txt b.txt data/ab --tokenizer hf:gpt2 --val-fraction 0.01

writes ``train-00000.bin ...`` (flat little-endian ids: uint16 where the
vocabulary fits, else uint32), ``val-00000.bin`` (the last ``--val-fraction``
of the tokens, held out for ``train.eval_every``) and ``tokens.json`` (the
dtype, the vocabulary size, the tokenizer and the counts) into the output
directory; train on them with ``data.path=<dir>`` and a ``model.vocab_size`` at
least the vocabulary size it prints.

Tokenizers (``--tokenizer``):
  ``bytes``            UTF-8 bytes, vocabulary 256 (no package needed);
  ``PATH.json``        a Hugging Face ``tokenizers`` file (``pip install tokenizers``);
  ``hf:NAME``          ``transformers.AutoTokenizer.from_pretrained(NAME)``: a local
                       folder, or a hub name already in the local cache;
  ``tiktoken:NAME``    a ``tiktoken`` encoding, e.g. ``tiktoken:gpt2``.
Each input file is one document; with ``--eos`` the tokenizer's end-of-text id
(or the id given) follows each.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Callable

import numpy as np

if not __package__:  # run as a file: python examples/tokenize_text.py (examples/script_form.py)
  import script_form
  script_form.checkout_first()

from examples.token_data import META_FILE

SHARD_TOKENS = 100_000_000  # ~200 MB of uint16 per shard


class Tokenizer:
  """``encode(text) -> list[int]`` with a ``vocab_size``, an optional
  ``eos_id`` and a ``name`` recorded in tokens.json."""

  def __init__(self, name: str, encode: Callable[[str], list[int]], vocab_size: int,
               eos_id: int | None = None):
    self.name, self.encode, self.vocab_size, self.eos_id = name, encode, vocab_size, eos_id


def load_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer ``spec`` names (see the module docstring).

  Raises:
    ValueError: an unknown spec or a missing package (the message says which).
  """
  def need(package: str):
    try:
      return __import__(package)
    except ImportError:
      raise ValueError(f"--tokenizer {spec} needs the {package} package: "
                       f"pip install {package}") from None

  if spec == "bytes":
    return Tokenizer("bytes", lambda text: list(text.encode("utf-8")), 256)
  if spec.endswith(".json"):
    tokenizers = need("tokenizers")
    if not pathlib.Path(spec).is_file():
      raise ValueError(f"--tokenizer {spec}: no such file")
    tok = tokenizers.Tokenizer.from_file(spec)
    eos = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>")
                if tok.token_to_id(t) is not None), None)
    return Tokenizer(f"tokenizers:{pathlib.Path(spec).name}",
                     lambda text: tok.encode(text).ids, tok.get_vocab_size(), eos)
  if spec.startswith("hf:"):
    transformers = need("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(spec[3:])
    return Tokenizer(spec, lambda text: tok(text)["input_ids"], len(tok), tok.eos_token_id)
  if spec.startswith("tiktoken:"):
    tiktoken = need("tiktoken")
    enc = tiktoken.get_encoding(spec.split(":", 1)[1])
    return Tokenizer(spec, lambda text: enc.encode_ordinary(text), enc.n_vocab, enc.eot_token)
  raise ValueError(f"--tokenizer {spec!r}: give bytes, a tokenizer .json file, hf:NAME or "
                   "tiktoken:NAME")


def token_dtype_for(vocab_size: int) -> str:
  return "uint16" if vocab_size <= 2**16 else "uint32"


def write_shards(texts: list[str], out_dir, tokenizer: Tokenizer, *, val_fraction: float = 0.05,
                 shard_tokens: int = SHARD_TOKENS, eos: bool = False) -> dict:
  """Tokenizes ``texts`` (one document each) into ``out_dir``; returns the
  ``tokens.json`` it writes."""
  ids = []
  for text in texts:
    ids.extend(tokenizer.encode(text))
    if eos and tokenizer.eos_id is not None:
      ids.append(tokenizer.eos_id)
  dtype = token_dtype_for(tokenizer.vocab_size)
  tokens = np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<"))
  num_val = int(round(tokens.size * val_fraction))
  train, val = tokens[:tokens.size - num_val], tokens[tokens.size - num_val:]
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  for split, part in (("train", train), ("val", val)):
    for old in out_dir.glob(f"{split}-*.bin"):
      old.unlink()
    for index, first in enumerate(range(0, max(part.size, 1), shard_tokens)):
      if part.size:
        part[first:first + shard_tokens].tofile(out_dir / f"{split}-{index:05d}.bin")
  meta = {"dtype": dtype, "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name,
          "eos_id": tokenizer.eos_id if eos else None, "train_tokens": int(train.size),
          "val_tokens": int(val.size)}
  (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
  return meta


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="tokenize_text.py", description=__doc__.splitlines()[0],
                                   epilog=__doc__.split("\n\n", 2)[2],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("inputs", nargs="+", metavar="TEXT", help="text files (UTF-8)")
  parser.add_argument("out_dir", metavar="OUT_DIR", help="where the shards go")
  parser.add_argument("--tokenizer", default="bytes", help="default: bytes")
  parser.add_argument("--val-fraction", type=float, default=0.05,
                      help="share of the tokens held out (default 0.05)")
  parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                      help=f"tokens per shard file (default {SHARD_TOKENS:,})")
  parser.add_argument("--eos", action="store_true", help="end each document with the EOS id")
  args = parser.parse_args(argv)
  if not 0 <= args.val_fraction < 1:
    parser.error(f"--val-fraction={args.val_fraction} must be in [0, 1)")
  if args.shard_tokens < 1:
    parser.error(f"--shard-tokens={args.shard_tokens} must be >= 1")
  try:
    tokenizer = load_tokenizer(args.tokenizer)
    texts = [pathlib.Path(path).read_text(encoding="utf-8") for path in args.inputs]
  except (ValueError, OSError) as error:
    parser.exit(2, f"{parser.prog}: error: {error}\n")
  meta = write_shards(texts, args.out_dir, tokenizer, val_fraction=args.val_fraction,
                      shard_tokens=args.shard_tokens, eos=args.eos)
  print(f"{meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
        f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}, {meta['tokenizer']}) in "
        f"{args.out_dir}/; train with: python -m examples.pretrain data.path={args.out_dir} "
        f"model.vocab_size={meta['vocab_size']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
