"""Token shards through Grain (examples/token_data.py) and the script that
writes them (examples/tokenize_text.py)."""

import json
import sys

import numpy as np
import pytest

import tokenizers

from tiny_run import REPO  # noqa: F401  (puts the repository on sys.path)
from examples import tokenize_text
from examples.token_data import TokenShardCorpus, TokenWindows, shard_paths

SEQ_LEN, BATCH = 8, 4


def write_counting_shards(directory, sizes, dtype="uint16", first=0):
  """Shards holding consecutive ids ``first, first + 1, ...``: a window is
  named by its first id."""
  directory.mkdir(parents=True, exist_ok=True)
  paths, start = [], first
  for index, size in enumerate(sizes):
    path = directory / f"train-{index:05d}.bin"
    np.arange(start, start + size, dtype=dtype).tofile(path)
    paths.append(path)
    start += size
  return paths


def corpus(path, **kwargs):
  settings = dict(seq_len=SEQ_LEN, batch_size=BATCH, seed=3, token_dtype=None,
                  vocab_size=2**16)
  return TokenShardCorpus(str(path), **{**settings, **kwargs})


@pytest.mark.parametrize("dtype, first", [("uint16", 0), ("uint32", 70_000)])
def test_windows_are_each_shard_cut_at_seq_len_strides(tmp_path, dtype, first):
  paths = write_counting_shards(tmp_path, [20, 9, 30], dtype, first)
  windows = TokenWindows(paths, seq_len=SEQ_LEN, token_dtype=dtype)
  # Reference: per shard, windows of SEQ_LEN + 1 ids starting every SEQ_LEN,
  # none running past the shard's end.
  expected = []
  for path in paths:
    ids = np.fromfile(path, dtype=dtype).astype(np.int64)
    expected += [ids[s:s + SEQ_LEN + 1] for s in range(0, ids.size - SEQ_LEN, SEQ_LEN)]
  assert len(windows) == len(expected) == 2 + 1 + 3
  for index, want in enumerate(expected):
    np.testing.assert_array_equal(windows[index], want)
    assert windows[index].dtype == np.int32


def test_processes_read_disjoint_rows_that_make_the_global_batch_and_cover_an_epoch(tmp_path):
  write_counting_shards(tmp_path, [8 * 40 + 1])  # 40 windows: 10 steps of 4 rows
  data = corpus(tmp_path)
  firsts = []
  for step in range(10):
    # Two processes, each making the rows of its devices (pretrain.global_batch).
    halves = [data.rows(step, 0, BATCH // 2), data.rows(step, BATCH // 2, BATCH)]
    np.testing.assert_array_equal(np.concatenate(halves), data.rows(step, 0, BATCH))
    assert not set(halves[0][:, 0]) & set(halves[1][:, 0])
    firsts += list(np.concatenate(halves)[:, 0])
  # One epoch is every window once, shuffled; the next epoch another order.
  assert sorted(firsts) == list(range(0, 8 * 40, 8)) and firsts != sorted(firsts)
  next_epoch = [data.rows(step, 0, BATCH)[:, 0] for step in range(10, 20)]
  assert sorted(np.concatenate(next_epoch)) == sorted(firsts)
  assert list(np.concatenate(next_epoch)) != firsts


def test_a_new_reader_continues_the_stream_where_the_checkpoint_says_bitwise(tmp_path):
  write_counting_shards(tmp_path, [1000, 777])
  uninterrupted = corpus(tmp_path)
  expected = [uninterrupted.rows(step, 0, BATCH) for step in range(12)]
  resumed = corpus(tmp_path)  # a new process: only the step (data_step) carries over
  for step in range(7, 12):
    np.testing.assert_array_equal(resumed.rows(step, 0, BATCH), expected[step])


def test_shards_are_refused_with_the_reason(tmp_path):
  write_counting_shards(tmp_path / "big", [300], first=1000)
  with pytest.raises(ValueError, match=r"need a vocabulary of 1300: set model.vocab_size>=1300"):
    corpus(tmp_path / "big", vocab_size=1024)
  write_counting_shards(tmp_path / "short", [SEQ_LEN])
  with pytest.raises(ValueError, match=r"holds 8 tokens; each shard needs at least"):
    corpus(tmp_path / "short")


def test_without_grain_token_shards_are_one_line_saying_how_to_install_it(tmp_path,
                                                                         monkeypatch):
  write_counting_shards(tmp_path, [100])
  monkeypatch.setitem(sys.modules, "grain", None)
  with pytest.raises(ValueError, match=r"read with Grain, which is not installed: pip install "):
    corpus(tmp_path)


def test_shard_paths_take_a_file_a_glob_or_a_directory_split(tmp_path):
  for name in ("train-00001.bin", "train-00000.bin", "val-00000.bin"):
    (tmp_path / name).write_bytes(b"")
  assert [p.name for p in shard_paths(str(tmp_path))] == ["train-00000.bin", "train-00001.bin"]
  assert [p.name for p in shard_paths(str(tmp_path), "val")] == ["val-00000.bin"]
  assert [p.name for p in shard_paths(str(tmp_path / "*-00000.bin"))] == [
      "train-00000.bin", "val-00000.bin"]


def test_tokenize_text_writes_byte_shards_with_a_held_out_tail(tmp_path, capsys):
  text = "The quick brown fox jumps over the lazy dog. " * 10 + "caf\u00e9"
  (tmp_path / "in.txt").write_text(text, encoding="utf-8")
  assert tokenize_text.main([str(tmp_path / "in.txt"), str(tmp_path / "out"),
                             "--val-fraction", "0.1", "--shard-tokens", "200"]) == 0
  ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)
  num_val = round(ids.size * 0.1)
  train = np.concatenate([np.fromfile(p, np.uint16) for p in shard_paths(str(tmp_path / "out"))])
  val = np.fromfile(tmp_path / "out" / "val-00000.bin", np.uint16)
  np.testing.assert_array_equal(np.concatenate([train, val]), ids)
  assert val.size == num_val and len(shard_paths(str(tmp_path / "out"))) == 3  # 200 + 200 + 51
  meta = json.loads((tmp_path / "out" / "tokens.json").read_text())
  assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
  assert "data.path=" in capsys.readouterr().out


def test_tokenize_text_with_a_tokenizers_file_round_trips(tmp_path):
  text = "low lower lowest newer newest wider widest " * 30
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  bpe.save(str(tmp_path / "tok.json"))
  (tmp_path / "in.txt").write_text(text)
  assert tokenize_text.main([str(tmp_path / "in.txt"), str(tmp_path / "out"), "--tokenizer",
                             str(tmp_path / "tok.json"), "--val-fraction", "0"]) == 0
  ids = np.fromfile(tmp_path / "out" / "train-00000.bin", np.uint16)
  assert ids.size < len(text) / 2  # merges happened
  assert bpe.decode(ids.tolist()) == text


def test_tokenize_text_refuses_an_unknown_tokenizer_in_one_line(tmp_path, capsys):
  (tmp_path / "in.txt").write_text("x")
  with pytest.raises(SystemExit) as exit_info:
    tokenize_text.main([str(tmp_path / "in.txt"), str(tmp_path / "o"), "--tokenizer", "what"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "--tokenizer 'what': give bytes" in err and len(err.splitlines()) == 1
