"""transformers' MarianMTModel and PegasusForConditionalGeneration written
again in float64 numpy from their source (modeling_marian.py,
modeling_pegasus.py), for one sentence at a time: the independent reference
the import (tests/test_marian.py) and the export (tests/test_hf_export.py)
are checked against where torch is not installed. It reads a model only
from its own files: the tensors of model.safetensors and config.json."""

from __future__ import annotations

import numpy as np


def _layer_norm(x, t, name):
  """torch's LayerNorm (eps 1e-5, fixed in both models) of `x` `[length, d]`."""
  centered = x - x.mean(-1, keepdims=True)
  return (centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-5)
          * t[f"{name}.weight"] + t[f"{name}.bias"])


def _linear(x, t, name):
  return x @ t[f"{name}.weight"].T + t[f"{name}.bias"]  # torch's [out, in]


def _attention(x, memory, t, name, heads, causal):
  """MarianAttention: queries from `x` `[q, d]`, keys and values from
  `memory` `[k, d]` -> `[q, d]`."""
  length, d = x.shape
  head_dim = d // heads

  def split(h):  # [n, d] -> [heads, n, head_dim]
    return h.reshape(len(h), heads, head_dim).transpose(1, 0, 2)

  q = split(_linear(x, t, f"{name}.q_proj") * head_dim ** -0.5)
  k, v = split(_linear(memory, t, f"{name}.k_proj")), split(_linear(memory, t, f"{name}.v_proj"))
  scores = q @ k.transpose(0, 2, 1)
  if causal:
    scores = np.where(np.tril(np.ones((length, len(memory)), bool)), scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return _linear((weights @ v).transpose(1, 0, 2).reshape(length, d), t, f"{name}.out_proj")


def _activation(name):
  """transformers' ACT2FN entries these models may name."""
  return {"swish": lambda x: x * 0.5 * (1 + np.tanh(x / 2)),  # x sigmoid(x), no overflow
          "silu": lambda x: x * 0.5 * (1 + np.tanh(x / 2)),
          "relu": lambda x: np.maximum(x, 0.0),
          "gelu_pytorch_tanh": lambda x: 0.5 * x * (
              1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))}[name]


def _table(t, *names):
  for name in names:
    if name in t:
      return t[name]
  raise KeyError(names)


def hf_log_probs(t, hf_config, source, decoder_inputs, *, ban_pad=True):
  """The log-softmax `[len(decoder_inputs), vocab]` of the model whose
  float64 tensors are `t` and whose config.json is `hf_config`, for one
  sentence of its ids: `source` (with </s>), `decoder_inputs`
  (decoder_start_token_id first). `ban_pad`: <pad> -inf before the softmax,
  as generate's bad_words_ids bans it (else the softmax transformers' loss
  and scores use). Marian: post-LN; Pegasus: pre-LN with a LayerNorm after
  each stack. Embeddings x sqrt(d_model) (scale_embedding), positions
  sines then cosines from 0, the output tied to the decoder's embedding
  unless lm_head.weight is given, plus final_logits_bias."""
  pre = hf_config["model_type"] == "pegasus"
  encoder_table = _table(t, "model.shared.weight", "model.encoder.embed_tokens.weight")
  decoder_table = _table(t, "model.shared.weight", "model.decoder.embed_tokens.weight")
  d, heads = encoder_table.shape[1], hf_config["encoder_attention_heads"]
  act = _activation(hf_config["activation_function"])

  def embed(table, ids):
    angles = np.arange(len(ids))[:, None] / 10000.0 ** (2 * np.arange(d // 2) / d)
    return table[ids] * np.sqrt(d) + np.concatenate([np.sin(angles), np.cos(angles)], 1)

  def sublayer(x, norm, compute):  # the residual and its LayerNorm, after or before
    if pre:
      return x + compute(_layer_norm(x, t, norm))
    return _layer_norm(x + compute(x), t, norm)

  def layer(x, memory, name):
    x = sublayer(x, f"{name}.self_attn_layer_norm",
                 lambda h: _attention(h, h, t, f"{name}.self_attn", heads, memory is not None))
    if memory is not None:
      x = sublayer(x, f"{name}.encoder_attn_layer_norm",
                   lambda h: _attention(h, memory, t, f"{name}.encoder_attn", heads, False))
    return sublayer(x, f"{name}.final_layer_norm",
                    lambda h: _linear(act(_linear(h, t, f"{name}.fc1")), t, f"{name}.fc2"))

  x = embed(encoder_table, source)
  for i in range(hf_config["encoder_layers"]):
    x = layer(x, None, f"model.encoder.layers.{i}")
  if pre:
    x = _layer_norm(x, t, "model.encoder.layer_norm")
  y = embed(decoder_table, decoder_inputs)
  for i in range(hf_config["decoder_layers"]):
    y = layer(y, x, f"model.decoder.layers.{i}")
  if pre:
    y = _layer_norm(y, t, "model.decoder.layer_norm")
  output = t["lm_head.weight"] if "lm_head.weight" in t else decoder_table
  logits = y @ output.T + t["final_logits_bias"][0]
  if ban_pad:
    logits[:, hf_config["pad_token_id"]] = -np.inf
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def hf_greedy(t, hf_config, source, max_len):
  """Greedy search with `hf_log_probs` from decoder_start_token_id, as
  transformers' generate(num_beams=1): -> (ids, </s> included if reached
  within `max_len`; their log-prob)."""
  out, log_prob = [], 0.0
  while len(out) < max_len and (not out or out[-1] != hf_config["eos_token_id"]):
    step = hf_log_probs(t, hf_config, source, [hf_config["decoder_start_token_id"]] + out)[-1]
    out.append(int(np.argmax(step)))
    log_prob += step[out[-1]]
  return out, log_prob
