"""What the training loop watches besides the loss being finite: the time
budget (time_budget.py), model FLOPs utilisation (flops.py), a stall
(stall.py) and a warm-up longer than the budget."""

from __future__ import annotations

import logging

from transformer.training import flops
from transformer.training import stall
from transformer.training import time_budget as time_budget_lib
from transformer.model.transformer import TransformerConfig
from transformer.data.prepared import PreparedCorpus
from transformer.data.tokenizer import EOS_ID

logger = logging.getLogger(__name__)


class RunMonitor:
  """What the loop watches besides the loss being finite: the time budget,
  model FLOPs utilisation, a stall (stall.StallCheck) and a warm-up longer
  than the budget (time_budget.warmup_warning). Warnings go to the log and
  the console, once each."""

  def __init__(self, config, model_config: TransformerConfig, tokenizer, train_pairs,
               budget: time_budget_lib.TimeBudget):
    self.config, self.budget = config, budget
    self.stopped_by_time = False
    self.warnings: list[str] = []
    rows = config.batch_size * config.grad_accum_steps
    self.flops_per_step = flops.training_flops_per_step(
        model_config, rows, config.max_length, config.max_length)
    self.peak_flops, self.peak_source = flops.peak_flops()
    logger.info("MFU is measured against the %s: %.1f GFLOP/s; a step is %.2f GFLOP.",
                self.peak_source, self.peak_flops / 1e9, self.flops_per_step / 1e9)
    every = max(1, len(train_pairs) // 20_000)  # 20k targets are plenty for the entropy
    if isinstance(train_pairs, PreparedCorpus):  # tokenized already (ids + EOS)
      target_ids = [train_pairs[i]["targets"][:-1].tolist()
                    for i in range(0, len(train_pairs), every)]
    else:
      target_ids = tokenizer.encode_target_batch(
          [train_pairs[i][1] for i in range(0, len(train_pairs), every)])
    self.stall = stall.StallCheck(stall.unigram_entropy(target_ids, EOS_ID), config)
    self._warned_warmup = False

  def mfu(self, steps_per_second: float) -> float:
    return self.flops_per_step * steps_per_second / self.peak_flops

  def after_log(self, step: int, summary: dict) -> list[str]:
    """The warnings this logging window raises (each at most once per run)."""
    found = [self.stall.check(step, summary["nll"])]
    if not self._warned_warmup and self.config.get("lr_schedule", "paper") == "paper":
      found.append(time_budget_lib.warmup_warning(
          self.config.warmup_steps, step, summary["steps_per_second"], self.budget))
      self._warned_warmup = found[-1] is not None
    found = [w for w in found if w]
    self.warnings.extend(found)
    return found
