"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in Flax linen.

Read top to bottom, this file is the paper's Section 3 (the hyper-parameters,
with the paper's names, are `config.py`'s TransformerConfig):

  sinusoidal_positional_encoding  Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model))
  attention_mask, shift_right     Section 3.2.3 / 3.1: masking, outputs offset by one
  scaled_dot_product_attention    Section 3.2.1, Equation (1): softmax(Q K^T / sqrt(d_k)) V,
                                  for training and decoding alike
  MultiHeadAttention              Section 3.2.2: Concat(head_1, ..., head_h) W^O
  FeedForward                     Section 3.3, Equation (2): max(0, x W_1 + b_1) W_2 + b_2
  ResidualNorm                    Section 3.1 / 5.4: LayerNorm(x + Dropout(Sublayer(x)))
  Embeddings, InputEmbedding      Section 3.4 / 3.5: shared embedding x sqrt(d_model), + PE
  EncoderLayer, Encoder           Section 3.1, the left half of Figure 1
  DecoderLayer, Decoder           Section 3.1, the right half of Figure 1, then the final
                                  linear transformation (Section 3.4); each with `step`,
                                  the same computation for one new position (decoding)
  Transformer                     encode / decode / __call__ -> logits (the loss applies
                                  softmax); encoder_memory + decode_step for decoding

Shapes: `[batch, length, d_model]` for activations; heads are split as
`[batch, length, num_heads, head_dim]`. Masks come from *segment ids*: 0 on
padding and 1, 2, 3, ... for the examples packed into one row; a query attends
to a key of its own segment that is not padding (nor, in the decoder, in the future).

Two paths through the decoder. Training and scoring see the whole target at
once (teacher forcing, the causal mask). Decoding produces one position per
step: each decoder layer's `step` runs the same three sub-layers for that
position, its self-attention reading the keys/values of earlier positions from
a cache, its encoder-decoder attention reading keys/values computed once from
the encoder output (`Transformer.encoder_memory`), not at every step.

What makes it fast sits beside it and computes the same thing: `layers.py`
(the dense layer, LayerNorm, dropout and the tied output projection, each
equal to its flax counterpart), `kv_cache.py` (the cache's layout and the
attention kernel for one decoding step), `attention_choice.py` (cuDNN / XLA /
einsum per machine).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.model import kv_cache, prng
from transformer.model.attention_choice import attention_backend, choose_attention_implementation
from transformer.model.config import TransformerConfig
from transformer.model.layers import (Dense, Dropout, LayerNorm, run_layers, stack_layers,
                                      tied_output_projection)

Array = jax.Array


def sinusoidal_positional_encoding(positions: Array, d_model: int) -> Array:
  """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...).

  positions: integers, any shape `[...]`; d_model: even -> float32 `[..., d_model]`,
  computed from the positions (no table, so no length limit).
  """
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)           # 2i
  inv_timescale = jnp.power(10000.0, -two_i / d_model)           # 1 / 10000^(2i/d)
  angles = positions[..., None].astype(jnp.float32) * inv_timescale
  # Interleave so that dimension 2i is the sine and 2i+1 the cosine, as written.
  pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  return pe.reshape(*positions.shape, d_model)


def attention_mask(query_segment_ids: Array, key_segment_ids: Array,
                   causal: bool = False) -> Array:
  """Which keys each query may attend to: segment ids `[batch, q_length]` and
  `[batch, kv_length]` (0 = padding) -> bool `[batch, 1, q_length, kv_length]`
  (broadcast over heads). `causal` also hides later positions (Section 3.2.3)."""
  mask = ((query_segment_ids[:, :, None] == key_segment_ids[:, None, :])
          & (key_segment_ids[:, None, :] > 0))
  if causal:
    q_len, kv_len = query_segment_ids.shape[1], key_segment_ids.shape[1]
    mask &= jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))
  return mask[:, None, :, :]


def shift_right(targets: Array, bos_id: int, segment_ids: Array | None = None) -> Array:
  """Decoder inputs: the targets moved one step right, each example starting with BOS.

  With packing, every segment starts with its own BOS and nothing leaks from the
  previous example.  targets, segment_ids: `[batch, length]` -> `[batch, length]`.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
  if segment_ids is None:
    return shifted
  starts = segment_ids != jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
  shifted = jnp.where(starts, bos_id, shifted)
  return jnp.where(segment_ids > 0, shifted, 0)


def scaled_dot_product_attention(
    query: Array, key: Array, value: Array, mask: Array | None = None, *,
    dropout_rate: float = 0.0, dropout_rng: Array | None = None,
    return_weights: bool = False, implementation: str | None = None,
    cached: bool = False, written: Array | None = None,
) -> tuple[Array, Array | None]:
  """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, Equation (1).

  Args:
    query: `[batch, q_length, heads, d_k]`; key, value: `[batch, kv_length, heads, d_k]`.
    mask: bool, broadcastable to `[batch, heads, q_length, kv_length]`; False hides a key.
    dropout_rate, dropout_rng: dropout on the attention weights (training only).
    return_weights: also return the weights (e.g. to plot them).
    implementation: None, "xla" or "cudnn", resolved for this machine by
      `choose_attention_implementation`.
    cached: incremental decoding (`DecoderLayer.step`): one query position per
      row, query `[batch * beams, 1, heads, d_k]`, against keys/values in
      `kv_cache`'s layout (the decoder's cache, or the encoder output's keys/
      values computed once per input), mask as `kv_cache.attend` takes it.
    written: with `cached`, how many cache positions are written (a scalar;
      None for the encoder's keys/values): later ones are not read at all.
  Returns:
    `([batch, q_length, heads, d_v], weights [batch, heads, q_length, kv_length] or None)`.
    A query whose every key is hidden (padding) gets uniform weights in the
    einsums and in XLA, and sees every key in cuDNN (which gave such rows
    non-finite gradients): no NaN, and no loss or real position depends on
    such a row.
  """
  if cached:
    # The same equation for one new position per row. It replaces the einsums
    # below with a kernel for the cache's layout (kv_cache.attend): the beams of
    # an input share one read of its keys/values, and only the written part of
    # the cache is read. Decoding is deterministic: no dropout, no weights.
    return kv_cache.attend(query, key, value, mask, written), None
  use_dropout = dropout_rng is not None and dropout_rate > 0.0
  q_len, kv_len = query.shape[1], key.shape[1]
  chosen = choose_attention_implementation(
      implementation, backend=attention_backend(), dtype=query.dtype,
      head_dim=query.shape[-1], dropout=use_dropout, return_weights=return_weights,
      odd_masked_length=mask is not None and bool(q_len % 2 or kv_len % 2))
  if chosen != "einsum":
    if chosen == "cudnn" and mask is not None:
      # cuDNN takes the mask as a bias of the full [q_length, kv_length]; it
      # refuses one broadcast over queries, e.g. [batch, 1, 1, kv_length].
      mask = jnp.broadcast_to(mask, (*mask.shape[:-2], q_len, kv_len))
      # A query that sees no key (a padding position) sees every key instead:
      # cuDNN gave such rows non-finite gradients (its first GPU check, H200),
      # where XLA and the einsums give uniform weights. No loss and no
      # real position reads a padding query, so nothing else changes.
      mask = mask | ~jnp.any(mask, axis=-1, keepdims=True)
    out = jax.nn.dot_product_attention(query, key, value, mask=mask, implementation=chosen)
    return out, None
  # Heads first, [batch, heads, length, d_k], so that both products are
  # batched matmuls over leading (batch, head) dimensions. (jax.nn's XLA path
  # keeps heads in the middle; on CPU its dots ran at 30-50 GFLOP/s.)
  query, key, value = (x.swapaxes(1, 2) for x in (query, key, value))
  d_k = query.shape[-1]
  scores = jnp.einsum("bhqd,bhkd->bhqk", query / math.sqrt(d_k), key,
                      preferred_element_type=jnp.float32)
  if mask is not None:
    # A large negative number rather than -inf: a row with every key hidden
    # (a padding query) gets uniform weights instead of NaN, like XLA's path.
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if use_dropout:
    weights = prng.dropout(weights, dropout_rate, dropout_rng)
  out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(value.dtype), value)
  return out.swapaxes(1, 2), weights


def _dense(config: TransformerConfig, features, in_dims=1, name=None) -> Dense:
  """x W + b: flax's DenseGeneral, computed as 2-D matrix products (layers.py)."""
  return Dense(features=features, in_dims=in_dims, dtype=config.compute_dtype,
               param_dtype=config.params_dtype, matmul_dtype=config.matmul_dtype, name=name)


def _layer_norm(config: TransformerConfig, name=None) -> LayerNorm:
  """flax's LayerNorm, with a faster backward pass (layers.py)."""
  return LayerNorm(epsilon=config.layer_norm_epsilon, param_dtype=config.params_dtype,
                   name=name)


class MultiHeadAttention(nn.Module):
  """Section 3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

  The h projections W_i^Q of width d_k are stored together as one
  `[d_model, h, d_k]` kernel (likewise K, V), and W^O as `[h, d_v, d_model]`,
  so that all heads are computed by one matrix multiplication. Attention
  weights `[batch, heads, q_length, kv_length]` are sown into "intermediates"
  as `attention_weights` when that collection is mutable.
  """

  config: TransformerConfig
  deterministic: bool = True

  def setup(self):
    cfg = self.config
    heads = (cfg.num_heads, cfg.head_dim)
    self.query = _dense(cfg, heads)
    self.key = _dense(cfg, heads)
    self.value = _dense(cfg, heads)
    self.out = _dense(cfg, cfg.d_model, in_dims=2)

  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None) -> Array:
    """`[batch, q_length, d_model]`, `[batch, kv_length, d_model]` -> `[batch, q_length, d_model]`."""
    return self.attend(inputs_q, *self.project_key_value(inputs_kv), mask)

  def project_key_value(self, inputs_kv: Array) -> tuple[Array, Array]:
    """`[batch, kv_length, d_model]` -> K W^K, V W^V `[batch, kv_length, heads, d_k]`."""
    return self.key(inputs_kv), self.value(inputs_kv)

  def attend(self, inputs_q: Array, key: Array, value: Array, mask: Array | None, *,
             cached: bool = False, written: Array | None = None) -> Array:
    """Attention of `inputs_q` `[batch, q_length, d_model]` to projected keys and
    values `[batch, kv_length, heads, d_k]`; in decoding (`cached`, `written`:
    see `scaled_dot_product_attention`) one position per row against keys and
    values in `kv_cache`'s layout. -> `[batch, q_length, d_model]`."""
    cfg = self.config
    dropout_rng = None
    if not self.deterministic and cfg.attention_dropout_rate > 0:
      dropout_rng = self.make_rng("dropout")
    heads, weights = scaled_dot_product_attention(
        self.query(inputs_q), key, value, mask, dropout_rate=cfg.attention_dropout_rate,
        dropout_rng=dropout_rng, return_weights=self.is_mutable_collection("intermediates"),
        implementation=cfg.attention_implementation, cached=cached, written=written)
    if weights is not None:
      self.sow("intermediates", "attention_weights", weights)
    return self.out(heads)  # Concat(heads) W^O


class FeedForward(nn.Module):
  """Section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position
  (max(0, .) is ReLU; `activation` may choose GELU or swish instead)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    activation = {"relu": nn.relu, "gelu": nn.gelu, "swish": nn.swish}[cfg.activation]
    h = activation(_dense(cfg, cfg.d_ff, name="inner")(x))
    return _dense(cfg, cfg.d_model, name="outer")(h)


class ResidualNorm(nn.Module):
  """Residual connection and layer normalisation around a sub-layer.

  post (the paper, Section 3.1 and 5.4):  LayerNorm(x + Dropout(Sublayer(x)))
  pre  (Xiong et al., 2020):               x + Dropout(Sublayer(LayerNorm(x)))
  """

  config: TransformerConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, sublayer: Callable[[Array], Array]) -> Array:
    cfg = self.config
    norm = _layer_norm(cfg, name="norm")
    dropout = Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    if cfg.normalization == "pre":
      return x + dropout(sublayer(norm(x).astype(cfg.compute_dtype)))
    return norm(x + dropout(sublayer(x))).astype(cfg.compute_dtype)


class Embeddings(nn.Module):
  """Section 3.4: token embedding times sqrt(d_model), and its transpose as the
  pre-softmax linear transformation. Initialised with standard deviation
  d_model^-0.5: the scaled embedding has unit variance, the tied logits unit scale."""

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.embedding = nn.Embed(
        cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
        embedding_init=nn.initializers.normal(stddev=cfg.d_model ** -0.5))

  def __call__(self, tokens: Array) -> Array:
    """`[batch, length]` int -> `[batch, length, d_model]`."""
    cfg = self.config
    return self.embedding(tokens) * jnp.sqrt(jnp.asarray(cfg.d_model, cfg.compute_dtype))

  def attend(self, y: Array) -> Array:
    """`[batch, length, d_model]` -> logits `[batch, length, vocab]` (y E^T)."""
    cfg = self.config
    if cfg.matmul_dtype is not None:  # (as `Dense` and decoding's `logits_kernel` multiply)
      return jnp.einsum("...d,vd->...v", y.astype(cfg.matmul_dtype),
                        self.embedding.embedding.astype(cfg.matmul_dtype),
                        preferred_element_type=cfg.compute_dtype)
    dtype = cfg.compute_dtype
    return tied_output_projection(y.astype(dtype), self.embedding.embedding.astype(dtype))


class InputEmbedding(nn.Module):
  """Token embedding + positional encoding, then dropout (Section 5.4)."""

  config: TransformerConfig
  embeddings: Embeddings
  deterministic: bool = True

  @nn.compact
  def __call__(self, tokens: Array, positions: Array) -> Array:
    cfg = self.config
    x = self.embeddings(tokens)
    if cfg.positional == "sinusoidal":
      pe = sinusoidal_positional_encoding(positions, cfg.d_model)
    else:
      pe = nn.Embed(cfg.max_len, cfg.d_model, dtype=cfg.compute_dtype,
                    param_dtype=cfg.params_dtype,
                    embedding_init=nn.initializers.normal(stddev=1.0),
                    name="learned_positions")(positions)
    x = x + pe.astype(x.dtype)
    return Dropout(cfg.dropout_rate, deterministic=self.deterministic)(x)


class EncoderLayer(nn.Module):
  """One encoder layer: self-attention, then feed-forward, each with ResidualNorm."""

  config: TransformerConfig
  deterministic: bool = True

  def setup(self):
    cfg, det = self.config, self.deterministic
    self.self_attention = MultiHeadAttention(cfg, det)
    self.feed_forward = FeedForward(cfg)
    self.self_attention_norm = ResidualNorm(cfg, det)
    self.feed_forward_norm = ResidualNorm(cfg, det)

  def __call__(self, x: Array, mask: Array) -> Array:
    """x `[batch, src_length, d_model]`, mask `[batch, 1, src_length, src_length]`."""
    x = self.self_attention_norm(x, lambda h: self.self_attention(h, h, mask))
    return self.feed_forward_norm(x, self.feed_forward)


class DecoderLayer(nn.Module):
  """One decoder layer: masked self-attention, encoder-decoder attention, feed-forward."""

  config: TransformerConfig
  deterministic: bool = True

  def setup(self):
    cfg, det = self.config, self.deterministic
    self.self_attention = MultiHeadAttention(cfg, det)
    self.cross_attention = MultiHeadAttention(cfg, det)
    self.feed_forward = FeedForward(cfg)
    self.self_attention_norm = ResidualNorm(cfg, det)
    self.cross_attention_norm = ResidualNorm(cfg, det)
    self.feed_forward_norm = ResidualNorm(cfg, det)

  def __call__(self, y: Array, encoded: Array, self_mask: Array, cross_mask: Array) -> Array:
    """The whole target at once (teacher forcing): y `[batch, tgt_length, d_model]`,
    encoded `[batch, src_length, d_model]`, self_mask `[batch, 1, tgt_length,
    tgt_length]` (causal), cross_mask `[batch, 1, tgt_length, src_length]`."""
    y = self.self_attention_norm(y, lambda h: self.self_attention(h, h, self_mask))
    y = self.cross_attention_norm(y, lambda h: self.cross_attention(h, encoded, cross_mask))
    return self.feed_forward_norm(y, self.feed_forward)

  def memory(self, encoded: Array) -> tuple[Array, Array]:
    """Decoding: the encoder-decoder attention's keys/values, once per input
    rather than at every step, in `kv_cache.memory_layout`."""
    return kv_cache.memory_layout(*self.cross_attention.project_key_value(encoded))

  def step(self, y: Array, cache: dict, memory: tuple[Array, Array],
           cross_mask: Array, self_mask: Array, index: Array) -> tuple[Array, dict]:
    """Decoding: the same three sub-layers for position `index` only, of `batch *
    beams` rows: y `[batch * beams, 1, d_model]` -> (same shape, this layer's
    `cache` with the position's keys/values written). Masked self-attention
    reads the positions written so far (`self_mask`: each beam its own
    history, `kv_cache.self_attention_mask`); encoder-decoder attention reads
    `memory`, the keys/values computed once from the encoder output."""
    def self_attention(h):
      nonlocal cache
      cache = kv_cache.write(cache, *self.self_attention.project_key_value(h), index)
      return self.self_attention.attend(h, cache["key"], cache["value"], self_mask,
                                        cached=True, written=index + 1)

    def cross_attention(h):
      return self.cross_attention.attend(h, *memory, cross_mask, cached=True)

    y = self.self_attention_norm(y, self_attention)
    y = self.cross_attention_norm(y, cross_attention)
    return self.feed_forward_norm(y, self.feed_forward), cache


class _ScannedEncoderLayer(EncoderLayer):
  """EncoderLayer in nn.scan's (carry, ...) -> (carry, output) form (`scan_layers`)."""

  def __call__(self, x, mask):
    return super().__call__(x, mask), None


class _ScannedDecoderLayer(DecoderLayer):
  """DecoderLayer in nn.scan's form (`step` has it already)."""

  def __call__(self, y, encoded, self_mask, cross_mask):
    return super().__call__(y, encoded, self_mask, cross_mask), None

  def memory(self, encoded, _):
    return encoded, super().memory(encoded)


class Encoder(nn.Module):
  """Input embedding, N encoder layers (and a final LayerNorm when pre-LN)."""

  config: TransformerConfig
  embeddings: Embeddings
  deterministic: bool = True

  def setup(self):
    cfg, det = self.config, self.deterministic
    self.input_embedding = InputEmbedding(cfg, self.embeddings, det)
    self.layers = stack_layers(EncoderLayer, _ScannedEncoderLayer, cfg.num_encoder_layers,
                               (cfg, det), scan=cfg.scan_layers, remat=cfg.remat,
                               scan_methods={"__call__": dict(in_axes=nn.broadcast)})
    if cfg.normalization == "pre":
      self.final_norm = _layer_norm(cfg)

  def __call__(self, inputs: Array, segment_ids: Array, positions: Array) -> Array:
    """inputs, segment_ids, positions `[batch, src_length]` -> `[batch, src_length, d_model]`."""
    cfg = self.config
    x = self.input_embedding(inputs, positions)
    x = run_layers(self.layers, cfg.scan_layers, x, attention_mask(segment_ids, segment_ids))
    if cfg.normalization == "pre":
      x = self.final_norm(x).astype(cfg.compute_dtype)
    return x


class Decoder(nn.Module):
  """Output embedding, N decoder layers, (final LayerNorm when pre-LN), logits.
  `__call__` runs the whole target at once (training, scoring); decoding runs
  one position at a time (`memory` once, then `step`)."""

  config: TransformerConfig
  embeddings: Embeddings
  deterministic: bool = True

  def setup(self):
    cfg, det, bcast = self.config, self.deterministic, nn.broadcast
    self.input_embedding = InputEmbedding(cfg, self.embeddings, det)
    self.layers = stack_layers(
        DecoderLayer, _ScannedDecoderLayer, cfg.num_decoder_layers, (cfg, det),
        scan=cfg.scan_layers, remat=cfg.remat,
        scan_methods={"__call__": dict(in_axes=bcast), "memory": dict(in_axes=(0,)),
                      "step": dict(in_axes=(0, 0, bcast, bcast, bcast))})
    if cfg.normalization == "pre":
      self.final_norm = _layer_norm(cfg)
    if not cfg.logits_via_embedding:
      self.output_projection = _dense(cfg, cfg.vocab_size)
    if cfg.logits_bias:  # (not the paper's; Marian's final_logits_bias)
      self.logits_bias = self.param("logits_bias", nn.initializers.zeros, (cfg.vocab_size,),
                                    cfg.params_dtype)

  def __call__(self, decoder_inputs: Array, segment_ids: Array, positions: Array,
               encoded: Array, encoder_segment_ids: Array) -> Array:
    """decoder_inputs `[batch, tgt_length]` (targets shifted right), encoded
    `[batch, src_length, d_model]` -> logits `[batch, tgt_length, vocab]`."""
    y = self.input_embedding(decoder_inputs, positions)
    y = run_layers(self.layers, self.config.scan_layers, y, encoded,
                   attention_mask(segment_ids, segment_ids, causal=True),
                   attention_mask(segment_ids, encoder_segment_ids))
    return self.logits(y)

  def logits(self, y: Array, logits_kernel: Array | None = None) -> Array:
    """The final linear transformation: `[..., d_model]` -> float32 `[..., vocab]`
    (`logits_kernel`: E^T already laid out `[d_model, vocab]`, for decoding)."""
    cfg = self.config
    if cfg.normalization == "pre":
      y = self.final_norm(y).astype(cfg.compute_dtype)
    if logits_kernel is not None:  # (in `matmul_dtype` if one is set: `logits_kernel()`)
      logits = jnp.dot(y.astype(logits_kernel.dtype), logits_kernel,
                       preferred_element_type=cfg.compute_dtype)
    elif cfg.logits_via_embedding:
      logits = self.embeddings.attend(y)
    else:
      logits = self.output_projection(y)
    if cfg.logits_bias:
      logits = logits + self.logits_bias.astype(logits.dtype)
    return logits.astype(jnp.float32)

  def memory(self, encoded: Array):
    """Every layer's cross-attention keys/values (stacked on axis 0 when scanned)."""
    if self.config.scan_layers:
      return self.layers.memory(encoded, None)[1]
    return [layer.memory(encoded) for layer in self.layers]

  def step(self, tokens: Array, cache: dict, memory, cross_mask: Array,
           logits_kernel: Array | None) -> tuple[Array, dict]:
    """Decoding: one position of every row, tokens `[batch * beams]` (the
    previous ones) -> logits `[batch * beams, vocab]` and the cache with this
    position written. `memory`: `Decoder.memory`'s; `cross_mask` `[batch, 1, 1,
    1, src_length]`; `logits_kernel`: see `Transformer.logits_kernel`."""
    index = cache["index"]
    self_mask, ancestry = kv_cache.self_attention_mask(cache)
    positions = jnp.full((tokens.shape[0], 1), index, jnp.int32)
    y = self.input_embedding(tokens[:, None], positions)
    if self.config.scan_layers:
      y, layers = self.layers.step(y, cache["layers"], memory, cross_mask, self_mask, index)
    else:
      layers = []
      for layer, layer_cache, layer_memory in zip(self.layers, cache["layers"], memory):
        y, layer_cache = layer.step(y, layer_cache, layer_memory, cross_mask, self_mask, index)
        layers.append(layer_cache)
    return (self.logits(y[:, 0], logits_kernel),
            {"index": index + 1, "ancestry": ancestry, "layers": layers})


class Transformer(nn.Module):
  """The encoder-decoder Transformer (Figure 1).

  Training / scoring:  logits = model.apply(params, inputs, decoder_inputs)
  Decoding:            encoded = apply(..., method=Transformer.encode)
                       memory  = apply(..., method=Transformer.encoder_memory)
                       cache   = kv_cache.init_cache(config, batch, max_len, beams)
                       logits, cache = apply(..., token_ids, cache, memory,
                                             method=Transformer.decode_step)
  """

  config: TransformerConfig
  deterministic: bool = True

  def setup(self):
    cfg, det = self.config, self.deterministic
    source_embeddings = Embeddings(cfg, name="embeddings" if cfg.share_embeddings
                                   else "source_embeddings")
    target_embeddings = (source_embeddings if cfg.share_embeddings
                         else Embeddings(cfg, name="target_embeddings"))
    self.encoder = Encoder(cfg, source_embeddings, det)
    self.decoder = Decoder(cfg, target_embeddings, det)

  def _segments_and_positions(self, tokens, segment_ids, positions):
    if segment_ids is None:  # an unpacked batch: 1 on real tokens, 0 on padding
      segment_ids = (tokens != self.config.pad_id).astype(jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return segment_ids, positions

  def __call__(self, inputs: Array, decoder_inputs: Array,
               inputs_segment_ids: Array | None = None,
               decoder_segment_ids: Array | None = None,
               inputs_positions: Array | None = None,
               decoder_positions: Array | None = None) -> Array:
    """inputs `[batch, src_length]`, decoder_inputs `[batch, tgt_length]` (targets
    shifted right, see `shift_right`) -> logits `[batch, tgt_length, vocab]`."""
    encoded = self.encode(inputs, inputs_segment_ids, inputs_positions)
    return self.decode(encoded, inputs, decoder_inputs, inputs_segment_ids,
                       decoder_segment_ids, decoder_positions)

  def encode(self, inputs: Array, inputs_segment_ids: Array | None = None,
             inputs_positions: Array | None = None) -> Array:
    """inputs `[batch, src_length]` token ids -> encoded `[batch, src_length, d_model]`."""
    segment_ids, positions = self._segments_and_positions(
        inputs, inputs_segment_ids, inputs_positions)
    return self.encoder(inputs, segment_ids, positions)

  def decode(self, encoded: Array, inputs: Array, decoder_inputs: Array,
             inputs_segment_ids: Array | None = None,
             decoder_segment_ids: Array | None = None,
             decoder_positions: Array | None = None) -> Array:
    """Teacher-forced decoder -> float32 logits `[batch, tgt_length, vocab]`.
    `inputs` (source ids) only mask source padding when `inputs_segment_ids` is
    not given; without `decoder_segment_ids` every decoder position is real."""
    enc_segments, _ = self._segments_and_positions(inputs, inputs_segment_ids, None)
    if decoder_segment_ids is None:
      decoder_segment_ids = jnp.ones_like(decoder_inputs, dtype=jnp.int32)
    _, positions = self._segments_and_positions(
        decoder_inputs, decoder_segment_ids, decoder_positions)
    return self.decoder(decoder_inputs, decoder_segment_ids, positions, encoded, enc_segments)

  def encoder_memory(self, encoded: Array, inputs: Array,
                     inputs_segment_ids: Array | None = None,
                     logits_kernel: Array | None = None) -> dict:
    """Decoding: what every step needs and no step changes, once per batch:
    every layer's cross-attention keys/values, the source padding mask and
    `logits_kernel()` (pass it in to share one copy across batches)."""
    segment_ids, _ = self._segments_and_positions(inputs, inputs_segment_ids, None)
    return {"key_value": self.decoder.memory(encoded),
            "mask": (segment_ids > 0)[:, None, None, None, :],
            "logits_kernel": self.logits_kernel() if logits_kernel is None else logits_kernel}

  def logits_kernel(self) -> Array | None:
    """Decoding: the tied pre-softmax projection E^T laid out `[d_model, vocab]`
    in `matmul_dtype`, else the compute dtype (None when untied): with a few
    rows per step, y E^T read from E as stored measured 25-35% slower, and it
    is a step's largest matmul."""
    cfg = self.config
    if not cfg.logits_via_embedding:
      return None
    embedding = self.decoder.embeddings.embedding.embedding  # E `[vocab, d_model]`
    return embedding.T.astype(cfg.matmul_dtype or cfg.compute_dtype)

  def decode_step(self, token_ids: Array, cache: dict, memory: dict) -> tuple[Array, dict]:
    """Decoding: token_ids `[batch * beams]`, the previous token of every row
    (BOS first; row b * beams + j is beam j of input b), a `kv_cache.init_cache`
    cache and the `encoder_memory` of the `batch` inputs -> float32 logits
    `[batch * beams, vocab]` of the next token, and the cache."""
    return self.decoder.step(token_ids, cache, memory["key_value"], memory["mask"],
                             memory["logits_kernel"])


def init_params(config: TransformerConfig, rng: Array, src_length: int = 8,
                tgt_length: int = 8):
  """Random initial parameters for `config` (float `param_dtype` pytree)."""
  inputs = jnp.ones((1, src_length), jnp.int32)
  targets = jnp.ones((1, tgt_length), jnp.int32)
  return Transformer(config).init(rng, inputs, targets)["params"]


def count_params(config_or_params) -> int:
  """Number of parameters of a config (computed abstractly, nothing allocated)
  or of a parameter pytree."""
  if isinstance(config_or_params, TransformerConfig):
    config_or_params = jax.eval_shape(
        functools.partial(init_params, config_or_params), jax.random.key(0))
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(config_or_params)))


