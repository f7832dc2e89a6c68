"""Tests for transformer/data/pipeline.py: sources, grain pipelines (the demo task itself:
test_demo_task.py)."""

import collections
import json
import math
import os
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from transformer.data import pipeline as data
from transformer.data import sources as data_sources
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.demo_task import demo_splits
from transformer.data.tokenizer import EOS_ID, PAD_ID

KEYS = {"inputs", "targets", "inputs_segment_ids", "targets_segment_ids",
        "inputs_positions", "targets_positions"}


@pytest.fixture(scope="module")
def demo():
  return demo_splits(seed=0, num_train=2000, num_eval=100, num_test=100)


@pytest.fixture(scope="module")
def tok(demo, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vocab") / "vocab.model")
  return tokenizer_lib.train_tokenizer(
      data_sources.sample_sentences(demo["train"]), path, vocab_size=400, model_type="bpe")


def _expected(tok, pair, max_length=None):
  """Independent tokenization: (inputs, targets) tuples with EOS appended."""
  src = tuple(tok.encode(pair[0])) + (EOS_ID,)
  tgt = tuple(tok.encode(pair[1])) + (EOS_ID,)
  if max_length is not None:
    src = src if len(src) <= max_length else src[:max_length - 1] + (EOS_ID,)
    tgt = tgt if len(tgt) <= max_length else tgt[:max_length - 1] + (EOS_ID,)
  return src, tgt


def _unpack(batch):
  """Brute force: every (inputs, targets) segment of every row, checking layout."""
  examples = []
  n_rows, length = batch["inputs"].shape
  for r in range(n_rows):
    segs = {}
    for side in ("inputs", "targets"):
      tokens = batch[side][r]
      seg = batch[f"{side}_segment_ids"][r]
      pos = batch[f"{side}_positions"][r]
      # Padding: token 0, segment 0, position 0.
      assert np.all(tokens[seg == 0] == PAD_ID)
      assert np.all(pos[seg == 0] == 0)
      ids = sorted(set(seg[seg > 0].tolist()))
      assert ids == list(range(1, len(ids) + 1)), f"segment ids not 1..k: {seg}"
      for s in ids:
        where = np.flatnonzero(seg == s)
        assert np.all(np.diff(where) == 1), "segment not contiguous"
        np.testing.assert_array_equal(pos[where], np.arange(len(where)))
        assert tokens[where[-1]] == EOS_ID and EOS_ID not in tokens[where[:-1]]
      # Real tokens are never PAD.
      assert np.all(tokens[seg > 0] != PAD_ID)
      segs[side] = {s: tuple(tokens[seg == s].tolist()) for s in ids}
    assert segs["inputs"].keys() == segs["targets"].keys()
    examples += [(segs["inputs"][s], segs["targets"][s]) for s in segs["inputs"]]
  return examples


def _check_shapes(batch, batch_size, max_length):
  assert set(batch) == KEYS
  for key, value in batch.items():
    assert value.shape == (batch_size, max_length), key
    assert value.dtype == np.int32, key


# ---------------------------------------------------------------------------
# Parallel text files.
# ---------------------------------------------------------------------------


def test_read_tsv(tmp_path):
  path = tmp_path / "train.tsv"
  path.write_bytes("\ufeffHello\tHallo\r\ngreat street\tgroße Straße\nempty target\t\n".encode())
  assert data_sources.read_parallel_tsv(str(path)) == [
      ("Hello", "Hallo"), ("great street", "große Straße"), ("empty target", "")]
  path.write_text("a\tb\nc\td")  # no newline at the end
  assert data_sources.read_parallel_tsv(str(path)) == [("a", "b"), ("c", "d")]


def test_read_two_files(tmp_path):
  (tmp_path / "s.txt").write_text("one\ntwo\n\nfour\n", encoding="utf-8")
  (tmp_path / "t.txt").write_text("eins\nzwei\n\nvier\n", encoding="utf-8")
  assert data_sources.read_parallel_files(str(tmp_path / "s.txt"), str(tmp_path / "t.txt")) == [
      ("one", "eins"), ("two", "zwei"), ("", ""), ("four", "vier")]


def test_missing_file(tmp_path):
  path = str(tmp_path / "nope.tsv")
  with pytest.raises(data_sources.DataError, match="nope.tsv.*not found"):
    data_sources.read_parallel_tsv(path)
  (tmp_path / "t.txt").write_text("x\n")
  with pytest.raises(data_sources.DataError, match="nope.tsv"):
    data_sources.read_parallel_files(path, str(tmp_path / "t.txt"))


@pytest.mark.parametrize("content", ["", "\n \r\n\t\n"])  # nothing, or only blank lines
def test_empty_file(tmp_path, content):
  path = tmp_path / "empty.tsv"
  path.write_text(content)
  with pytest.raises(data_sources.DataError) as info:
    data_sources.read_parallel_tsv(str(path))
  assert str(info.value) == f"{path}: file is empty (line 1). Put one example per line."


def test_mismatched_line_counts(tmp_path):
  src, tgt = tmp_path / "train.en", tmp_path / "train.de"
  src.write_text("a\nb\nc\n")
  tgt.write_text("x\ny\n")
  with pytest.raises(data_sources.DataError) as info:
    data_sources.read_parallel_files(str(src), str(tgt))
  msg = str(info.value)
  assert f"{src}:3" in msg and "line 3" in msg and "3 lines" in msg and "2" in msg
  assert str(tgt) in msg


@pytest.mark.parametrize("line, what", [("no tab here", "no tab"), ("a\tb\tc", "2 tabs")])
def test_tsv_line_without_exactly_one_tab(tmp_path, line, what):
  path = tmp_path / "bad.tsv"
  path.write_text(f"a\tb\nc\td\n{line}\ne\tf\n")
  with pytest.raises(data_sources.DataError) as info:
    data_sources.read_parallel_tsv(str(path))
  msg = str(info.value)
  assert f"{path}:3" in msg and "line 3" in msg and what in msg


def test_non_utf8_bytes(tmp_path):
  path = tmp_path / "latin1.tsv"
  path.write_bytes(b"a\tb\nStra\xdfe\tstreet\n")
  with pytest.raises(data_sources.DataError) as info:
    data_sources.read_parallel_tsv(str(path))
  msg = str(info.value)  # text_io.NotUtf8Error's message (tested in test_text_io.py)
  assert msg.startswith(f"{path}:2: line 2, column 5: byte 0xdf is not valid UTF-8")
  assert f"iconv -f latin1 -t utf-8 {path}" in msg
  good = tmp_path / "good.txt"
  good.write_text("x\ny\n")
  with pytest.raises(data_sources.DataError, match=r"latin1.tsv:2"):
    data_sources.read_parallel_files(str(good), str(path))


# ---------------------------------------------------------------------------
# Source selection.
# ---------------------------------------------------------------------------


def test_load_split_from_config(tmp_path, demo):
  cfg = ml_collections.ConfigDict(dict(source="demo", demo_seed=0, demo_num_train=2000,
                                       demo_num_eval=100, demo_num_test=100))
  assert data_sources.load_split(cfg, "train") == demo["train"]
  assert data_sources.load_split(cfg, "eval") == demo["eval"]

  (tmp_path / "train.tsv").write_text("a\tb\n")
  cfg = ml_collections.ConfigDict(dict(source="tsv", train_path=str(tmp_path / "train.tsv"),
                                       eval_path=""))
  assert data_sources.load_split(cfg, "train") == [("a", "b")]
  with pytest.raises(data_sources.DataError, match=r"config\.data\.eval_path"):
    data_sources.load_split(cfg, "eval")

  (tmp_path / "e.en").write_text("x\n")
  (tmp_path / "e.de").write_text("y\n")
  cfg = {"source": "files", "eval_src": str(tmp_path / "e.en"), "eval_tgt": str(tmp_path / "e.de")}
  assert data_sources.load_split(cfg, "eval") == [("x", "y")]


def test_unknown_source_names_the_option():
  cfg = ml_collections.ConfigDict(dict(source="csv"))
  with pytest.raises(data_sources.DataError, match=r"config\.data\.source='csv'"):
    data_sources.load_split(cfg, "train")


def test_sample_sentences(demo):
  got = list(data_sources.sample_sentences(demo["train"], max_sentences=10))
  assert len(got) == 10
  assert got[0:2] == list(demo["train"][0]) and got[-2:] == list(demo["train"][-1])
  assert len(list(data_sources.sample_sentences(demo["eval"]))) == 2 * len(demo["eval"])


# ---------------------------------------------------------------------------
# TFDS (mocked: nothing is downloaded).
# ---------------------------------------------------------------------------


def test_tfds_source_with_mock_data(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=24):
    pairs = data_sources.read_tfds("wmt14_translate/de-en", "train", "en", "de")
    assert len(pairs) == 24
    examples = [pairs[i] for i in range(len(pairs))]
    assert all(isinstance(s, str) and isinstance(t, str) for s, t in examples)
    raw = tfds.data_source("wmt14_translate/de-en", split="train")
    text = lambda v: v.decode() if isinstance(v, bytes) else v
    assert examples == [(text(raw[i]["en"]), text(raw[i]["de"])) for i in range(24)]
    assert len(set(examples)) > 1 and examples[0][0] != examples[0][1]
    tok = tokenizer_lib.train_tokenizer(
        data_sources.sample_sentences(pairs), str(tmp_path / "v.model"), vocab_size=60)
    it = data.train_iterator(pairs, tok, batch_size=4, max_length=48, seed=0)
    for _ in range(3):
      batch = next(it)
      _check_shapes(batch, 4, 48)
      expected = {_expected(tok, p) for p in examples}
      assert set(_unpack(batch)) <= expected
    cfg = ml_collections.ConfigDict(dict(
        source="tfds", tfds_name="wmt14_translate/de-en", tfds_eval_split="validation",
        source_lang="en", target_lang="de", tfds_data_dir=None))
    evals = data_sources.load_split(cfg, "eval")
    batches = list(data.eval_batches(evals, tok, batch_size=5, max_length=48))
    assert len(batches) == 5 and sum(int(b["weights"].sum()) for b in batches) == 24


def test_tfds_not_prepared_is_a_clear_error(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  with pytest.raises(data_sources.DataError) as info:
    data_sources.read_tfds("wmt14_translate/de-en", "train", "en", "de", data_dir=str(tmp_path))
  msg = str(info.value)
  assert "wmt14_translate/de-en" in msg
  assert "tfds build wmt14_translate/de-en --file_format=array_record" in msg


# ---------------------------------------------------------------------------
# Training batches: packing, padding, sharding, determinism, checkpointing.
# ---------------------------------------------------------------------------


def _take(it, n):
  return [next(it) for _ in range(n)]


def _count_until(it, pairs_count, epochs):
  """Takes batches until they hold >= epochs * pairs_count examples."""
  counts, batches = collections.Counter(), 0
  while sum(counts.values()) < epochs * pairs_count:
    counts.update(_unpack(next(it)))
    batches += 1
  return counts


@pytest.mark.parametrize("pack", [True, False])
def test_batches_reconstruct_the_examples(demo, tok, pack):
  pairs = demo["train"][:300]
  expected = {_expected(tok, p): i for i, p in enumerate(pairs)}
  assert len(expected) == len(pairs)
  it = data.train_iterator(pairs, tok, batch_size=8, max_length=32, seed=3, pack=pack)
  first = next(it)
  _check_shapes(first, 8, 32)
  if pack:  # Several examples share a row.
    assert first["inputs_segment_ids"].max() >= 2
  else:
    assert first["inputs_segment_ids"].max() == 1
  counts = collections.Counter(_unpack(first)) + _count_until(it, len(pairs), 2)
  assert set(counts) == set(expected)  # nothing invented, nothing lost
  # Grain's packer keeps the order of the shuffled stream (epoch after epoch),
  # so after M examples each one was seen floor(M/n) or floor(M/n)+1 times.
  total, n = sum(counts.values()), len(pairs)
  assert set(counts.values()) <= {total // n, total // n + 1}
  assert sum(1 for c in counts.values() if c == total // n + 1) == total % n


def test_packing_fills_rows(demo, tok):
  pairs = demo["train"][:500]
  packed = _take(data.train_iterator(pairs, tok, batch_size=16, max_length=32, seed=0), 5)
  padded = _take(data.train_iterator(pairs, tok, batch_size=16, max_length=32, seed=0,
                                     pack=False), 5)
  fill = lambda bs: np.mean([(b["targets_segment_ids"] > 0).mean() for b in bs])
  assert fill(packed) > 2 * fill(padded)


def test_long_examples_dropped_or_truncated(demo, tok):
  long_pair = (" ".join(["seven hundred seventy-seven"] * 20), "sieben " * 40)
  pairs = list(demo["train"][:20]) + [long_pair]
  summary = data.summarize(pairs, tok, max_length=32)
  assert summary.num_examples == 21 and summary.num_too_long == 1
  assert "1 longer than max_length=32" in str(summary)

  dropped = _count_until(data.train_iterator(pairs, tok, batch_size=4, max_length=32,
                                             seed=0, pack=False), 21, 2)
  assert _expected(tok, long_pair, 32) not in dropped and len(dropped) == 20

  with pytest.raises(data_sources.DataError, match="max_length=4"):
    data.train_iterator(pairs, tok, batch_size=4, max_length=4, seed=0)

  kept = _count_until(data.train_iterator(pairs, tok, batch_size=4, max_length=32, seed=0,
                                          pack=False, drop_long=False), 21, 2)
  truncated = _expected(tok, long_pair, 32)
  assert truncated in kept and len(truncated[0]) == 32 and len(truncated[1]) == 32


def test_sharding_is_disjoint_and_covers_everything(demo, tok):
  pairs = demo["train"][:101]
  seen = []
  for shard in range(2):
    start, end = data.shard_bounds(len(pairs), shard, 2)
    it = data.train_iterator(pairs, tok, batch_size=4, max_length=32, seed=0,
                             shard_index=shard, shard_count=2)
    seen.append(set(_count_until(it, end - start, 2)))
    assert seen[-1] == {_expected(tok, p) for p in pairs[start:end]}
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == {_expected(tok, p) for p in pairs}
  assert data.shard_bounds(101, 0, 2) == (0, 50) and data.shard_bounds(101, 1, 2) == (50, 101)


def test_same_seed_same_batches(demo, tok):
  pairs = demo["train"][:400]
  make = lambda seed: data.train_iterator(pairs, tok, batch_size=8, max_length=32, seed=seed)
  a, b, c = _take(make(0), 4), _take(make(0), 4), _take(make(1), 4)
  for x, y in zip(a, b):
    for key in KEYS:
      np.testing.assert_array_equal(x[key], y[key])
  # Another seed gives another example order, not just shuffled rows.
  assert set(_unpack(a[0])) != set(_unpack(c[0]))


@pytest.mark.parametrize("pack, prefetch", [(True, 2), (False, 2), (True, 0)])
def test_iterator_state_save_and_restore(demo, tok, pack, prefetch):
  pairs = demo["train"][:150]  # small, so the restored part crosses an epoch
  make = lambda: data.train_iterator(pairs, tok, batch_size=8, max_length=32, seed=5,
                                     pack=pack, prefetch=prefetch)
  it = make()
  _take(it, 7)
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON (orbax)
  after = _take(it, 12)
  restored = make()
  restored.set_state(state)
  for x, y in zip(after, _take(restored, 12)):
    for key in KEYS:
      np.testing.assert_array_equal(x[key], y[key])


# ---------------------------------------------------------------------------
# Evaluation batches.
# ---------------------------------------------------------------------------


def test_eval_batches_keep_every_example_once_in_order(demo, tok):
  pairs = list(demo["eval"][:23])
  long_pair = ("one big dog " * 30, "ein großer Hund " * 30)
  pairs.append(long_pair)
  batches = list(data.eval_batches(pairs, tok, batch_size=5, max_length=32))
  assert len(batches) == math.ceil(24 / 5)
  rows = []
  for batch in batches:
    assert set(batch) == KEYS | {"weights"}
    assert batch["weights"].shape == (5,) and batch["weights"].dtype == np.int32
    _check_shapes({k: v for k, v in batch.items() if k != "weights"}, 5, 32)
    for r in range(5):
      if batch["weights"][r]:
        (example,) = _unpack({k: v[r:r + 1] for k, v in batch.items() if k != "weights"})
        rows.append(example)
      else:  # An empty filler row.
        for key in KEYS:
          assert not batch[key][r].any()
  assert batches[-1]["weights"].tolist() == [1, 1, 1, 1, 0]
  assert rows == [_expected(tok, p, max_length=32) for p in pairs]
  assert len(rows[-1][0]) == 32 and rows[-1][0][-1] == EOS_ID  # truncated, EOS kept


def test_process_exits_cleanly_with_a_live_iterator(tok):
  # A prefetch thread still running at exit used to abort the interpreter
  # (exit status 134) after training had finished.
  script = "\n".join([
      "from transformer.data import demo_task, pipeline as data, tokenizer",
      f"tok = tokenizer.load_tokenizer({tok.model_path!r})",
      "pairs = demo_task.demo_splits(0, num_train=200, num_eval=1, num_test=1)['train']",
      "it = data.train_iterator(pairs, tok, batch_size=8, max_length=32, seed=0)",
      "next(it)",
      "print('ok')",
  ])
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "ok"
