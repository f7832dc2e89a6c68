"""Tests for transformer/data/prepared.py (token shards on disk) and the streamed
sources behind it (sources.stream_split): the same batches as from the text, in
the same order, a resumable position, and a changed corpus or vocabulary refused."""

import os

import numpy as np
import pytest

from transformer.data import pipeline as data
from transformer.data import prepared
from transformer.data import sources as data_sources
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.demo_task import demo_splits
from transformer.data.tokenizer import EOS_ID


@pytest.fixture(scope="module")
def pairs():
  return demo_splits(seed=3, num_train=1500, num_eval=10, num_test=10)["train"]


@pytest.fixture(scope="module")
def tok(pairs, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vocab") / "vocab.model")
  return tokenizer_lib.train_tokenizer(
      data_sources.sample_sentences(pairs), path, vocab_size=300, model_type="bpe")


@pytest.fixture()
def tsv(pairs, tmp_path):
  path = tmp_path / "train.tsv"
  path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
  return str(path)


def _prepare(tsv_path, tok, directory, **options):
  stream = data_sources.stream_split({"source": "tsv", "train_path": tsv_path}, "train")
  prepared.prepare(stream, tok, directory, **options)
  return prepared.open_prepared(directory, tok, stream)


def _batches(source, tok, n, **options):
  it = data.train_iterator(source, tok, prefetch=0, **options)
  out = [next(it) for _ in range(n)]
  it.close()
  return out


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_stream_split_gives_the_pairs_of_load_split(pairs, tsv, tmp_path):
  stream = data_sources.stream_split({"source": "tsv", "train_path": tsv}, "train")
  assert list(stream) == data_sources.read_parallel_tsv(tsv) == pairs
  assert len(stream) == len(pairs)
  src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
  src.write_text("\r\n".join(s for s, _ in pairs), encoding="utf-8")  # no final newline
  tgt.write_bytes(b"\xef\xbb\xbf" + "".join(t + "\n" for _, t in pairs).encode())
  config = {"source": "files", "train_src": str(src), "train_tgt": str(tgt)}
  assert list(data_sources.stream_split(config, "train")) == pairs
  # The vocabulary's sample: the same sentences from the stream as from the list.
  for max_sentences in (10, 999, 10**6):
    assert (list(data_sources.sample_sentences(stream, max_sentences))
            == list(data_sources.sample_sentences(pairs, max_sentences)))


def test_stream_split_refuses_bad_lines_as_load_split_does(tmp_path):
  path = tmp_path / "bad.tsv"
  path.write_text("a\tb\nno tab here\nc\td\n", encoding="utf-8")
  stream = data_sources.stream_split({"source": "tsv", "train_path": str(path)}, "train")
  with pytest.raises(data_sources.DataError, match=r"bad.tsv:2: line 2 has no tab"):
    list(stream)
  src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
  src.write_text("a\nb\nc\n", encoding="utf-8")
  tgt.write_text("x\ny\n", encoding="utf-8")
  config = {"source": "files", "train_src": str(src), "train_tgt": str(tgt)}
  with pytest.raises(data_sources.DataError) as streamed:
    list(data_sources.stream_split(config, "train"))
  with pytest.raises(data_sources.DataError) as listed:
    data_sources.load_split(config, "train")
  assert str(streamed.value) == str(listed.value)


def test_shards_hold_each_pairs_ids(pairs, tok, tsv, tmp_path):
  directory = str(tmp_path / "prep")
  corpus = _prepare(tsv, tok, directory, shard_tokens=4000, chunk_pairs=97)
  manifest = corpus.manifest
  assert len(manifest["shards"]) > 3  # several shards, chunks crossing them
  assert len(corpus) == manifest["num_examples"] == len(pairs)
  assert manifest["dtype"] == "<u2"
  for i in [0, 1, 96, 97, 500, len(pairs) - 1] + [s["num_examples"] for s in manifest["shards"][:1]]:
    src, tgt = pairs[i]
    np.testing.assert_array_equal(corpus[i]["inputs"], tok.encode(src) + [EOS_ID])
    np.testing.assert_array_equal(corpus[i]["targets"], tok.encode(tgt) + [EOS_ID])
    assert corpus[i]["inputs"].dtype == np.int32
  total = sum(len(tok.encode(s)) + 1 for s, _ in pairs)
  assert manifest["source_tokens"] == total
  for shard in manifest["shards"][:-1]:  # bounded: closed once it holds shard_tokens
    assert shard["source_tokens"] + shard["target_tokens"] < 4000 + 97 * 2 * 40
  assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.parametrize("pack,max_length,drop_long,shard", [
    (True, 32, True, (0, 1)),
    (True, 12, True, (1, 2)),      # some dropped; this process's half only
    (False, 10, False, (0, 1)),    # some truncated
])
def test_batches_from_shards_equal_batches_from_text(pairs, tok, tsv, tmp_path, pack,
                                                     max_length, drop_long, shard):
  corpus = _prepare(tsv, tok, str(tmp_path / "prep"), shard_tokens=3000, chunk_pairs=128)
  options = dict(batch_size=8, max_length=max_length, seed=7, pack=pack, drop_long=drop_long,
                 shard_index=shard[0], shard_count=shard[1])
  n = 400 if pack else 200  # more than an epoch of this shard
  from_text = _batches(data_sources.read_parallel_tsv(tsv), tok, n, **options)
  from_shards = _batches(corpus, tok, n, **options)
  _assert_same(from_text, from_shards)
  assert any(not np.array_equal(a["inputs"], b["inputs"])  # not one batch repeated
             for a, b in zip(from_shards, from_shards[1:]))


def test_resume_mid_epoch_continues_identically(pairs, tok, tsv, tmp_path):
  corpus = _prepare(tsv, tok, str(tmp_path / "prep"), shard_tokens=3000, chunk_pairs=100)
  options = dict(batch_size=8, max_length=24, seed=1, prefetch=2)
  it = data.train_iterator(corpus, tok, **options)
  for _ in range(37):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(120)]  # into the next epoch
  it.close()
  for source in (corpus, data_sources.read_parallel_tsv(tsv)):  # either path resumes
    resumed = data.train_iterator(source, tok, **options)
    resumed.set_state(state)
    _assert_same([next(resumed) for _ in range(120)], expected)
    resumed.close()



def test_worker_processes_pack_each_example_of_the_corpus_once(pairs, tok, tsv, tmp_path):
  """workers=2 (grain worker processes): every packed segment is an example of
  the corpus, none twice within an epoch, and the same batches again from a
  fresh pool; a position saved by 2 workers is refused by another count."""
  corpus = _prepare(tsv, tok, str(tmp_path / "prep"))
  options = dict(batch_size=8, max_length=24, seed=1, workers=2)
  examples = {(tuple(tok.encode(s) + [EOS_ID]), tuple(tok.encode(t) + [EOS_ID]))
              for s, t in pairs}

  def segments(batch):
    for row in range(len(batch["inputs"])):
      for seg in range(1, batch["inputs_segment_ids"][row].max() + 1):
        yield tuple(tuple(batch[key][row][batch[f"{key}_segment_ids"][row] == seg])
                    for key in ("inputs", "targets"))

  first = _batches(corpus, tok, 30, **options)
  seen = [s for batch in first for s in segments(batch)]
  assert 200 < len(seen) < len(pairs)                  # (within the first epoch)
  assert set(seen) <= examples and len(set(seen)) == len(seen)
  _assert_same(_batches(corpus, tok, 30, **options), first)
  it = data.train_iterator(corpus, tok, **options)
  next(it)
  state = it.get_state()
  it.close()
  for other in (0, 3):
    with pytest.raises(data_sources.DataError, match="set config.data.workers=2"):
      data.check_position_workers(state, other)

def test_a_changed_corpus_is_refused(pairs, tok, tsv, tmp_path):
  directory = str(tmp_path / "prep")
  _prepare(tsv, tok, directory)
  config = {"source": "tsv", "train_path": tsv}
  original = open(tsv, encoding="utf-8").read()
  stat = os.stat(tsv)
  os.utime(tsv, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same text
  prepared.open_prepared(directory, tok, data_sources.stream_split(config, "train"))
  with open(tsv, "a", encoding="utf-8") as f:
    f.write("one more\tpair\n")
  with pytest.raises(prepared.PreparedDataError, match=r"another corpus: .*bytes.*Remove"):
    prepared.open_prepared(directory, tok, data_sources.stream_split(config, "train"))
  assert original[:5] == "fifty"
  open(tsv, "w", encoding="utf-8").write("fiftx" + original[5:])  # same size, other text
  with pytest.raises(prepared.PreparedDataError, match=r"the text of tsv .* differs"):
    prepared.open_prepared(directory, tok, data_sources.stream_split(config, "train"))
  # Pairs in memory (the demo, train(train_pairs=...)): compared by their text.
  memory = str(tmp_path / "memory")
  prepared.prepare(data_sources.stream_pairs(pairs), tok, memory)
  prepared.open_prepared(memory, tok, data_sources.stream_pairs(list(pairs)))
  changed = list(pairs)
  changed[700] = (changed[700][0], changed[700][1] + "!")
  with pytest.raises(prepared.PreparedDataError, match="differs"):
    prepared.open_prepared(memory, tok, data_sources.stream_pairs(changed))


def test_another_vocabulary_or_a_missing_shard_is_refused(pairs, tok, tsv, tmp_path):
  directory = str(tmp_path / "prep")
  _prepare(tsv, tok, directory, shard_tokens=3000, chunk_pairs=100)
  other = tokenizer_lib.train_tokenizer(data_sources.sample_sentences(pairs), None,
                                        vocab_size=280, model_type="bpe")
  with pytest.raises(prepared.PreparedDataError, match=r"another vocabulary .*280 ids"):
    prepared.open_prepared(directory, other)
  os.remove(os.path.join(directory, "shard-00001.targets"))
  with pytest.raises(prepared.PreparedDataError, match=r"shard-00001.targets is missing"):
    prepared.open_prepared(directory, tok)
  with pytest.raises(prepared.PreparedDataError, match="already prepared"):
    prepared.prepare(data_sources.stream_pairs(pairs), tok, directory)
  with pytest.raises(prepared.PreparedDataError, match="no prepared corpus"):
    prepared.open_prepared(str(tmp_path / "nothing"), tok)
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("mine")
  with pytest.raises(prepared.PreparedDataError, match="busy is not empty"):  # before the work
    prepared.prepare(data_sources.StreamedPairs(lambda: 1 / 0, "never read"), tok,
                     str(tmp_path / "busy"))


def test_a_failed_preparation_leaves_nothing(pairs, tok, tmp_path):
  def broken():
    yield from pairs[:600]
    raise data_sources.DataError("x.tsv:601: bad line")
  directory = str(tmp_path / "prep")
  with pytest.raises(data_sources.DataError, match="601"):
    prepared.prepare(data_sources.StreamedPairs(broken, "broken"), tok, directory,
                     chunk_pairs=100)
  assert os.listdir(tmp_path) == []


def _peak_rss_growth(run) -> int:
  """Bytes the peak resident set grows by while `run()` runs (Linux: the peak is
  reset through /proc/self/clear_refs first)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  before = _vm_kb("VmRSS")
  run()
  return (_vm_kb("VmHWM") - before) * 1024


def _vm_kb(field: str) -> int:
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_host_memory_does_not_grow_with_the_corpus(tok, tmp_path):
  """Preparing 10x more pairs (made on the fly, never a list) takes no more
  memory; benchmarks/bench_input_pipeline.py --memory measures it at scale."""
  words = "null eins zwei drei vier fünf sechs sieben acht neun zehn".split()

  def synthetic(n):
    def pairs_():
      rng = np.random.default_rng(0)
      for _ in range(n):
        k = rng.integers(3, 12, size=2)
        yield (" ".join(words[j] for j in rng.integers(0, 11, k[0])),
               " ".join(words[j] for j in rng.integers(0, 11, k[1])))
    return data_sources.StreamedPairs(pairs_, f"synthetic {n}")

  small = _peak_rss_growth(lambda: prepared.prepare(synthetic(6_000), tok,
                                                    str(tmp_path / "small")))
  large = _peak_rss_growth(lambda: prepared.prepare(synthetic(60_000), tok,
                                                    str(tmp_path / "large")))
  assert prepared.read_manifest(str(tmp_path / "large"))["num_examples"] == 60_000
  # A list of 60k such pairs alone takes ~12 MB; growth stays within 4 MB of the small run's.
  assert large < small + 4 * 2**20, (small, large)


def test_the_prepare_command_makes_the_vocabulary_then_the_shards(pairs, tsv, tmp_path):
  import fork_server
  from helpers import REPO, subprocess_env

  def run(cmd):  # (`python -m ...`, forked from a process that imported its libraries)
    return fork_server.run(cmd, subprocess_env(), cwd=REPO, preload=fork_server.TRAINING,
                           text=True, timeout=120)
  workdir = tmp_path / "run"
  cmd = ["-m", "transformer.training.prepare", f"--workdir={workdir}",
         "--config.data.source=tsv", f"--config.data.train_path={tsv}",
         "--config.vocab_size=300"]
  proc = run(cmd)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"{workdir}/prepared: {len(pairs)} pairs" in proc.stdout
  tok = tokenizer_lib.load_tokenizer(str(workdir / "vocab.model"))
  corpus = prepared.open_prepared(str(workdir / "prepared"), tok)
  np.testing.assert_array_equal(corpus[42]["targets"], tok.encode(pairs[42][1]) + [EOS_ID])
  other = tmp_path / "other.tsv"
  other.write_text("a\tb\n", encoding="utf-8")
  proc = run(cmd[:-2] + [f"--config.data.train_path={other}", cmd[-1]])
  assert proc.returncode == 1
  assert "error: " in proc.stderr and "prepared from another corpus" in proc.stderr
