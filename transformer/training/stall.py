"""No silent stalls: telling a user, within the first minutes, that a run is
not learning.

The yardstick is the entropy of the target tokens' unigram distribution: the
loss of a model that predicts every target token by its frequency alone,
ignoring the source and the tokens before it. A model that learns gets below
it quickly; a stalled one sits on it. Measured on the gettext English->French
corpus (8k SentencePiece vocabulary, unigram entropy 6.24 nats, shape S):

  * post-LN, warm-up 100 steps (the paper's schedule): train NLL 6.29 at step
    50 and 6.30-6.34 from step 75 to 225, token accuracy flat at 8%: stalled.
  * pre-LN, otherwise the same (warm-up 400): NLL 5.55 at step 100, 5.13 at
    step 125 and falling: learning.

The rule (`StallCheck`): once the warm-up has had time to act, at step
`check_step(warmup_steps)` = min(warmup, 500) + 200, a training NLL (the loss
without label smoothing, over the last logging window) above the unigram
entropy minus MARGIN_NATS is a stall; the user gets one warning naming the
likely causes and their fixes. A model that does not stall has left the
unigram level by then in every run measured (the demo, the gettext corpus):
MARGIN_NATS of 0.25 leaves a model still at the unigram level flagged and one
that has started to use the context (already 0.7 nats lower at step 100 above)
alone.
"""

from __future__ import annotations

import collections
import math
from typing import Iterable, Sequence

MARGIN_NATS = 0.25


def unigram_entropy(token_id_lists: Iterable[Sequence[int]], eos_id: int) -> float:
  """Entropy in nats of the unigram distribution of the tokens of
  `token_id_lists`, each list followed by `eos_id` (as the model predicts it)."""
  counts: collections.Counter = collections.Counter()
  for ids in token_id_lists:
    counts.update(ids)
    counts[eos_id] += 1
  total = sum(counts.values())
  if not total:
    raise ValueError("unigram_entropy: no tokens.")
  return -sum(n / total * math.log(n / total) for n in counts.values())


def check_step(warmup_steps: int) -> int:
  """The step from which a NLL at the unigram level counts as a stall."""
  return min(int(warmup_steps), 500) + 200


class StallCheck:
  """`check(step, nll)` -> a warning (once), or None.

  Args:
    unigram_nats: `unigram_entropy` of the training targets.
    config: the training config: its warm-up, learning-rate scale and model
      normalization name the causes in the warning.
  """

  def __init__(self, unigram_nats: float, config):
    self.unigram_nats = float(unigram_nats)
    self.from_step = check_step(config.warmup_steps)
    self._config = config
    self.warned = False

  def check(self, step: int, nll: float) -> str | None:
    if self.warned or step < self.from_step or nll <= self.unigram_nats - MARGIN_NATS:
      return None
    self.warned = True
    return self._message(step, nll)

  def _message(self, step: int, nll: float) -> str:
    c = self._config
    causes = []
    if c.model.normalization == "post":
      causes.append(
          f"post-LN (config.model.normalization=post) with a short warm-up "
          f"(config.warmup_steps={c.warmup_steps}) or a high peak rate "
          f"(config.learning_rate_scale={c.learning_rate_scale:g}): the paper's layout "
          "needs a long warm-up. Fix: --config.model.normalization=pre (it trains from "
          "the first steps), or --config.warmup_steps=4000 and a lower "
          "--config.learning_rate_scale")
    else:
      causes.append(
          f"a learning rate too high or too low for this model "
          f"(config.learning_rate_scale={c.learning_rate_scale:g}, "
          f"config.warmup_steps={c.warmup_steps}). Fix: halve (or double) "
          "--config.learning_rate_scale")
    causes.append("source and target lines that do not correspond (check a few pairs "
                  "of the training data)")
    numbered = " ".join(f"({i}) {cause}." for i, cause in enumerate(causes, 1))
    return (f"step {step}: the model is not learning. Its training loss (NLL "
            f"{nll:.2f} nats) is no better than predicting each target token by its "
            f"frequency alone ({self.unigram_nats:.2f} nats). Likely causes: {numbered} "
            "A changed model needs a new --workdir.")
