"""How sentences become decoding batches, and decoded rows become hypotheses.

`Translator.translate_hypotheses` (translator.py) decodes a list of token-id
inputs in batches shaped here:
  1. `length_batches`: the non-empty inputs, shortest first, cut into batches
     of `batch_size` inputs (or of `batch_tokens` source tokens), each padded
     to `bucket_length` of its longest (a power of two): few shapes to compile,
     rows left over only where they save padding (`_least_padding_cuts`).
     `shared_buckets` first sends the inputs of a bucket too small to pay for
     a decoder of its own to the next longer one.
  2. `first_search_length`: how many steps a batch decodes first (its cache
     that long); the inputs left unfinished are searched again in full.
  3. `pack_batch` / `unpack_hypotheses`: inputs into a batch's rows (one row
     per sample with `copies` > 1), and the decoder's rows back into each
     input's hypotheses.
Plain Python and numpy (of the decoding options, only `EARLY_EXIT_CHUNK`
is read): the rules can be read and tested apart from the model.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from transformer.decoding import options

MIN_BUCKET = 8
# A batch first decodes its padded source length plus half of it, at least 16
# more tokens (its cache that long), and searches again in full only the inputs
# not finished by then (`first_search_length`).
FIRST_SEARCH_EXTRA = 16
# ... and none where that is more than this share of the search (sources of
# 64 tokens: 96 of 114 steps): a cache shorter by less than a quarter saves
# too little to pay for searching its unfinished inputs twice, and for their
# decoder. 1,000 gettext lines, the 10-minute small-corpus model, 2-core AVX2
# CPU, in one process (5 alternating rounds): greedy 1.97 -> 1.84 s, beam 4
# 5.96 -> 5.50 s, the same translations; a first decode.py compiles 1 decoder
# fewer (greedy 3 -> 2, beam 4 5 -> 4: docs/benchmarks.md).
FIRST_SEARCH_MAX_SHARE = 0.75
# What a decoder of its own costs, in the units of padding (decoder rows
# times the growth of the squared padded length): loading one from disk costs
# ~0.2 s however few rows it decodes (compiling it, seconds), and padding a
# row from L to L' tokens ~2e-7 s x (L'^2 - L^2) (its steps and the cache and
# source they read grow with L; greedy, the small-corpus model, 2 CPU cores:
# docs/benchmarks.md). `shared_buckets` weighs the two.
DECODER_COST = 2**20
# `length_batches` cuts batches of at most this many inputs where they pad the
# least (its dynamic programming holds batches x this^2 numbers); larger
# ones are filled in turn.
LEAST_PADDING_MAX_BATCH = 512


def bucket_length(length: int, max_length: int) -> int:
  """The padded length for an input of `length` tokens: the next power of two
  (at least MIN_BUCKET), capped at `max_length`."""
  return min(power_of_two_at_least(length, MIN_BUCKET), max_length)


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= n."""
  return -(-n // multiple) * multiple


def power_of_two_at_least(n: int, smallest: int) -> int:
  """`smallest` times the smallest power of two that makes it >= n."""
  size = smallest
  while size < n:
    size *= 2
  return size


def shared_buckets(encoded: Sequence[list[int]], max_length: int, rows_per_input: int,
                   decoder_cost: float = DECODER_COST) -> dict[int, int]:
  """{bucket: the longer bucket its inputs are padded to}: the buckets of
  `encoded` whose inputs are too few to pay for a decoder of their own. Of
  every choice of the buckets to keep (the longest always; each other
  bucket's inputs padded to the next kept one), the one of least cost:
  `decoder_cost` per bucket kept, plus each input's `rows_per_input` (its
  samples) times the growth of its squared padded length (L'^2 - L^2).
  1,000 gettext lines greedy: buckets 8, 16, 32, 64 -> 16, 64 (2 decoders
  instead of 4); 10,000 lines: 16, 32, 64."""
  rows: dict[int, int] = {}
  for ids in encoded:
    if ids:
      length = bucket_length(len(ids), max_length)
      rows[length] = rows.get(length, 0) + rows_per_input
  in_use = sorted(rows)

  def padded_to(kept: set[int]) -> dict[int, int]:
    return {length: min(k for k in kept if k >= length) for length in in_use}

  def cost(kept: set[int]) -> float:
    return len(kept) * decoder_cost + sum(
        rows[length] * (target**2 - length**2) for length, target in padded_to(kept).items())

  choices = (  # (at most 2^(log2(max_length) - 3) of them: 64 for 512 tokens)
      {length for i, length in enumerate(in_use[:-1]) if mask >> i & 1} | set(in_use[-1:])
      for mask in range(2 ** max(len(in_use) - 1, 0)))
  best = min(choices, key=cost)
  return {length: target for length, target in padded_to(best).items() if target != length}


def length_batches(encoded: Sequence[list[int]], max_length: int,
                   inputs_per_batch: Callable[[int], int],
                   shared: dict[int, int] | None = None,
                   least_padding: bool = True) -> list[tuple[int, list[int]]]:
  """The decoding batches: [(padded length, indices of its inputs)]. The
  non-empty inputs, shortest first, are taken in that order, as many to a
  batch as `inputs_per_batch(padded length)` allows, and a batch is padded
  to `bucket_length` of its longest, or to where `shared` (`shared_buckets`)
  sends that bucket. So batches hold inputs of consecutive lengths, and rows
  are left over only where they save padding: batches of one length bucket
  each (a bucket's last batch part empty) left 5-22% of the rows of 1,000
  real sentences empty (at batch size 32-128; docs/benchmarks.md).

  With `least_padding` and one batch size for every length (`--batch_size`,
  at most LEAST_PADDING_MAX_BATCH),
  the batches are as many as filling each in turn makes, but cut where they
  pad the least (`_least_padding_cuts`) when that halves the padding: a
  batch filled in turn may hold the last inputs of a bucket and the first
  of a much longer one, all padded to the longer, when the rows left over
  would let the short ones end a batch of their own (1,000 gettext lines
  greedy at 128: 105 inputs padded from 16 to 64 tokens, decoded 7-12%
  slower). Greedy search and sampling only, on a CPU
  (`batch_plan.Policy.cut_least_padding`): beam search's batches decoded 3% slower
  cut so (their longest inputs, fewer to a batch, no longer fit the sizes
  it shrinks to; docs/benchmarks.md)."""
  shared = shared or {}
  todo = sorted((i for i, ids in enumerate(encoded) if ids), key=lambda i: len(encoded[i]))
  lengths = [shared.get(length, length)
             for length in (bucket_length(len(encoded[i]), max_length) for i in todo)]
  cuts = [0]  # batch k holds todo[cuts[k]:cuts[k + 1]]
  for n, length in enumerate(lengths):  # (the longest so far: sorted)
    if n > cuts[-1] and n - cuts[-1] >= inputs_per_batch(length):
      cuts.append(n)
  if todo:
    cuts.append(len(todo))
  capacities = {inputs_per_batch(length) for length in set(lengths)}
  if (least_padding and len(capacities) == 1 and len(cuts) > 2
      and next(iter(capacities)) <= LEAST_PADDING_MAX_BATCH):
    least = _least_padding_cuts(lengths, capacities.pop(), len(cuts) - 1)
    # Only where that at least halves the padding: the measure is crude (a
    # batch's time also depends on how its longest inputs fill the sizes it
    # shrinks to), and cuts that saved 3% of it decoded beam search 2-7%
    # slower (docs/benchmarks.md).
    if 2 * _padding(lengths, least) <= _padding(lengths, cuts):
      cuts = least
  return [(lengths[end - 1], todo[start:end]) for start, end in zip(cuts, cuts[1:])]


def _padding(lengths: Sequence[int], cuts: Sequence[int]) -> int:
  """sum (L_run^2 - L^2) over the inputs of `lengths` cut into runs at `cuts`,
  L_run a run's last (longest) length."""
  return sum((end - start) * lengths[end - 1] ** 2 - sum(x * x for x in lengths[start:end])
             for start, end in zip(cuts, cuts[1:]))


def _least_padding_cuts(lengths: Sequence[int], capacity: int, batches: int) -> list[int]:
  """Where to cut `lengths` (padded lengths, shortest first) into `batches`
  runs of at most `capacity` each so that padding each input to its run's
  longest costs the least, sum (L_run^2 - L^2) (`shared_buckets`' measure);
  [0, cut_1, ..., len(lengths)]. Of equally good cuts, the latest (full
  batches first, as filling them in turn does). Dynamic programming over
  the cut positions each batch boundary can take: at most `batches` x
  capacity x capacity steps (numpy), since `batches` runs of `capacity`
  leave fewer than `capacity` rows over."""
  n = len(lengths)
  squares = np.asarray(lengths, np.int64) ** 2
  prefix = np.concatenate([[0], np.cumsum(squares)])  # prefix[i]: sum of the first i

  def window(k):  # the positions cut k can take
    return np.arange(max(k, n - (batches - k) * capacity), min(k * capacity, n) + 1)

  # best[k][j]: least cost of the first window(k)[j] inputs in k batches.
  positions, best, choice = [np.array([0])], [np.array([0], np.int64)], []
  for k in range(1, batches + 1):
    ends, starts = window(k), positions[-1]
    size = ends[:, None] - starts[None, :]  # [ends, starts]
    cost = (size * squares[ends - 1][:, None] - (prefix[ends][:, None] - prefix[starts][None, :]))
    total = np.where((size >= 1) & (size <= capacity), best[-1][None, :] + cost,
                     np.iinfo(np.int64).max)
    # argmin of the reversed starts: among equal costs, the latest start
    pick = total.shape[1] - 1 - np.argmin(total[:, ::-1], axis=1)
    positions.append(ends)
    best.append(total[np.arange(len(ends)), pick])
    choice.append(pick)
  cuts = [n]
  j = int(np.flatnonzero(positions[-1] == n)[0])
  for k in range(batches, 0, -1):
    j = int(choice[k - 1][j])
    cuts.append(int(positions[k - 1][j]))
  return cuts[::-1]


def first_search_length(src_len: int, out_len: int, min_len: int) -> int:
  """The steps a batch of inputs padded to `src_len` decodes first, of the
  `out_len` its search may run: past `min_len`, the padded source plus half
  of it, at least FIRST_SEARCH_EXTRA tokens more (whole early-exit chunks);
  the whole search (`out_len`: no first search) where that is more than
  FIRST_SEARCH_MAX_SHARE of it.
  A step reads its whole cache, which is as long as the steps decoded: the
  default out_len (the source + 50) is 2.4x this for sources of 8 tokens,
  1.7x for 16. The inputs not finished by then are searched again in full
  (`batch_plan.search_again_shape`): a translation 1.5x its source's padded
  length is rare."""
  first = min_len + src_len + max(FIRST_SEARCH_EXTRA, src_len // 2)
  first = round_up(first, options.EARLY_EXIT_CHUNK)
  return first if first <= FIRST_SEARCH_MAX_SHARE * out_len else out_len


def pack_batch(inputs: Sequence[list[int]], rows: int, length: int, copies: int) -> np.ndarray:
  """`[rows, length]` int32: input r in rows r * copies ... r * copies + copies - 1
  (copies > 1: one row per sample), padded with 0; the rows left over are empty."""
  batch = np.zeros((rows, length), np.int32)
  for r, ids in enumerate(inputs):
    batch[r * copies:(r + 1) * copies, :len(ids)] = ids
  return batch


def unpack_hypotheses(seqs: np.ndarray, scores: np.ndarray, count: int, copies: int,
                      n_best: int) -> list[list[tuple[np.ndarray, float]]]:
  """The (token ids, score) hypotheses of each of the first `count` inputs of a
  batch packed by `pack_batch`: its `copies` sample rows (copies > 1), else
  the first n_best of its row. `seqs` [rows, n, length], `scores` [rows, n]."""
  if copies > 1:
    return [[(seqs[r * copies + c, 0], scores[r * copies + c, 0]) for c in range(copies)]
            for r in range(count)]
  return [[(seqs[r, k], scores[r, k]) for k in range(n_best)] for r in range(count)]
