"""Prepared corpora: a corpus tokenized once into token shards on disk, read by
training through memory maps, so that host memory does not grow with the corpus
and no sentence is tokenized again each epoch.

Host-side only (numpy); no JAX here. `prepare` writes a directory; `open_prepared`
checks it against the vocabulary and the corpus and returns a `PreparedCorpus`,
a grain random-access data source that `pipeline.train_dataset` takes in place
of the pairs: the same shuffle, packing, per-process shard and checkpointable
position, and the same batches as from the text (tests/test_prepared.py).

The directory
-------------
::

    manifest.json             what was prepared, from what, with which vocabulary
    shard-00000.inputs        source ids of the shard's examples, one flat array
    shard-00000.targets       target ids, one flat array
    shard-00000.offsets       int64 [examples + 1, 2]: where each example's
                              (source, target) ids end; row 0 is (0, 0)
    shard-00001.inputs ...

Ids are raw little-endian arrays (uint16 when the vocabulary has at most 65,536
ids, else int32; the manifest says which), each example's ids followed by EOS
and *not* truncated: `max_length` and `drop_long` are applied when training
reads them, so one preparation serves any max_length. A shard is closed once it
holds `shard_tokens` ids (source + target), so a file stays of bounded size
(~256 MB at the default, in uint16).

`prepare` streams the pairs (`sources.StreamedPairs`), tokenizing `chunk_pairs`
at a time, writes into `<directory>.tmp-<pid>` and renames it into place at the
end: a preparation killed half-way leaves no directory that looks prepared.

The manifest records the vocabulary's SHA-256 and the corpus (its description,
number of pairs, the SHA-256 of its text, and for files their paths, sizes and
modification times). `open_prepared` refuses, naming what changed and what to do,
a directory prepared with another vocabulary or from another corpus: files of
another size or content (the content is hashed again only when a file's
modification time or path changed), or, for pairs held in memory, other text.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Iterable, Sequence

import numpy as np

from transformer.data import text_io
from transformer.data.sources import DataError, Pair, StreamedPairs
from transformer.data.tokenizer import EOS_ID

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 1 << 27  # ids (source + target) per shard: 256 MB in uint16
DEFAULT_CHUNK_PAIRS = 4096       # pairs tokenized at a time


class PreparedDataError(DataError):
  """A prepared directory that is missing, incomplete, or does not match the
  vocabulary or the corpus; the message says which and what to do."""


def vocabulary_hash(tokenizer) -> str:
  """SHA-256 of the vocabulary's serialized model (what tokenizes the corpus)."""
  return hashlib.sha256(tokenizer.serialized_model()).hexdigest()


def _update_hash(hasher, src: str, tgt: str) -> None:
  hasher.update(src.encode("utf-8"))
  hasher.update(b"\t")
  hasher.update(tgt.encode("utf-8"))
  hasher.update(b"\n")


def content_hash(pairs: Iterable[Pair]) -> tuple[str, int]:
  """(SHA-256 of the pairs' text as "source<TAB>target\\n" lines, number of pairs)."""
  hasher, n = hashlib.sha256(), 0
  for src, tgt in pairs:
    _update_hash(hasher, src, tgt)
    n += 1
  return hasher.hexdigest(), n


def id_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def _shard_name(index: int) -> str:
  return f"shard-{index:05d}"


def _flat_ids(id_lists: Sequence[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
  """(every list's ids followed by EOS, concatenated; the lengths, EOS included)."""
  lengths = np.fromiter((len(ids) + 1 for ids in id_lists), np.int64, count=len(id_lists))
  flat = np.fromiter(itertools.chain.from_iterable(ids + [EOS_ID] for ids in id_lists),
                     dtype, count=int(lengths.sum()))
  return flat, lengths


class _ShardWriter:
  """Appends chunks of tokenized examples to shard files, starting a new shard
  once one holds `shard_tokens` ids."""

  def __init__(self, directory: str, dtype, shard_tokens: int):
    self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
    self.shards: list[dict] = []
    self._files = None

  def _open(self) -> None:
    name = _shard_name(len(self.shards))
    self._files = [open(os.path.join(self.directory, f"{name}.{part}"), "wb")
                   for part in ("inputs", "targets", "offsets")]
    self._files[2].write(np.zeros((1, 2), "<i8").tobytes())
    self.shards.append({"name": name, "num_examples": 0, "source_tokens": 0,
                        "target_tokens": 0})

  def _close(self) -> None:
    if self._files is not None:
      for f in self._files:
        f.flush()
        os.fsync(f.fileno())
        f.close()
      self._files = None

  def add(self, source_ids: Sequence[list[int]], target_ids: Sequence[list[int]]) -> None:
    if self._files is None:
      self._open()
    shard = self.shards[-1]
    src, src_len = _flat_ids(source_ids, self.dtype)
    tgt, tgt_len = _flat_ids(target_ids, self.dtype)
    offsets = np.stack([shard["source_tokens"] + np.cumsum(src_len),
                        shard["target_tokens"] + np.cumsum(tgt_len)], axis=1).astype("<i8")
    self._files[0].write(src.tobytes())
    self._files[1].write(tgt.tobytes())
    self._files[2].write(offsets.tobytes())
    shard["num_examples"] += len(source_ids)
    shard["source_tokens"] += len(src)
    shard["target_tokens"] += len(tgt)
    if shard["source_tokens"] + shard["target_tokens"] >= self.shard_tokens:
      self._close()

  def finish(self) -> list[dict]:
    self._close()
    return self.shards


def prepare(pairs: StreamedPairs, tokenizer, directory: str, *,
            shard_tokens: int = DEFAULT_SHARD_TOKENS,
            chunk_pairs: int = DEFAULT_CHUNK_PAIRS, log_every_seconds: float = 60.0) -> dict:
  """Tokenizes `pairs` (streamed, in order) into token shards in `directory`
  (see the module docstring), which must not exist yet. Returns the manifest.

  Source sentences are encoded with `tokenizer.encode`, targets with
  `encode_target` (EOS appended to both), as `pipeline.train_dataset` does from
  text. Memory holds one chunk of `chunk_pairs` pairs at a time.
  """
  if os.path.exists(os.path.join(directory, MANIFEST)):
    raise PreparedDataError(f"{directory} is already prepared; remove it to prepare again.")
  if os.path.isdir(directory) and os.listdir(directory):
    raise PreparedDataError(f"{directory} is not empty and holds no prepared corpus; give "
                            "config.data.prepared_dir a new or empty directory.")
  if shard_tokens < 1 or chunk_pairs < 1:
    raise ValueError(f"need shard_tokens, chunk_pairs >= 1, got {shard_tokens}, {chunk_pairs}")
  start = last_log = time.perf_counter()
  tmp = f"{os.path.abspath(directory)}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    dtype = id_dtype(tokenizer.vocab_size)
    writer, hasher, count = _ShardWriter(tmp, dtype, shard_tokens), hashlib.sha256(), 0
    longest = [0, 0]
    stream = iter(pairs)
    while True:
      chunk = list(itertools.islice(stream, chunk_pairs))
      if not chunk:
        break
      for src, tgt in chunk:
        _update_hash(hasher, src, tgt)
      source_ids = tokenizer.encode_batch([src for src, _ in chunk])
      target_ids = tokenizer.encode_target_batch([tgt for _, tgt in chunk])
      longest = [max(longest[0], 1 + max(map(len, source_ids))),
                 max(longest[1], 1 + max(map(len, target_ids)))]
      writer.add(source_ids, target_ids)
      count += len(chunk)
      if time.perf_counter() - last_log > log_every_seconds:
        last_log = time.perf_counter()
        logger.info("Prepared %d pairs (%.0f pairs/s) into %s", count,
                    count / (last_log - start), directory)
    shards = writer.finish()
    if not count:
      raise PreparedDataError(f"{pairs.description}: no pairs to prepare.")
    manifest = {
        "format": FORMAT,
        "num_examples": count,
        "dtype": dtype.str,
        "vocab_size": tokenizer.vocab_size,
        "vocabulary_sha256": vocabulary_hash(tokenizer),
        "corpus": {
            "description": pairs.description,
            "num_pairs": count,
            "sha256": hasher.hexdigest(),
            "files": [{"path": p, "size": size, "mtime_ns": mtime}
                      for p, size, mtime in pairs.files],
        },
        "source_tokens": sum(s["source_tokens"] for s in shards),
        "target_tokens": sum(s["target_tokens"] for s in shards),
        "longest_source": longest[0],
        "longest_target": longest[1],
        "shards": shards,
        "seconds": round(time.perf_counter() - start, 3),
    }
    text_io.write_atomically(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    if os.path.isdir(directory) and not os.listdir(directory):
      os.rmdir(directory)
    os.rename(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  logger.info("Prepared %d pairs (%d source, %d target tokens, %d shards) from %s into %s "
              "in %.1f s.", count, manifest["source_tokens"], manifest["target_tokens"],
              len(shards), pairs.description, directory, manifest["seconds"])
  return manifest


def read_manifest(directory: str) -> dict | None:
  """The manifest of a prepared `directory`; None if it has none (not prepared)."""
  path = os.path.join(directory, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
      raise ValueError(f"larger than {MAX_MANIFEST_BYTES:,} bytes")
    manifest = json.loads(raw.decode("utf-8"))
  except ValueError as e:  # (UnicodeDecodeError, JSONDecodeError among them)
    raise PreparedDataError(f"{path} is not valid JSON ({e}); remove {directory} and "
                            "prepare it again.") from None
  problem = manifest_problem(manifest)
  if problem:
    raise PreparedDataError(f"{path} is not a manifest this version wrote ({problem}); "
                            f"remove {directory} and prepare it again.")
  return manifest


MAX_MANIFEST_BYTES = 1 << 26  # 64 MB: ~100 bytes a shard, a few hundred a corpus file
_MAX_COUNT = 1 << 48          # examples or ids: past any corpus, yet an int64


def _count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def manifest_problem(manifest) -> str | None:
  """Why `manifest` (read from a directory that may come from elsewhere) is not
  one `prepare` writes, in a few words, or None. Checks the types and ranges of
  everything `open_prepared` and `PreparedCorpus` use: the format, the id type
  (only those `id_dtype` gives), the shards' names (exactly shard-00000,
  shard-00001, ...: no path leaves the directory) and counts, the corpus."""
  if not isinstance(manifest, dict):
    return "not a JSON object"
  if manifest.get("format") != FORMAT:
    return None  # (open_prepared names the format and what to do)
  for name in ("num_examples", "vocab_size", "source_tokens", "target_tokens"):
    if not _count(manifest.get(name)):
      return f"{name} is not a count"
  if manifest["vocab_size"] < 1 or manifest.get("dtype") != id_dtype(manifest["vocab_size"]).str:
    return f"dtype {manifest.get('dtype')!r:.20} is not the id type of {manifest['vocab_size']} ids"
  if not isinstance(manifest.get("vocabulary_sha256"), str):
    return "vocabulary_sha256 is not a string"
  corpus = manifest.get("corpus")
  if not (isinstance(corpus, dict) and isinstance(corpus.get("description"), str)
          and _count(corpus.get("num_pairs")) and isinstance(corpus.get("sha256"), str)
          and isinstance(corpus.get("files"), list)):
    return "corpus is not {description, num_pairs, sha256, files}"
  for f in corpus["files"]:
    if not (isinstance(f, dict) and isinstance(f.get("path"), str) and _count(f.get("size"))
            and isinstance(f.get("mtime_ns"), int)):
      return "a corpus file is not {path, size, mtime_ns}"
  shards = manifest.get("shards")
  if not isinstance(shards, list) or not shards:
    return "shards is not a list of shards"
  for index, shard in enumerate(shards):
    if not isinstance(shard, dict) or shard.get("name") != _shard_name(index):
      return f"shard {index} is not named {_shard_name(index)}"
    for name in ("num_examples", "source_tokens", "target_tokens"):
      if not _count(shard.get(name)):
        return f"{_shard_name(index)}'s {name} is not a count"
  for name in ("num_examples", "source_tokens", "target_tokens"):
    if sum(shard[name] for shard in shards) != manifest[name]:
      return f"its shards' {name} do not add up to {manifest[name]}"
  return None


class PreparedCorpus:
  """The examples of a prepared directory: a grain random-access data source
  (`len()`, `[i]`) whose example i is {"inputs", "targets"}: int32 ids with EOS,
  not truncated, of pair i of the corpus. Reads through memory maps, opened on
  first use (also after pickling, e.g. into a grain worker process): only the
  pages of the examples read come into memory, and the OS may drop them again."""

  def __init__(self, directory: str, manifest: dict):
    self.directory, self.manifest = directory, manifest
    self.dtype = np.dtype(manifest["dtype"])
    self.vocab_size = int(manifest["vocab_size"])
    counts = [s["num_examples"] for s in manifest["shards"]]
    self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self._maps = None

  def __getstate__(self):
    return {"directory": self.directory, "manifest": self.manifest}

  def __setstate__(self, state):
    self.__init__(state["directory"], state["manifest"])

  def _open(self):
    maps = []
    for shard in self.manifest["shards"]:
      base = os.path.join(self.directory, shard["name"])
      maps.append((_map(f"{base}.inputs", self.dtype), _map(f"{base}.targets", self.dtype),
                   _map(f"{base}.offsets", np.dtype("<i8")).reshape(-1, 2)))
    self._maps = maps
    return maps

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if index < 0:
      index += len(self)
    if not 0 <= index < len(self):
      raise IndexError(index)
    maps = self._maps or self._open()
    shard = int(np.searchsorted(self._starts, index, side="right")) - 1
    inputs, targets, offsets = maps[shard]
    j = index - int(self._starts[shard])
    src_start, tgt_start, src_end, tgt_end = offsets[j:j + 2].ravel().tolist()
    if not (0 <= src_start <= src_end <= len(inputs) and 0 <= tgt_start <= tgt_end <= len(targets)):
      raise PreparedDataError(
          f"{os.path.join(self.directory, self.manifest['shards'][shard]['name'])}.offsets "
          f"gives example {j} the ids {src_start}:{src_end} and {tgt_start}:{tgt_end}, outside "
          f"its shard: {self.directory} is damaged. Remove it and prepare it again.")
    example = {"inputs": np.asarray(inputs[src_start:src_end], np.int32),
               "targets": np.asarray(targets[tgt_start:tgt_end], np.int32)}
    for part, ids in example.items():
      if ids.size and not (int(ids.max()) < self.vocab_size
                           and (self.dtype.kind == "u" or int(ids.min()) >= 0)):
        raise PreparedDataError(
            f"{os.path.join(self.directory, self.manifest['shards'][shard]['name'])}.{part} "
            f"holds ids outside [0, {self.vocab_size}) in example {j}: {self.directory} is "
            "damaged. Remove it and prepare it again.")
    return example

  def __repr__(self) -> str:
    return (f"PreparedCorpus({self.directory!r}, {len(self)} examples from "
            f"{self.manifest['corpus']['description']})")


def _map(path: str, dtype: np.dtype) -> np.ndarray:
  """The file as a read-only 1-D array over a memory map (a plain ndarray: slicing
  it costs less than slicing an np.memmap)."""
  if os.path.getsize(path) == 0:
    return np.zeros(0, dtype)
  with open(path, "rb") as f:
    return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype)


def _check_files(directory: str, manifest: dict) -> None:
  for shard in manifest["shards"]:
    for part, size in (("inputs", shard["source_tokens"]), ("targets", shard["target_tokens"]),
                       ("offsets", 2 * (shard["num_examples"] + 1))):
      path = os.path.join(directory, f"{shard['name']}.{part}")
      item = 8 if part == "offsets" else np.dtype(manifest["dtype"]).itemsize
      if not os.path.exists(path) or os.path.getsize(path) != size * item:
        raise PreparedDataError(
            f"{path} is missing or of the wrong size (expected {size * item} bytes): "
            f"{directory} is incomplete. Remove it and prepare it again.")


def corpus_change(manifest: dict, pairs: StreamedPairs) -> str | None:
  """Why `pairs` is not the corpus `manifest` was prepared from (a sentence), or
  None when it is (or cannot be told: the corpus files are gone, logged)."""
  stored = manifest["corpus"]
  files = [(f["path"], f["size"], f["mtime_ns"]) for f in stored["files"]]
  if files or pairs.files:
    if not pairs.files:
      logger.warning("The corpus files of %s are not here; training from the prepared "
                     "shards as they are.", stored["description"])
      return None
    if files == pairs.files:
      return None  # the same files, untouched
    if len(files) != len(pairs.files) or any(a[1] != b[1] for a, b in zip(files, pairs.files)):
      return (f"the corpus is {pairs.description} ({', '.join(f'{p}: {s} bytes' for p, s, _ in pairs.files)}),"
              f" the shards were prepared from {stored['description']} "
              f"({', '.join(f'{p}: {s} bytes' for p, s, _ in files)})")
  elif not pairs.content_is_cheap:  # e.g. TFDS: its name, split and size
    if (pairs.description, len(pairs)) != (stored["description"], stored["num_pairs"]):
      return (f"the corpus is {pairs.description} ({len(pairs)} pairs), the shards were "
              f"prepared from {stored['description']} ({stored['num_pairs']} pairs)")
    return None
  sha, count = content_hash(pairs)  # same sizes, other path or time: compare the text
  if sha != stored["sha256"] or count != stored["num_pairs"]:
    return (f"the text of {pairs.description} ({count} pairs) differs from the text the shards "
            f"were prepared from ({stored['description']}, {stored['num_pairs']} pairs)")
  return None


def open_prepared(directory: str, tokenizer, pairs: StreamedPairs | None = None) -> PreparedCorpus:
  """The prepared corpus in `directory`, checked: complete, prepared with
  `tokenizer`'s vocabulary and (when `pairs` is given) from that corpus.

  Raises:
    PreparedDataError: not prepared, incomplete, another vocabulary or another
      corpus; the message names the directory, what differs and what to do.
  """
  manifest = read_manifest(directory)
  if manifest is None:
    raise PreparedDataError(f"{directory} holds no prepared corpus (no {MANIFEST}).")
  if manifest.get("format") != FORMAT:
    raise PreparedDataError(f"{directory} was prepared in format {manifest.get('format')}, "
                            f"this version reads format {FORMAT}: remove it and prepare again.")
  if manifest["vocabulary_sha256"] != vocabulary_hash(tokenizer):
    raise PreparedDataError(
        f"{directory} was tokenized with another vocabulary (SHA-256 "
        f"{manifest['vocabulary_sha256'][:12]}..., {manifest['vocab_size']} ids) than this "
        f"run's {tokenizer.model_path or ''} ({vocabulary_hash(tokenizer)[:12]}..., "
        f"{tokenizer.vocab_size} ids). Remove {directory} to prepare it again with this "
        "vocabulary, or set config.data.prepared_dir to another directory.")
  _check_files(directory, manifest)
  if pairs is not None:
    change = corpus_change(manifest, pairs)
    if change:
      raise PreparedDataError(
          f"{directory} was prepared from another corpus: {change}. Remove {directory} to "
          "prepare it again from this corpus, or set config.data.prepared_dir to another "
          "directory.")
  return PreparedCorpus(directory, manifest)
