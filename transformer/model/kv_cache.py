"""Incremental decoding's keys and values: what is cached, where each step writes,
and the kernel that reads it. The decoding step itself is the model's
(`transformer.py`: `DecoderLayer.step`, `Decoder.step`, `Transformer.decode_step`,
beside the teacher-forced path), whose `scaled_dot_product_attention(cached=True)`
hands its arrays to `attend` here; the search strategies (`decoding/search.py`)
see the cache only as a pytree.

Two kinds of keys/values are read by a decoding step:
  - the encoder-decoder attention's, computed once per input from the encoder
    output (`memory_layout`), never per step, and shared by all beams of an input;
  - the decoder self-attention's, filled one position per step (`init_cache`,
    `write`).

Layout (heads first, so that a step transposes nothing of the cache's size):
  key    `[batch, heads, d_k, length * slots]`  (q K^T is one matmul)
  value  `[batch, heads, length * slots, d_v]`  (one matmul reads it)
position-major: slot j of position t at t * slots + j, so that a step writes
its beams' keys (values) with one update, and a prefix of positions is a
prefix of the cache.
The `beams` rows of input b (rows b * beams ... b * beams + beams - 1) are its
query positions, so keys/values shared by the beams are read once per input.
The memory has one slot; the self-attention cache has one slot per beam.

Beams never copy their cache: beam j writes position t into its own slot j, and
when beam search keeps a hypothesis only the small `ancestry` table follows it
(`reorder_cache`): `ancestry[b, j, t]` is the slot that holds position t of
beam j's history, so beam j attends to slot p at position t iff t has been
written and ancestry[b, j, t] == p (`self_attention_mask`). A greedy or
sampling step reads only a written prefix of the cache (`attend`,
`_attend_cache_prefix`); a beam step all of it (BEAM_CACHE_PREFIX_PARTS), and
so does any step traced under `prefix_parts(1)`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

Array = jax.Array

CACHE_PREFIX_PARTS = 4  # static prefixes a step chooses from (1 = the whole cache)
# ... with beams: 1. With batches that shrink, beam search's step measured
# within noise of 4 parts (1,000 gettext lines: 8.8 against 9.0 s in one A/B,
# 6% slower in another) for 0.55x the compile time (12.1 against 21.8 s; a
# first decode.py of those lines 26.6 against 36.5 s); greedy's gains 11%
# (2.28 against 2.57 s) for 1.4x (10.5 against 7.8 s). docs/benchmarks.md.
BEAM_CACHE_PREFIX_PARTS = 1
# What `prefix_parts` sets for the steps traced under it (None: the above).
_PREFIX_PARTS = contextvars.ContextVar("cache_prefix_parts", default=None)


@contextlib.contextmanager
def prefix_parts(parts: int | None):
  """Steps traced in this context read the self-attention cache through
  `parts` static prefixes (1: the whole cache at every step), whatever the
  module's defaults; None keeps them. A decoder chooses it for itself
  (`batch_plan.Policy.small_decoder`: one copy of the attention per layer to
  load instead of `parts`, where few rows would not pay for them). A
  context variable, so that decoders traced side by side in threads each
  see their own."""
  token = _PREFIX_PARTS.set(parts)
  try:
    yield
  finally:
    _PREFIX_PARTS.reset(token)


# ----------------------------------------------------------------------------
# The cache: layout, writes, reordering
# ----------------------------------------------------------------------------


def init_cache(config, batch_size: int, max_decode_len: int, beams: int = 1) -> dict:
  """An empty self-attention cache for `batch_size` inputs with `beams` rows each.

  `config`: the model's `TransformerConfig`. Per decoder layer (with
  `scan_layers`, stacked on a leading layer axis): "key" `[batch, heads, d_k,
  max_decode_len * beams]` and "value" `[batch, heads, max_decode_len * beams,
  d_k]` (position-major: beam j of position t at t * beams + j); "ancestry"
  `[batch, beams, max_decode_len]` int32 says which slot holds each position
  of each beam's history; "index" is the position decoded next.
  """
  heads = (batch_size, config.num_heads)
  shapes = {"key": heads + (config.head_dim, max_decode_len * beams),
            "value": heads + (max_decode_len * beams, config.head_dim)}
  zeros = lambda shape: jnp.zeros(shape, config.compute_dtype)
  if config.scan_layers:
    layers = {name: zeros((config.num_decoder_layers,) + shape)
              for name, shape in shapes.items()}
  else:
    layers = [{name: zeros(shape) for name, shape in shapes.items()}
              for _ in range(config.num_decoder_layers)]
  return {"index": jnp.array(0, dtype=jnp.int32),
          "ancestry": jnp.zeros((batch_size, beams, max_decode_len), jnp.int32),
          "layers": layers}


def reorder_cache(cache: dict, parents: Array) -> dict:
  """Beam search's cache update (see `decoding.beam_search(reorder_cache=...)`).

  parents `[batch, beams]`: the beam each surviving hypothesis extends. Only
  the ancestry table follows the hypotheses (`[batch, beams, max_decode_len]`
  int32, a few KB); the keys/values, megabytes, stay where they were written.
  """
  ancestry = jnp.take_along_axis(cache["ancestry"], parents[:, :, None], axis=1)
  return dict(cache, ancestry=ancestry)


def select_inputs(decoding: dict, indices: Array, stacked_layers: bool) -> dict:
  """A decoding batch's state {"cache": `init_cache`'s, "memory":
  `Transformer.encoder_memory`'s} for the inputs `indices` `[n]` int32 only,
  in that order: every array's input axis (0; 1 in layers stacked by
  `scan_layers`) gathered, the rest kept. What a batch keeps when it drops
  its finished inputs (`decoding.search.Shrink`)."""
  take = lambda axis: lambda x: jnp.take(x, indices, axis=axis)
  layer_axis = 1 if stacked_layers else 0
  cache, memory = decoding["cache"], decoding["memory"]
  return {"cache": {"index": cache["index"], "ancestry": cache["ancestry"][indices],
                    "layers": jax.tree.map(take(layer_axis), cache["layers"])},
          "memory": dict(memory, key_value=jax.tree.map(take(layer_axis), memory["key_value"]),
                         mask=memory["mask"][indices])}


def self_attention_mask(cache: dict) -> tuple[Array, Array]:
  """Which cache slots and positions each beam sees at step `cache["index"]`.

  Returns (mask broadcastable to `[batch, heads, beams, slots, max_decode_len]`,
  the ancestry with this step's position recorded: each beam writes it into
  its own slot).
  """
  index, ancestry = cache["index"], cache["ancestry"]
  batch, beams, length = ancestry.shape
  written = jnp.arange(length) <= index
  if beams == 1:  # greedy search, sampling: a row's history is its own slot
    return written[None, None, None, None, :], ancestry
  own_slot = jnp.broadcast_to(jnp.arange(beams, dtype=ancestry.dtype)[None, :, None],
                              (batch, beams, 1))
  ancestry = jax.lax.dynamic_update_slice(ancestry, own_slot, (0, 0, index))
  slots = jnp.arange(beams)[None, None, :, None]
  visible = (ancestry[:, :, None, :] == slots) & written  # [batch, beam, slot, t]
  return visible[:, None], ancestry


def write(layer_cache: dict, key: Array, value: Array, index: Array) -> dict:
  """One layer's cache with this step's keys/values `[batch * beams, 1, heads,
  d_k]` written at position `index`, beam j into slot j: columns (key) or rows
  (value) index * beams ... index * beams + beams - 1, one in-place update
  each. (Slot-major, beam j of position t at j * max_decode_len + t, took an
  update per beam: 4x the updates, and beam search's largest op after its
  matmuls.)"""
  key_cache, value_cache = layer_cache["key"], layer_cache["value"]
  batch, heads, d_k, _ = key_cache.shape
  key = key.reshape(batch, -1, heads, d_k).transpose(0, 2, 3, 1)  # [batch, heads, d_k, beams]
  value = value.reshape(batch, -1, heads, value_cache.shape[-1]).transpose(0, 2, 1, 3)
  beams = key.shape[-1]  # (value: [batch, heads, beams, d_v])
  zero = jnp.zeros((), jnp.int32)
  start = (index * beams).astype(jnp.int32)
  return {"key": jax.lax.dynamic_update_slice(
              key_cache, key.astype(key_cache.dtype), (zero, zero, zero, start)),
          "value": jax.lax.dynamic_update_slice(
              value_cache, value.astype(value_cache.dtype), (zero, zero, start, zero))}


def memory_layout(key: Array, value: Array) -> tuple[Array, Array]:
  """Encoder-decoder attention keys/values `[batch, src_length, heads, d_k]` ->
  the layouts `attend` reads, as one slot shared by all beams: keys `[batch,
  heads, d_k, src_length]`, values `[batch, heads, src_length, d_v]`."""
  return key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------
# Reading: one step's attention
# ----------------------------------------------------------------------------


def attend(query: Array, key: Array, value: Array, mask: Array,
           written: Array | None = None) -> Array:
  """Scaled dot-product attention of one decoding step (Equation (1) of the
  paper) for `batch * beams` queries against per-input keys/values.

  Args:
    query: `[batch * beams, 1, heads, d_k]`, projected (Q W^Q), not yet scaled.
    key: `[batch, heads, d_k, kv_length * slots]` (position-major).
    value: `[batch, heads, kv_length * slots, d_v]` (position-major).
    mask: bool, broadcastable to `[batch, heads, beams, slots, kv_length]`
      (its axis 3 says how many slots the keys/values hold).
    written: for a self-attention cache, the number of positions written so
      far (scalar): only they can be visible, so only a prefix of the cache is
      read (`_attend_cache_prefix`). None for the encoder memory.
  Returns:
    the heads' outputs `[batch * beams, 1, heads, d_v]`, before W^O.
  """
  flat, _, heads, d_k = query.shape
  batch = key.shape[0]
  beams = flat // batch
  query = query / jnp.sqrt(jnp.asarray(d_k, query.dtype))
  query = query.reshape(batch, beams, heads, d_k).transpose(0, 2, 1, 3)
  if written is None:
    out = _attend_slots(query, key, value, mask)
  else:
    parts = _PREFIX_PARTS.get() or (
        CACHE_PREFIX_PARTS if mask.shape[3] == 1 else BEAM_CACHE_PREFIX_PARTS)
    out = _attend_cache_prefix(query, key, value, mask, written, parts)
  return out.transpose(0, 2, 1, 3).reshape(flat, 1, heads, value.shape[-1])


def _attend_slots(query: Array, key: Array, value: Array, mask: Array) -> Array:
  """Scaled dot-product attention of each input's beams over its key/value slots.

  query `[batch, heads, beams, d_k]` (already scaled by 1/sqrt(d_k)), key
  `[batch, heads, d_k, length * slots]`, value `[batch, heads, value_length
  * slots, d_v]` with value_length >= length (positions past `length` get
  weight 0), mask broadcastable to `[batch, heads, beams, slots, length]`
  (slots = its axis 3) -> `[batch, heads, beams, d_v]`.
  """
  # scores[b, h, q, t, s] = sum_d query[b, h, q, d] key[b, h, d, t, s]: every
  # beam against every slot in one matmul per (input, head), [beams, d_k] x
  # [d_k, length * slots]. (Beam search computed them as d_k elementwise
  # multiply-adds of key rows until 2026-11-26: a third of its decoder's
  # instructions, and slower than the matmul once XLA's CPU ran batched
  # matmuls through YNNPACK.)
  slots = mask.shape[3]
  length = key.shape[-1] // slots
  scores = jnp.einsum("bhqd,bhdx->bhqx", query, key, preferred_element_type=jnp.float32)
  scores = scores.reshape(scores.shape[:3] + (length, slots))
  scores = jnp.where(jnp.swapaxes(mask, 3, 4), scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=(3, 4)).astype(value.dtype)
  # heads[b, h, q, d] = sum_{t, s} weights[b, h, q, t, s] value[b, h, t * S + s, d]
  # with S = slots: zero weights pad a prefix's to the whole value cache, which
  # the matmul then reads in place (slicing the prefix would copy it first,
  # at a higher cost than the extra rows).
  value_length = value.shape[2] // slots
  if value_length > length:
    weights = jnp.pad(weights, ((0, 0),) * 3 + ((0, value_length - length), (0, 0)))
  weights = weights.reshape(weights.shape[:3] + (-1,))
  return jnp.einsum("bhqx,bhxd->bhqd", weights, value)


def _attend_cache_prefix(query: Array, key: Array, value: Array, mask: Array,
                         written: Array, parts: int | None = None) -> Array:
  """`_attend_slots` over the decoder cache, reading only a written prefix.

  At step t only positions <= t are visible, yet a cache of static length L
  would be read whole at every step. Instead the step picks (`lax.switch`) the
  shortest of CACHE_PREFIX_PARTS static prefixes (L/4, L/2, 3L/4, L) that
  holds the `written` positions: on average 5/8 of the cache is read instead
  of all of it, for 4 compiled copies of this small function. `parts`: how
  many prefixes (default CACHE_PREFIX_PARTS; 1 reads the whole cache).
  """
  slots = mask.shape[3]
  length = key.shape[-1] // slots
  parts = min(CACHE_PREFIX_PARTS if parts is None else parts, length)
  if parts == 1:
    return _attend_slots(query, key, value, mask)
  bounds = [-(-length * (i + 1) // parts) for i in range(parts)]

  def prefix(n):
    def attend_prefix(query, key, value, mask):
      # Keys and scores are read for the prefix only; values in place (see
      # `_attend_slots`: the weights past n are zeros).
      return _attend_slots(query, key[..., :n * slots], value, mask[..., :n])
    return attend_prefix

  branch = sum((written > bound).astype(jnp.int32) for bound in bounds[:-1])
  return jax.lax.switch(branch, [prefix(n) for n in bounds], query, key, value, mask)
