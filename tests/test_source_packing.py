"""Tests for transformer/decoding/source_packing.py: packing a batch's sentences
several to a row (host) and the encoder output unpacked from it (device),
against the unpacked encoder of the same model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.decoding import source_packing
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer, init_params


def test_pack_is_first_fit_decreasing_by_hand():
  """Lengths 2, 5, 3, 1, 3, 2 into rows of 8: longest first, each into the
  first row with room: 5 and 3 fill row 0; 3, 2, 2, 1 fill row 1."""
  inputs = [[11] * 2, [12] * 5, [13] * 3, [14] * 1, [15] * 3, [16] * 2]
  packed = source_packing.pack(inputs, rows=6, length=8)
  np.testing.assert_array_equal(packed.tokens[:2], [[12] * 5 + [13] * 3,
                                                    [15] * 3 + [11] * 2 + [16] * 2 + [14]])
  assert not packed.tokens[2:].any() and not packed.segments[2:].any()
  np.testing.assert_array_equal(packed.segments[:2], [[1] * 5 + [2] * 3,
                                                      [1] * 3 + [2] * 2 + [3] * 2 + [4]])
  np.testing.assert_array_equal(packed.positions[:2], [[0, 1, 2, 3, 4, 0, 1, 2],
                                                       [0, 1, 2, 0, 1, 0, 1, 0]])
  np.testing.assert_array_equal(packed.where, [[1, 3], [0, 0], [0, 5], [1, 7], [1, 0], [1, 5]])


@pytest.mark.parametrize("seed", range(5))
def test_pack_places_every_sentence_whole_and_alone(seed):
  """Random batches (empty rows included): each sentence's tokens are at its
  `where`, under a segment id no other sentence of its row has, positions
  0 ... n - 1; nothing else is in the rows; the rows in use come first."""
  rng = np.random.default_rng(seed)
  rows, length = 16, 16
  inputs = [list(rng.integers(3, 100, size=rng.integers(0, length + 1)))
            for _ in range(rng.integers(1, rows + 1))]
  packed = source_packing.pack(inputs, rows, length)
  covered = np.zeros((rows, length), bool)
  for r, ids in enumerate(inputs):
    if not ids:
      continue
    row, start = packed.where[r]
    span = slice(start, start + len(ids))
    assert not covered[row, span].any()
    covered[row, span] = True
    np.testing.assert_array_equal(packed.tokens[row, span], ids)
    np.testing.assert_array_equal(packed.positions[row, span], np.arange(len(ids)))
    segment = packed.segments[row, start]
    assert (packed.segments[row, span] == segment).all() and segment > 0
    assert (packed.segments[row][~covered[row]] != segment).all()
  assert ((packed.tokens != 0) == covered).all() and ((packed.segments > 0) == covered).all()
  in_use = covered.any(axis=1)
  assert list(in_use) == sorted(in_use, reverse=True)
  assert in_use.sum() <= sum(1 for ids in inputs if ids)


def test_pack_refuses_what_cannot_fit():
  with pytest.raises(ValueError, match="3 inputs do not fit in 2 rows"):
    source_packing.pack([[5], [5], [5]], rows=2, length=4)
  with pytest.raises(ValueError, match="input 1 has 5 tokens"):
    source_packing.pack([[5], [5] * 5], rows=2, length=4)


@pytest.mark.parametrize("scan_layers,rows,chunk", [(True, 12, 4), (False, 12, 5), (True, 3, 8)])
def test_encode_packed_equals_the_encoder_on_each_sentence_padded(scan_layers, rows, chunk):
  """The encoder output of sentences packed several to a row, unpacked, is
  at every real position the padded batch's (the model's encoder on the
  unpacked `[rows, length]`), and the encoder runs ceil(rows in use / chunk)
  times (chunks that overlap at the end; a chunk larger than the batch)."""
  cfg = TransformerConfig(vocab_size=50, d_model=32, num_heads=4, d_ff=64,
                          num_encoder_layers=2, num_decoder_layers=1, max_len=32,
                          scan_layers=scan_layers)
  model, params = Transformer(cfg), init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(rows)
  length = 8
  inputs = [list(rng.integers(3, 50, size=rng.integers(1, length + 1))) for _ in range(rows)]
  inputs[1] = []  # an empty row
  padded = np.zeros((rows, length), np.int32)
  for r, ids in enumerate(inputs):
    padded[r, :len(ids)] = ids
  packed = source_packing.pack(inputs, rows, length)
  calls = []

  def encode(tokens, segments, positions):
    jax.debug.callback(lambda: calls.append(1))
    return model.apply({"params": params}, tokens, segments, positions, method="encode")

  with jax.default_matmul_precision("highest"):
    want = model.apply({"params": params}, jnp.asarray(padded), method="encode")
    got = jax.jit(lambda *a: source_packing.encode_packed(encode, *a, chunk=chunk))(
        *map(jnp.asarray, packed))
    jax.effects_barrier()
  for r, ids in enumerate(inputs):
    np.testing.assert_allclose(got[r, :len(ids)], want[r, :len(ids)], atol=1e-5,
                               err_msg=f"sentence {r}")
  in_use = int((packed.segments > 0).any(axis=1).sum())
  assert in_use < sum(1 for ids in inputs if ids) or rows < 4  # (it did pack)
  assert len(calls) == -(-in_use // min(chunk, rows))
