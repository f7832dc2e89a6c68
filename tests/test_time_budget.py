"""The schedule of a time budget (config.lr_schedule="budget"): the learning
rate against a numpy reference, the planner's decisions on a fake clock, the
end's reserve, the choice of the final model, and a short budgeted run whose
learning rates follow the plan it recorded (training/time_budget.py, steps.py,
loop.py)."""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import train_worker  # noqa: E402  (no JAX import)

from transformer.runtime import checkpoints, workdir as workdir_lib  # noqa: E402
from transformer.runtime import checkpoint_names
from transformer.training import loop as training  # noqa: E402
from transformer.training import budget_model, final_model, run_setup  # noqa: E402
from transformer.training import steps as steps_lib  # noqa: E402
from transformer.runtime import parallel  # noqa: E402
from transformer.training import time_budget  # noqa: E402


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def reference_rate(step: int, warmup: int, decay_start: int, decay_steps: int,
                   peak: float) -> float:
  """The budget schedule written out case by case (float64, 0-based step)."""
  if warmup == 0:
    return 0.0
  rate = peak * min(1.0, (step + 1) / warmup)
  if decay_steps:
    rate = min(rate, peak * max(0.0, (decay_start + decay_steps - step) / decay_steps))
  return rate


@pytest.mark.parametrize("plan", [(0, 0, 0), (10, 0, 0), (10, 60, 40), (1, 5, 1), (25, 25, 75)])
def test_budget_learning_rate_is_warmup_stable_then_linear_decay(plan):
  peak = 2e-3
  rates = np.asarray(jax.vmap(lambda s: steps_lib.budget_learning_rate(s, np.array(plan), peak))(
      np.arange(120)))
  expected = [reference_rate(s, *plan, peak) for s in range(120)]
  np.testing.assert_allclose(rates, expected, rtol=1e-6, atol=1e-12)
  if plan[2]:  # the decay reaches zero at its end and stays there
    assert rates[plan[1] + plan[2]] == 0 and rates[-1] == 0


def test_budget_optimizer_applies_the_plan_rate_to_adams_direction():
  """An update of the budget schedule = -rate * Adam's direction; the first
  update's Adam direction is sign(g) (bias-corrected m / sqrt(v))."""
  config = train_worker.tiny_config({"lr_schedule": "budget", "train_minutes": 1.0,
                                     "learning_rate": 0.01})
  optimizer, schedule = steps_lib.make_optimizer(config, d_model=32)
  params = {"w": np.array([1.0, -2.0, 3.0], np.float32)}
  grads = {"w": np.array([0.5, -0.25, 0.0], np.float32)}
  state = {"step": np.int32(0), "schedule": np.array([4, 0, 0], np.int32)}
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  rate = float(steps_lib.learning_rate(schedule, state))
  assert rate == pytest.approx(0.01 * 1 / 4)
  np.testing.assert_allclose(-rate * np.asarray(updates["w"]), [-rate, rate, 0.0], atol=1e-6)


def test_budget_config_is_checked():
  base = {"lr_schedule": "budget", "train_minutes": 1.0}
  with pytest.raises(ValueError, match="lr_schedule='budget' follows a time budget"):
    run_setup.check_train_config(train_worker.tiny_config(dict(base, train_minutes=0.0)))
  with pytest.raises(ValueError, match="decay_fraction=1.5"):
    run_setup.check_train_config(train_worker.tiny_config(dict(base, decay_fraction=1.5)))
  with pytest.raises(ValueError, match="must be at most 1"):
    run_setup.check_train_config(train_worker.tiny_config(
        dict(base, warmup_fraction=0.5, decay_fraction=0.6)))
  with pytest.raises(ValueError, match="lr_schedule='cosine' must be one of"):
    run_setup.check_train_config(train_worker.tiny_config({"lr_schedule": "cosine"}))


def test_reserve_counts_saves_averaging_evaluations_test_and_its_compilation():
  clock = FakeClock()
  budget = time_budget.TimeBudget(10, test_tokens=2000, eval_tokens=400, test_cost=3.5,
                                  test_compile_cost=2.5, final_evaluations=2,
                                  checkpoints_to_average=3, clock=clock)
  assert budget.reserve_seconds() == 60 and not budget.evaluated  # a tenth before measuring
  assert budget.eval_seconds() == 0
  budget.measured(save_seconds=2.0)
  # The first evaluation: 30 s in all, of which translating 26 s, compiling
  # 12 s of them, for 1,400 tokens (an early model's long outputs): 0.01 s a token.
  budget.measured(eval_seconds=30.0, translate_seconds=26.0, compile_seconds=12.0,
                  generated_tokens=1400)
  assert budget.evaluated
  # A final evaluation: 4 s of loss + 400 reference tokens x 0.01 s = 8 s.
  assert budget.eval_seconds() == pytest.approx(8.0)
  # saves 2 x (1 + 3 read back) + 2 evaluations x 8 s + 2000 x 0.01 x 3.5 + 12 x 2.5 + margin
  assert budget.reserve_seconds() == pytest.approx(
      8 + 16 + 70 + 30 + time_budget.MARGIN_SECONDS)
  # A later evaluation compiles nothing: the compile seconds measured first are kept.
  budget.measured(eval_seconds=9.0, translate_seconds=5.0, compile_seconds=0.0,
                  generated_tokens=500)
  assert budget.reserve_seconds() == pytest.approx(
      8 + 2 * (4 + 4) + 70 + 30 + time_budget.MARGIN_SECONDS)
  # Without a test split nothing is kept for it, its compilation included.
  alone = time_budget.TimeBudget(10, eval_tokens=400, clock=clock)
  alone.measured(eval_seconds=30.0, translate_seconds=26.0, compile_seconds=12.0,
                 generated_tokens=1400)
  assert alone.reserve_seconds() == pytest.approx(8 + time_budget.MARGIN_SECONDS)


def make_planner(clock, minutes=10.0, **kwargs):
  budget = time_budget.TimeBudget(minutes, clock=clock)
  options = dict(warmup_fraction=0.1, decay_fraction=0.3, eval_minutes=200 / 60,
                 checkpoints_in_decay=4)  # (evaluations at 200 s, 400 s, ...)
  options.update(kwargs)
  return time_budget.BudgetPlanner(budget, np.zeros(3), **options)


def test_planner_fixes_the_warmup_from_the_first_timed_step():
  clock = FakeClock()
  planner = make_planner(clock)  # 600 s, 60 s kept before anything is measured
  clock.now += 20.0  # compiling
  assert not planner.after_step(1, 0.0)          # not timed yet: nothing fixed
  assert planner.plan.tolist() == [0, 0, 0]
  assert planner.after_step(3, 0.5)              # 520 s / 0.5 s = 1040 steps left
  assert planner.plan.tolist() == [round(0.1 * (3 + 1040)), 0, 0]
  assert not planner.after_step(4, 0.25)         # fixed once: a faster step changes nothing
  assert planner.plan[steps_lib.WARMUP] == 104


def test_planner_decays_over_the_steps_left_once_an_evaluation_measured_the_end():
  clock = FakeClock()
  planner = make_planner(clock)
  planner.after_step(3, 1.0)                     # warm-up fixed
  budget = planner.budget
  clock.now = 1000.0 + 300                       # 300 s left, 60 s kept: 240 steps of 1 s
  # Nothing measured the end yet: an evaluation is asked for once the steps
  # left are 2 x 0.3 of the run (240 <= 0.6 x (step + 240) from step 160 on).
  assert not planner.after_step(150, 1.0) and not planner.wants_evaluation
  assert not planner.after_step(170, 1.0) and planner.wants_evaluation
  clock.now = 1000.0 + 410                       # 190 s left: 130 steps, due from step 304
  assert not planner.after_step(330, 1.0) and planner.wants_evaluation
  assert planner.should_evaluate(330) and not planner.wants_evaluation
  budget.measured(save_seconds=1.0, eval_seconds=10.0, translate_seconds=4.0,
                  compile_seconds=4.0)
  # reserve: 1 save + 6 s evaluation + 5 margin = 12 s (the second planned
  # evaluation, at 2/3 of 600 s = 400 s, has passed): 178 steps left, more
  # than 0.3 of the run now that the end is known to cost less.
  assert not planner.after_step(330, 1.0) and not planner.wants_evaluation
  clock.now = 1000.0 + 460                       # 140 s left: 128 steps, 0.28 of the run
  assert planner.after_step(330, 1.0)
  assert planner.plan.tolist()[1:] == [330, 128]
  assert planner.total_steps() == 458 and not planner.finished(457) and planner.finished(458)
  # Checkpoints at each quarter of the decay (32 steps), its last step included.
  saved = [s for s in range(330, 520) if planner.should_save(s)]
  assert saved == [362, 394, 426, 458]
  assert planner.decay_checkpoints([100, 330, 362, 394, 426, 458]) == [362, 394, 426, 458]
  assert not planner.after_step(400, 0.1)        # fixed once


def test_planner_evaluates_evenly_in_time_and_counts_those_to_come():
  clock = FakeClock()
  planner = make_planner(clock, minutes=10.0)   # evaluations at 200 s and 400 s
  planner.budget.measured(eval_seconds=10.0, save_seconds=0.0)
  # reserve 10 + 5 = 15 s; two evaluations of 10 s to come: 600 - 15 - 20 = 565 s.
  assert planner.steps_left(1.0) == 565
  clock.now += 150
  assert not planner.should_evaluate(10)
  clock.now += 60                                # 210 s
  assert planner.should_evaluate(20) and not planner.should_evaluate(21)
  assert planner.steps_left(1.0) == 600 - 210 - 15 - 10
  clock.now += 200                               # 410 s
  assert planner.should_evaluate(30) and not planner.should_evaluate(31)
  # A resumed run does not repeat the evaluations whose time has passed.
  resumed = time_budget.BudgetPlanner(planner.budget, planner.plan, warmup_fraction=0.1,
                                      decay_fraction=0.3, eval_minutes=200 / 60)
  assert not resumed.should_evaluate(32)


class FakeEvaluator:
  """Validation metrics by which parameters are asked about: {"w": value}."""

  def __init__(self, bleu_of):
    self.bleu_of = bleu_of
    self.calls = []

  def __call__(self, params, step, *, averaged=False):
    value = float(np.asarray(params["w"]).mean())
    self.calls.append((value, averaged))
    return {"loss": 1.0, "bleu": self.bleu_of(value)}


@pytest.mark.parametrize("average_is_better,keep", [(True, "if_no_worse"),
                                                    (False, "if_no_worse"), (False, "always")])
def test_the_average_is_kept_only_when_validation_says_it_is_no_worse(tmp_path,
                                                                      average_is_better, keep):
  """Checkpoints of w = 1, 2, 3, 4: the average of the last three is 3, the
  last step 4. The evaluator scores 3 above or below 4; keep_average="always"
  keeps the average regardless (the paper's way)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with checkpoints.Checkpointer(str(tmp_path), keep=5, save_every=1) as ckpt:
    for step in (1, 2, 3, 4):
      state = {"params": {"w": np.full(4, float(step), np.float32)}, "step": np.int32(step)}
      ckpt.save(step, state, force=True)
    ckpt.wait()
    config = train_worker.tiny_config({"average_last": 3, "keep_checkpoints": 5,
                                       "keep_average": keep})
    evaluate = FakeEvaluator(lambda w: (50 - w) if average_is_better else w)
    params, metrics, choice = final_model.choose(
        config, str(tmp_path), ckpt, state, 4, mesh, evaluate, planner=None)
  assert [averaged for _, averaged in evaluate.calls] == [False, True]
  if average_is_better or keep == "always":
    assert float(np.asarray(params["w"]).mean()) == pytest.approx(3.0)
    assert "average of steps [2, 3, 4]" in choice
    assert metrics["bleu"] == (47 if average_is_better else 3)
    assert workdir_lib.resolve_checkpoint(str(tmp_path), "auto") == "averaged"
  else:
    assert float(np.asarray(params["w"]).mean()) == 4.0
    assert "the last step (4)" in choice and "worse" in choice
    assert workdir_lib.resolve_checkpoint(str(tmp_path), "auto") == 4  # no average saved


@pytest.mark.slow  # (~60 s on 2 cores)
def test_a_budget_run_records_its_plan_and_follows_it(tmp_path, compilation_cache):
  """A short budgeted run with the budget schedule: it fixes a warm-up and a
  decay, stops at the decay's end or the budget, logs learning rates that are
  budget_learning_rate of its recorded plan, and saves the plan with the
  state, so that a resumed run follows it."""
  config = train_worker.tiny_config({
      "num_train_steps": 10**6, "train_minutes": 1.0, "lr_schedule": "budget",
      "learning_rate": 3e-3, "log_every": 5, "num_bleu_examples": 8, "test_report": False,
      "checkpoint_every": 10**5, "average_last": 2, "keep_checkpoints": 3})
  result = training.train_and_evaluate(config, str(tmp_path), quiet=True)
  warmup, decay_start, decay_steps = result.schedule
  assert warmup > 0 and decay_steps > 0 and result.stopped_by_time
  assert result.step <= decay_start + decay_steps
  with checkpoints.Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.latest_step() == result.step
    restored, _ = ckpt.restore(jax.device_get(_abstract_state(config, tmp_path)))
  assert np.asarray(restored["schedule"]).tolist() == result.schedule
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rates = [(r["step"], r["learning_rate"]) for r in records if r["split"] == "train"]
  assert rates
  for step, rate in rates:  # (logged: the rate of the window's last update, step - 1)
    assert rate == pytest.approx(reference_rate(step - 1, *result.schedule, 3e-3), abs=1e-9)
  # Checkpoints at the decay's half and end (average_last=2), averaged and
  # compared with the last step: one of them is the final model.
  in_decay = [s for s in checkpoint_names.checkpoint_steps(tmp_path) if s > decay_start]
  assert in_decay[0] == decay_start + math.ceil(decay_steps / 2)
  assert in_decay[-1] == result.step
  assert any(r["split"] == "eval_averaged" for r in records)
  assert "the last step" in result.final_model or "the average of steps" in result.final_model


def _abstract_state(config, workdir):
  """A train state of `config`'s model, as a target to restore into."""
  from transformer.data import tokenizer as tokenizer_lib
  tokenizer = tokenizer_lib.load_tokenizer(str(workdir / "vocab.model"))
  model_config = run_setup.model_config_from(config, tokenizer.vocab_size)
  optimizer, _ = steps_lib.make_optimizer(config, model_config.d_model)
  state = steps_lib.create_train_state(model_config, optimizer, config.seed)
  return steps_lib.with_budget_plan(state)


def small_corpus_config(**overrides):
  from transformer.configs import small_corpus
  config = small_corpus.get_config()
  config.update(overrides)
  return config


class FakeStepTimes:
  """`step_seconds` for model_for_budget: seconds a step by d_model, and
  which widths were timed."""

  def __init__(self, seconds: dict[int, float]):
    self.seconds, self.timed = seconds, []

  def __call__(self, config, model_config) -> float:
    assert config.train_minutes and model_config.vocab_size == config.vocab_size
    self.timed.append((model_config.d_model, model_config.num_heads, model_config.d_ff))
    return self.seconds[model_config.d_model]


def test_model_for_budget_chooses_the_largest_size_whose_timed_steps_reach_enough(tmp_path):
  """small_corpus, 20 minutes: 0.75 x 1200 = 900 s of training; 700 steps
  need a step of at most 900 / 700 = 1.2857 s."""
  assert budget_model.MIN_BUDGET_STEPS == 700 and budget_model.TRAINING_SHARE == 0.75
  config = small_corpus_config(train_minutes=20.0)
  fast = FakeStepTimes({512: 1.3, 256: 1.28, 128: 0.5})   # 692 and 703 steps
  chosen = budget_model.model_for_budget(config, str(tmp_path), peak_flops=1e15,
                                         step_seconds=fast)
  assert (chosen.model.d_model, chosen.model.num_heads, chosen.model.d_ff) == (256, 4, 1024)
  assert fast.timed == [(512, 8, 2048), (256, 4, 1024)]   # the chosen one last: not 128
  slow = FakeStepTimes({512: 5.0, 256: 1.3, 128: 0.5})
  chosen = budget_model.model_for_budget(config, str(tmp_path), peak_flops=1e15,
                                         step_seconds=slow)
  assert (chosen.model.d_model, chosen.model.d_ff) == (128, 512)
  assert [t[0] for t in slow.timed] == [512, 256]          # the smallest is never timed
  roomy = FakeStepTimes({512: 1.2, 256: 0.3, 128: 0.1})
  assert budget_model.model_for_budget(config, str(tmp_path), peak_flops=1e15,
                                       step_seconds=roomy).model.d_ff == 2048
  assert config.model.d_model == 256  # (the caller's config is left as it was)
  # Twice the budget: twice the steps.
  longer = budget_model.model_for_budget(small_corpus_config(train_minutes=40.0), str(tmp_path),
                                         peak_flops=1e15, step_seconds=slow)
  assert longer.model.d_model == 256
  # No choice without "auto" or without a budget.
  assert budget_model.model_for_budget(small_corpus_config(model_for_budget=""), str(tmp_path),
                                       step_seconds=slow).model.d_model == 256
  assert budget_model.model_for_budget(small_corpus_config(train_minutes=0.0), str(tmp_path),
                                       step_seconds=slow).model.d_model == 256


def test_model_for_budget_does_not_time_a_size_the_peak_cannot_afford(tmp_path):
  """The step FLOPs by hand (64 x 64 tokens each side, vocabulary 8000,
  3 + 3 layers): 3 x (2 x 4096 x (3 x enc + 3 x dec + 3 x cross_kv + d x 8000)
  + 64 x 4 x d x 9 x 4096), where enc = 4d^2 + 2 d d_ff, dec = enc + 2d^2 and
  cross_kv = 2d^2. d_model 512: 656.32 GFLOP, so 700 steps in 900 s need a
  peak of 510.5 GFLOP/s; d_model 256: 192.87 GFLOP, 150.0 GFLOP/s."""
  def step_flops(d, d_ff):
    enc = 4 * d * d + 2 * d * d_ff
    return 3 * (2 * 4096 * (3 * enc + 3 * (enc + 2 * d * d) + 3 * 2 * d * d + d * 8000)
                + 64 * 4 * d * 9 * 4096)
  assert step_flops(512, 2048) / 1e9 == pytest.approx(656.32, abs=0.01)
  assert 700 * step_flops(512, 2048) / 900 / 1e9 == pytest.approx(510.5, abs=0.1)
  assert 700 * step_flops(256, 1024) / 900 / 1e9 == pytest.approx(150.0, abs=0.1)
  config = small_corpus_config(train_minutes=20.0)
  for peak, timed in ((511e9, [512, 256]), (510e9, [256]), (151e9, [256]), (149e9, [])):
    times = FakeStepTimes({512: 9.0, 256: 9.0, 128: 0.1})
    chosen = budget_model.model_for_budget(config, str(tmp_path), peak_flops=peak,
                                           step_seconds=times)
    assert [t[0] for t in times.timed] == timed, peak
    assert chosen.model.d_model == 128


def test_model_for_budget_keeps_the_workdirs_model_on_resume(tmp_path):
  config = small_corpus_config(train_minutes=20.0)
  slow = budget_model.model_for_budget(config, str(tmp_path), peak_flops=1e15,
                                       step_seconds=FakeStepTimes({512: 9, 256: 9, 128: 1}))
  workdir_lib.save_configs(str(tmp_path), slow.to_dict(),
                           run_setup.model_config_from(slow, 8000))
  # A resumed run on a faster machine keeps the model its checkpoints hold.
  never = FakeStepTimes({})
  resumed = budget_model.model_for_budget(config, str(tmp_path), peak_flops=1e15,
                                          step_seconds=never)
  assert (resumed.model.d_model, resumed.model.d_ff) == (128, 512)
  assert never.timed == []
  assert not workdir_lib.check_config(str(tmp_path), resumed.to_dict())


def test_timing_a_candidate_compiles_the_step_the_loop_then_reads_from_the_cache(
    compilation_cache):
  """time_training_step runs the loop's own step (jit_local_train_step, the
  same state layout and batch shape): the loop's compile of the chosen size
  is then a hit of the persistent compilation cache, not a second compile."""
  from transformer.decoding import executable_cache  # (it counts JAX's cache hits)
  config = small_corpus_config(train_minutes=20.0, vocab_size=64, batch_size=4,
                               max_length=8)
  config.model.update(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                      num_decoder_layers=1)
  model_config = run_setup.model_config_from(config, config.vocab_size)
  seconds = budget_model.time_training_step(config, model_config)
  assert 0 < seconds < 60
  # The loop's own calls (loop._run), with a batch of the loop's shapes.
  mesh = parallel.make_mesh()
  optimizer, schedule = steps_lib.make_optimizer(config, model_config.d_model)
  state, shardings = steps_lib.init_train_state(config, model_config, optimizer, mesh)
  step_fn = steps_lib.jit_local_train_step(config, model_config, optimizer, schedule, mesh,
                                           shardings)
  batch = budget_model._random_batch(config, model_config.vocab_size)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      k: ((1, 4, 8), np.int32) for k in ("inputs", "targets", "inputs_segment_ids",
                                         "targets_segment_ids", "inputs_positions",
                                         "targets_positions")}
  hits = executable_cache._persistent_cache_hits
  state, metrics = step_fn(state, batch)
  assert np.isfinite(float(metrics["loss"]))
  assert executable_cache._persistent_cache_hits == hits + 1


def test_a_test_split_that_cannot_fit_is_skipped_rather_than_overrun():
  clock = FakeClock()
  budget = time_budget.TimeBudget(1, test_tokens=2000, eval_tokens=100, test_cost=3.5,
                                  test_compile_cost=3.0, clock=clock)
  assert budget.test_fits()           # nothing measured: no reason to skip
  budget.measured(eval_seconds=12.0, translate_seconds=11.0, compile_seconds=10.0,
                  generated_tokens=100)
  # 2000 x 0.01 x 3.5 + 10 x 3 = 100 s of test: more than 60 s would allow.
  assert budget.test_seconds() == pytest.approx(100.0)
  assert not budget.test_fits()
  roomy = time_budget.TimeBudget(10, test_tokens=2000, eval_tokens=100, clock=clock)
  roomy.measured(eval_seconds=12.0, translate_seconds=11.0, compile_seconds=10.0,
                 generated_tokens=100)
  clock.now += 600 - 97                # 97 s left (+ 30 s of tolerance) for 100 s of test
  assert roomy.test_fits()
  clock.now += 40                      # 57 s left
  assert not roomy.test_fits()
