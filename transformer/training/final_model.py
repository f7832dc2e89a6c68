"""The model a training run ends with: the last step's parameters, or the
average of its last checkpoints (the paper's: 5 base, 20 big; with a budget's
schedule, the decay's) where validation says it is no worse. `choose` is
what the loop (loop.py) calls after its last step."""

from __future__ import annotations

import logging

from transformer.runtime import averaging, checkpoints, parallel
from transformer.training import evaluation, time_budget

logger = logging.getLogger(__name__)


def choose(config, workdir: str, ckpt: checkpoints.Checkpointer, state: dict, step: int,
           mesh, evaluate: evaluation.Evaluator,
           planner: time_budget.BudgetPlanner | None) -> tuple[dict, dict, str]:
  """(the final parameters, their validation metrics, which they are and why).

  With config.average_last > 1, the average of the last checkpoints (as the
  paper did: 5 base, 20 big; with a budget's plan, of the decay phase's) is
  evaluated beside the last step and kept, saved in the workdir, only where
  validation (BLEU when it is computed, else the loss) says it is no worse
  (or always, with config.keep_average="always"): decode.py's
  --checkpoint=auto then takes it; otherwise the last step."""
  last = evaluate(state["params"], step)
  steps = ckpt.all_steps()
  if planner is not None:
    steps = planner.decay_checkpoints(steps)
  steps = steps[-config.average_last:] if config.average_last > 1 else []
  if len(steps) <= 1:
    return state["params"], last, f"the last step ({step})"
  averaged = averaging.average_checkpoints(workdir, state["params"], steps=steps)
  averaged = parallel.replicate(averaged, mesh)
  candidate = evaluate(averaged, step, averaged=True)
  metric, better = (("bleu", candidate["bleu"] >= last["bleu"]) if "bleu" in last
                    else ("loss", candidate["loss"] <= last["loss"]))
  versus = f"validation {metric} {candidate[metric]:.2f} against {last[metric]:.2f}"
  if not better and config.get("keep_average", "if_no_worse") != "always":
    choice = f"the last step ({step}): the average of steps {steps} is worse ({versus})"
    logger.info("Final model: %s; the average is not kept.", choice)
    return state["params"], last, choice
  averaging.save_averaged(workdir, averaged, steps, per_process=ckpt.per_process)
  choice = f"the average of steps {steps} ({versus} for the last step)"
  logger.info("Final model: %s, saved in the workdir.", choice)
  return averaged, candidate, choice
