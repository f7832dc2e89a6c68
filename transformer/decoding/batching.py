"""How sentences become decoding batches, and decoded rows become hypotheses.

`Translator.translate_hypotheses` (translator.py) decodes a list of token-id
inputs in batches shaped here:
  1. `length_batches`: the non-empty inputs, shortest first, cut into batches
     of `batch_size` inputs (or of `batch_tokens` source tokens), each padded
     to `bucket_length` of its longest (a power of two): few shapes to compile,
     and only the last batch has empty rows. `shared_buckets` first sends the
     inputs of a bucket too small to pay for a decoder of its own to the next
     longer one.
  2. `first_search_length`: how many steps a batch decodes first (its cache
     that long); the inputs left unfinished are searched again in full.
  3. `pack_batch` / `unpack_hypotheses`: inputs into a batch's rows (one row
     per sample with `copies` > 1), and the decoder's rows back into each
     input's hypotheses.
Plain Python and numpy (of the decoding loops, only `loops.EARLY_EXIT_CHUNK`
is read): the rules can be read and tested apart from the model.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from transformer.decoding import loops

MIN_BUCKET = 8
# A batch first decodes its padded source length plus half of it, at least 16
# more tokens (its cache that long), and searches again in full only the inputs
# not finished by then (`first_search_length`).
FIRST_SEARCH_EXTRA = 16
# What a decoder of its own costs, in the units of padding (decoder rows
# times the growth of the squared padded length): loading one from disk costs
# ~0.2 s however few rows it decodes (compiling it, seconds), and padding a
# row from L to L' tokens ~2e-7 s x (L'^2 - L^2) (its steps and the cache and
# source they read grow with L; greedy, the small-corpus model, 2 CPU cores:
# docs/decoding.md). `shared_buckets` weighs the two.
DECODER_COST = 2**20


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
                   shared: dict[int, int] | None = None) -> list[tuple[int, list[int]]]:
  """The decoding batches: [(padded length, indices of its inputs)]. The
  non-empty inputs, shortest first, are taken in that order, as many to a
  batch as `inputs_per_batch(padded length)` allows, and a batch is padded
  to `bucket_length` of its longest, or to where `shared` (`shared_buckets`)
  sends that bucket. So only the last batch has rows left
  over, where batches of one length bucket each (a bucket's last batch part
  empty) left 5-22% of the rows of 1,000 real sentences empty (at batch
  size 32-128; docs/benchmarks.md)."""
  shared = shared or {}
  todo = sorted((i for i, ids in enumerate(encoded) if ids), key=lambda i: len(encoded[i]))
  batches: list[tuple[int, list[int]]] = []
  members: list[int] = []
  batch_length = 0  # of `members`: its last (longest) input's bucket
  for i in todo:
    length = bucket_length(len(encoded[i]), max_length)  # (the longest so far: sorted)
    length = shared.get(length, length)
    if members and len(members) >= inputs_per_batch(length):
      batches.append((batch_length, members))
      members = []
    members.append(i)
    batch_length = length
  if members:
    batches.append((batch_length, members))
  return batches


def first_search_length(src_len: int, out_len: int, min_len: int) -> int:
  """The steps a batch of inputs padded to `src_len` decodes first, of the
  `out_len` its search may run: past `min_len`, the padded source plus half
  of it, at least FIRST_SEARCH_EXTRA tokens more (whole early-exit chunks).
  A step reads its whole cache, which is as long as the steps decoded: the
  default out_len (the source + 50) is 2.4x this for sources of 8 tokens,
  1.7x for 16. The inputs not finished by then are searched again in full
  (`Translator._search_again_shape`): a translation 1.5x its source's padded
  length is rare."""
  first = min_len + src_len + max(FIRST_SEARCH_EXTRA, src_len // 2)
  return min(out_len, round_up(first, loops.EARLY_EXIT_CHUNK))


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
