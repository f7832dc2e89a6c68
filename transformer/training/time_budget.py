"""Training for a time budget: `config.train_minutes`.

"Give it 20 minutes" means the whole run: loading the data, compiling, the
training steps, and after them the last checkpoint, the averaging of the last
checkpoints and the final evaluation (with a test split, its translation).
The loop therefore stops early enough to leave time for that end, which it
estimates from what it has measured in this run (`reserve_seconds`):

  * the last checkpoint save (the step waits for it to be committed);
  * the final evaluation: the last periodic evaluation's duration, plus the
    test split's translation at the measured seconds per translated sentence,
    times BEAM_COST for beam search (4 hypotheses cost ~3 greedy decodes on
    a CPU, measured with benchmarks/bench_decode.py: S 70.5 vs 21.9 sentences/s);
  * before anything was measured, a guess: EARLY_RESERVE of the budget.

The budget counts across resumptions: every checkpoint records the seconds
spent up to it (`SPENT_KEY` in its metadata), and a resumed run starts from
there. A run whose budget is spent goes straight to its final evaluation.

The learning-rate schedule needs no change: the paper's (a linear warm-up,
then the inverse square root of the step) does not depend on the number of
steps, so a run stopped by the clock has followed exactly the schedule a run
stopped at that step count would have; averaging the last checkpoints then
plays the part a final decay plays in other schedules. What a budget can get
wrong is a warm-up longer than the run: `warmup_warning` says so once the
speed is known.
"""

from __future__ import annotations

import time
from typing import Callable

SPENT_KEY = "train_seconds"   # checkpoint metadata: seconds spent up to that step
EARLY_RESERVE = 0.1           # share of the budget kept for the end before any measurement
BEAM_COST = 3.5               # seconds of a beam-4 sentence / seconds of a greedy one
MARGIN_SECONDS = 5.0          # for what is not measured (averaging, writing the report)


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
               num_test_sentences: int = 0, test_cost: float = BEAM_COST,
               clock: Callable[[], float] = time.monotonic):
    self.seconds = float(minutes) * 60.0
    self.enabled = self.seconds > 0
    self._clock = clock
    self._start = clock() - float(spent_seconds)
    self._num_test = num_test_sentences
    self._test_cost = float(test_cost)  # a test sentence's seconds / an eval sentence's
    self._save_seconds = 0.0
    self._eval_seconds: float | None = None
    self._seconds_per_sentence: float | None = None

  def spent(self) -> float:
    """Seconds spent so far, earlier runs of the workdir included."""
    return self._clock() - self._start

  def remaining(self) -> float:
    return self.seconds - self.spent()

  def measured(self, *, save_seconds: float | None = None, eval_seconds: float | None = None,
               seconds_per_sentence: float | None = None) -> None:
    """Records the duration of a checkpoint save, of a periodic evaluation, or
    the greedy decoding seconds per sentence it measured."""
    if save_seconds is not None:
      self._save_seconds = max(self._save_seconds, save_seconds)
    if eval_seconds is not None:
      self._eval_seconds = eval_seconds
    if seconds_per_sentence is not None:
      self._seconds_per_sentence = seconds_per_sentence

  def reserve_seconds(self) -> float:
    """The estimated seconds the run needs after its last step."""
    if self._eval_seconds is None:
      return EARLY_RESERVE * self.seconds
    test = self._num_test * (self._seconds_per_sentence or 0.0) * self._test_cost
    return self._save_seconds + self._eval_seconds + test + MARGIN_SECONDS

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
