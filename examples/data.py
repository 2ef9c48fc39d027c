"""Token streams that are pure functions of ``(seed, step, row)``: the
synthetic corpus, byte-level text and (``examples/token_data.py``) token
shards read through Grain.

Row ``r`` of step ``s`` is drawn from its own generator seeded with
``(seed, s, r)``, so every process makes exactly the rows its devices hold,
a resumed run sees the same batches as an uninterrupted one, and the stream
does not depend on how many processes share the batch.
"""

from __future__ import annotations

import pathlib

import numpy as np

from examples.token_data import TokenShardCorpus
from examples.train_config import Config

# The last generator key of held-out rows (0x4E1D: "held").
HELD_OUT_KEY = 0x4E1D


class SyntheticCorpus:
  """Sequences from one of ``num_topics`` sparse random Markov chains.

  Each topic is a first-order chain over the vocabulary in which a token can
  be followed by only ``successors`` tokens, with random probabilities. A
  sequence picks its topic at random, so a model must learn the bigram
  tables and infer from the context which table is in use: the loss falls
  fast from ``log(vocab_size)`` towards :attr:`entropy_floor`.

  >>> corpus = SyntheticCorpus(vocab_size=32, seq_len=8, num_topics=2, successors=3, seed=0)
  >>> corpus.rows(step=0, start=0, stop=4).shape
  (4, 9)
  """

  def __init__(self, *, vocab_size: int, seq_len: int, num_topics: int, successors: int,
               seed: int, held_out: bool = False):
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    # Held-out rows come from the same chains through other generator keys.
    self.stream_key = [HELD_OUT_KEY] if held_out else []
    self.num_topics = num_topics
    rng = np.random.default_rng([seed, 0x5EED])
    shape = (num_topics, vocab_size, successors)
    # next_tokens[t, prev, j]: the j-th possible successor of prev under topic
    # t; strictly increasing offsets spanning less than the vocabulary keep
    # the successors of one token distinct.
    offsets = np.cumsum(rng.integers(1, vocab_size // successors, size=shape), axis=-1)
    first = rng.integers(vocab_size, size=shape[:2] + (1,))
    self.next_tokens = ((first + offsets) % vocab_size).astype(np.int32)
    probs = rng.dirichlet(np.ones(successors), size=shape[:2])  # [topics, vocab, successors]
    self.cumulative = np.cumsum(probs, axis=-1)
    self.entropy_floor = self._entropy_floor(probs)

  def _entropy_floor(self, probs: np.ndarray) -> float:
    """Nats per token of the chains once the topic is known: the loss a
    perfect model approaches (slightly below what is reachable, since the
    first tokens of a sequence leave the topic uncertain)."""
    entropies = -(probs * np.log(probs)).sum(-1)  # [topics, vocab]
    floor = 0.0
    for topic in range(self.num_topics):
      stationary = np.full(self.vocab_size, 1.0 / self.vocab_size)
      for _ in range(200):  # power iteration over the sparse transitions
        stationary = np.bincount(self.next_tokens[topic].ravel(),
                                 weights=(stationary[:, None] * probs[topic]).ravel(),
                                 minlength=self.vocab_size)
      floor += stationary @ entropies[topic] / self.num_topics
    return float(floor)

  def rows(self, step: int, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of step ``step``'s batch: ``[stop - start, seq_len + 1]`` int32."""
    count = stop - start
    topics = np.empty(count, np.int64)
    first = np.empty(count, np.int64)
    uniforms = np.empty((count, self.seq_len))
    for i, row in enumerate(range(start, stop)):
      rng = np.random.default_rng([self.seed, step, row, *self.stream_key])
      topics[i], first[i] = rng.integers(self.num_topics), rng.integers(self.vocab_size)
      uniforms[i] = rng.random(self.seq_len)
    tokens = np.empty((count, self.seq_len + 1), np.int32)
    tokens[:, 0] = first
    for t in range(self.seq_len):
      prev = tokens[:, t]
      choice = (uniforms[:, t, None] > self.cumulative[topics, prev]).sum(-1)
      choice = np.minimum(choice, self.next_tokens.shape[-1] - 1)  # cumsum rounding
      tokens[:, t + 1] = self.next_tokens[topics, prev, choice]
    return tokens

  def describe(self) -> str:
    return (f"synthetic corpus: vocab {self.vocab_size}, {self.num_topics} hidden chains, "
            f"loss floor ~{self.entropy_floor:.2f} nats/token")


class ByteCorpus:
  """Random ``seq_len + 1``-byte windows of a file (vocabulary 256)."""

  def __init__(self, path, *, seq_len: int, seed: int):
    self.path = pathlib.Path(path)
    self.bytes = np.fromfile(self.path, dtype=np.uint8)
    self.seq_len, self.seed = seq_len, seed
    if self.bytes.size <= seq_len + 1:
      raise ValueError(f"{self.path} has {self.bytes.size} bytes; needs more than "
                       f"train.seq_len + 1 = {seq_len + 1}")

  def rows(self, step: int, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of step ``step``'s batch: ``[stop - start, seq_len + 1]`` int32."""
    offsets = np.array([np.random.default_rng([self.seed, step, row]).integers(
        self.bytes.size - self.seq_len - 1) for row in range(start, stop)])
    return self.bytes[offsets[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)

  def describe(self) -> str:
    return f"byte-level corpus: {self.path} ({self.bytes.size:,} bytes)"


def make_corpus(config: Config, split: str = "train"):
  """The corpus ``config.data`` names; ``split="eval"``: its held-out data
  (``data.eval_path``; a shard directory's ``val*.bin``; the synthetic
  corpus's held-out rows), or None where there is none.

  Raises:
    OSError, ValueError: a data file that cannot be used (the message says why).
  """
  train, data = config.train, config.data
  path = data.path if split == "train" else data.eval_path
  shard_split = "train" if split == "train" else "val"
  if split == "eval" and path is None and data.path is not None:
    if not data.is_byte_text and pathlib.Path(data.path).is_dir():
      path = data.path  # its val*.bin
    else:
      return None
  if path is None:
    return SyntheticCorpus(vocab_size=config.model.vocab_size, seq_len=train.seq_len,
                           num_topics=data.num_topics, successors=data.successors,
                           seed=train.seed, held_out=split == "eval")
  if data.is_byte_text:
    return ByteCorpus(path, seq_len=train.seq_len, seed=train.seed)
  return TokenShardCorpus(path, split=shard_split, seq_len=train.seq_len,
                          batch_size=train.batch_size, seed=train.seed,
                          token_dtype=data.token_dtype, vocab_size=config.model.vocab_size)
