"""Data: sentence pairs (`sources.py`) -> numpy token batches, through grain.

Host-side only (numpy + grain); no JAX here. The trainer puts batches on
devices (`jax.make_array_from_process_local_data`).

Batches
-------
`train_iterator` (endless, shuffled, packed or padded) and `eval_batches` (one
ordered pass, padded) both give dicts of int32 numpy arrays, each
``[batch_size, max_length]``::

    inputs, targets                         token ids, PAD_ID=0 on padding;
                                            both end with EOS_ID=1
    inputs_segment_ids, targets_segment_ids 1, 2, 3, ... per packed example in
                                            a row, 0 on padding
    inputs_positions, targets_positions     0, 1, 2, ... restarting for every
                                            example, 0 on padding

`eval_batches` adds ``weights``: ``[batch_size]`` int32, 1 for a real row, 0
for the empty rows that fill the last batch.

Targets are *not* shifted: the trainer builds decoder inputs (BOS + targets
shifted right, per segment) itself.

Checkpointing the data position
-------------------------------
`train_iterator` returns a `grain.DatasetIterator`: ``get_state()`` gives a
JSON-able dict, ``set_state(state)`` restores it (on an iterator built with
the same arguments). For orbax, grain provides
``grain.checkpoint.CheckpointHandler`` with the args
``grain.checkpoint.CheckpointSave(item=iterator)`` and
``grain.checkpoint.CheckpointRestore(item=iterator)`` (it writes one
``process_<i>-of-<n>.json`` per process), e.g.
``ocp.args.Composite(state=..., data=grain.checkpoint.CheckpointSave(it))``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import weakref
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from transformer.data.prepared import PreparedCorpus
from transformer.data.sources import DataError, Pair
from transformer.data.tokenizer import EOS_ID, PAD_ID, Tokenizer

Batch = dict[str, np.ndarray]

BATCH_KEYS = (
    "inputs",
    "targets",
    "inputs_segment_ids",
    "targets_segment_ids",
    "inputs_positions",
    "targets_positions",
)


# ---------------------------------------------------------------------------
# Tokenized batches.
# ---------------------------------------------------------------------------


def _encode(tokenizer: Tokenizer, text: str, max_length: int,
            target: bool = False) -> tuple[np.ndarray, bool]:
  """Text -> ids + EOS, truncated to max_length (EOS kept last); (ids, too_long).
  `target`: the target side's model (differs for an imported Marian vocabulary)."""
  ids = tokenizer.encode_target(text) if target else tokenizer.encode(text)
  ids.append(EOS_ID)
  too_long = len(ids) > max_length
  if too_long:
    ids = ids[:max_length - 1] + [EOS_ID]
  return np.asarray(ids, dtype=np.int32), too_long


class _Tokenize:
  """Pair -> {"inputs", "targets"} (EOS appended); None if dropped as too long."""

  def __init__(self, tokenizer: Tokenizer, max_length: int, drop_long: bool):
    self.tokenizer, self.max_length, self.drop_long = tokenizer, max_length, drop_long

  def __call__(self, pair: Pair):
    src, tgt = pair
    inputs, long_src = _encode(self.tokenizer, src, self.max_length)
    targets, long_tgt = _encode(self.tokenizer, tgt, self.max_length, target=True)
    if self.drop_long and (long_src or long_tgt):
      return None
    return {"inputs": inputs, "targets": targets}


class _Cut:
  """Prepared example (ids + EOS, `prepared.PreparedCorpus`) -> the same as
  `_Tokenize` gives from its text: truncated to max_length (EOS kept last), or
  None if dropped as too long."""

  def __init__(self, max_length: int, drop_long: bool):
    self.max_length, self.drop_long = max_length, drop_long

  def __call__(self, example: dict[str, np.ndarray]):
    out = {}
    for key in ("inputs", "targets"):
      ids = example[key]
      if len(ids) > self.max_length:
        if self.drop_long:
          return None
        ids = np.concatenate([ids[:self.max_length - 1], [EOS_ID]]).astype(np.int32)
      out[key] = ids
    return out


def _pad_example(example: dict[str, np.ndarray], max_length: int) -> Batch:
  out = {}
  for key in ("inputs", "targets"):
    ids = example[key]
    n = len(ids)
    tokens = np.full((max_length,), PAD_ID, np.int32)
    tokens[:n] = ids
    segments = np.zeros((max_length,), np.int32)
    segments[:n] = 1
    positions = np.zeros((max_length,), np.int32)
    positions[:n] = np.arange(n, dtype=np.int32)
    out[key] = tokens
    out[f"{key}_segment_ids"] = segments
    out[f"{key}_positions"] = positions
  return out


def shard_bounds(num_examples: int, shard_index: int, shard_count: int) -> tuple[int, int]:
  """[start, end) of contiguous shard `shard_index` of `shard_count`.

  Like `tfds.split_for_jax_process` / grain's `ShardOptions` without
  drop_remainder: shards differ in size by at most one example.
  """
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
  return (num_examples * shard_index // shard_count,
          num_examples * (shard_index + 1) // shard_count)


def train_dataset(
    pairs: Sequence[Pair],
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    pack: bool = True,
    drop_long: bool = True,
    num_threads: int | None = None,
    prefetch: int = 2,
) -> grain.IterDataset:
  """The endless, shuffled training `grain.IterDataset` behind `train_iterator`.

  Long for its options (each a stage of the grain pipeline, documented below);
  the pipeline itself reads top to bottom: slice, shuffle, tokenize, pack or pad, batch.

  Exposed for callers that want to add grain stages of their own (with
  prefetch=0, e.g. `.mp_prefetch(...)` for worker processes); `iter()` of it
  gives no exit guard (`train_iterator` adds one).

  Args:
    pairs: random-access sequence of (source, target) strings (`load_split`),
      or a `prepared.PreparedCorpus` (tokenized once into shards on disk: the
      same batches as from its text, without tokenizing or holding the text).
    tokenizer: the shared vocabulary; EOS is appended to source and target
      (not used for a prepared corpus, tokenized with it already).
    batch_size: rows per batch *on this process*.
    max_length: tokens per row (EOS included), for inputs and for targets.
    seed: shuffle seed (each epoch is reshuffled; same seed -> same batches).
    shard_index, shard_count: this process reads only the contiguous slice
      `shard_bounds(len(pairs), shard_index, shard_count)` of the data
      (`jax.process_index()`, `jax.process_count()`).
    pack: True: several examples per row with grain's first-fit packer
      (`grain.experimental.FirstFitPackIterDataset`, one packing round of
      `batch_size` bins per batch); False: one example per row, padded.
    drop_long: True: examples whose source or target exceeds `max_length`
      tokens are skipped; False: they are truncated (EOS kept as the last
      token). `summarize` counts them.
    num_threads: grain threads reading + tokenizing examples. None: 0 for an
      in-memory list/tuple or a prepared corpus (threads only add GIL
      contention), 4 otherwise (e.g. TFDS array_record files).
    prefetch: batches prepared ahead in a background thread
      (`grain.experimental.ThreadPrefetchIterDataset`); 0 disables it.

  Returns:
    A `grain.IterDataset` of dicts (see the module docstring for keys), each
    `[batch_size, max_length]` int32.
  """
  if batch_size < 1 or max_length < 2:
    raise ValueError(f"need batch_size >= 1 and max_length >= 2, got {batch_size}, {max_length}")
  start, end = shard_bounds(len(pairs), shard_index, shard_count)
  if end <= start:
    raise DataError(
        f"Process shard {shard_index} of {shard_count} has no training examples "
        f"(only {len(pairs)} in total). Use more data or fewer processes."
    )
  if isinstance(pairs, PreparedCorpus):  # tokenized already: cut to max_length
    tokenize = _Cut(max_length, drop_long)
  else:
    tokenize = _Tokenize(tokenizer, max_length, drop_long)
  if drop_long:  # Fail fast instead of looping forever over dropped examples.
    probe = range(start, min(end, start + 100))
    if all(tokenize(pairs[i]) is None for i in probe):
      raise DataError(
          f"All of the first {len(probe)} training examples are longer than "
          f"max_length={max_length} tokens (source or target, EOS included), so "
          "all would be dropped. Increase max_length or truncate instead of "
          "dropping (drop_long=False)."
      )
  ds = grain.MapDataset.source(pairs)[start:end]
  ds = ds.shuffle(seed=seed).repeat(None)  # reshuffled every epoch
  ds = ds.map(tokenize)  # None = dropped
  if num_threads is None:  # In-memory data: threads only add GIL contention.
    num_threads = 0 if isinstance(pairs, (list, tuple, PreparedCorpus)) else 4
  it_ds = ds.to_iter_dataset(
      grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=max(8, 4 * batch_size)))
  if pack:
    it_ds = grain.experimental.FirstFitPackIterDataset(
        it_ds,
        length_struct={"inputs": max_length, "targets": max_length},
        num_packing_bins=batch_size,
        seed=seed,
        shuffle_bins=True,
    )
  else:
    it_ds = it_ds.map(functools.partial(_pad_example, max_length=max_length))
  it_ds = it_ds.batch(batch_size, drop_remainder=True)
  if prefetch > 0:  # Prepare batches in a background thread (checkpointable).
    it_ds = grain.experimental.ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=prefetch)
  return it_ds


def train_iterator(pairs: Sequence[Pair], tokenizer: Tokenizer, *, workers: int = 0,
                   **options) -> grain.DatasetIterator:
  """Endless, shuffled, checkpointable iterator of training batches.

  `options` are `train_dataset`'s keyword arguments (batch_size, max_length,
  seed required; shard_index, shard_count, pack, drop_long, num_threads,
  prefetch). `workers` > 0 builds the batches in that many grain worker
  processes (`WorkerPoolIterator`: each packs its own slice of the shuffled
  examples, batches taken from the workers in turn), so that an input
  pipeline bound by one core scales with the cores; other batches than with 0
  workers, and the same for the same count.

  Returns:
    A `grain.DatasetIterator` of dicts (see the module docstring for keys),
    each `[batch_size, max_length]` int32. `get_state()` / `set_state()` save
    and restore the exact position.
  """
  if workers < 0:
    raise ValueError(f"workers must be >= 0, got {workers}")
  if workers:
    options["prefetch"] = 0  # (the workers' own buffers prefetch)
  dataset = train_dataset(pairs, tokenizer, **options)
  if workers:
    iterator = WorkerPoolIterator(dataset, workers)
  else:
    iterator = iter(dataset)
  _close_at_exit(iterator)
  return iterator


class WorkerPoolIterator:
  """A training dataset's batches built in `workers` grain worker processes
  (`IterDataset.mp_prefetch`), with a state that says how many workers made it.

  grain restores the position only into a pool of the same size (another
  count fails deep inside grain, or would give other batches); this state,
  ``{"grain_workers": n, "grain": <grain's state>}``, lets `set_state` refuse
  a resume with another count in one sentence instead.
  """

  def __init__(self, dataset: grain.IterDataset, workers: int):
    from absl import flags  # grain's worker processes read absl flags
    if not flags.FLAGS.is_parsed():  # (parsed already under train.py's absl app)
      flags.FLAGS.mark_as_parsed()
    self.workers = workers
    self._iterator = iter(dataset.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=workers, per_worker_buffer_size=2)))

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    return next(self._iterator)

  def get_state(self) -> dict:
    return {"grain_workers": self.workers, "grain": self._iterator.get_state()}

  def set_state(self, state: dict) -> None:
    check_position_workers(state, self.workers)
    self._iterator.set_state(state["grain"])

  def close(self) -> None:
    self._iterator.close()


def check_position_workers(state, workers: int) -> None:
  """Raises DataError, naming the setting to use, if the data position `state`
  (a `train_iterator`'s `get_state()`) was saved with another number of
  worker processes than `workers`."""
  saved = state.get("grain_workers", 0) if isinstance(state, dict) else 0
  if saved != workers:
    raise DataError(
        f"The checkpoint's data position was saved with {saved} grain worker "
        f"processes, and this run has {workers}: set config.data.workers={saved} "
        "to resume it (each count gives its own batches).")


def _close_at_exit(iterator: grain.DatasetIterator) -> None:
  """Stops the iterator's background threads before the interpreter exits.

  Without this, a `ThreadPrefetchIterDataset` thread still running at exit
  gets killed inside C++ code and the process aborts ("terminate called
  without an active exception", exit status 134) after training finished.
  """
  ref = weakref.ref(iterator)

  def close():
    live = ref()
    if live is not None:
      live.close()

  atexit.register(close)


def eval_batches(
    pairs: Sequence[Pair],
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    max_length: int,
) -> Iterator[Batch]:
  """One ordered pass over `pairs` in padded batches; nothing dropped.

  Row r of batch b is example `b * batch_size + r`. Over-long examples are
  truncated (EOS kept last; see `summarize`). The last batch is filled up with
  empty rows (all PAD, segment id 0); ``weights`` ([batch_size] int32) is 1 on
  real rows and 0 on those, so every example counts exactly once.
  """
  if batch_size < 1 or max_length < 2:
    raise ValueError(f"need batch_size >= 1 and max_length >= 2, got {batch_size}, {max_length}")
  tokenize = _Tokenize(tokenizer, max_length, drop_long=False)
  empty = {key: np.zeros((max_length,), np.int32) for key in BATCH_KEYS}
  for start in range(0, len(pairs), batch_size):
    rows = [_pad_example(tokenize(pairs[i]), max_length)
            for i in range(start, min(start + batch_size, len(pairs)))]
    weights = np.zeros((batch_size,), np.int32)
    weights[:len(rows)] = 1
    rows += [empty] * (batch_size - len(rows))
    batch = {key: np.stack([row[key] for row in rows]) for key in BATCH_KEYS}
    batch["weights"] = weights
    yield batch


@dataclasses.dataclass(frozen=True)
class DataSummary:
  """Token statistics of a split, for the log."""

  num_examples: int
  num_checked: int  # examples tokenized to compute the statistics below
  num_too_long: int  # source or target > max_length: dropped (train) / truncated (eval)
  max_length: int
  mean_source_length: float  # tokens incl. EOS, before truncation
  mean_target_length: float
  longest_source: int
  longest_target: int

  def __str__(self) -> str:
    sampled = "" if self.num_checked == self.num_examples else f" (of {self.num_checked} checked)"
    return (
        f"{self.num_examples} examples; {self.num_too_long}{sampled} longer than "
        f"max_length={self.max_length} (dropped in training, truncated in eval); "
        f"mean length {self.mean_source_length:.1f} source / "
        f"{self.mean_target_length:.1f} target tokens, longest "
        f"{self.longest_source} / {self.longest_target}"
    )


def summarize(
    pairs: Sequence[Pair],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    max_examples: int | None = 100_000,
) -> DataSummary:
  """Counts examples and how many exceed `max_length` (EOS included).

  For big corpora only `max_examples` evenly spaced examples are tokenized
  (`num_checked` says how many); None checks all.
  """
  n = len(pairs)
  if max_examples is None or max_examples >= n:
    indices = range(n)
  else:
    indices = np.linspace(0, n - 1, max_examples).round().astype(np.int64).tolist()
  src_lens, tgt_lens = [], []
  for i in indices:
    src, tgt = pairs[i]
    src_lens.append(len(tokenizer.encode(src)) + 1)
    tgt_lens.append(len(tokenizer.encode_target(tgt)) + 1)
  s, t = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
  return DataSummary(
      num_examples=n,
      num_checked=len(s),
      num_too_long=int(np.sum((s > max_length) | (t > max_length))),
      max_length=max_length,
      mean_source_length=float(s.mean()) if len(s) else 0.0,
      mean_target_length=float(t.mean()) if len(t) else 0.0,
      longest_source=int(s.max()) if len(s) else 0,
      longest_target=int(t.max()) if len(t) else 0,
  )
