"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in Flax linen.

Read top to bottom, this file is the paper's Section 3:

  TransformerConfig             the hyper-parameters, with the paper's names (Table 3)
  sinusoidal_positional_encoding  Section 3.5
  scaled_dot_product_attention  Section 3.2.1, Equation (1)
  tied_output_projection        Section 3.4: y E^T, the pre-softmax projection
  Dense                         x W + b (the projections), as one 2-D matrix product
  LayerNorm                     Ba et al. (2016), used by ResidualNorm
  MultiHeadAttention            Section 3.2.2
  FeedForward                   Section 3.3, Equation (2)
  Dropout, ResidualNorm         Section 3.1 / 5.4: LayerNorm(x + Dropout(Sublayer(x)))
  Embeddings                    Section 3.4: shared embedding, scaled by sqrt(d_model)
  EncoderLayer, Encoder         Section 3.1, left half of Figure 1
  DecoderLayer, Decoder         Section 3.1, right half of Figure 1
  Transformer                   encode / decode / __call__ -> logits, plus the
                                incremental-decoding API used by `decoding.py`

Shapes: `[batch, length, d_model]` for activations; heads are split as
`[batch, length, num_heads, head_dim]`.

Masks come from *segment ids*: 0 on padding and 1, 2, 3, ... for the examples
packed into one row. A query attends to a key only when both belong to the same
segment and the key is not padding (and, in the decoder, is not in the future).
An unpacked batch is the special case of segment id 1 on every real token.

Incremental decoding (`Transformer.decode_step`) keeps a self-attention key/value
cache filled one position per step, and takes the encoder-decoder attention keys
and values from a `memory` computed once per input (`Transformer.encoder_memory`),
never recomputed per step. Beams of one input share that memory: the decoder
reshapes its `[batch * beams]` queries to `[batch, beams]` and lets the beams
attend to the same keys as if they were extra query positions. The beams'
self-attention caches are never copied either: each beam writes into its own
slot, and an `ancestry` table says which slot holds each position of a beam's
history (`Decoder.step`, `reorder_cache`). Decoding keeps keys/values heads
first, `[batch, heads, length, d_k]`, so a step transposes nothing of size,
and a step reads only a written prefix of the keys (`_attend_cache_prefix`).
The tied pre-softmax projection is read from a row-major E^T made once
(`Transformer.logits_kernel`), not from the embedding as stored.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import prng

Array = jax.Array

# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of the Transformer. Defaults are the paper's base model."""

  vocab_size: int = 37000          # shared source/target vocabulary
  d_model: int = 512               # width of every residual-stream vector
  num_heads: int = 8               # h
  d_ff: int = 2048                 # inner width of the feed-forward network
  num_encoder_layers: int = 6      # N (encoder)
  num_decoder_layers: int = 6      # N (decoder)
  max_len: int = 256               # longest sequence (learned positions, checks)
  dropout_rate: float = 0.1        # P_drop: sub-layer outputs, embeddings + PE
  attention_dropout_rate: float = 0.0  # on the attention weights (not in the paper)
  share_embeddings: bool = True    # one embedding for source and target tokens
  logits_via_embedding: bool = True  # pre-softmax projection = embedding^T
  normalization: str = "post"      # "post" (paper) or "pre" (LayerNorm first)
  activation: str = "relu"         # feed-forward non-linearity: "relu" or "gelu"
  positional: str = "sinusoidal"   # "sinusoidal" (paper) or "learned"
  layer_norm_epsilon: float = 1e-6
  dtype: str = "float32"           # compute dtype ("bfloat16" on accelerators)
  param_dtype: str = "float32"     # storage dtype of the parameters
  scan_layers: bool = False        # stack layers with nn.scan (flat compile time)
  remat: bool = False              # recompute layer activations in the backward pass
  attention_implementation: str | None = None  # jax.nn.dot_product_attention: None, "xla", "cudnn"
  pad_id: int = 0
  eos_id: int = 1
  bos_id: int = 2

  def __post_init__(self):
    def fail(field, problem):
      raise ValueError(
          f"TransformerConfig.{field}={getattr(self, field)!r}: {problem}")

    for field in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
      if not isinstance(getattr(self, field), int) or getattr(self, field) <= 0:
        fail(field, "must be a positive integer")
    for field in ("num_encoder_layers", "num_decoder_layers"):
      if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
        fail(field, "must be an integer >= 1")
    if self.d_model % self.num_heads:
      fail("d_model", f"must be divisible by num_heads={self.num_heads} "
           "(each head gets d_model / num_heads dimensions)")
    for field in ("dropout_rate", "attention_dropout_rate"):
      if not 0.0 <= getattr(self, field) < 1.0:
        fail(field, "must be in [0, 1)")
    if self.normalization not in ("post", "pre"):
      fail("normalization", "must be 'post' (the paper) or 'pre'")
    if self.activation not in ("relu", "gelu"):
      fail("activation", "must be 'relu' (the paper) or 'gelu'")
    if self.positional not in ("sinusoidal", "learned"):
      fail("positional", "must be 'sinusoidal' (the paper) or 'learned'")
    for field in ("dtype", "param_dtype"):
      if getattr(self, field) not in _DTYPES:
        fail(field, f"must be one of {_DTYPES}")
    if self.attention_implementation not in (None, "xla", "cudnn"):
      fail("attention_implementation", "must be None (auto), 'xla' or 'cudnn'")
    for field in ("pad_id", "eos_id", "bos_id"):
      if not 0 <= getattr(self, field) < self.vocab_size:
        fail(field, f"must be a token id in [0, vocab_size={self.vocab_size})")

  @property
  def head_dim(self) -> int:
    """d_k = d_v = d_model / h."""
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values) -> "TransformerConfig":
    """Builds a config from a mapping, ignoring keys that are not fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(values).items() if k in names})


# ----------------------------------------------------------------------------
# Pure functions: positions, masks, attention
# ----------------------------------------------------------------------------


def sinusoidal_positional_encoding(positions: Array, d_model: int) -> Array:
  """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...).

  Args:
    positions: integer positions, any shape `[...]`.
    d_model: even model width.
  Returns:
    float32 `[..., d_model]`, computed from the positions (no table, so no limit).
  """
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)           # 2i
  inv_timescale = jnp.power(10000.0, -two_i / d_model)           # 1 / 10000^(2i/d)
  angles = positions[..., None].astype(jnp.float32) * inv_timescale
  # Interleave so that dimension 2i is the sine and 2i+1 the cosine, as written.
  pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  return pe.reshape(*positions.shape, d_model)


def segment_ids_from_tokens(tokens: Array, pad_id: int) -> Array:
  """1 on real tokens, 0 on padding: the segment ids of an unpacked batch."""
  return (tokens != pad_id).astype(jnp.int32)


def attention_mask(query_segment_ids: Array, key_segment_ids: Array,
                   causal: bool = False) -> Array:
  """Which keys each query may attend to.

  Args:
    query_segment_ids: `[batch, q_length]`, 0 = padding.
    key_segment_ids: `[batch, kv_length]`, 0 = padding.
    causal: also hide keys at later positions (decoder self-attention).
  Returns:
    bool `[batch, 1, q_length, kv_length]` (broadcast over heads).
  """
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
) -> tuple[Array, Array | None]:
  """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, Equation (1).

  Args:
    query: `[batch, q_length, heads, d_k]`.
    key: `[batch, kv_length, heads, d_k]`.
    value: `[batch, kv_length, heads, d_v]`.
    mask: bool, broadcastable to `[batch, heads, q_length, kv_length]`; False hides a key.
    dropout_rate, dropout_rng: dropout on the attention weights (training only).
    return_weights: also return the weights (e.g. to plot them).
    implementation: "xla" or "cudnn": `jax.nn.dot_product_attention` with
      that implementation. None (the default): that function's own choice on
      GPU (cuDNN flash attention where it applies), the einsums below elsewhere.
  Returns:
    `([batch, q_length, heads, d_v], weights [batch, heads, q_length, kv_length] or None)`.
  """
  use_dropout = dropout_rng is not None and dropout_rate > 0.0
  fused = implementation is not None or jax.default_backend() == "gpu"
  if fused and not (return_weights or use_dropout):
    out = jax.nn.dot_product_attention(query, key, value, mask=mask,
                                       implementation=implementation)
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
    # (a padding query) gets uniform weights instead of NaN, like the fused path.
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if use_dropout:
    weights = prng.dropout(weights, dropout_rate, dropout_rng)
  out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(value.dtype), value)
  return out.swapaxes(1, 2), weights


@jax.custom_vjp
def tied_output_projection(y: Array, embedding: Array) -> Array:
  """Section 3.4's pre-softmax linear transformation with the embedding's
  weights: `y` `[..., d_model]` x `embedding` `[vocab, d_model]` -> `[..., vocab]`
  (y E^T).

  Plain autodiff, but the embedding's gradient is computed as (y^T g)^T: XLA
  otherwise folds the transpose into the matmul, computes g^T y, and first
  copies the whole `[tokens, vocab]` gradient g transposed. y^T g measured 1.5x
  faster than g^T y on CPU (`[2048, 8192]` g: 187 vs 132 GFLOP/s).
  """
  return jnp.einsum("...d,vd->...v", y, embedding)


def _tied_output_projection_fwd(y, embedding):
  return tied_output_projection(y, embedding), (y, embedding)


def _tied_output_projection_bwd(residuals, g):
  y, embedding = residuals
  # As 2-D products: contracting [batch, length] at once would first copy y
  # transposed (see `Dense`).
  y2, g2 = y.reshape(-1, y.shape[-1]), g.reshape(-1, g.shape[-1])
  d_y = jnp.dot(g2, embedding).reshape(y.shape)
  d_embedding_t = jnp.dot(y2.T, g2)  # [d_model, vocab]
  # The barrier keeps XLA from rewriting transpose(y^T g) back into g^T y.
  return d_y, jax.lax.optimization_barrier(d_embedding_t).T


tied_output_projection.defvjp(_tied_output_projection_fwd, _tied_output_projection_bwd)


# ----------------------------------------------------------------------------
# Modules, one per component of Figure 1
# ----------------------------------------------------------------------------


class Dense(nn.Module):
  """y = x W + b, contracting the last `in_dims` axes of x with the first of W.

  `flax.linen.DenseGeneral`'s parameters (names, shapes, initialisation: the
  kernel is initialised as a `[prod(in), prod(features)]` matrix and reshaped),
  computed as one matrix product of x flattened to `[tokens, prod(in)]` with W
  flattened to `[prod(in), prod(features)]`. Why: for a multi-axis kernel such
  as W^Q `[d_model, heads, d_k]`, the gradients dx = dy W^T and dW = x^T dy
  contract several axes at once, and XLA first copies W, dy or x transposed
  to bring them to matrix form; as 2-D products they need no copy (on CPU
  the base model's training step had ~200 such copies).

  Shapes: x `[..., *in]` -> `[..., *features]`, where `in` = x.shape[-in_dims:].
  """

  features: int | tuple[int, ...]
  in_dims: int = 1
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.zeros

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    in_shape = x.shape[x.ndim - self.in_dims:]
    fan_in, fan_out = math.prod(in_shape), math.prod(features)
    kernel = self.param(
        "kernel", lambda rng, shape, dtype: self.kernel_init(
            rng, (fan_in, fan_out), dtype).reshape(shape),
        in_shape + features, self.param_dtype)
    bias = self.param(
        "bias", lambda rng, shape, dtype: self.bias_init(
            rng, (fan_out,), dtype).reshape(shape),
        features, self.param_dtype)
    flat = x.reshape(-1, fan_in).astype(self.dtype)
    y = jnp.dot(flat, kernel.reshape(fan_in, fan_out).astype(self.dtype))
    y = y + bias.reshape(fan_out).astype(self.dtype)
    return y.reshape(x.shape[:x.ndim - self.in_dims] + features)


def _dense(config: TransformerConfig, features, in_dims=1, name=None) -> Dense:
  return Dense(features=features, in_dims=in_dims, dtype=config.compute_dtype,
               param_dtype=config.params_dtype, name=name)


def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float) -> Array:
  """Layer normalisation (Ba et al., 2016) over the last axis, in float32:
  x_hat = (x - mean) / sqrt(var + epsilon), y = x_hat * scale + bias.

  Autodiff's gradients, written out (with g the output's gradient, s = scale):
      dx = (g s - mean(g s) - x_hat mean(g s x_hat)) / sqrt(var + epsilon),
      dscale = sum over positions of g x_hat,  dbias = sum of g,
  where the two row means are matrix-vector products, g @ s and (g x_hat) @ s.
  Why: XLA on CPU hands a row reduction of g * s to YNNPACK, which cannot
  broadcast s itself, so every LayerNorm backward first wrote s broadcast to
  the activations' size; this VJP made the base model's CPU step ~5% faster.

  Shapes: x `[..., d]`, scale and bias `[d]` -> float32 `[..., d]`. The casts
  to float32 sit outside the custom VJP, so autodiff returns each gradient in
  its input's dtype (bfloat16 activations, float32 parameters).
  """
  f32 = lambda a: a.astype(jnp.float32)
  return _layer_norm_float32(f32(x), f32(scale), f32(bias), epsilon)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_float32(x, scale, bias, epsilon):
  return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
  centred = x - x.mean(-1, keepdims=True)
  inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, -1, keepdims=True) + epsilon)
  x_hat = centred * inv_std
  return x_hat * scale + bias, (x_hat, inv_std, scale)


def _layer_norm_bwd(epsilon, residuals, g):
  del epsilon
  x_hat, inv_std, scale = residuals
  d = x_hat.shape[-1]
  g_x_hat = g * x_hat
  mean_gs = jnp.dot(g, scale)[..., None] / d
  mean_gs_x_hat = jnp.dot(g_x_hat, scale)[..., None] / d
  dx = inv_std * (g * scale - mean_gs - x_hat * mean_gs_x_hat)
  positions = tuple(range(g.ndim - 1))
  return dx, g_x_hat.sum(positions), g.sum(positions)


_layer_norm_float32.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.Module):
  """`layer_norm` with learned `scale` (ones) and `bias` (zeros): the same
  parameters as `flax.linen.LayerNorm`, so checkpoints carry over.
  Statistics and output in float32 even when computing in bfloat16."""

  epsilon: float = 1e-6
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (x.shape[-1],)
    scale = self.param("scale", nn.initializers.ones, features, self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, features, self.param_dtype)
    return layer_norm(x, scale, bias, self.epsilon)


def _layer_norm(config: TransformerConfig, name=None) -> LayerNorm:
  return LayerNorm(epsilon=config.layer_norm_epsilon, param_dtype=config.params_dtype,
                   name=name)


class MultiHeadAttention(nn.Module):
  """Section 3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

  The h projections W_i^Q of width d_k are stored together as one
  `[d_model, h, d_k]` kernel (likewise K, V), and W^O as `[h, d_v, d_model]`,
  so that all heads are computed by one matrix multiplication.
  Attention weights are sown into the "intermediates" collection as
  `attention_weights` `[batch, heads, q_length, kv_length]` when it is mutable.
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

  def project_key_value(self, inputs_kv: Array) -> tuple[Array, Array]:
    """`[batch, kv_length, d_model]` -> keys, values `[batch, kv_length, heads, d_k]`."""
    return self.key(inputs_kv), self.value(inputs_kv)

  def attend(self, inputs_q: Array, key: Array, value: Array,
             mask: Array | None) -> Array:
    """Attention of `inputs_q` `[batch, q_length, d_model]` to projected keys/values."""
    cfg = self.config
    query = self.query(inputs_q)
    want_weights = self.is_mutable_collection("intermediates")
    dropout_rng = None
    if not self.deterministic and cfg.attention_dropout_rate > 0:
      dropout_rng = self.make_rng("dropout")
    heads, weights = scaled_dot_product_attention(
        query, key, value, mask, dropout_rate=cfg.attention_dropout_rate,
        dropout_rng=dropout_rng, return_weights=want_weights,
        implementation=cfg.attention_implementation)
    if weights is not None:
      self.sow("intermediates", "attention_weights", weights)
    return self.out(heads)  # Concat(heads) W^O

  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None) -> Array:
    """`[batch, q_length, d_model]`, `[batch, kv_length, d_model]` -> `[batch, q_length, d_model]`."""
    key, value = self.project_key_value(inputs_kv)
    return self.attend(inputs_q, key, value, mask)

  # -- incremental decoding ---------------------------------------------------

  def project_key_value_for_step(self, inputs_kv: Array) -> tuple[Array, Array]:
    """`[batch, kv_length, d_model]` -> keys `[batch, heads, 1, d_k, kv_length]`
    and values `[batch, heads, kv_length, d_v]`: the layouts `attend_step`
    reads (one "slot", as the encoder memory is shared by all beams)."""
    key, value = self.project_key_value(inputs_kv)
    return key.transpose(0, 2, 3, 1)[:, :, None], value.transpose(0, 2, 1, 3)

  def attend_step(self, inputs_q: Array, key: Array, value: Array, mask: Array,
                  written: Array | None = None) -> Array:
    """One decoding step: `batch * beams` queries against per-input keys/values.

    The `beams` rows of one input (rows b * beams ... b * beams + beams - 1) are
    its query positions, so keys/values shared by the beams (the encoder
    memory, or the cache slots of all its beams) are read once per input.

    Args:
      inputs_q: `[batch * beams, 1, d_model]`.
      key: `[batch, heads, slots, d_k, kv_length]`.
      value: `[batch, heads, slots * kv_length, d_v]` (slot-major).
      mask: bool, broadcastable to `[batch, heads, beams, slots, kv_length]`.
      written: for a decoder cache, the number of positions written so far
        (scalar): only the first `written` positions can be visible, so only
        a prefix of the cache is read (see `_attend_cache_prefix`).
    Returns:
      `[batch * beams, 1, d_model]`.

    The layouts are chosen so that nothing of the cache's size is transposed
    or copied per step.
    """
    cfg = self.config
    batch, flat = key.shape[0], inputs_q.shape[0]
    beams = flat // batch
    query = self.query(inputs_q) / jnp.sqrt(jnp.asarray(cfg.head_dim, inputs_q.dtype))
    query = query.reshape(batch, beams, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    if written is None:
      heads = _attend_slots(query, key, value, mask)
    else:
      heads = _attend_cache_prefix(query, key, value, mask, written)
    heads = heads.transpose(0, 2, 1, 3).reshape(flat, 1, cfg.num_heads, cfg.head_dim)
    return self.out(heads)


def _attend_slots(query: Array, key: Array, value: Array, mask: Array) -> Array:
  """Scaled dot-product attention of each input's beams over its key/value slots.

  query `[batch, heads, beams, d_k]` (already scaled by 1/sqrt(d_k)), key
  `[batch, heads, slots, d_k, length]`, value `[batch, heads, slots *
  value_length, d_v]` with value_length >= length (positions past `length`
  get weight 0), mask broadcastable to `[batch, heads, beams, slots, length]`
  -> `[batch, heads, beams, d_v]`.
  """
  # scores[b, h, q, s, t] = sum_d query[b, h, q, d] key[b, h, s, d, t]
  if key.shape[2] == 1:  # one slot (the encoder memory, greedy's cache): a matmul
    scores = jnp.einsum("bhqd,bhdt->bhqt", query, key[:, :, 0],
                        preferred_element_type=jnp.float32)[:, :, :, None]
  else:
    # Every beam against every slot: as d_k multiply-adds of whole
    # [.., length] rows, one elementwise loop that streams the keys once (a
    # batched matmul or a reduce measured 10-20x slower for these shapes).
    # Summed as a balanced tree, not a chain of d_k dependent adds, so the
    # CPU can overlap them (12-40% faster per call, measured).
    query = query.astype(jnp.float32)
    scores = _tree_sum([query[:, :, :, None, d, None] * key[:, :, None, :, d, :]
                        for d in range(query.shape[-1])])
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=(3, 4)).astype(value.dtype)
  # heads[b, h, q, d] = sum_{s, t} weights[b, h, q, s, t] value[b, h, s * L + t, d]
  # with L = value_length: zero weights pad a prefix's to the whole value
  # cache, which the matmul then reads in place (slicing each slot's prefix
  # would copy it first, at a higher cost than the extra rows).
  slots, length = key.shape[2], key.shape[-1]
  value_length = value.shape[2] // slots
  if value_length > length:
    weights = jnp.pad(weights, ((0, 0),) * 4 + ((0, value_length - length),))
  weights = weights.reshape(weights.shape[:3] + (-1,))
  return jnp.einsum("bhqx,bhxd->bhqd", weights, value)


def _tree_sum(terms: list[Array]) -> Array:
  """terms[0] + terms[1] + ..., added pairwise: depth log2(n), not n."""
  while len(terms) > 1:
    terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i]
             for i in range(0, len(terms), 2)]
  return terms[0]


CACHE_PREFIX_PARTS = 4


def _attend_cache_prefix(query: Array, key: Array, value: Array, mask: Array,
                         written: Array) -> Array:
  """`_attend_slots` over the decoder cache, reading only a written prefix.

  At step t only positions <= t are visible, yet a cache of static length L
  would be read whole at every step. Instead the step picks (`lax.switch`) the
  shortest of CACHE_PREFIX_PARTS static prefixes (L/4, L/2, 3L/4, L) that
  holds the `written` positions: on average 5/8 of the cache is read instead
  of all of it, for 4 compiled copies of this small function.
  """
  length = key.shape[-1]
  parts = min(CACHE_PREFIX_PARTS, length)
  bounds = [-(-length * (i + 1) // parts) for i in range(parts)]

  def prefix(n):
    def attend(query, key, value, mask):
      # Keys and scores are read for the prefix only; values in place (see
      # `_attend_slots`: the weights past n are zeros).
      return _attend_slots(query, key[..., :n], value, mask[..., :n])
    return attend

  branch = sum((written > bound).astype(jnp.int32) for bound in bounds[:-1])
  return jax.lax.switch(branch, [prefix(n) for n in bounds], query, key, value, mask)


class FeedForward(nn.Module):
  """Section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    activation = nn.relu if cfg.activation == "relu" else nn.gelu
    h = activation(_dense(cfg, cfg.d_ff, name="inner")(x))
    return _dense(cfg, cfg.d_model, name="outer")(h)


class Dropout(nn.Module):
  """Section 5.4, residual dropout: `flax.linen.Dropout`, mask for mask (same
  random bits from the same "dropout" RNG), with the mask hashed in the same
  fused kernel that applies it (`prng.dropout`: 3-4x faster on CPU)."""

  rate: float
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    if self.deterministic or self.rate == 0.0:
      return x
    return prng.dropout(x, self.rate, self.make_rng("dropout"))


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
  pre-softmax linear transformation.

  Initialised with standard deviation d_model^-0.5, so the scaled embedding has
  unit variance and the tied logits start at unit scale.
  """

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.embedding = nn.Embed(
        cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype,
        embedding_init=nn.initializers.normal(stddev=cfg.d_model ** -0.5))

  def __call__(self, tokens: Array) -> Array:
    """`[batch, length]` int -> `[batch, length, d_model]`."""
    return self.embedding(tokens) * jnp.sqrt(jnp.asarray(self.config.d_model, self.config.compute_dtype))

  def attend(self, y: Array) -> Array:
    """`[batch, length, d_model]` -> logits `[batch, length, vocab]` (y E^T)."""
    dtype = self.config.compute_dtype
    return tied_output_projection(y.astype(dtype), self.embedding.embedding.astype(dtype))

  def attend_kernel(self) -> Array:
    """E^T as a `[d_model, vocab]` array in the compute dtype: `attend(y)` is
    `y @ attend_kernel()`."""
    return self.embedding.embedding.T.astype(self.config.compute_dtype)


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

  def __call__(self, y: Array, encoded: Array, self_mask: Array,
               cross_mask: Array) -> Array:
    """Teacher-forced pass over the whole target.

    y `[batch, tgt_length, d_model]`, encoded `[batch, src_length, d_model]`,
    self_mask `[batch, 1, tgt_length, tgt_length]` (causal + padding),
    cross_mask `[batch, 1, tgt_length, src_length]`.
    """
    y = self.self_attention_norm(y, lambda h: self.self_attention(h, h, self_mask))
    y = self.cross_attention_norm(y, lambda h: self.cross_attention(h, encoded, cross_mask))
    return self.feed_forward_norm(y, self.feed_forward)

  def memory(self, encoded: Array) -> tuple[Array, Array]:
    """Encoder-decoder attention keys/values, computed once per input for decoding.

    `[batch, src_length, d_model]` -> keys `[batch, heads, 1, d_k, src_length]`,
    values `[batch, heads, src_length, d_k]` (see `MultiHeadAttention.attend_step`).
    """
    return self.cross_attention.project_key_value_for_step(encoded)

  def step(self, y: Array, cache: dict, memory: tuple[Array, Array],
           cross_mask: Array, self_mask: Array, index: Array) -> tuple[Array, dict]:
    """One decoding step at position `index` for `batch * beams` rows.

    Args:
      y: `[batch * beams, 1, d_model]`, the embedded previous tokens.
      cache: {"key": `[batch, heads, beams, d_k, max_decode_len]`, "value":
        `[batch, heads, beams * max_decode_len, d_k]`}; beam j of input b
        writes position `index` into its own slot j.
      memory: this layer's cross-attention keys/values (`DecoderLayer.memory`).
      cross_mask: `[batch, 1, 1, 1, src_length]`.
      self_mask: `[batch or 1, 1, beams, beams or 1, max_decode_len]`, which
        cache slots each beam may see (its own history, see `Decoder.step`).
      index: scalar, the position being decoded.
    Returns:
      `([batch * beams, 1, d_model]`, updated cache).
    """
    def self_attention(h):
      new_key, new_value = self.self_attention.project_key_value(h)
      cache["key"] = _write_key_position(cache["key"], new_key, index)
      cache["value"] = _write_value_position(cache["value"], new_value, index)
      return self.self_attention.attend_step(h, cache["key"], cache["value"], self_mask,
                                             written=index + 1)

    def cross_attention(h):
      return self.cross_attention.attend_step(h, *memory, cross_mask)

    cache = dict(cache)
    y = self.self_attention_norm(y, self_attention)
    y = self.cross_attention_norm(y, cross_attention)
    return self.feed_forward_norm(y, self.feed_forward), cache


def _write_key_position(cache: Array, new: Array, index: Array) -> Array:
  """Writes `new` `[batch * beams, 1, heads, d_k]` at position `index` of
  `cache` `[batch, heads, beams, d_k, max_decode_len]`, beam j into slot j."""
  batch, heads, beams, d_k, _ = cache.shape
  new = new.reshape(batch, beams, heads, d_k).transpose(0, 2, 1, 3)[..., None]
  return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, 0, 0, 0, index))


def _write_value_position(cache: Array, new: Array, index: Array) -> Array:
  """Writes `new` `[batch * beams, 1, heads, d_v]` at position `index` of
  `cache` `[batch, heads, beams * max_decode_len, d_v]`, beam j at j * max_decode_len + index.

  One in-place update per beam: a single reshaped update would make XLA copy
  the whole cache for the matmul that reads it."""
  batch, heads, flat_length, d_v = cache.shape
  beams = new.shape[0] // batch
  length = flat_length // beams
  new = new.reshape(batch, beams, heads, d_v).transpose(0, 2, 1, 3).astype(cache.dtype)
  for j in range(beams):
    cache = jax.lax.dynamic_update_slice(cache, new[:, :, j:j + 1],
                                         (0, 0, j * length + index, 0))
  return cache


# ----------------------------------------------------------------------------
# Layer stacks: a Python loop, or nn.scan (one compiled layer, flat compile time)
# ----------------------------------------------------------------------------


class _ScannedEncoderLayer(EncoderLayer):
  """EncoderLayer in the (carry, per-layer input) -> (carry, output) form of nn.scan."""

  def __call__(self, x, mask):
    return super().__call__(x, mask), None


class _ScannedDecoderLayer(DecoderLayer):
  """DecoderLayer in nn.scan form; `memory` and `step` scan over stacked per-layer data."""

  def __call__(self, y, encoded, self_mask, cross_mask):
    return super().__call__(y, encoded, self_mask, cross_mask), None

  def memory(self, encoded, _):
    return encoded, super().memory(encoded)

  def step(self, y, cache, memory, cross_mask, self_mask, index):
    return super().step(y, cache, memory, cross_mask, self_mask, index)


def _scan(layer_cls, config: TransformerConfig, length: int, methods: dict):
  """nn.scan over `length` copies of `layer_cls`, parameters stacked on axis 0."""
  common = dict(variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True}, length=length)
  return nn.scan(layer_cls, methods={m: dict(common, **kw) for m, kw in methods.items()})


def _maybe_remat(layer_cls, config: TransformerConfig):
  if not config.remat:
    return layer_cls
  # Under nn.scan, common-subexpression elimination cannot merge the recomputation.
  return nn.remat(layer_cls, prevent_cse=not config.scan_layers)


class Encoder(nn.Module):
  """Input embedding, N encoder layers (and a final LayerNorm when pre-LN)."""

  config: TransformerConfig
  embeddings: Embeddings
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs: Array, segment_ids: Array, positions: Array) -> Array:
    """inputs, segment_ids, positions `[batch, src_length]` -> `[batch, src_length, d_model]`."""
    cfg, det = self.config, self.deterministic
    x = InputEmbedding(cfg, self.embeddings, det, name="input_embedding")(inputs, positions)
    mask = attention_mask(segment_ids, segment_ids)
    if cfg.scan_layers:
      layers = _scan(_maybe_remat(_ScannedEncoderLayer, cfg), cfg, cfg.num_encoder_layers,
                     {"__call__": dict(in_axes=nn.broadcast)})
      x, _ = layers(cfg, det, name="layers")(x, mask)
    else:
      for i in range(cfg.num_encoder_layers):
        x = _maybe_remat(EncoderLayer, cfg)(cfg, det, name=f"layers_{i}")(x, mask)
    if cfg.normalization == "pre":
      x = _layer_norm(cfg, name="final_norm")(x).astype(cfg.compute_dtype)
    return x


class Decoder(nn.Module):
  """Output embedding, N decoder layers, (final LayerNorm when pre-LN), logits.

  Two modes share the parameters: `__call__` runs the whole target at once
  (training, scoring); `memory` + `step` decode one position at a time.
  """

  config: TransformerConfig
  embeddings: Embeddings
  deterministic: bool = True

  def setup(self):
    cfg, det = self.config, self.deterministic
    self.input_embedding = InputEmbedding(cfg, self.embeddings, det)
    if cfg.scan_layers:
      broadcast = nn.broadcast
      self.layers = _scan(
          _maybe_remat(_ScannedDecoderLayer, cfg), cfg, cfg.num_decoder_layers,
          {"__call__": dict(in_axes=broadcast),
           "memory": dict(in_axes=(0,)),
           "step": dict(in_axes=(0, 0, broadcast, broadcast, broadcast))},
      )(cfg, det)
    else:
      self.layers = [_maybe_remat(DecoderLayer, cfg)(cfg, det)
                     for _ in range(cfg.num_decoder_layers)]
    if cfg.normalization == "pre":
      self.final_norm = _layer_norm(cfg)
    if not cfg.logits_via_embedding:
      self.output_projection = _dense(cfg, cfg.vocab_size)

  def logits(self, y: Array, logits_kernel: Array | None = None) -> Array:
    """The final linear transformation: `[..., d_model]` -> float32 `[..., vocab]`.

    `logits_kernel` (decoding): the tied projection already laid out as
    `[d_model, vocab]` (`logits_kernel()`), so that y E^T reads it row-major.
    """
    cfg = self.config
    if cfg.normalization == "pre":
      y = self.final_norm(y).astype(cfg.compute_dtype)
    if logits_kernel is not None:
      logits = jnp.dot(y.astype(cfg.compute_dtype), logits_kernel)
    elif cfg.logits_via_embedding:
      logits = self.embeddings.attend(y)
    else:
      logits = self.output_projection(y)
    return logits.astype(jnp.float32)

  def logits_kernel(self) -> Array | None:
    """E^T `[d_model, vocab]` in the compute dtype, for the tied projection of
    decoding steps (None when the projection is untied: its kernel is already
    `[d_model, vocab]`).

    Made once per batch by `Transformer.encoder_memory`, or once for all
    batches by its caller (`translation.Translator`), never per step: with a
    few rows per step, y E^T against E stored `[vocab, d_model]` measured
    25-35% slower than against a row-major E^T copy (B greedy: 6.5 vs 4.7 ms
    per step), and the projection is the step's largest matmul.
    """
    cfg = self.config
    if not cfg.logits_via_embedding:
      return None
    return self.embeddings.attend_kernel()

  def __call__(self, decoder_inputs: Array, segment_ids: Array, positions: Array,
               encoded: Array, encoder_segment_ids: Array) -> Array:
    """Teacher forcing: decoder_inputs `[batch, tgt_length]` (targets shifted
    right), encoded `[batch, src_length, d_model]` -> logits `[batch, tgt_length, vocab]`."""
    cfg = self.config
    y = self.input_embedding(decoder_inputs, positions)
    self_mask = attention_mask(segment_ids, segment_ids, causal=True)
    cross_mask = attention_mask(segment_ids, encoder_segment_ids)
    if cfg.scan_layers:
      y, _ = self.layers(y, encoded, self_mask, cross_mask)
    else:
      for layer in self.layers:
        y = layer(y, encoded, self_mask, cross_mask)
    return self.logits(y)

  def memory(self, encoded: Array):
    """Per-layer cross-attention keys/values (stacked on axis 0 when scanning)."""
    if self.config.scan_layers:
      _, kv = self.layers.memory(encoded, None)
      return kv
    return [layer.memory(encoded) for layer in self.layers]

  def step(self, tokens: Array, cache: dict, memory, cross_mask: Array,
           logits_kernel: Array | None = None):
    """tokens `[batch * beams]` -> logits `[batch * beams, vocab]`, new cache.

    `memory`: every layer's cross-attention keys/values (`memory()`);
    `logits_kernel`: from `logits_kernel()`, or None to read the embedding.

    Beam j of input b writes its keys/values into its own cache slot j, and no
    slot is ever moved: when beam search keeps a hypothesis, only the small
    `ancestry` table follows it (`reorder_cache`). `ancestry[b, j, t]` is the
    slot that holds position t of beam j's history, so beam j attends to slot
    p at position t iff t <= index and ancestry[b, j, t] == p.
    """
    cfg = self.config
    index, ancestry = cache["index"], cache["ancestry"]
    batch, beams, length = ancestry.shape
    written = jnp.arange(length) <= index
    if beams == 1:  # greedy search, sampling: a row's history is its own slot
      self_mask = written[None, None, None, None, :]
    else:
      # This step's position is written by each beam into its own slot.
      own_slot = jnp.broadcast_to(jnp.arange(beams, dtype=ancestry.dtype)[None, :, None],
                                  (batch, beams, 1))
      ancestry = jax.lax.dynamic_update_slice(ancestry, own_slot, (0, 0, index))
      slots = jnp.arange(beams)[None, None, :, None]
      visible = (ancestry[:, :, None, :] == slots) & written  # [batch, beam, slot, t]
      self_mask = visible[:, None]

    positions = jnp.full((tokens.shape[0], 1), index, dtype=jnp.int32)
    y = self.input_embedding(tokens[:, None], positions)
    if cfg.scan_layers:
      y, layers = self.layers.step(y, cache["layers"], memory, cross_mask, self_mask, index)
    else:
      layers = []
      for layer, layer_cache, layer_memory in zip(self.layers, cache["layers"], memory):
        y, layer_cache = layer.step(y, layer_cache, layer_memory, cross_mask, self_mask,
                                    index)
        layers.append(layer_cache)
    return (self.logits(y[:, 0], logits_kernel),
            {"index": index + 1, "ancestry": ancestry, "layers": layers})


class Transformer(nn.Module):
  """The encoder-decoder Transformer (Figure 1).

  Training / scoring:    logits = model.apply(params, inputs, decoder_inputs)
  Decoding:              encoded = apply(..., method=Transformer.encode)
                         memory  = apply(..., method=Transformer.encoder_memory)
                         cache   = init_cache(config, batch, max_decode_len, beams)
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
    if segment_ids is None:
      segment_ids = segment_ids_from_tokens(tokens, self.config.pad_id)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return segment_ids, positions

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
    """Teacher-forced decoder: -> logits `[batch, tgt_length, vocab]` (float32).

    `inputs` (source token ids) only serve to mask source padding when
    `inputs_segment_ids` is not given. Without `decoder_segment_ids`, every
    decoder position counts as real (BOS may equal the padding id).
    """
    enc_segments, _ = self._segments_and_positions(inputs, inputs_segment_ids, None)
    if decoder_segment_ids is None:
      decoder_segment_ids = jnp.ones_like(decoder_inputs, dtype=jnp.int32)
    _, positions = self._segments_and_positions(
        decoder_inputs, decoder_segment_ids, decoder_positions)
    return self.decoder(decoder_inputs, decoder_segment_ids, positions, encoded, enc_segments)

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

  def encoder_memory(self, encoded: Array, inputs: Array,
                     inputs_segment_ids: Array | None = None,
                     logits_kernel: Array | None = None) -> dict:
    """What every decoding step needs and no step changes, computed once per
    batch: every layer's cross-attention keys/values, the source padding mask
    and (tied embeddings) the pre-softmax projection E^T laid out for the step
    (`logits_kernel()`; pass it in to reuse one copy across batches)."""
    segment_ids, _ = self._segments_and_positions(inputs, inputs_segment_ids, None)
    if logits_kernel is None:
      logits_kernel = self.decoder.logits_kernel()
    return {"key_value": self.decoder.memory(encoded),
            "mask": (segment_ids > 0)[:, None, None, None, :],
            "logits_kernel": logits_kernel}

  def logits_kernel(self) -> Array | None:
    """E^T `[d_model, vocab]` for decoding steps (None if untied): see
    `Decoder.logits_kernel`. It depends on the parameters only, so a caller
    decoding many batches computes it once (`translation.Translator`)."""
    return self.decoder.logits_kernel()

  def decode_step(self, token_ids: Array, cache: dict, memory: dict) -> tuple[Array, dict]:
    """One step of incremental decoding.

    Args:
      token_ids: `[batch * beams]`, the previous token of every row (BOS first);
        row b * beams + j is beam j of input b.
      cache: from `init_cache(config, batch, max_decode_len, beams)`.
      memory: from `encoder_memory` for the `batch` inputs.
    Returns:
      logits `[batch * beams, vocab]` (float32) for the next token, and the cache.
    """
    return self.decoder.step(token_ids, cache, memory["key_value"], memory["mask"],
                             memory["logits_kernel"])


def init_cache(config: TransformerConfig, batch_size: int, max_decode_len: int,
               beams: int = 1) -> dict:
  """An empty self-attention cache for `batch_size` inputs with `beams` rows each.

  Keys are `[batch, heads, beams, d_k, max_decode_len]` and values `[batch,
  heads, beams * max_decode_len, d_k]` (beam-major) per layer (with `scan_layers`, stacked on
  a leading layer axis): the layouts `MultiHeadAttention.attend_step` reads
  without transposing or copying anything; `ancestry` `[batch, beams,
  max_decode_len]` int32 says which beam slot holds each position of each
  beam's history (see `Decoder.step`); `index` is the position decoded next.
  """
  heads = (batch_size, config.num_heads)
  shapes = {"key": heads + (beams, config.head_dim, max_decode_len),
            "value": heads + (beams * max_decode_len, config.head_dim)}
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
  """Beam search's cache update for `init_cache`'s layout (see
  `decoding.beam_search(reorder_cache=...)`).

  parents `[batch, beams]`: the beam each surviving hypothesis extends. Only
  the ancestry table follows the hypotheses (`[batch, beams, max_decode_len]`
  int32, a few KB); the keys/values, megabytes, stay where they were written.
  """
  ancestry = jnp.take_along_axis(cache["ancestry"], parents[:, :, None], axis=1)
  return dict(cache, ancestry=ancestry)


# ----------------------------------------------------------------------------
# Utilities
# ----------------------------------------------------------------------------


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
