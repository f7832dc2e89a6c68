"""Scoring given translations (`Translator.score`, `decode.py --score`): the
log-probability of each target under the model, against two references
computed without this code: a float64 numpy forward pass of the paper's
equations on the fixture model's weights, and CTranslate2's `score_batch` on
the same weights exported."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from transformer.decoding import loader

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "workdir_decode_cli"  # (1 + 1 layers, post-LN, tied)

PAIRS = [
    ("one red cat", "eine rote Katze"),
    ("forty-two red apples", "zweiundvierzig rote Äpfel"),
    ("two small cats", "zwei kleine Katzen"),
    ("fifty-eight green dogs and one small cat", "achtundfünfzig grüne Hunde und eine kleine Katze"),
    ("one red cat", "zwei grüne Hunde"),   # a wrong translation: scored lower (below)
    ("three", "drei drei drei drei drei drei drei drei"),
    ("", "leer"),                          # a blank source: its EOS alone
    ("one red cat", ""),                   # a blank target: the EOS alone
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("scoring") / "run"
  shutil.copytree(FIXTURE, path)
  return path


@pytest.fixture(scope="module")
def translator(workdir):
  with jax.default_matmul_precision("highest"):
    yield loader.load_translator(str(workdir))


# ----------------------------------------------------------------------------
# The reference: the paper's equations in float64 numpy on the same weights
# ----------------------------------------------------------------------------


def _layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _dense(x, p):  # x [..., in] against a kernel [in, out...] (W^Q: [d_model, heads, d_k])
  return np.tensordot(x, p["kernel"], axes=1) + p["bias"]


def _attention(x, memory, p, mask):
  """Section 3.2: softmax(Q K^T / sqrt(d_k)) V per head, then W^O."""
  q, k, v = _dense(x, p["query"]), _dense(memory, p["key"]), _dense(memory, p["value"])
  logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  heads = np.einsum("hqk,khd->qhd", weights, v)
  return np.tensordot(heads, p["out"]["kernel"], axes=2) + p["out"]["bias"]  # [h, d_v, d_model]


def _positions(n, d):  # Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), (pos, 2i+1) = cos
  pe = np.zeros((n, d))
  for pos in range(n):
    for i in range(0, d, 2):
      pe[pos, i] = np.sin(pos / 10000 ** (i / d))
      pe[pos, i + 1] = np.cos(pos / 10000 ** (i / d))
  return pe


def numpy_token_log_probs(config, params, source_ids, target_ids):
  """log p of each target id (EOS appended to both sides), teacher forced."""
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  eps, d = config.layer_norm_epsilon, config.d_model
  embedding = params["embeddings"]["embedding"]["embedding"]
  src = list(source_ids) + [config.eos_id]
  tgt = list(target_ids) + [config.eos_id]
  dec_in = [config.bos_id] + tgt[:-1]

  def post_ln(x, norm, sublayer):
    return _layer_norm(x + sublayer(x), norm["norm"], eps)

  def ffn(x, p):
    return _dense(np.maximum(_dense(x, p["inner"]), 0.0), p["outer"])

  x = embedding[src] * np.sqrt(d) + _positions(len(src), d)
  full = np.ones((len(src), len(src)), bool)
  for i in range(config.num_encoder_layers):
    p = params["encoder"][f"layers_{i}"]
    x = post_ln(x, p["self_attention_norm"], lambda h: _attention(h, h, p["self_attention"], full))
    x = post_ln(x, p["feed_forward_norm"], lambda h: ffn(h, p["feed_forward"]))
  y = embedding[dec_in] * np.sqrt(d) + _positions(len(dec_in), d)
  causal = np.tril(np.ones((len(dec_in), len(dec_in)), bool))
  cross = np.ones((len(dec_in), len(src)), bool)
  for i in range(config.num_decoder_layers):
    p = params["decoder"][f"layers_{i}"]
    y = post_ln(y, p["self_attention_norm"], lambda h: _attention(h, h, p["self_attention"], causal))
    y = post_ln(y, p["cross_attention_norm"],
                lambda h: _attention(h, x, p["cross_attention"], cross))
    y = post_ln(y, p["feed_forward_norm"], lambda h: ffn(h, p["feed_forward"]))
  logits = y @ embedding.T  # Section 3.4: the embedding's transpose
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  return log_probs[np.arange(len(tgt)), tgt]


def test_the_premises_of_the_reference():
  """The numpy reference covers the fixture's architecture, and no more."""
  config = loader.read_workdir(str(FIXTURE)).model_config
  assert (config.normalization, config.activation, config.positional) == ("post", "relu",
                                                                          "sinusoidal")
  assert config.share_embeddings and config.logits_via_embedding and not config.logits_bias


def test_scores_are_the_numpy_forward_pass_of_the_paper(translator):
  cfg, tok = translator.config, translator.tokenizer
  with jax.default_matmul_precision("highest"):
    scores = translator.score([s for s, _ in PAIRS], [t for _, t in PAIRS])
  for (source, target), score in zip(PAIRS, scores):
    expected = numpy_token_log_probs(cfg, translator.params, tok.encode(source),
                                     tok.encode(target))
    assert score.tokens == len(expected) == len(score.token_log_probs)
    # float32 against float64: a few units in the last place over 1-2 layers
    np.testing.assert_allclose(score.token_log_probs, expected, rtol=1e-5, atol=2e-5)
    assert score.log_prob == pytest.approx(expected.sum(), abs=1e-4)
    assert score.alignment is None
  right, wrong = scores[0].log_prob, scores[4].log_prob
  assert right > wrong  # (the model learned something: its own translation scores higher)


def test_batching_and_shares_change_no_score(translator):
  sources, targets = [s for s, _ in PAIRS], [t for _, t in PAIRS]
  with jax.default_matmul_precision("highest"):
    whole = translator.score(sources, targets)
    first = translator.score(sources, targets, batch_size=3, share=(0, 2))
    second = translator.score(sources, targets, batch_size=3, share=(1, 2))
  # (8 pairs in batches of 3, 3, 2: share 0 scores the first and the last, share 1 the middle)
  assert sum(r is not None for r in first) == 5 and sum(r is not None for r in second) == 3
  for k, (a, b) in enumerate(zip(first, second)):
    merged = a if a is not None else b
    assert merged is not None and merged.tokens == whole[k].tokens
    np.testing.assert_allclose(merged.token_log_probs, whole[k].token_log_probs, atol=1e-5)


def test_the_alignment_is_each_target_tokens_most_attended_source_token(translator):
  source, target = PAIRS[3]
  with jax.default_matmul_precision("highest"):
    (score,) = translator.score([source], [target], alignment=True)
    _, target_pieces, weights = translator.cross_attention(source, target)
  # cross_attention: `[layers, heads, target, source]`; the last layer, heads averaged.
  assert score.alignment == list(np.argmax(weights[-1].mean(axis=0), axis=-1))
  assert len(score.alignment) == len(target_pieces) == score.tokens


def test_a_target_longer_than_max_len_is_scored_on_its_start_and_counted(translator):
  long = " ".join(["drei"] * 400)
  (score,) = translator.score(["three"], [long])
  assert score.tokens == translator.config.max_len
  assert translator.last_stats["truncated"] == 1
  with pytest.raises(ValueError, match="2 sources but 1 targets"):
    translator.score(["a", "b"], ["c"])


def test_scores_are_ctranslate2s_score_batch_on_the_same_weights(workdir, translator, tmp_path):
  ctranslate2 = pytest.importorskip("ctranslate2")
  from transformer.interop import ctranslate2_export
  out = ctranslate2_export.export_workdir(str(workdir), str(tmp_path / "ct2"))
  tok = translator.tokenizer
  pairs = [(s, t) for s, t in PAIRS if s and t]
  theirs = ctranslate2.Translator(out, intra_threads=1).score_batch(
      [tok.pieces(tok.encode(s)) for s, _ in pairs], [tok.pieces(tok.encode(t)) for _, t in pairs])
  with jax.default_matmul_precision("highest"):
    ours = translator.score([s for s, _ in pairs], [t for _, t in pairs])
  for mine, other in zip(ours, theirs):
    assert mine.tokens == len(other.log_probs)  # (its tokens and the EOS)
    # Two float32 implementations (CTranslate2's own kernels): 1e-4 per token.
    np.testing.assert_allclose(mine.token_log_probs, other.log_probs, rtol=1e-4, atol=1e-4)
