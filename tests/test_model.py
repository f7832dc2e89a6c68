"""Tests of transformer/model/transformer.py against independent references (float64 numpy,
hand-worked examples, the paper's formulas)."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.decoding.batch_plan import DecoderShape
from transformer.model import kv_cache
from transformer.model import transformer as M

REPO = Path(__file__).resolve().parents[1]

TINY = dict(vocab_size=40, d_model=32, num_heads=4, d_ff=64,
            num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)


# Compilation dominates these tests; XLA's -O0 compiles several times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny_config(**changes):
  return M.TransformerConfig(**{**TINY, **changes})


@functools.lru_cache(maxsize=None)
def _jitted_forward(cfg, deterministic):
  def run(p, s, d, kw, r):
    return M.Transformer(cfg, deterministic).apply({"params": p}, s, d, rngs=r, **kw)
  return jax.jit(run, compiler_options=FAST_COMPILE)


def forward(cfg, params, src, dec_in, deterministic=True, rngs=None, **kwargs):
  """Jitted Transformer(cfg).apply (one compilation is much cheaper than eager)."""
  return _jitted_forward(cfg, deterministic)(params, src, dec_in, kwargs, rngs)


# --------------------------------------------------------------------------
# numpy references
# --------------------------------------------------------------------------


def np_softmax(x, axis=-1):
  x = x - x.max(axis=axis, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=axis, keepdims=True)


def np_attention(q, k, v, mask=None):
  """q [Tq, dk], k [Tk, dk], v [Tk, dv], mask [Tq, Tk] bool (float64)."""
  scores = q @ k.T / np.sqrt(q.shape[-1])
  if mask is not None:
    scores = np.where(mask, scores, -1e30)
  return np_softmax(scores) @ v


# --------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------


def test_attention_worked_example():
  q = np.array([[0.1, 0.4], [0.3, 0.7]])
  k = np.array([[0.2, 0.5], [0.6, 0.3]])
  v = np.array([[1.2, 0.9], [0.8, 1.1]])
  expected = np.array([[1.00283, 0.99859], [1.00141, 0.99929]])
  as_heads = lambda a: jnp.asarray(a, jnp.float32)[None, :, None, :]
  for return_weights in (False, True):
    out, _ = M.scaled_dot_product_attention(as_heads(q), as_heads(k), as_heads(v),
                                            return_weights=return_weights)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, :], expected, atol=1e-5)


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_numpy(masked, return_weights):
  rng = np.random.default_rng(0)
  b, tq, tk, h, dk = 2, 5, 7, 3, 8
  q, k, v = (rng.normal(size=(b, t, h, dk)) for t in (tq, tk, tk))
  mask = rng.random((b, 1, tq, tk)) > 0.3 if masked else None
  if masked:
    mask[..., 0] = True  # every query sees at least one key
  out, weights = M.scaled_dot_product_attention(
      *(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
      None if mask is None else jnp.asarray(mask), return_weights=return_weights)
  for bi in range(b):
    for hi in range(h):
      m = None if mask is None else mask[bi, 0]
      ref = np_attention(q[bi, :, hi], k[bi, :, hi], v[bi, :, hi], m)
      np.testing.assert_allclose(np.asarray(out)[bi, :, hi], ref, atol=2e-5)
      if return_weights:
        ref_w = np_softmax(np.where(m, q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(dk), -1e30)
                           if m is not None else q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(dk))
        np.testing.assert_allclose(np.asarray(weights)[bi, hi], ref_w, atol=2e-6)


def test_attention_masked_keys_get_zero_weight():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 3, 1, 4)), jnp.float32) for _ in range(3))
  mask = jnp.array([True, False, True])[None, None, None, :]
  _, weights = M.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
  np.testing.assert_array_equal(np.asarray(weights)[..., 1], 0.0)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


# --------------------------------------------------------------------------
# Multi-head attention, feed-forward, residual + LayerNorm
# --------------------------------------------------------------------------


def test_multi_head_attention_matches_numpy_concat_heads():
  cfg = tiny_config()
  rng = np.random.default_rng(2)
  xq = rng.normal(size=(2, 5, cfg.d_model))
  xkv = rng.normal(size=(2, 6, cfg.d_model))
  mha = M.MultiHeadAttention(cfg)
  params = mha.init(jax.random.key(0), jnp.asarray(xq, jnp.float32),
                    jnp.asarray(xkv, jnp.float32), None)["params"]
  out = mha.apply({"params": params}, jnp.asarray(xq, jnp.float32),
                  jnp.asarray(xkv, jnp.float32), None)
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  h, dk = cfg.num_heads, cfg.head_dim
  for b in range(2):
    heads = []
    for i in range(h):  # head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
      wq = p["query"]["kernel"][:, i, :]; bq = p["query"]["bias"][i]
      wk = p["key"]["kernel"][:, i, :]; bk = p["key"]["bias"][i]
      wv = p["value"]["kernel"][:, i, :]; bv = p["value"]["bias"][i]
      heads.append(np_attention(xq[b] @ wq + bq, xkv[b] @ wk + bk, xkv[b] @ wv + bv))
    concat = np.concatenate(heads, axis=-1)                 # [Tq, h * dk]
    w_o = p["out"]["kernel"].reshape(h * dk, cfg.d_model)  # W^O
    ref = concat @ w_o + p["out"]["bias"]
    np.testing.assert_allclose(np.asarray(out)[b], ref, atol=1e-4)


def test_residual_layer_norm_worked_example():
  cfg = M.TransformerConfig(vocab_size=8, d_model=2, num_heads=1, d_ff=4,
                            dropout_rate=0.0)
  x = jnp.array([[2.0, 4.0]])
  sublayer = lambda _: jnp.array([[1.0, 3.0]])
  block = M.ResidualNorm(cfg)
  params = block.init(jax.random.key(0), x, sublayer)
  # gamma = 1, beta = 0 at initialisation
  np.testing.assert_array_equal(params["params"]["norm"]["scale"], [1.0, 1.0])
  out = block.apply(params, x, sublayer)
  np.testing.assert_allclose(np.asarray(out), [[-1.0, 1.0]], atol=1e-5)
  # pre-LN: x + sublayer(LN(x)) = [2, 4] + [1, 3]
  pre = M.ResidualNorm(cfg.replace(normalization="pre"))
  out = pre.apply(pre.init(jax.random.key(0), x, sublayer), x, sublayer)
  np.testing.assert_allclose(np.asarray(out), [[3.0, 7.0]], atol=1e-6)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swish"])
def test_feed_forward_matches_numpy(activation):
  cfg = tiny_config(activation=activation)
  x = np.random.default_rng(3).normal(size=(2, 3, cfg.d_model))
  ffn = M.FeedForward(cfg)
  params = ffn.init(jax.random.key(0), jnp.asarray(x, jnp.float32))["params"]
  out = ffn.apply({"params": params}, jnp.asarray(x, jnp.float32))
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  pre = x @ p["inner"]["kernel"] + p["inner"]["bias"]
  if activation == "relu":
    hidden = np.maximum(0.0, pre)
  elif activation == "swish":  # x sigmoid(x) (OPUS-MT's feed-forward)
    hidden = pre / (1 + np.exp(-pre))
  else:  # tanh approximation, as jax.nn.gelu by default
    hidden = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre ** 3)))
  ref = hidden @ p["outer"]["kernel"] + p["outer"]["bias"]
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4)


def test_logits_bias_is_added_to_every_position_in_both_paths():
  """With `logits_bias` the output logits are those without it plus the bias,
  teacher-forced and in a decoding step alike."""
  cfg = tiny_config(logits_bias=True)
  plain = tiny_config()
  params = M.init_params(cfg, jax.random.key(0))
  bias = np.random.default_rng(0).normal(size=cfg.vocab_size).astype(np.float32)
  params = dict(params, decoder=dict(params["decoder"], logits_bias=jnp.asarray(bias)))
  without = {k: v for k, v in params["decoder"].items() if k != "logits_bias"}
  inputs = jnp.asarray([[5, 6, 7, 1]], jnp.int32)
  decoder_inputs = jnp.asarray([[2, 8, 9]], jnp.int32)
  with_bias = forward(cfg, params, inputs, decoder_inputs)
  no_bias = forward(plain, dict(params, decoder=without), inputs, decoder_inputs)
  np.testing.assert_allclose(with_bias, no_bias + bias, rtol=1e-5, atol=1e-5)
  from transformer.model import kv_cache
  model = M.Transformer(cfg)

  def first_step(p):  # (one program, not op by op)
    encoded = model.apply({"params": p}, inputs, method=M.Transformer.encode)
    memory = model.apply({"params": p}, encoded, inputs, method=M.Transformer.encoder_memory)
    return model.apply({"params": p}, jnp.asarray([2], jnp.int32),
                       kv_cache.init_cache(cfg, 1, 4), memory, method=M.Transformer.decode_step)
  logits, _ = jax.jit(first_step, compiler_options=FAST_COMPILE)(params)
  np.testing.assert_allclose(logits[0], with_bias[0, 0], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Positional encoding
# --------------------------------------------------------------------------


def test_positional_encoding_matches_the_paper_formula():
  d_model = 64
  positions = np.arange(200)
  pe = np.asarray(M.sinusoidal_positional_encoding(jnp.asarray(positions), d_model))
  ref = np.zeros((len(positions), d_model))
  for pos in positions:
    for i in range(d_model // 2):
      ref[pos, 2 * i] = np.sin(pos / 10000 ** (2 * i / d_model))
      ref[pos, 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / d_model))
  # float32 angles lose ~1e-5 relative precision at position 200
  np.testing.assert_allclose(pe, ref, atol=2e-4)
  # the dimensions really have different frequencies (not all 10000^0)
  assert not np.allclose(pe[:, 0], pe[:, 2])


def test_positional_encoding_shift_is_a_linear_map():
  """PE(pos + k) = R_k PE(pos), R_k block-diagonal rotations independent of pos."""
  d_model, k = 16, 7
  pe = np.asarray(M.sinusoidal_positional_encoding(jnp.arange(100), d_model), np.float64)
  # One matrix maps PE(pos) to PE(pos + k) for every pos (least-squares fit).
  pos = np.arange(0, 90)
  R, *_ = np.linalg.lstsq(pe[pos], pe[pos + k], rcond=None)
  np.testing.assert_allclose(pe[pos] @ R, pe[pos + k], atol=1e-4)
  test_pos = pos
  # ... and it is the rotation the paper's formula predicts.
  R_formula = np.zeros((d_model, d_model))
  for i in range(d_model // 2):
    w = 1 / 10000 ** (2 * i / d_model)
    c, s = np.cos(k * w), np.sin(k * w)
    # [sin(a+b), cos(a+b)] = [sin a, cos a] @ [[c, -s], [s, c]]
    R_formula[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, -s], [s, c]]
  np.testing.assert_allclose(pe[test_pos] @ R_formula, pe[test_pos + k], atol=1e-4)


# --------------------------------------------------------------------------
# The whole model
# --------------------------------------------------------------------------


def random_batch(cfg, rng, batch=3, src_len=9, tgt_len=7):
  src = rng.integers(4, cfg.vocab_size, (batch, src_len))
  src[1, 6:] = cfg.pad_id
  tgt = rng.integers(4, cfg.vocab_size, (batch, tgt_len))
  return jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)


def test_decoder_is_causal():
  cfg = tiny_config()
  params = M.init_params(cfg, jax.random.key(0))
  src, tgt = random_batch(cfg, np.random.default_rng(4))
  dec_in = M.shift_right(tgt, cfg.bos_id)
  base = forward(cfg, params, src, dec_in)
  t = 3
  changed = dec_in.at[:, t + 1:].set((dec_in[:, t + 1:] + 5) % cfg.vocab_size)
  out = forward(cfg, params, src, changed)
  np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-5)
  assert not np.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-3)


def test_source_padding_is_ignored():
  cfg = tiny_config()
  params = M.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(5)
  src, tgt = random_batch(cfg, rng)
  dec_in = M.shift_right(tgt, cfg.bos_id)
  base = forward(cfg, params, src, dec_in)
  # Pad the sources further: the same real tokens followed by more padding.
  longer = jnp.pad(src, ((0, 0), (0, 4)), constant_values=cfg.pad_id)
  np.testing.assert_allclose(forward(cfg, params, longer, dec_in), base, atol=1e-5)
  # Change what sits in padded source positions (explicit segment ids mark them).
  seg = (src != cfg.pad_id).astype(jnp.int32)
  garbage = jnp.where(seg > 0, src, 17)
  out = forward(cfg, params, garbage, dec_in, inputs_segment_ids=seg)
  np.testing.assert_allclose(out, base, atol=1e-5)
  # ... whereas changing a real token does change the output.
  out = forward(cfg, params, src.at[1, 2].set(5), dec_in)
  assert not np.allclose(out[1], base[1], atol=1e-3)


def test_packed_row_equals_separate_examples():
  cfg = tiny_config()
  params = M.init_params(cfg, jax.random.key(1))
  rng = np.random.default_rng(6)
  s1, s2 = rng.integers(4, 40, 4), rng.integers(4, 40, 3)
  t1, t2 = rng.integers(4, 40, 3), rng.integers(4, 40, 5)
  # one packed row: [s1 s2 pad], [t1 t2 pad]
  src = np.zeros((1, 9), np.int32); src[0, :4] = s1; src[0, 4:7] = s2
  src_seg = np.array([[1] * 4 + [2] * 3 + [0] * 2]); src_pos = np.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]])
  tgt = np.zeros((1, 10), np.int32); tgt[0, :3] = t1; tgt[0, 3:8] = t2
  tgt_seg = np.array([[1] * 3 + [2] * 5 + [0] * 2]); tgt_pos = np.array([[0, 1, 2, 0, 1, 2, 3, 4, 0, 0]])
  dec_in = M.shift_right(jnp.asarray(tgt), cfg.bos_id, jnp.asarray(tgt_seg))
  np.testing.assert_array_equal(
      dec_in[0], [2, t1[0], t1[1], 2, t2[0], t2[1], t2[2], t2[3], 0, 0])
  packed = forward(cfg, params, jnp.asarray(src), dec_in,
                       inputs_segment_ids=jnp.asarray(src_seg),
                       decoder_segment_ids=jnp.asarray(tgt_seg),
                       inputs_positions=jnp.asarray(src_pos),
                       decoder_positions=jnp.asarray(tgt_pos))
  for s, t, sl in ((s1, t1, slice(0, 3)), (s2, t2, slice(3, 8))):
    alone = forward(cfg, params, jnp.asarray(s)[None],
                        M.shift_right(jnp.asarray(t)[None], cfg.bos_id))
    np.testing.assert_allclose(packed[0, sl], alone[0], atol=1e-5)


def incremental_logits(cfg, params, src, dec_in, beams=1):
  """Runs decode_step one position at a time (optionally with beams sharing memory)."""
  model = M.Transformer(cfg)
  memory = jax.jit(compiler_options=FAST_COMPILE)(lambda p, s: model.apply(
      {"params": p}, model.apply({"params": p}, s, method=M.Transformer.encode), s,
      method=M.Transformer.encoder_memory))(params, src)
  flat = jnp.repeat(dec_in, beams, axis=0)
  cache = kv_cache.init_cache(cfg, dec_in.shape[0], dec_in.shape[1], beams)
  step = jax.jit(compiler_options=FAST_COMPILE)(lambda t, c: model.apply({"params": params}, t, c, memory,
                                          method=M.Transformer.decode_step))
  outs = []
  for t in range(dec_in.shape[1]):
    logits, cache = step(flat[:, t], cache)
    outs.append(logits)
  return jnp.stack(outs, axis=1)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("normalization", ["post", "pre"])
def test_incremental_decoding_equals_full_forward(normalization, scan_layers):
  cfg = tiny_config(normalization=normalization, scan_layers=scan_layers,
                    num_decoder_layers=3)
  params = M.init_params(cfg, jax.random.key(2))
  src, tgt = random_batch(cfg, np.random.default_rng(7))
  dec_in = M.shift_right(tgt, cfg.bos_id)
  full = forward(cfg, params, src, dec_in)
  np.testing.assert_allclose(incremental_logits(cfg, params, src, dec_in), full, atol=2e-5)
  # Three beams per input share one copy of the cross-attention memory.
  beams = incremental_logits(cfg, params, src, dec_in, beams=3)
  np.testing.assert_allclose(beams, jnp.repeat(full, 3, axis=0), atol=2e-5)


def full_forward_tokens_to_logits(cfg, params, max_len):
  """A decoder without a key/value cache, for `decoding`'s generic beam search:
  its cache is the source and the tokens fed so far, and every step re-runs the
  whole teacher-forced forward pass (positions after `index` are padding,
  which the causal mask hides)."""
  model = M.Transformer(cfg)

  def tokens_to_logits(token_ids, cache):
    index = cache["index"]
    history = jax.lax.dynamic_update_slice_in_dim(cache["history"], token_ids[:, None],
                                                  index, axis=1)
    logits = model.apply({"params": params}, cache["source"], history)
    logits = jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False)
    return logits, dict(cache, index=index + 1, history=history)

  def init(source):
    return {"index": jnp.int32(0), "source": source,
            "history": jnp.zeros((source.shape[0], max_len), jnp.int32)}
  return tokens_to_logits, init


def test_beam_search_with_in_place_cache_equals_full_forward_search():
  """The decoder's beam cache never moves keys/values (beams attend through the
  ancestry table): the search must equal one that re-runs the full forward
  pass over each hypothesis' tokens, reordered by the generic gather."""
  from transformer.decoding import search as decoding
  from transformer.decoding import beam_search as beam_lib
  from transformer.decoding.translator import Translator
  # Pre-LN and larger random weights: hypotheses that differ, so beams are
  # reordered (at initialisation a post-LN model says nearly the same thing
  # whatever the input and history).
  cfg = tiny_config(num_decoder_layers=3, vocab_size=12, normalization="pre")
  leaves, tree = jax.tree_util.tree_flatten(M.init_params(cfg, jax.random.key(5)))
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree_util.tree_unflatten(
      tree, [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  src, _ = random_batch(cfg, np.random.default_rng(9))
  batch, beams, max_len, min_len = src.shape[0], 3, 6, 2
  tokens_to_logits, init = full_forward_tokens_to_logits(cfg, params, max_len)
  common = dict(batch_size=batch, max_len=max_len, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                min_len=min_len)
  want_seqs, want_scores = jax.jit(functools.partial(
      beam_lib.beam_search, tokens_to_logits, beam_size=beams, length_penalty=0.6,
      **common), compiler_options=FAST_COMPILE)(init(src))
  assert len({tuple(s) for s in np.asarray(want_seqs).reshape(-1, max_len)}) > batch

  translator = Translator(cfg, params, tokenizer=None)
  decode = translator.decoders.program(
      DecoderShape("beam", batch, src.shape[1], max_len, beams, 0))
  rows, limits = np.zeros(batch, np.int32), np.full(batch, max_len, np.int32)
  seqs, scores, _ = decode(translator.params, translator.decoders.logits_kernel, np.asarray(src),
                           jax.random.key(0), rows, rows, limits, 0.6, 1.0, 1.0, min_len, ())
  np.testing.assert_array_equal(seqs, want_seqs)
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5)

  greedy = translator.decoders.program(
      DecoderShape("greedy", batch, src.shape[1], max_len, 1, 0))
  seqs, scores, _ = greedy(translator.params, translator.decoders.logits_kernel, np.asarray(src),
                           jax.random.key(0), rows, rows, limits, 0.6, 1.0, 1.0, min_len, ())
  want_seqs, want_scores = jax.jit(functools.partial(
      decoding.greedy_search, tokens_to_logits, **common),
      compiler_options=FAST_COMPILE)(init(src))
  np.testing.assert_array_equal(seqs[:, 0], want_seqs)
  np.testing.assert_allclose(scores[:, 0], want_scores, rtol=1e-5)



def unstack_scanned(params, cfg):
  """Scanned parameters (layers stacked on axis 0) -> the unrolled layout."""
  params = jax.tree_util.tree_map(lambda x: x, params)  # copy
  for side, n in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    stacked = params[side].pop("layers")
    for i in range(n):
      params[side][f"layers_{i}"] = jax.tree_util.tree_map(lambda x: x[i], stacked)
  return params


def test_scan_layers_and_remat_compute_the_same_function():
  base = tiny_config(num_decoder_layers=3)
  scanned = base.replace(scan_layers=True, remat=True)
  params = M.init_params(scanned, jax.random.key(3))
  src, tgt = random_batch(base, np.random.default_rng(8))
  dec_in = M.shift_right(tgt, base.bos_id)
  unrolled = unstack_scanned(params, base)
  np.testing.assert_allclose(forward(scanned, params, src, dec_in),
                             forward(base, unrolled, src, dec_in), atol=1e-5)

  def grad(cfg, p):
    return jax.jit(compiler_options=FAST_COMPILE)(jax.grad(lambda p: M.Transformer(cfg).apply({"params": p}, src, dec_in).sum()))(p)
  g_scan = unstack_scanned(grad(scanned, params), base)
  g_loop = grad(base, unrolled)
  for a, b in zip(jax.tree_util.tree_leaves(g_scan), jax.tree_util.tree_leaves(g_loop)):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_dropout_is_active_only_in_training():
  cfg = tiny_config(dropout_rate=0.3, attention_dropout_rate=0.2)
  params = M.init_params(cfg, jax.random.key(4))
  src, tgt = random_batch(cfg, np.random.default_rng(9))
  dec_in = M.shift_right(tgt, cfg.bos_id)
  a = forward(cfg, params, src, dec_in, False, {"dropout": jax.random.key(0)})
  b = forward(cfg, params, src, dec_in, False, {"dropout": jax.random.key(1)})
  assert not np.allclose(a, b, atol=1e-3)
  e1 = forward(cfg, params, src, dec_in)
  e2 = forward(cfg, params, src, dec_in)
  np.testing.assert_array_equal(e1, e2)


def test_attention_weights_are_sown():
  cfg = tiny_config()
  params = M.init_params(cfg, jax.random.key(5))
  src, tgt = random_batch(cfg, np.random.default_rng(10))
  _, state = jax.jit(compiler_options=FAST_COMPILE)(lambda p: M.Transformer(cfg).apply(
      {"params": p}, src, M.shift_right(tgt, 2), mutable=["intermediates"]))(params)
  cross = state["intermediates"]["decoder"]["layers_1"]["cross_attention"]["attention_weights"][0]
  assert cross.shape == (3, cfg.num_heads, tgt.shape[1], src.shape[1])
  np.testing.assert_allclose(cross.sum(-1), 1.0, rtol=1e-5)
  # source padding of example 1 (positions 6..8) gets no attention
  np.testing.assert_array_equal(np.asarray(cross)[1, :, :, 6:], 0.0)
  self_w = state["intermediates"]["decoder"]["layers_0"]["self_attention"]["attention_weights"][0]
  assert np.all(np.triu(np.asarray(self_w)[0, 0], k=1) == 0)  # causal


def test_tied_embedding_scaling_and_logits():
  cfg = tiny_config()
  params = M.init_params(cfg, jax.random.key(6))
  table = np.asarray(params["embeddings"]["embedding"]["embedding"], np.float64)
  emb = M.Embeddings(cfg)
  tokens = jnp.array([[5, 7]])
  out = emb.apply({"params": params["embeddings"]}, tokens)
  np.testing.assert_allclose(out[0], table[[5, 7]] * np.sqrt(cfg.d_model), rtol=1e-6)
  y = np.random.default_rng(11).normal(size=(1, 2, cfg.d_model))
  logits = emb.apply({"params": params["embeddings"]}, jnp.asarray(y, jnp.float32),
                     method=M.Embeddings.attend)
  np.testing.assert_allclose(logits[0], y[0] @ table.T, atol=1e-4)


def test_bfloat16_compute_stays_close_to_float32():
  cfg = tiny_config()
  params = M.init_params(cfg, jax.random.key(7))
  src, tgt = random_batch(cfg, np.random.default_rng(12))
  dec_in = M.shift_right(tgt, cfg.bos_id)
  f32 = forward(cfg, params, src, dec_in)
  bf16_cfg = cfg.replace(dtype="bfloat16")
  bf16 = forward(bf16_cfg, params, src, dec_in)
  assert bf16.dtype == jnp.float32  # logits are returned in float32
  assert jax.tree_util.tree_leaves(M.init_params(bf16_cfg, jax.random.key(0)))[0].dtype == jnp.float32
  p32 = jax.nn.softmax(f32)
  p16 = jax.nn.softmax(bf16)
  assert float(jnp.abs(p32 - p16).max()) < 0.05
  assert float(jnp.abs(f32 - bf16).mean()) < 0.05 * float(jnp.abs(f32).mean()) + 0.02
  assert (jnp.argmax(f32, -1) == jnp.argmax(bf16, -1)).mean() > 0.9


# --------------------------------------------------------------------------
# Parameter count and configuration checks
# --------------------------------------------------------------------------


def closed_form_params(c: M.TransformerConfig) -> int:
  d, f, v = c.d_model, c.d_ff, c.vocab_size
  attention = 4 * (d * d + d)            # W^Q, W^K, W^V, W^O with biases
  ffn = d * f + f + f * d + d
  norm = 2 * d                           # gamma, beta
  encoder_layer = attention + ffn + 2 * norm
  decoder_layer = 2 * attention + ffn + 3 * norm
  total = c.num_encoder_layers * encoder_layer + c.num_decoder_layers * decoder_layer
  total += v * d * (1 if c.share_embeddings else 2)
  if not c.logits_via_embedding:
    total += d * v + v
  if c.positional == "learned":
    total += 2 * c.max_len * d
  if c.normalization == "pre":
    total += 2 * norm
  return total


@pytest.mark.parametrize("changes", [
    {},
    dict(share_embeddings=False),
    dict(logits_via_embedding=False),
    dict(positional="learned", normalization="pre"),
    dict(scan_layers=True, num_encoder_layers=3),
])
def test_parameter_count_matches_closed_form(changes):
  cfg = tiny_config(**changes)
  assert M.count_params(cfg) == closed_form_params(cfg)
  assert M.count_params(M.init_params(cfg, jax.random.key(0))) == closed_form_params(cfg)


def test_paper_model_sizes():
  base = M.TransformerConfig()  # the paper's base model, vocabulary 37000
  big = base.replace(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
  assert M.count_params(base) == closed_form_params(base) == 63_082_496
  assert M.count_params(big) == closed_form_params(big) == 214_245_376


@pytest.mark.parametrize("field,value,needle", [
    ("d_model", 30, "divisible by num_heads"),
    ("normalization", "middle", "normalization"),
    ("activation", "tanh", "activation"),
    ("positional", "rotary", "positional"),
    ("dtype", "int8", "dtype"),
    ("dropout_rate", 1.0, "dropout_rate"),
    ("num_encoder_layers", 0, "num_encoder_layers"),
    ("vocab_size", -3, "vocab_size"),
    ("eos_id", 40, "eos_id"),
    ("attention_implementation", "flash", "attention_implementation"),
])
def test_invalid_config_raises_named_error(field, value, needle):
  with pytest.raises(ValueError) as err:
    tiny_config(**{field: value})
  assert f"TransformerConfig.{field}=" in str(err.value)
  assert needle in str(err.value)


def test_config_round_trips_through_dict():
  cfg = tiny_config(normalization="pre", dtype="bfloat16")
  assert M.TransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_bfloat16_incremental_decoding_stays_close_to_float32():
  """The decode step's bfloat16 path (bfloat16 cache, float32 scores) against
  the float32 teacher-forced logits, with beams sharing the memory."""
  cfg = tiny_config(num_decoder_layers=2)
  params = M.init_params(cfg, jax.random.key(8))
  src, tgt = random_batch(cfg, np.random.default_rng(13))
  dec_in = M.shift_right(tgt, cfg.bos_id)
  f32 = jnp.repeat(forward(cfg, params, src, dec_in), 2, axis=0)
  bf16 = incremental_logits(cfg.replace(dtype="bfloat16"), params, src, dec_in, beams=2)
  assert bf16.dtype == jnp.float32
  p32, p16 = jax.nn.softmax(f32), jax.nn.softmax(bf16)
  assert float(jnp.abs(p32 - p16).max()) < 0.05
  assert (jnp.argmax(f32, -1) == jnp.argmax(bf16, -1)).mean() > 0.9


def test_bfloat16_weights_decode_as_their_full_forward_and_close_to_float32():
  """`matmul_dtype="bfloat16"` with the projections' weights stored in bfloat16
  (`Translator(weights_dtype="bfloat16")`): the decode step (its output
  projection through `logits_kernel`) gives the teacher-forced logits of the
  same config, beams sharing the memory; both near the float32 model's, and
  not equal to them (the products are bfloat16's)."""
  from transformer.decoding.decoders import projection_weights_as
  cfg = tiny_config(num_decoder_layers=2)
  params = M.init_params(cfg, jax.random.key(8))
  src, tgt = random_batch(cfg, np.random.default_rng(13))
  dec_in = M.shift_right(tgt, cfg.bos_id)
  bf16_cfg = cfg.replace(matmul_dtype="bfloat16")
  bf16_params = projection_weights_as(params, "bfloat16")
  dtypes = {}  # is it a projection's weights -> the dtypes of such leaves
  for path, x in jax.tree_util.tree_leaves_with_path(bf16_params):
    dtypes.setdefault(path[-1].key == "kernel", set()).add(x.dtype)
  assert dtypes == {True: {jnp.dtype(jnp.bfloat16)}, False: {jnp.dtype(jnp.float32)}}
  with jax.default_matmul_precision("highest"):
    f32 = forward(cfg, params, src, dec_in)
    full = forward(bf16_cfg, bf16_params, src, dec_in)
    steps = incremental_logits(bf16_cfg, bf16_params, src, dec_in, beams=2)
  assert steps.dtype == jnp.float32
  np.testing.assert_allclose(steps, jnp.repeat(full, 2, axis=0), atol=1e-4)
  assert float(jnp.abs(full - f32).max()) > 1e-3
  assert float(jnp.abs(jax.nn.softmax(full) - jax.nn.softmax(f32)).max()) < 0.05
  assert (jnp.argmax(full, -1) == jnp.argmax(f32, -1)).mean() > 0.9


@pytest.mark.parametrize("normalization", ["post", "pre"])
def test_bfloat16_training_gradients_are_float32_and_close(normalization):
  """Training with bfloat16 compute (configs/wmt14_*.py): every gradient comes
  back in the parameters' float32 and points where the float32 one does."""
  cfg = tiny_config(normalization=normalization)
  params = M.init_params(cfg, jax.random.key(8))
  src, tgt = random_batch(cfg, np.random.default_rng(13))
  dec_in = M.shift_right(tgt, cfg.bos_id)

  def gradients(config):
    def loss(p):
      logits = M.Transformer(config).apply({"params": p}, src, dec_in)
      log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
      return -jnp.mean(jnp.take_along_axis(log_p, tgt[..., None], -1))
    return jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params)

  g32, g16 = gradients(cfg), gradients(cfg.replace(dtype="bfloat16"))
  for leaf in jax.tree_util.tree_leaves(g16):
    assert leaf.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(leaf)))
  flat32 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g32)])
  flat16 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g16)])
  cosine = flat32 @ flat16 / (np.linalg.norm(flat32) * np.linalg.norm(flat16))
  assert cosine > 0.99


@pytest.mark.slow  # (~20 s on 2 cores: `python -m pytest -m slow`)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_shrinking_decoding_batch_translates_as_the_whole_batch(scan_layers, monkeypatch):
  """The Translator's decoders drop finished inputs as they go
  (`kv_cache.select_inputs`: the cache, its ancestry table and the encoder
  memory of the inputs left; layers stacked by scan_layers or not). The
  trained fixture model, 8 sentences of very different lengths shrinking by
  halves to 2 rows: greedy and beam 4 (greedy only with stacked layers: the
  same selection) give what decoding every row to the end gives
  (`early_exit=False`, no shrinking), tokens and scores."""
  from transformer.data import demo_task
  from transformer.decoding import loader
  from transformer.decoding import batch_plan, batching, translator as translator_lib
  monkeypatch.setattr(batch_plan, "SHRINK_FACTOR", 2)
  monkeypatch.setattr(batch_plan, "SHRINK_MIN_ROWS", 2)
  fixture = loader.load_translator(str(REPO / "tests" / "fixtures" / "workdir_d26a6fb"))
  cfg, params = fixture.config, fixture.params
  if scan_layers:
    cfg = dataclasses.replace(cfg, scan_layers=True)
    params = stack_layers(params, cfg)
  translator = translator_lib.Translator(cfg, params, fixture.tokenizer)
  shrink = translator.decoders.shrink(DecoderShape("greedy", 8, 8, 24, 1, 0))
  assert shrink.sizes(8) == [8, 4, 2]
  pairs = demo_task.demo_splits(4, num_train=200, num_eval=1, num_test=1)["train"]
  sentences = sorted({s for s, _ in pairs}, key=len)
  # Short and long interleaved, 5 + 3: the rows kept are the 3 unfinished
  # and a finished one filling the 4th row, not a prefix of the batch.
  short, long = sentences[:5], sentences[-3:]
  sentences = [short[0], long[0], short[1], long[1], short[2], long[2], *short[3:]]
  encoded, _ = translator.encode(sentences)
  src_len = batching.bucket_length(max(map(len, encoded)), cfg.max_len)
  inputs = batching.pack_batch(encoded, 8, src_len, copies=1)
  rows = np.arange(8, dtype=np.int32)
  with jax.default_matmul_precision("highest"):
    for method in ("greedy",) if scan_layers else ("greedy", "beam"):
      out = {}
      for early_exit in (True, False):
        decode = translator.decoders.program(
            DecoderShape(method, 8, src_len, 24, 4, 0, early_exit))
        out[early_exit] = jax.device_get(decode(
            translator.params, translator.decoders.logits_kernel, inputs, jax.random.key(0), rows,
            rows, np.full(8, 24, np.int32), 0.6, 1.0, 1.0, 0, ()))
      np.testing.assert_array_equal(out[True][0], out[False][0], err_msg=method)
      np.testing.assert_allclose(out[True][1], out[False][1], rtol=1e-5, err_msg=method)
      best = out[False][0][:, 0]
      ends = [list(row).index(cfg.eos_id) + 1 if cfg.eos_id in row else 24 for row in best]
      assert min(ends) < 8 < max(ends), ends  # (rows leave at the first check)


def test_a_translator_with_bfloat16_weights_translates_as_float32(caplog, monkeypatch):
  """`Translator(weights_dtype="bfloat16")` on the trained fixture model: its
  projections' weights are stored in bfloat16, its decoders multiply in
  bfloat16 (their compiled programs convert activations to it), and greedy and beam
  4 translate demo sentences as the float32 model does. A CPU without
  bfloat16 instructions is warned of; an unknown dtype names the option."""
  import logging
  import re
  from transformer.data import demo_task
  from transformer.decoding import executable_cache, loader
  from transformer.decoding import translator as translator_lib
  from transformer.runtime.errors import OptionError
  workdir = str(REPO / "tests" / "fixtures" / "workdir_d26a6fb")
  float32 = loader.load_translator(workdir)
  bfloat16 = loader.load_translator(workdir, weights_dtype="bfloat16")
  assert bfloat16.config.matmul_dtype == "bfloat16" and float32.config.matmul_dtype is None
  kernel = bfloat16.params["decoder"]["layers_0"]["feed_forward"]["inner"]["kernel"]
  assert kernel.dtype == jnp.bfloat16 and bfloat16.decoders.logits_kernel.dtype == jnp.bfloat16
  pairs = demo_task.demo_splits(5, num_train=40, num_eval=1, num_test=1)["train"]
  sentences = sorted({s for s, _ in pairs}, key=len)[:8]  # (one batch, one decoder)
  for options in ({"method": "greedy"}, {"method": "beam", "beam_size": 4}):
    assert (bfloat16.translate(sentences, batch_size=8, **options)
            == float32.translate(sentences, batch_size=8, **options)), options
  # The activations go into the products as bfloat16 (`Dense(matmul_dtype=)`).
  to_bfloat16 = re.compile(r"= bf16\[[0-9,]*\]\S* convert\(")
  assert to_bfloat16.search(next(iter(bfloat16.decoders.executables.values())).as_text())
  assert not to_bfloat16.search(next(iter(float32.decoders.executables.values())).as_text())

  monkeypatch.setattr(executable_cache, "host_cpu_flags", lambda: {"avx2", "fma"})
  with caplog.at_level(logging.WARNING, logger=translator_lib.__name__):
    translator_lib.Translator(float32.config, float32.params, float32.tokenizer,
                              weights_dtype="bfloat16")
  assert "without bfloat16 instructions" in caplog.text
  with pytest.raises(OptionError, match="weights_dtype"):
    translator_lib.Translator(float32.config, float32.params, float32.tokenizer,
                              weights_dtype="float16")


def stack_layers(params, cfg):
  """The unrolled layout (layers_0, layers_1, ...) -> layers stacked on axis 0."""
  params = jax.tree_util.tree_map(lambda x: x, params)  # copy
  for side, n in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    layers = [params[side].pop(f"layers_{i}") for i in range(n)]
    params[side]["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  return params
