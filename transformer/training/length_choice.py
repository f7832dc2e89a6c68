"""The length penalty a trained model decodes with, measured on validation.

Beam search ranks hypotheses by log p / ((5 + length) / 6)^alpha; the paper's
alpha 0.6 was tuned for WMT models trained for days. A small model trained
for minutes ends sentences early under beam search: on gettext-en-fr's 1,000
validation pairs (two cores) a 20-minute model's brevity penalty was 0.972
greedy and 0.931 with beam 4 at alpha 0.6 (multi-sentence messages cut after
the first sentence). BLEU by alpha (20 minutes / 5 minutes): 0.6 46.92 /
19.08, 1.0 47.17 / 19.49, 1.2 47.24 / 18.84, 1.4-1.5 46.69 / 12.56 (the
5-minute model's translations then run 50% long). So the small-corpus
recipe decodes with config.length_penalty=1.0, near the best at every
budget measured; config.length_penalty_candidates instead chooses among
several on the validation BLEU pairs at the end of the run (the best BLEU,
the earliest on a tie: three beam searches of 200 sentences, 20-35 s on two
cores, too dear for a 5-minute budget to pay for its 0.4 BLEU). Either way
the alpha translates the test split and, where it is not the paper's, is
recorded in <workdir>/decoding.json, which decode.py and `load_translator`
take as the workdir's default (`workdir_records.read_decoding`).
"""

from __future__ import annotations

import logging
import os

from etils import epath

from transformer.decoding.options import PAPER_LENGTH_PENALTY
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
  _record(workdir, best, chosen_on=f"{len(pairs)} validation pairs, beam {beam_size}",
          validation={f"{a:g}": {k: round(s[k], 4) for k in ("bleu", "chrf", "brevity_penalty")}
                      for a, s in scores.items()})
  return best


def _record(workdir: str, alpha: float, **measured) -> None:
  """Writes decoding.json: `alpha`, and what chose it."""
  workdir_lib.write_file(os.path.join(workdir, workdir_records.DECODING_FILE),
                         workdir_records.decoding_record({"length_penalty": alpha}, **measured))


def forget(workdir: str) -> None:
  """Removes a decoding.json an earlier run of the workdir wrote (this run
  decodes with the paper's alpha)."""
  path = epath.Path(workdir, workdir_records.DECODING_FILE)
  try:
    path.unlink()
  except FileNotFoundError:  # (none; or another process of the run removed it)
    return
  logger.info("Removed %s: it was chosen for an earlier model of this workdir.", path)


def tuned(config, evaluate, params, workdir: str, *, fits: bool) -> float:
  """The end of a training run: the alpha the test split and then decode.py
  use. `choose`n among config.length_penalty_candidates on `evaluate`'s
  validation BLEU pairs for the final `params`, where there are both and
  the budget's end `fits`; else config.length_penalty, which decoding.json
  records where it is not the paper's (an earlier run's record removed)."""
  candidates = config.get("length_penalty_candidates", ())
  if candidates and evaluate.bleu_pairs and fits:
    return choose(evaluate.translator(params), evaluate.bleu_pairs, candidates, workdir,
                  beam_size=config.eval_beam_size)
  alpha = float(config.get("length_penalty", PAPER_LENGTH_PENALTY))
  if alpha == PAPER_LENGTH_PENALTY:
    forget(workdir)
  else:
    _record(workdir, alpha, chosen_on="config.length_penalty")
  return alpha
