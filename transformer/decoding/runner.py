"""Running a batch plan: each batch's arguments, its decoder made ready, the
batches dispatched in lanes side by side, read back as they finish, and the
inputs a first search left unfinished searched again in full.

`run` is what `Translator.translate_hypotheses` calls between planning
(`batch_plan.py`) and detokenizing: it hands each batch's decoded rows to a
`detokenize(members, seqs, scores)` callback, from the lane that decoded it,
so that the host detokenizes batch k - 1 while the device decodes batch k.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from transformer.data.tokenizer import available_cores
from transformer.decoding import batch_plan, batching, source_packing
from transformer.decoding.batch_plan import DecoderShape, Plan
from transformer.decoding.decoders import Decoders

# At most this many batches decoded at once (`default_concurrent_batches`):
# each holds its own cache.
MAX_CONCURRENT_BATCHES = 8


class Arguments(NamedTuple):
  """What every batch of one call shares (the rest is per batch: `batch_arguments`)."""
  encoded: Sequence[list[int]]  # token ids + EOS per input
  limits: dict[int, int]  # input -> most tokens it generates
  copies: int  # rows per input (its samples)
  first_line: int  # the line number of input 0 (the sampling keys)
  key_data: np.ndarray  # the sampling key's raw data (zeros unless sampling)
  options: tuple  # (length_penalty, temperature, top_p, min_len), traced


class Totals(NamedTuple):
  """What `run` measured: seconds preparing (compiling or loading) decoders,
  tokens generated, the host's own seconds (packing, detokenizing) summed over
  the lanes, and how many inputs were searched again."""
  compile_seconds: float
  generated: int
  host_seconds: float
  searched_again: int


def default_concurrent_batches(devices: int) -> int:
  """Batches decoded at once when the caller does not say: on a CPU, one per
  core its `devices` leave (at most MAX_CONCURRENT_BATCHES); elsewhere 1 (one
  batch at a time already fills a GPU or TPU, and JAX overlaps the host's
  work with it).

  Why on a CPU: a decoding step is many small ops, which XLA splits across
  the cores poorly; two batches side by side on 2 cores decode 1.2-1.6x
  faster than one batch at a time (docs/benchmarks.md)."""
  if jax.default_backend() != "cpu":
    return 1
  return max(1, min(MAX_CONCURRENT_BATCHES, available_cores() // devices))


def batch_arguments(shape: DecoderShape, members: list[int], args: Arguments) -> tuple:
  """The decoder's arguments after the parameters for one batch of `members`."""
  rows, copies, encoded = shape.batch, args.copies, args.encoded
  sources = [encoded[i] for i in members]
  inputs = batching.pack_batch(sources, rows, shape.src_len, copies)
  row_lines = np.zeros(rows, np.int32)
  row_lines[:len(members) * copies] = np.repeat(np.asarray(members) + args.first_line, copies)
  row_copies = np.tile(np.arange(copies, dtype=np.int32), rows // copies + 1)[:rows]
  row_limits = np.full(rows, shape.search_len, np.int32)
  row_limits[:len(members) * copies] = np.repeat([args.limits[i] for i in members], copies)
  packing = (tuple(source_packing.pack([ids for ids in sources for _ in range(copies)],
                                       rows, shape.src_len))
             if shape.packed else ())
  return inputs, args.key_data, row_lines, row_copies, row_limits, *args.options, packing


def run(decoders: Decoders, plan: Plan, args: Arguments,
        detokenize: Callable[[list[int], np.ndarray, np.ndarray], int], *,
        lanes: int, overlap: bool = True) -> Totals:
  """Decodes `plan`'s batches with `decoders`, in up to `lanes` lanes. Each
  batch's finished inputs go to `detokenize(members, seqs [n, k, len], scores
  [n, k])` (-> tokens generated); those its first search left unfinished are
  searched again in full, after the rest, those of every batch of one
  decoder together (`batch_plan.search_again_shape`: one decoder for them).
  `overlap` False: each batch read back before the next is dispatched (for
  measuring what the overlap gains)."""
  unfinished: dict[DecoderShape, list[int]] = {}  # first search's decoder -> its inputs
  take_unfinished = threading.Lock()  # (lanes finish side by side)

  def finish(pending) -> int:
    """A dispatched batch read back (waiting for the device only if it is
    not done), its finished inputs detokenized: tokens generated."""
    (shape, members), seqs, scores, done = pending
    seqs, scores, done = np.asarray(seqs), np.asarray(scores), np.asarray(done)
    if shape.first_search:
      copies = args.copies
      done = done[:len(members) * copies].reshape(len(members), copies).all(axis=1)
      if not done.all():
        with take_unfinished:
          unfinished.setdefault(shape, []).extend(i for i, d in zip(members, done) if not d)
        kept = np.flatnonzero(done)
        members = [members[k] for k in kept]
        picked = (kept[:, None] * copies + np.arange(copies)).reshape(-1)  # their rows
        seqs, scores = seqs[picked], scores[picked]
    return detokenize(members, seqs, scores)

  compile_seconds = _prepare(decoders, plan.batches, args)
  totals = _decode_in_lanes(decoders, plan.batches, args, finish, lanes, overlap)
  again = []  # (rare: `batching.first_search_length`)
  for shape, members in sorted(unfinished.items(), key=lambda item: min(item[1])):
    again_shape = batch_plan.search_again_shape(shape, args.copies, decoders.devices)
    members, per_batch = sorted(members), again_shape.batch // args.copies
    again += [(again_shape, members[start:start + per_batch])
              for start in range(0, len(members), per_batch)]
  if again:
    compile_seconds += _prepare(decoders, again, args)
    totals += _decode_in_lanes(decoders, again, args, finish, lanes, overlap)
  return Totals(compile_seconds, sum(tokens for tokens, _ in totals),
                sum(seconds for _, seconds in totals),
                sum(len(members) for members in unfinished.values()))


def _prepare(decoders: Decoders, batches, args: Arguments) -> float:
  """`Decoders.prepare_all` for every decoder `batches` [(shape, members)]
  need, each lowered with its first batch's arguments; the seconds it took."""
  first_batches: dict[DecoderShape, list[int]] = {}
  for shape, members in batches:
    first_batches.setdefault(shape, members)
  return decoders.prepare_all([(shape, batch_arguments(shape, members, args))
                               for shape, members in first_batches.items()])


def _decode_in_lanes(decoders: Decoders, batches, args: Arguments, finish, lanes: int,
                     overlap: bool) -> list[tuple[int, float]]:
  """Decodes `batches` [(shape, members)] in order, in up to `lanes`
  lanes side by side: the calling thread is one, each other lane a thread
  of its own; `finish((shape, members), *outputs)` reads a batch back and
  returns its tokens generated. Per lane: (tokens generated, host seconds).

  Why the calling thread decodes too: where JAX runs a computation on the
  thread that calls it (decode.py's large batches on a CPU:
  `host_memory.run_computations_on_calling_threads`), the batch's
  temporaries come from that thread's heap, and the main thread's (glibc's
  main heap) keeps freed blocks of any size for the next batch, where a
  thread's own keeps none over 64 MB (beam 4 at batch 128: 397k -> 184k
  page faults per later call on 1,000 gettext lines; docs/benchmarks.md)."""
  queue = iter(batches)
  take = threading.Lock()  # (lanes take the next batch in turn)
  failed = threading.Event()  # (one lane's error stops the others)

  def lane() -> tuple[int, float]:
    """Decodes batches from `queue` until it is empty. The device works on
    batch k while the host packs batch k + 1 and detokenizes batch k - 1
    (where JAX dispatches asynchronously; where it does not, the other
    lanes keep the cores busy meanwhile)."""
    generated, host_seconds, pending = 0, 0.0, None
    while not failed.is_set():
      with take:
        shape, members = next(queue, (None, None))
      if shape is None:
        break
      host_start = time.perf_counter()
      inputs = batch_arguments(shape, members, args)
      host_seconds += time.perf_counter() - host_start
      outputs = decoders.dispatch(shape, inputs)
      if pending is not None:
        host_start = time.perf_counter()
        generated += finish(pending)
        host_seconds += time.perf_counter() - host_start
      pending = ((shape, members), *outputs)
      if not overlap:
        generated += finish(pending)
        pending = None
    if pending is not None:
      generated += finish(pending)
    return generated, host_seconds

  lanes = min(lanes, max(len(batches), 1))
  if lanes == 1:
    return [lane()]

  def guarded_lane():  # (the lanes' batches run side by side)
    try:
      return lane()
    except BaseException:
      failed.set()
      raise
  with concurrent.futures.ThreadPoolExecutor(lanes - 1, thread_name_prefix="decode") as pool:
    futures = [pool.submit(guarded_lane) for _ in range(lanes - 1)]
    mine = guarded_lane()
    return [mine] + [future.result() for future in futures]
