"""Packed sources: a decoding batch's encoder reads its sentences packed
several to a row, not each padded to the batch's length.

A batch of `rows` sentences is padded to `length` (a power of two, at least
8: `batching.bucket_length`), so on real text the encoder reads 40-52% of
padding (1,000 gettext lines: 59.8% of the tokens read are real at batch 32,
48.4% at 128; rows left empty at the end of the last batch are read too),
and on CPU the encoder is a third of greedy decoding's time. Instead:

  1. `pack` (host, numpy): the sentences go into rows of the same `[rows,
     length]` shape, longest first, each into the first row with room
     (first-fit decreasing); every sentence gets a segment id of its own and
     positions from 0, so that attention stays within it (the encoder's
     segment mask, as in packed training) and its positional encodings are
     those it has alone.
  2. `encode_packed` (device, jittable): the encoder runs on the packed rows
     that hold anything, `chunk` rows at a time (a data-dependent number of
     times), then each sentence's encoding is gathered back into its own row
     at its own offset: the unpacked `[rows, length, d_model]` every later
     step reads (positions past a sentence's end hold other sentences'
     encodings, hidden by the source mask as padding is).

Each sentence's encoding is what the unpacked encoder computes for it, up to
float rounding (the matmuls run on other shapes).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Packed rows the encoder runs on at a time: its matmuls stay large enough
# to run at full speed on a CPU, and at most CHUNK - 1 empty rows are read.
CHUNK = 8


class PackedSources(NamedTuple):
  """A batch's sentences packed into rows (`pack`).

  tokens, segments, positions: int32 `[rows, length]`: the packed rows (0 =
    padding), each sentence's segment id (1, 2, ... within its row; 0 on
    padding) and positions (0, 1, ... from its start).
  where: int32 `[rows, 2]`: for sentence r (row r of the unpacked batch),
    the packed row that holds it and its offset there (0, 0 for empty rows).
  """
  tokens: np.ndarray
  segments: np.ndarray
  positions: np.ndarray
  where: np.ndarray


def pack(inputs: Sequence[Sequence[int]], rows: int, length: int) -> PackedSources:
  """Packs `inputs` (token ids, each at most `length`; at most `rows`) into
  `[rows, length]` rows, first-fit decreasing. Always fits: in the worst
  case each sentence has a row of its own."""
  if len(inputs) > rows:
    raise ValueError(f"{len(inputs)} inputs do not fit in {rows} rows")
  tokens = np.zeros((rows, length), np.int32)
  segments = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  where = np.zeros((rows, 2), np.int32)
  used = np.zeros(rows, np.int64)  # tokens in each packed row
  count = np.zeros(rows, np.int32)  # sentences in each packed row
  for r in sorted(range(len(inputs)), key=lambda r: -len(inputs[r])):
    ids = inputs[r]
    if not ids:
      continue
    if len(ids) > length:
      raise ValueError(f"input {r} has {len(ids)} tokens, more than the rows' {length}")
    # The first row with room (rows fill in order, so an empty row comes after
    # every row in use): one vectorised scan, not a Python loop over the rows.
    row = int(np.argmax(used + len(ids) <= length))
    start = used[row]
    count[row] += 1
    tokens[row, start:start + len(ids)] = ids
    segments[row, start:start + len(ids)] = count[row]
    positions[row, start:start + len(ids)] = np.arange(len(ids))
    where[r] = row, start
    used[row] += len(ids)
  return PackedSources(tokens, segments, positions, where)


def encode_packed(encode: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
                  tokens: jax.Array, segments: jax.Array, positions: jax.Array,
                  where: jax.Array, chunk: int = CHUNK) -> jax.Array:
  """The unpacked encoder output `[rows, length, d_model]` of sentences
  packed by `pack`.

  encode(tokens, segments, positions) `[n, length]` each -> `[n, length,
  d_model]`: the model's encoder on packed rows. It runs on the packed rows
  in use only, `chunk` at a time (the last chunk may overlap the one
  before); then sentence r is row where[r, 0] from offset where[r, 1].
  """
  rows, length = tokens.shape
  chunk = min(chunk, rows)
  in_use = jnp.sum(jnp.any(segments > 0, axis=1))  # (the first rows: `pack` fills in order)
  shape = jax.eval_shape(encode, tokens[:chunk], segments[:chunk], positions[:chunk])
  encoded = jnp.zeros((rows,) + shape.shape[1:], shape.dtype)

  def encode_chunk(k, encoded):
    start = jnp.minimum(k * chunk, rows - chunk)
    part = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk)
    return jax.lax.dynamic_update_slice_in_dim(
        encoded, encode(part(tokens), part(segments), part(positions)), start, 0)

  encoded = jax.lax.fori_loop(0, -(-in_use // chunk), encode_chunk, encoded)
  # Sentence r's position j is packed row where[r, 0], position where[r, 1] + j
  # (clipped at the row's end: those positions are past the sentence, masked).
  columns = jnp.minimum(where[:, 1:2] + jnp.arange(length), length - 1)  # [rows, length]
  return encoded[where[:, 0:1], columns]
