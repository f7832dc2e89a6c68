"""Training for a time budget: `config.train_minutes`.

"Give it 20 minutes" means the whole run: loading the data, compiling, the
training steps, and after them the last checkpoint, the averaging of the last
checkpoints and the final evaluation (with a test split, its translation).
The loop therefore stops early enough to leave time for that end, which it
estimates from what it has measured in this run (`TimeBudget.reserve_seconds`):

  * the last checkpoint save (the step waits for it to be committed), and
    reading back the checkpoints to average (each about a save);
  * the final evaluation (twice when an average is compared with the last
    checkpoint): the loss part as the last periodic evaluation measured it,
    the translation as the validation references' tokens at the measured
    seconds per generated token (an early model's long outputs would
    otherwise make the end look far dearer than it is);
  * the test split's translation: its references' tokens at that speed,
    times BEAM_COST for beam search, plus the compilation of its decoders:
    the evaluation's measured compile seconds times TEST_COMPILE_COST;
  * the length penalties' beam searches (`training/length_choice.py`):
    the validation references' tokens once per candidate, as the test's,
    and their decoder's compilation, TUNING_COMPILE_COST evaluations';
  * before anything was measured, a guess: EARLY_RESERVE of the budget.

The budget counts across resumptions: every checkpoint records the seconds
spent up to it (`SPENT_KEY` in its metadata), and a resumed run starts from
there. A run whose budget is spent goes straight to its final evaluation.

The paper's schedule (config.lr_schedule="paper") does not depend on the
number of steps; a budget run with it only needs a warm-up that ends in time
(`warmup_warning`). config.lr_schedule="budget" follows the budget instead
(`BudgetPlanner`): a linear warm-up over config.warmup_fraction of the steps
the measured speed affords, the peak rate, then a linear decay to zero over
the last config.decay_fraction of the run, its length fixed when it starts
(late, when the speed, the evaluation and the end's cost are measured). The
plan lives in the train state, so a resumed run follows it exactly.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import jax
import numpy as np

from transformer.training import steps as steps_lib

logger = logging.getLogger(__name__)

SPENT_KEY = "train_seconds"   # checkpoint metadata: seconds spent up to that step
EARLY_RESERVE = 0.1           # share of the budget kept for the end before any measurement
# Seconds of a beam-4 token / of a greedy one, both compiled (a CPU:
# benchmarks/bench_decode.py, shape S, 70.5 vs 21.9 sentences/s).
BEAM_COST = 3.5
# Compile seconds of the 1,000 test sentences' decoders / of the 200
# validation sentences' greedy ones. The test is translated as decode.py
# translates (its own decoders, whatever the method: `report.test_report`):
# beam 4 16.5 / 6.5 s (2.5) on a quiet 2-core AVX2 CPU, 41.7 / 10.7 s (3.9)
# beside another job; greedy 15.5 / 6.5 s (2.4) (small_corpus's model on
# gettext-en-fr: docs/benchmarks.md). Overrunning the budget is worse than
# ending a few seconds early: 3.
TEST_COMPILE_COST = 3.0
# Compile seconds of the length penalty's beam decoder (config.length_penalty_
# candidates: one decoder for the 200 validation sentences, as the evaluation
# plans them) / of the evaluation's greedy ones: 13.0 / 7.6 s (1.7) cold on a
# 2-core AVX-512 CPU; rounded up, as above.
TUNING_COMPILE_COST = 2.0
MARGIN_SECONDS = 5.0          # for what is not measured (writing the report, the curves)
MEASURE_STEPS = 2             # updates timed after the first (compiling) one


def decode_cost(method: str) -> float:
  """Seconds of translating a sentence with `method`, in greedy sentences."""
  return BEAM_COST if method == "beam" else 1.0


class TimeBudget:
  """A deadline for the training loop.

  `budget = TimeBudget(minutes, spent_seconds)` at the start of a run (spent:
  what earlier runs of the workdir used); `budget.measured(...)` as durations
  become known; `budget.should_stop(step_seconds)` before each step;
  `budget.spent()` for the checkpoint's metadata. minutes <= 0: no budget.
  """

  def __init__(self, minutes: float, spent_seconds: float = 0.0, *,
               test_tokens: int = 0, eval_tokens: int = 0, test_cost: float = BEAM_COST,
               test_compile_cost: float = TEST_COMPILE_COST, final_evaluations: int = 1,
               checkpoints_to_average: int = 0,
               clock: Callable[[], float] = time.monotonic):
    self.seconds = float(minutes) * 60.0
    self.enabled = self.seconds > 0
    self._clock = clock
    self._start = clock() - float(spent_seconds)
    self._test_tokens = test_tokens    # the test references' tokens (EOS included)
    self._eval_tokens = eval_tokens    # the validation references' (of its BLEU pairs)
    self._test_cost = float(test_cost)  # a test token's seconds / a validation one's
    self._test_compile_cost = float(test_compile_cost) if test_tokens else 0.0
    self.final_evaluations = final_evaluations  # 2: the average against the last step
    self.checkpoints_to_average = checkpoints_to_average
    self._save_seconds = 0.0
    self._loss_seconds: float | None = None  # an evaluation's part besides translating
    self._compile_seconds = 0.0
    self._seconds_per_token = 0.0

  def spent(self) -> float:
    """Seconds spent so far, earlier runs of the workdir included."""
    return self._clock() - self._start

  def remaining(self) -> float:
    return self.seconds - self.spent()

  def measured(self, *, save_seconds: float | None = None, eval_seconds: float | None = None,
               compile_seconds: float = 0.0, translate_seconds: float = 0.0,
               generated_tokens: int = 0) -> None:
    """Records the duration of a checkpoint save, or of a periodic evaluation:
    `eval_seconds` in all, of which its translation took `translate_seconds`
    (compiling its decoders `compile_seconds` of them) for `generated_tokens`."""
    if save_seconds is not None:
      self._save_seconds = max(self._save_seconds, save_seconds)
    if eval_seconds is None:
      return
    self._loss_seconds = max(0.0, eval_seconds - translate_seconds)
    if compile_seconds:  # (the first evaluation's: later ones reuse its decoders)
      self._compile_seconds = max(self._compile_seconds, compile_seconds)
    if generated_tokens:
      self._seconds_per_token = max(0.0, translate_seconds - compile_seconds) / generated_tokens

  @property
  def evaluated(self) -> bool:
    """Whether an evaluation was measured (the end's cost is then known)."""
    return self._loss_seconds is not None

  def eval_seconds(self) -> float:
    """Seconds of an evaluation with its decoders compiled (0 before one was measured)."""
    if self._loss_seconds is None:
      return 0.0
    return self._loss_seconds + self._eval_tokens * self._seconds_per_token

  def test_seconds(self) -> float:
    """The estimated seconds of the test split's translation, compiling included."""
    return (self._test_tokens * self._seconds_per_token * self._test_cost
            + self._compile_seconds * self._test_compile_cost)

  def reserve_seconds(self) -> float:
    """The estimated seconds the run needs after its last step."""
    if self._loss_seconds is None:
      return EARLY_RESERVE * self.seconds
    saves = self._save_seconds * (1 + self.checkpoints_to_average)
    return (saves + self.final_evaluations * self.eval_seconds() + self.test_seconds()
            + MARGIN_SECONDS)

  def test_fits(self) -> bool:
    """Whether the test's translation fits in what is left (give or take a
    twentieth of the budget): a budget shorter than its own end (a minute on
    a slow CPU) skips it rather than overrun."""
    return (not self.enabled or not self.evaluated
            or self.test_seconds() <= self.remaining() + 0.05 * self.seconds)

  def should_stop(self, step_seconds: float) -> bool:
    """Whether one more step of `step_seconds` would eat into the reserve."""
    return self.enabled and self.remaining() < step_seconds + self.reserve_seconds()


def warmup_warning(warmup_steps: int, step: int, steps_per_second: float,
                   budget: TimeBudget) -> str | None:
  """A warning when, at the measured speed, the learning-rate warm-up would
  not end in the first half of the steps the budget leaves; else None."""
  if not budget.enabled or step >= warmup_steps or steps_per_second <= 0:
    return None
  total = step + (budget.remaining() - budget.reserve_seconds()) * steps_per_second
  if warmup_steps <= total / 2:
    return None
  return (f"warm-up ends at step {warmup_steps}, but at {steps_per_second:.2f} steps/s "
          f"config.train_minutes={budget.seconds / 60:g} allows about {int(total)} steps: "
          "the learning rate would still be rising for most of the run. Use "
          f"--config.warmup_steps={max(1, int(total) // 8)} (an eighth of the run), or a "
          "longer budget.")


class BudgetPlanner:
  """Fixes a budget run's learning-rate plan (`steps.budget_learning_rate`:
  [warm-up steps, decay start, decay steps]) as the run's speed becomes known.

  The loop calls `after_step(step, step_seconds)` after every update with the
  seconds of an update it has measured (0 while none is); a plan that changed
  is put into the train state. Two decisions, each taken once:

  * the warm-up: once an update has been timed after the first (compiling)
    one, `warmup_fraction` of the steps the budget then affords;
  * the decay: once an evaluation has measured the end's cost and the steps
    left are no more than `decay_fraction` of the run, those steps left
    (the decay reaches zero on the last step the budget affords).

  A run plans its evaluations in time: one every `eval_minutes`
  (`should_evaluate`); when the decay is due before any, one is asked for
  first (`wants_evaluation`). In the decay, checkpoints are
  saved evenly (`should_save`: `checkpoints_in_decay` of them, the last one
  included) for the average of the decay phase (`decay_steps`).
  """

  def __init__(self, budget: TimeBudget, plan, *, warmup_fraction: float,
               decay_fraction: float, eval_minutes: float = 5.0,
               checkpoints_in_decay: int = 1):
    self.budget = budget
    self.plan = np.array(plan, np.int64).reshape(3)
    self.warmup_fraction, self.decay_fraction = float(warmup_fraction), float(decay_fraction)
    self.eval_seconds = float(eval_minutes) * 60.0
    self.checkpoints_in_decay = max(1, int(checkpoints_in_decay))
    self.wants_evaluation = False
    self._done = self._due()  # (a resumed run: the evaluations whose time has passed)

  # -- what the plan says -------------------------------------------------------

  @property
  def decay_start(self) -> int:
    return int(self.plan[steps_lib.DECAY_START])

  @property
  def decay_steps(self) -> int:
    return int(self.plan[steps_lib.DECAY_STEPS])

  def total_steps(self) -> int | None:
    """The run's last step, once the decay is planned; else None."""
    return self.decay_start + self.decay_steps if self.decay_steps else None

  def finished(self, step: int) -> bool:
    """Whether the decay has reached zero: no update would change the model."""
    total = self.total_steps()
    return total is not None and step >= total

  def should_save(self, step: int) -> bool:
    """A checkpoint at each `checkpoints_in_decay`-th of the decay (its end included)."""
    if not self.decay_steps or not self.decay_start < step <= self.total_steps():
      return False
    every = self.decay_steps / self.checkpoints_in_decay
    done = step - self.decay_start
    return done == self.decay_steps or int(done / every) > int((done - 1) / every)

  def decay_checkpoints(self, steps: list[int]) -> list[int]:
    """Of the checkpoints `steps`, those of the decay phase (after its start)."""
    if not self.decay_steps:
      return []
    return [s for s in steps if s > self.decay_start]

  # -- the decisions ------------------------------------------------------------

  def steps_left(self, step_seconds: float) -> int:
    """Updates of `step_seconds` the budget affords after what the end of the
    run and the evaluations still to come need."""
    if step_seconds <= 0:
      return 0
    pending = self._evaluations_to_come() * self.budget.eval_seconds()
    seconds = self.budget.remaining() - self.budget.reserve_seconds() - pending
    return max(0, int(seconds / step_seconds))

  def estimated_total(self, step: int, step_seconds: float) -> int | None:
    """The planned last step, or the estimate of it; None before a measurement."""
    if self.total_steps() is not None:
      return self.total_steps()
    return step + self.steps_left(step_seconds) if step_seconds > 0 else None

  def after_step(self, step: int, step_seconds: float) -> bool:
    """Takes the decision that is due after update `step`; returns whether the plan changed."""
    if step_seconds <= 0 or self.decay_steps:
      return False
    left = self.steps_left(step_seconds)
    if not self.plan[steps_lib.WARMUP]:
      self.plan[steps_lib.WARMUP] = max(1, round(self.warmup_fraction * (step + left)))
      return True
    if not self.budget.evaluated:
      # The end's cost is a guess until an evaluation measures it (on a slow
      # CPU the test's decoders alone can take a quarter of 5 minutes): ask
      # for one well before the decay could be due.
      if left <= min(0.9, 2 * self.decay_fraction) * (step + left):
        self.wants_evaluation = True
      return False
    if left > self.decay_fraction * (step + left):
      return False
    self.plan[steps_lib.DECAY_START] = step
    self.plan[steps_lib.DECAY_STEPS] = max(1, left)
    return True

  def should_evaluate(self, step: int) -> bool:
    """Whether a periodic evaluation is due: every `eval_minutes` of the
    budget (none in the decay's last step), or when the decay needs one."""
    if self.wants_evaluation:
      self.wants_evaluation = False
      self._done = self._due()
      return True
    due = self._due()
    if due > self._done and not self.finished(step + 1):
      self._done = due
      return True
    return False

  def _due(self) -> int:
    """How many of the planned evaluations' times have passed."""
    if not self.budget.enabled or self.eval_seconds <= 0:
      return 0
    return int(self.budget.spent() / self.eval_seconds)

  def _evaluations_to_come(self) -> int:
    """Planned evaluations whose time has not come, before the end's reserve."""
    if not self.budget.enabled or self.eval_seconds <= 0:
      return 0
    end = self.budget.seconds - self.budget.reserve_seconds()
    return max(0, math.ceil(end / self.eval_seconds) - 1 - self._done)


class FirstStepsTimer:
  """Times the updates after a run's first (compiling) one, for the budget's
  plan: `after_step(metrics)` returns the seconds of an update once
  MEASURE_STEPS were timed, else 0. Waits for the device twice in all."""

  def __init__(self):
    self._steps, self._start = 0, 0.0

  def after_step(self, metrics) -> float:
    self._steps += 1
    if self._steps == 1 or self._steps == 1 + MEASURE_STEPS:
      jax.block_until_ready(metrics)
      if self._steps == 1:
        self._start = time.perf_counter()
        return 0.0
      return (time.perf_counter() - self._start) / MEASURE_STEPS
    return 0.0


def plan_message(planner: BudgetPlanner, step: int, step_seconds: float) -> str:
  """What the budget's plan fixed after `step`, for the console and train.log."""
  warmup = int(planner.plan[steps_lib.WARMUP])
  if not planner.decay_steps:
    message = (f"step {step}: {step_seconds:.2f} s per step; the budget affords about "
               f"{planner.estimated_total(step, step_seconds)} steps: warm-up over {warmup}")
  else:
    message = (f"step {step}: the learning rate decays to zero over the {planner.decay_steps} "
               f"steps the budget leaves (to step {planner.total_steps()}, "
               f"{step_seconds:.2f} s per step)")
  logger.info("%s", message)
  return message


def estimated_total(planner: BudgetPlanner | None, budget: TimeBudget, step: int,
                    step_seconds: float, num_train_steps: int) -> int:
  """The steps a budgeted run will reach at `step_seconds` a step (its plan's
  end once fixed), at most num_train_steps."""
  if planner is not None:
    total = planner.estimated_total(step, step_seconds) or num_train_steps
  else:
    left = (budget.remaining() - budget.reserve_seconds()) / max(step_seconds, 1e-9)
    total = step + max(0, int(left))
  return max(step, min(num_train_steps, total))
