"""Sources of (source, target) sentence pairs, chosen by `config.data.source`
(`load_split`); every source is a random-access sequence of string pairs.
Host-side only: no JAX here.
Sources (chosen by `config.data.source`, see `load_split`)
------------------------------------------------------------
* ``demo``  - the built-in synthetic translation task (English number phrases
  -> German, `transformer.data.demo_task`): offline, deterministic, trains on a
  laptop CPU in minutes.
* ``tsv``   - one UTF-8 file per split, ``source<TAB>target`` on every line.
* ``files`` - two aligned UTF-8 files per split, one sentence per line.
* ``tfds``  - a TFDS translation dataset (e.g. ``wmt14_translate/de-en``) read
  with ``tfds.data_source`` from array_record files: random access, no
  TensorFlow needed to read. Preparing it once does need TensorFlow:
  ``tfds build wmt14_translate/de-en --file_format=array_record``.

Every source is a random-access sequence of ``(source, target)`` string pairs.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from transformer.data import text_io
from transformer.data.demo_task import demo_splits

Pair = tuple[str, str]

SPLITS = ("train", "eval", "test")
SOURCES = ("demo", "tsv", "files", "tfds")


class DataError(ValueError):
  """Bad input data or data configuration; the message names file/line/option."""


# ---------------------------------------------------------------------------
# Parallel text files.
# ---------------------------------------------------------------------------


def _read_lines(path: str) -> list[str]:
  """The lines of a UTF-8 text file (`text_io.read_lines`), which must not be
  empty; DataError names the file (and the line of a non-UTF-8 byte)."""
  try:
    lines = text_io.read_lines(path)
  except (text_io.TextFileError, text_io.NotUtf8Error) as e:
    raise DataError(str(e)) from None
  if not any(line.strip() for line in lines):
    raise DataError(f"{path}: file is empty (line 1). Put one example per line.")
  return lines


def read_parallel_tsv(path: str) -> list[Pair]:
  """Reads ``source<TAB>target`` lines (UTF-8) into a list of pairs.

  Raises:
    DataError: missing or empty file, a line without exactly one tab, or bytes
      that are not UTF-8; the message names the file and the 1-based line.
  """
  pairs = []
  for number, line in enumerate(_read_lines(path), start=1):
    tabs = line.count("\t")
    if tabs != 1:
      what = "has no tab" if tabs == 0 else f"has {tabs} tabs"
      raise DataError(
          f"{path}:{number}: line {number} {what}; every line must be "
          f"'source<TAB>target' with exactly one tab (got {line[:60]!r}). Fix "
          "or remove that line."
      )
    src, tgt = line.split("\t")
    pairs.append((src, tgt))
  return pairs


def read_parallel_files(src_path: str, tgt_path: str) -> list[Pair]:
  """Reads two aligned UTF-8 files (line i of one translates line i of other).

  Raises:
    DataError: missing or empty file, different line counts (naming the first
      line without a partner), or bytes that are not UTF-8.
  """
  src = _read_lines(src_path)
  tgt = _read_lines(tgt_path)
  if len(src) != len(tgt):
    longer, shorter = (src_path, tgt_path) if len(src) > len(tgt) else (tgt_path, src_path)
    first = min(len(src), len(tgt)) + 1
    raise DataError(
        f"{longer}:{first}: {src_path} has {len(src)} lines but {tgt_path} has "
        f"{len(tgt)}; line {first} of {longer} has no partner in {shorter}. "
        "The files must be line-aligned translations of each other."
    )
  return list(zip(src, tgt))


# ---------------------------------------------------------------------------
# TFDS.
# ---------------------------------------------------------------------------


def _as_text(value) -> str:
  if isinstance(value, np.ndarray):
    value = value.item()
  if isinstance(value, (bytes, np.bytes_)):
    return bytes(value).decode("utf-8")
  return str(value)


class TfdsPairs(Sequence):
  """Random-access (source, target) view over a TFDS translation data source."""

  def __init__(self, source, name: str, source_lang: str, target_lang: str):
    self._source = source
    self.name = name
    self.source_lang = source_lang
    self.target_lang = target_lang

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    if index < 0:
      index += len(self)
    if not 0 <= index < len(self):
      raise IndexError(index)
    example = self._source[index]
    try:
      return (_as_text(example[self.source_lang]), _as_text(example[self.target_lang]))
    except KeyError as e:
      raise DataError(
          f"TFDS dataset {self.name!r} has no language {e.args[0]!r}; its "
          f"examples have {sorted(example)}. Set config.data.source_lang / "
          "config.data.target_lang to two of those."
      ) from None

  def __repr__(self):
    return (f"TfdsPairs({self.name!r}, {self.source_lang}->{self.target_lang}, "
            f"{len(self)} examples)")


def read_tfds(
    name: str,
    split: str,
    source_lang: str,
    target_lang: str,
    data_dir: str | None = None,
) -> TfdsPairs:
  """Opens a prepared TFDS translation dataset as a sequence of (src, tgt).

  Uses ``tfds.data_source(name, split=split, data_dir=data_dir,
  download=False)``: array_record files, random access, no TensorFlow and no
  network. The dataset must have been prepared once with
  ``tfds build <name> --file_format=array_record [--data_dir=<data_dir>]``
  (that step needs TensorFlow and downloads the data).

  In tests, ``tfds.testing.mock_data(num_examples=...)`` mocks this: it patches
  ``DatasetBuilder.as_data_source``, which ``tfds.data_source`` calls, so the
  same code path runs on random strings and nothing is downloaded.
  """
  import tensorflow_datasets as tfds  # Lazy: slow import, only this source needs it.

  try:  # Registers the legacy WMT builders, which tfds imports lazily.
    import tensorflow_datasets.translate  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except Exception:  # pylint: disable=broad-except
    pass
  where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  build = (f"tfds build {name} --file_format=array_record"
           + (f" --data_dir={data_dir}" if data_dir else ""))
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except tfds.core.registered.DatasetNotFoundError as e:
    first = str(e).splitlines()[0] if str(e) else repr(e)
    raise DataError(
        f"TFDS dataset {name!r} is unknown ({first}). Check config.data.tfds_name "
        "(e.g. 'wmt14_translate/de-en')."
    ) from None
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(
        f"TFDS dataset {name!r} (split {split!r}) could not be opened from {where}: "
        "it is probably not prepared, or not in the array_record format. Prepare "
        f"it once (needs TensorFlow and network): `{build}`. "
        f"(tfds said: {type(e).__name__}: {str(e).strip()[:500]})"
    ) from e
  return TfdsPairs(source, name, source_lang, target_lang)


# ---------------------------------------------------------------------------
# Choosing the source from the config.
# ---------------------------------------------------------------------------


def _field(config, name: str, default: Any = None) -> Any:
  if isinstance(config, Mapping):
    value = config.get(name, default)
  else:
    value = getattr(config, name, default)
  return default if value is None else value


def _required(config, name: str, source: str) -> Any:
  value = _field(config, name)
  if value is None or value == "":
    raise DataError(
        f"config.data.{name} is not set; it is required when "
        f"config.data.source={source!r}. Pass --config.data.{name}=..."
    )
  return value


def load_split(data_config, split: str) -> Sequence[Pair]:
  """The (source, target) pairs of `split` ("train", "eval" or "test").

  `data_config` is `config.data` (an ml_collections ConfigDict, any attribute
  object, or a dict). Fields, by `source`:

  * ``source``: "demo" | "tsv" | "files" | "tfds".
  * demo: ``demo_seed`` (0), optional ``demo_num_train`` (20000),
    ``demo_num_eval`` (500), ``demo_num_test`` (500).
  * tsv: ``train_path``, ``eval_path``, ``test_path``.
  * files: ``train_src``, ``train_tgt``, ``eval_src``, ``eval_tgt``,
    ``test_src``, ``test_tgt``.
  * tfds: ``tfds_name`` (e.g. "wmt14_translate/de-en"), ``tfds_train_split``
    ("train"), ``tfds_eval_split`` ("validation"), ``tfds_test_split``
    ("test"), ``source_lang`` ("en"), ``target_lang`` ("de"),
    ``tfds_data_dir`` (None: $TFDS_DATA_DIR or ~/tensorflow_datasets).

  Only the fields of the chosen source (and split) are read.
  """
  if split not in SPLITS:
    raise DataError(f"Unknown split {split!r}; expected one of {SPLITS}.")
  source = _field(data_config, "source")
  if source == "demo":
    splits = demo_splits(
        seed=_field(data_config, "demo_seed", 0),
        num_train=_field(data_config, "demo_num_train", 20_000),
        num_eval=_field(data_config, "demo_num_eval", 500),
        num_test=_field(data_config, "demo_num_test", 500),
    )
    return splits[split]
  if source == "tsv":
    return read_parallel_tsv(_required(data_config, f"{split}_path", source))
  if source == "files":
    return read_parallel_files(_required(data_config, f"{split}_src", source),
                               _required(data_config, f"{split}_tgt", source))
  if source == "tfds":
    defaults = {"train": "train", "eval": "validation", "test": "test"}
    return read_tfds(
        _required(data_config, "tfds_name", source),
        _field(data_config, f"tfds_{split}_split", defaults[split]),
        source_lang=_field(data_config, "source_lang", "en"),
        target_lang=_field(data_config, "target_lang", "de"),
        data_dir=_field(data_config, "tfds_data_dir") or None,
    )
  raise DataError(
      f"config.data.source={source!r} is not a known data source; choose one "
      f"of {SOURCES}."
  )


def has_split(data_config, split: str) -> bool:
  """Whether `config.data` names `split` (a test split is optional; the demo
  and TFDS always have one unless its split name is emptied)."""
  source = _field(data_config, "source")
  if source == "demo":
    return split != "test" or _field(data_config, "demo_num_test", 500) > 0
  if source == "tsv":
    return bool(_field(data_config, f"{split}_path", ""))
  if source == "files":
    return bool(_field(data_config, f"{split}_src", "")) and bool(
        _field(data_config, f"{split}_tgt", ""))
  if source == "tfds":
    return split != "test" or bool(_field(data_config, "tfds_test_split", "test"))
  return False


def _sample_indices(n: int, max_sentences: int) -> np.ndarray:
  """The indices of the evenly spaced pairs `sample_sentences` takes."""
  num_pairs = min(n, max(1, max_sentences // 2))
  return np.linspace(0, n - 1, num_pairs).round().astype(np.int64) if n else np.zeros(0, np.int64)


def sample_sentences(pairs, max_sentences: int = 1_000_000) -> Iterator[str]:
  """Source and target sentences from evenly spaced pairs (for the vocabulary).

  Yields at most `max_sentences` strings (source, target, source, ...),
  deterministic, spread over the whole corpus rather than its first lines.
  `pairs` is a random-access sequence, or a `StreamedPairs` (read through
  once after it is counted; the same sentences as from the list of its pairs).
  """
  indices = _sample_indices(len(pairs), max_sentences)
  if isinstance(pairs, StreamedPairs):
    wanted = collections.Counter(indices.tolist())
    last = int(indices[-1]) if len(indices) else -1
    for i, (src, tgt) in enumerate(pairs):
      if i > last:
        break
      for _ in range(wanted.get(i, 0)):
        yield src
        yield tgt
    return
  for i in indices:
    src, tgt = pairs[int(i)]
    yield src
    yield tgt


# ---------------------------------------------------------------------------
# Streaming a split (for preparing token shards: the corpus is never held).
# ---------------------------------------------------------------------------


class StreamedPairs:
  """The (source, target) pairs of a split, read one at a time: `iter()`
  reads from the start again, `len()` counts them (once, by reading through);
  memory does not grow with the corpus. The same pairs, in the same order, as
  `load_split` gives as a list (same checks, same messages, given when the
  bad line is reached).

  Attributes:
    description: what the corpus is, for messages ("tsv /data/train.tsv").
    files: [(path, size in bytes, mtime in ns)] of the files read (empty for
      data that is not in files: a changed corpus is then found by its
      content, `content_is_cheap`).
    content_is_cheap: whether reading the whole content again to compare it
      is cheap (the pairs are in memory).
  """

  def __init__(self, make_iter, description: str, files: Sequence[str] = (),
               content_is_cheap: bool = False, num_pairs: int | None = None):
    self._make_iter, self._len = make_iter, num_pairs
    self.description, self.content_is_cheap = description, content_is_cheap
    self.files = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns)
                  for f in files if os.path.exists(f)]

  def __iter__(self) -> Iterator[Pair]:
    return iter(self._make_iter())

  def __len__(self) -> int:
    if self._len is None:
      self._len = sum(1 for _ in self)
    return self._len

  def __repr__(self) -> str:
    return f"StreamedPairs({self.description})"


def _iter_text_lines(path: str) -> Iterator[str]:
  """`text_io.iter_lines` as DataError; an empty file refused as `_read_lines` does."""
  seen_text = False
  try:
    for _, line in text_io.iter_lines(path):
      seen_text = seen_text or bool(line.strip())
      yield line
  except (text_io.TextFileError, text_io.NotUtf8Error) as e:
    raise DataError(str(e)) from None
  if not seen_text:
    raise DataError(f"{path}: file is empty (line 1). Put one example per line.")


def _iter_tsv(path: str) -> Iterator[Pair]:
  for number, line in enumerate(_iter_text_lines(path), start=1):
    tabs = line.count("\t")
    if tabs != 1:
      what = "has no tab" if tabs == 0 else f"has {tabs} tabs"
      raise DataError(
          f"{path}:{number}: line {number} {what}; every line must be "
          f"'source<TAB>target' with exactly one tab (got {line[:60]!r}). Fix "
          "or remove that line."
      )
    src, tgt = line.split("\t")
    yield src, tgt


def _iter_files(src_path: str, tgt_path: str) -> Iterator[Pair]:
  src_lines, tgt_lines = _iter_text_lines(src_path), _iter_text_lines(tgt_path)
  number = 0
  while True:
    src, tgt = next(src_lines, None), next(tgt_lines, None)
    if src is None and tgt is None:
      return
    number += 1
    if src is None or tgt is None:
      longer, shorter = (src_path, tgt_path) if tgt is None else (tgt_path, src_path)
      rest = 1 + sum(1 for _ in (src_lines if tgt is None else tgt_lines))
      longer_count, shorter_count = number - 1 + rest, number - 1
      src_count, tgt_count = ((longer_count, shorter_count) if tgt is None
                              else (shorter_count, longer_count))
      raise DataError(
          f"{longer}:{number}: {src_path} has {src_count} lines but {tgt_path} has "
          f"{tgt_count}; line {number} of {longer} has no partner in {shorter}. "
          "The files must be line-aligned translations of each other."
      )
    yield src, tgt


def stream_pairs(pairs: Sequence[Pair], description: str = "pairs in memory") -> StreamedPairs:
  """A sequence of pairs already in memory (the demo, `train(train_pairs=...)`) as a
  StreamedPairs."""
  return StreamedPairs(lambda: iter(pairs), description, content_is_cheap=True,
                       num_pairs=len(pairs))


def stream_split(data_config, split: str) -> StreamedPairs:
  """The pairs of `split` as `load_split` gives them, streamed (`StreamedPairs`):
  text files are read a line at a time, TFDS a record at a time."""
  source = _field(data_config, "source")
  if source == "tsv":
    path = _required(data_config, f"{split}_path", source)
    return StreamedPairs(lambda: _iter_tsv(path), f"tsv {path}", files=[path])
  if source == "files":
    src = _required(data_config, f"{split}_src", source)
    tgt = _required(data_config, f"{split}_tgt", source)
    return StreamedPairs(lambda: _iter_files(src, tgt), f"files {src} {tgt}", files=[src, tgt])
  pairs = load_split(data_config, split)  # demo (small, in memory) or TFDS (random access)
  if source == "tfds":
    return StreamedPairs(lambda: iter(pairs), f"{pairs!r} split {split}", num_pairs=len(pairs))
  return stream_pairs(pairs, f"{source} {split} split")
