"""The reference score the interop tests compare CTranslate2's `score_batch`
with: this model's own teacher-forced log-probabilities."""

from __future__ import annotations

import jax
import numpy as np

from transformer.model import Transformer


def teacher_forced_log_probs(config, params, sources, targets) -> np.ndarray:
  """Per sentence, sum over target ids + EOS of log p under teacher forcing
  (the model's own forward pass and log-softmax, float32, highest precision),
  the sentences padded into one batch (padding is masked: source keys by their
  pad id, later target positions by the causal mask). `sources`, `targets`:
  lists of id lists, without EOS."""
  src_len = max(len(s) for s in sources) + 1
  tgt_len = max(len(t) for t in targets) + 1
  inputs = np.full((len(sources), src_len), config.pad_id, np.int32)
  decoder_inputs = np.full((len(sources), tgt_len), config.pad_id, np.int32)
  for row, (src, tgt) in enumerate(zip(sources, targets)):
    inputs[row, :len(src) + 1] = src + [config.eos_id]
    decoder_inputs[row, :len(tgt) + 1] = [config.bos_id] + tgt
  with jax.default_matmul_precision("highest"):
    logits = jax.jit(Transformer(config).apply)({"params": params}, inputs, decoder_inputs)
  log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
  return np.asarray([sum(log_probs[row, t, label] for t, label in enumerate(tgt + [config.eos_id]))
                     for row, tgt in enumerate(targets)])
