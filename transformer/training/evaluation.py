"""Validation during and after training: the eval loss, accuracy and perplexity,
and the translation scores (BLEU, chrF, ...) of the first validation pairs.

With several processes both are split: each process computes the loss sums of
its contiguous share of the loss pairs (added over all processes by the
jitted step) and translates its share of the BLEU pairs (gathered to every
process, which scores them all), so each pair is seen once and the numbers are
those of one process doing everything."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from transformer.data import pipeline as data
from transformer.data import tokenizer as tokenizer_lib
from transformer.decoding import translator as translation
from transformer.model.config import TransformerConfig
from transformer.runtime import multihost, parallel
from transformer.training import metrics as metrics_lib
from transformer.training.steps import eval_step, global_batch, summarize_sums




class Evaluator:
  """Validation of the parameters during and after training.

  `evaluator(params, step)` computes the eval loss, token accuracy and
  perplexity over the eval pairs (the first `config.num_eval_examples`, or
  all), and when `config.num_bleu_examples` > 0 the BLEU and exact match of the
  translations of the first ones (`config.eval_decode_method`, beam
  `config.eval_beam_size`); writes them to the metrics and returns them.
  `samples` keeps (source, reference, translation) of the last evaluation.
  One Translator serves every evaluation (the new parameters swapped in), so
  its decoders compile once.
  """

  def __init__(self, config: ml_collections.ConfigDict, model_config: TransformerConfig,
               tokenizer: tokenizer_lib.Tokenizer, eval_pairs, mesh,
               writer: metrics_lib.MetricsWriter, minutes=None):
    self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
    self.writer = writer
    self.loss_pairs = (eval_pairs[:config.num_eval_examples] if config.num_eval_examples
                       else eval_pairs)
    self.bleu_pairs = list(eval_pairs[:config.num_bleu_examples])
    self.samples: list[tuple[str, str, str]] = []
    self._sharding = NamedSharding(mesh, P("data"))
    replicated = parallel.replicated(mesh)
    self._eval_fn = jax.jit(
        lambda p, b: eval_step(p, b, model_config=model_config,
                               label_smoothing=config.label_smoothing),
        # (params as they are: replicated, or split with state_sharding="fsdp")
        in_shardings=(None, self._sharding), out_shardings=replicated)
    self._translator: translation.Translator | None = None
    self.seconds = 0.0                    # of the last evaluation
    self.seconds_per_sentence = 0.0       # of its translation, compiling left out
    self.compile_seconds = 0.0            # of its decoders (0 once they are compiled)
    self.translate_seconds = 0.0          # its translation's, compiling included
    self.generated_tokens = 0             # by its translation (EOS included)
    self.minutes = minutes                # a callable -> training minutes, for the records

  def translator(self, params) -> translation.Translator:
    """The Translator, holding `params` (its decoders compile once)."""
    if self._translator is None:
      self._translator = translation.Translator(self.model_config, params, self.tokenizer)
      # Whole searches: early in training most translations run to the end,
      # and a short first search would decode (and compile) each twice.
      self._translator.policy.first_search = False
      # Buckets of their own: its decoders are compiled once and kept for
      # every evaluation, so sharing a longer bucket's would save nothing
      # after the first and pad the short inputs at each. A time budget's few
      # evaluations share them: compiling is what they pay most for (200
      # validation sentences greedy, cold: 4 decoders in 22 s or 1 in 6.5 s).
      self._translator.policy.share_buckets = bool(self.config.get("train_minutes", 0))
    else:
      self._translator.set_params(params)
    return self._translator

  def reference_tokens(self, pairs=None) -> int:
    """Tokens of the references of `pairs` (default: the BLEU pairs), an EOS
    each: about what a trained model generates translating them."""
    pairs = self.bleu_pairs if pairs is None else pairs
    return sum(len(ids) + 1 for ids in self.tokenizer.encode_batch([t for _, t in pairs]))

  def __call__(self, params, step: int, *, averaged: bool = False) -> dict[str, float]:
    """Evaluates `params` at `step`; the metrics go under "eval", or
    "eval_averaged" for averaged checkpoints."""
    start = time.perf_counter()
    self.compile_seconds = self.translate_seconds = 0.0
    self.generated_tokens = 0
    result = self.loss(params)
    if self.bleu_pairs:
      result.update(self.translation_scores(params))
    self.seconds = time.perf_counter() - start
    record = dict(result, minutes=self.minutes()) if self.minutes is not None else result
    self.writer.write(step, record, prefix="eval_averaged" if averaged else "eval")
    return result

  def loss(self, params) -> dict[str, float]:
    """Per-token eval loss, NLL, accuracy and perplexity (`summarize_sums`)."""
    return summarize_sums(self.loss_sums(params))

  def loss_sums(self, params) -> dict[str, float]:
    """The eval step's sums (loss, nll, correct, weight = target tokens) over
    the loss pairs, each counted once. Each process feeds its contiguous share
    (`multihost.process_share`) in batches of config.eval_batch_size rows
    (a global batch holds that many rows of each process), all processes the
    same number of batches: a share that runs out first is topped up with
    empty batches (all padding: zero weight, nothing added)."""
    pairs = self.loss_pairs
    batch_size, max_length = self.config.eval_batch_size, self.config.max_length
    num_batches = math.ceil(math.ceil(len(pairs) / jax.process_count()) / batch_size)
    share = data.eval_batches(pairs[multihost.process_share(len(pairs))], self.tokenizer,
                              batch_size=batch_size, max_length=max_length)
    empty = {key: np.zeros((batch_size, max_length), np.int32) for key in data.BATCH_KEYS}
    sums = None
    for _ in range(num_batches):
      batch = next(share, None) or empty
      batch = {key: batch[key] for key in data.BATCH_KEYS}   # (not "weights")
      out = self._eval_fn(params, global_batch(batch, self._sharding))
      sums = out if sums is None else jax.tree_util.tree_map(jnp.add, sums, out)
    return {key: float(value) for key, value in jax.device_get(sums).items()}

  def translation_scores(self, params) -> dict[str, float]:
    """BLEU, chrF, exact match ... (`metrics.translation_scores`) of the
    translations of `bleu_pairs`. With several processes each translates its
    share of the batches (`multihost.split_across_processes`) and every process
    scores them all."""
    translator = self.translator(params)
    sources = [source for source, _ in self.bleu_pairs]
    references = [target for _, target in self.bleu_pairs]
    start = time.perf_counter()
    hypotheses = multihost.split_across_processes(
        lambda sources, share: translator.translate(
            sources, method=self.config.eval_decode_method,
            beam_size=self.config.eval_beam_size, share=share),
        sources, what="validation sentences")
    self.translate_seconds = time.perf_counter() - start
    self.compile_seconds = float(translator.last_stats.get("compile_seconds", 0.0))
    self.generated_tokens = int(translator.last_stats.get("generated_tokens", 0))
    self.seconds_per_sentence = (self.translate_seconds - self.compile_seconds) / len(sources)
    self.samples = list(zip(sources, references, hypotheses))
    return metrics_lib.translation_scores(hypotheses, references)
