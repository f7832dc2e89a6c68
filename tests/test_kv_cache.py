"""Tests of transformer/model/kv_cache.py against float64 numpy attention. (Cached
decoding as a whole, against the full forward pass, is tested in test_model.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import kv_cache


def np_attention(q, k, v):
  """q [Tq, dk], k [Tk, dk], v [Tk, dv] (float64)."""
  scores = q @ k.T / np.sqrt(q.shape[-1])
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  return weights / weights.sum(-1, keepdims=True) @ v


@pytest.mark.parametrize("length", [7, 8])
def test_cache_attention_reads_a_prefix_yet_equals_attention_over_written_positions(length):
  """The decoder step reads only the shortest of four static cache prefixes
  that holds the written positions: for every number written (1..length, with
  a length that 4 does not divide too), each beam's attention over the slots
  its mask allows equals float64 numpy attention over exactly those positions,
  whatever garbage the unwritten positions hold."""
  rng = np.random.default_rng(3)
  batch, heads, beams, d = 2, 2, 3, 4
  query = rng.normal(size=(batch, heads, beams, d))
  key = rng.normal(size=(batch, heads, beams, d, length))
  value = rng.normal(size=(batch, heads, length * beams, d))
  # the cache's layout: [batch, heads, d, length * beams], position-major
  key_cache = key.transpose(0, 1, 3, 4, 2).reshape(batch, heads, d, length * beams)
  slot_of = rng.integers(0, beams, size=(batch, beams, length))  # an ancestry table
  attend = jax.jit(kv_cache._attend_cache_prefix)
  for written in range(1, length + 1):
    visible = (slot_of[:, :, None, :] == np.arange(beams)[None, None, :, None]) & (
        np.arange(length) < written)  # [batch, beam, slot, t]
    scaled = query / np.sqrt(d)  # the step scales queries by 1/sqrt(d_k) before
    got = np.asarray(attend(*(jnp.asarray(x, jnp.float32) for x in (scaled, key_cache, value)),
                            jnp.asarray(visible[:, None]), jnp.int32(written)))
    for b in range(batch):
      for h in range(heads):
        for q in range(beams):
          slots, ts = np.nonzero(visible[b, q])
          keys = key[b, h, slots, :, ts]                  # [visible, d]
          values = value[b, h, ts * beams + slots]        # [visible, d]
          want = np_attention(query[b, h, q][None], keys, values)[0]
          np.testing.assert_allclose(got[b, h, q], want, atol=1e-5,
                                     err_msg=f"written={written} b={b} h={h} beam={q}")
