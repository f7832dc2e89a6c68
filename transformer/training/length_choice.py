"""The length penalty a trained model decodes with, chosen on validation.

Beam search ranks hypotheses by log p / ((5 + length) / 6)^alpha; the paper's
alpha 0.6 was tuned for WMT models trained for days. A small model trained
for minutes ends sentences early under beam search: on gettext-en-fr (20
minutes, two cores) its 1,000 validation translations had a brevity penalty
of 0.972 greedy and 0.931 with beam 4 at alpha 0.6 (multi-sentence messages
cut after the first sentence), 0.943 at 1.0 and 1.000 at 1.5 (BLEU 46.92,
47.17, 46.69). So a run with config.length_penalty_candidates translates
its validation BLEU pairs with beam search at each candidate after choosing
its final model, keeps the best BLEU (the earliest candidate on a tie), uses
it for the test split, and records it in <workdir>/decoding.json, which
decode.py and `load_translator` take as the workdir's default
(`workdir_records.read_decoding`).
"""

from __future__ import annotations

import logging
import os

from transformer.runtime import multihost, workdir_records
from transformer.runtime import workdir as workdir_lib
from transformer.training import metrics as metrics_lib

logger = logging.getLogger(__name__)


def choose(translator, pairs, candidates, workdir: str, *, beam_size: int = 4) -> float:
  """The alpha of `candidates` whose beam search (`beam_size`) translates the
  sources of `pairs` with the best BLEU against their targets (ties: the
  earliest), written with every candidate's scores to the workdir's
  decoding.json. `translator` is the evaluation's, as it is: its policy
  compiles one beam decoder for all the pairs (13 s cold for the small-corpus
  model on 2 cores, where decode.py's policy compiled ~28 s of them); the
  alphas share it. With several processes each translates its share of the
  batches; all score them all, so all choose the same."""
  sources = [source for source, _ in pairs]
  references = [target for _, target in pairs]
  scores = {}
  for alpha in candidates:
    hypotheses = multihost.split_across_processes(
        lambda sources, share: translator.translate(
            sources, method="beam", beam_size=beam_size, length_penalty=float(alpha),
            share=share),
        sources, what="validation sentences")
    scores[float(alpha)] = metrics_lib.translation_scores(hypotheses, references)
  best = max(scores, key=lambda alpha: scores[alpha]["bleu"])  # (max keeps the first of ties)
  logger.info("Length penalty: %s on %d validation pairs, beam %d: alpha %g kept (decoding.json:"
              " decode.py's default for this workdir).", "; ".join(
                  f"alpha {a:g}: BLEU {s['bleu']:.2f}, brevity penalty {s['brevity_penalty']:.3f}"
                  for a, s in scores.items()), len(pairs), beam_size, best)
  record = workdir_records.decoding_record(
      {"length_penalty": best}, chosen_on=f"{len(pairs)} validation pairs, beam {beam_size}",
      validation={f"{a:g}": {k: round(s[k], 4) for k in ("bleu", "chrf", "brevity_penalty")}
                  for a, s in scores.items()})
  workdir_lib.write_file(os.path.join(workdir, workdir_records.DECODING_FILE), record)
  return best


def forget(workdir: str) -> None:
  """Removes a decoding.json an earlier run of the workdir chose for other
  parameters (this run chose none: its end had no time, or no candidates)."""
  path = workdir_lib.resolve(workdir) / workdir_records.DECODING_FILE
  try:
    path.unlink()
  except FileNotFoundError:  # (none; or another process of the run removed it)
    return
  logger.info("Removed %s: it was chosen for an earlier model of this workdir.", path)


def tuned(config, evaluate, params, workdir: str, *, fits: bool) -> float | None:
  """The end of a training run: `choose` among config.length_penalty_candidates
  on `evaluate`'s validation BLEU pairs for the final `params`, where there
  are both and the budget's end `fits`; None (the translator's default)
  otherwise, an earlier run's decoding.json removed."""
  candidates = config.get("length_penalty_candidates", ())
  if not (candidates and evaluate.bleu_pairs and fits):
    forget(workdir)
    return None
  return choose(evaluate.translator(params), evaluate.bleu_pairs, candidates, workdir,
                beam_size=config.eval_beam_size)
