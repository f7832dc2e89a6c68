"""Scoring given translations (forced decoding): log p(target | source) of
each pair under the model, with no search (`Translator.score`, `decode.py
--score`).

    scores = score_pairs(translator, ["one red cat"], ["eine rote Katze"])
    scores[0].log_prob, scores[0].tokens, scores[0].token_log_probs

Each batch is one forward pass of the whole model with the target, shifted
right, as the decoder's input (teacher forcing, as training's loss computes
it: `Decoders.score_program`); each target token's log-probability is its
logit minus the log-sum-exp of its position's logits. Pairs are sorted by
length and cut into batches of `batch_size`, their lengths padded to a
multiple of LENGTH_STEP (few programs to compile, few padding tokens); the
batches run side by side, one lane per core on a CPU, as translation's do.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import NamedTuple, Sequence

import numpy as np

from transformer.decoding import batching
from transformer.runtime.errors import OptionError

# A batch's sources and targets are padded to a multiple of this many tokens:
# a program per 8 lengths, at most 7 padding tokens a row (translation's
# power-of-two buckets pad up to half a row: with them and one lane, 1,000
# pairs scored at 0.68x CTranslate2's speed; with both changed, 0.93x).
LENGTH_STEP = 8


class Score(NamedTuple):
  """A given translation's log-probability under the model: `log_prob` the
  sum over its tokens and the EOS, `tokens` how many those are,
  `token_log_probs` each one's; `alignment` (when asked for) the source token
  each attends to most, an index into the source's pieces (its EOS included)."""
  log_prob: float
  tokens: int
  token_log_probs: list[float]
  alignment: list[int] | None = None


def score_pairs(translator, sources: Sequence[str], targets: Sequence[str], *,
                alignment: bool = False, batch_size: int = 32,
                share: tuple[int, int] = (0, 1)) -> list[Score | None]:
  """A `Score` for each (source, target) pair under `translator`'s model (a
  `translator.Translator`, which calls this); with `alignment`, each target
  token's most attended source token (the last decoder layer's
  encoder-decoder attention, averaged over its heads).

  Sources are truncated as `translate` truncates them; a target longer than
  the model's max_len is scored on its first max_len - 1 pieces and the EOS
  (both counted in `translator.last_stats["truncated"]`). A blank source is
  its EOS alone, as is a blank target's score. `share` (index, count): score
  only batches index, index + count, ... (None for the others: several
  processes, as `translate_hypotheses`' share).
  """
  if len(sources) != len(targets):
    raise ValueError(f"score: {len(sources)} sources but {len(targets)} targets")
  if batch_size < 1:
    raise OptionError("batch_size", batch_size, "must be >= 1")
  cfg, start = translator.config, time.perf_counter()
  encoded, long_sources = translator.encode(sources)
  wanted, long_targets = translator.encode(targets, target=True)
  truncated = long_sources + long_targets
  encoded, wanted = ([ids or [cfg.eos_id] for ids in side] for side in (encoded, wanted))
  order = sorted(range(len(sources)), key=lambda i: (len(wanted[i]), len(encoded[i])))
  batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
  mine = batches[share[0]::share[1]]
  results: list[Score | None] = [None] * len(sources)
  made = {"seconds": 0.0, "loaded": 0}  # (the scorers this call compiled or loaded)

  def score_batch(members: list[int]) -> None:
    # Rows: the batch size, or the next power of two for a last, smaller batch.
    rows = batch_size if len(members) == batch_size else 1 << (len(members) - 1).bit_length()
    src_len, tgt_len = (min(batching.round_up(max(len(side[i]) for i in members), LENGTH_STEP),
                            cfg.max_len) for side in (encoded, wanted))
    inputs = np.full((rows, src_len), cfg.pad_id, np.int32)
    decoder_inputs = np.full((rows, tgt_len), cfg.pad_id, np.int32)
    target_ids = np.full((rows, tgt_len), cfg.pad_id, np.int32)
    for row, i in enumerate(members):
      inputs[row, :len(encoded[i])] = encoded[i]
      decoder_inputs[row, :len(wanted[i])] = [cfg.bos_id] + wanted[i][:-1]
      target_ids[row, :len(wanted[i])] = wanted[i]
    args = (translator.params, inputs, decoder_inputs, target_ids)
    began = time.perf_counter()
    compiled, loaded = translator.decoders.scorer(alignment, args)
    if loaded is not None:  # (made for this call, not kept from an earlier one)
      made["seconds"] += time.perf_counter() - began
      made["loaded"] += loaded
    out = compiled(*args)
    token_log_probs, where = out if alignment else (out, None)
    token_log_probs = np.asarray(token_log_probs, np.float64)
    where = None if where is None else np.asarray(where)
    for row, i in enumerate(members):
      n = len(wanted[i])
      results[i] = Score(float(token_log_probs[row, :n].sum()), n,
                         token_log_probs[row, :n].tolist(),
                         None if where is None else where[row, :n].tolist())

  # One batch's small matrix products do not fill a CPU's cores: a lane each.
  lanes = min(translator.default_concurrent_batches(), len(mine)) or 1
  with concurrent.futures.ThreadPoolExecutor(lanes) as pool:
    list(pool.map(score_batch, mine))  # (an error in a batch is raised here)
  tokens = sum(len(wanted[i]) for members in mine for i in members)
  seconds = time.perf_counter() - start
  translator.last_stats = {
      "sentences": len(sources), "decoded": sum(len(m) for m in mine), "truncated": truncated,
      "generated_tokens": tokens, "seconds": seconds, "compile_seconds": made["seconds"],
      "host_seconds": 0.0, "decoders_loaded": made["loaded"], "searched_again": 0,
      "devices": translator.decoders.devices,
      "tokens_per_second": tokens / max(seconds - made["seconds"], 1e-9)}
  return results
