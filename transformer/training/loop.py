"""The training loop: `train_and_evaluate(config, workdir)` is what `python train.py` runs:

  data (config.data)  ->  SentencePiece vocabulary (<workdir>/vocab.model; run_setup.py)
  [->  token shards on disk, config.data.prepared (prepare.py; data/prepared.py)]
  ->  packed token batches (grain, one shard per process; data/pipeline.py)
  ->  the jitted train step over a device mesh (steps.py)
  ->  metrics (console, TensorBoard, metrics.jsonl; MFU: flops.py), periodic
      eval loss + BLEU + chrF (evaluation.py), a warning if the model is not
      learning (stall.py, through run_monitor.py)
  ->  orbax checkpoints (exact resume), average of the last N at the end
  ->  the report: test BLEU / chrF and translations, curves.png (report.py).

The loop ends at config.num_train_steps or, with config.train_minutes, in time
to save, average and evaluate within the budget (time_budget.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer.data import pipeline as data
from transformer.data import sources as data_sources
from transformer.data.tokenizer import available_cores
from transformer.model import attention_choice
from transformer.runtime import (averaging, checkpoints, multihost, parallel, preemption,
                                 run_lock, run_log)
from transformer.runtime import workdir as workdir_lib
from transformer.training import evaluation, final_model, report, run_monitor, run_setup
from transformer.training import budget_model, length_choice
from transformer.training import prepare as prepare_lib
from transformer.training import steps as steps_lib
from transformer.training import metrics as metrics_lib
from transformer.training import time_budget as time_budget_lib

logger = logging.getLogger(__name__)


class TrainingDiverged(FloatingPointError):
  """The loss became NaN or infinite; the run stopped, checkpoints are untouched."""


def _stack_micro_batches(it: Iterator[dict], num: int) -> dict[str, np.ndarray]:
  micro = [next(it) for _ in range(num)]
  return {key: np.stack([m[key] for m in micro]) for key in micro[0]}


@dataclasses.dataclass
class TrainResult:
  """What `train_and_evaluate` returns."""

  step: int
  train: dict[str, float]
  eval: dict[str, float]
  samples: list[tuple[str, str, str]]  # (source, reference, translation)
  workdir: str
  test: dict[str, float] = dataclasses.field(default_factory=dict)  # report.test_report
  minutes: float = 0.0          # training minutes, earlier runs of the workdir included
  stopped_by_time: bool = False  # the loop ended at config.train_minutes
  warnings: list[str] = dataclasses.field(default_factory=list)  # stall / warm-up
  final_model: str = ""         # which parameters were evaluated last, and why
  budget_minutes: float = 0.0   # config.train_minutes (0: none)
  schedule: list[int] | None = None  # a budget's plan: [warm-up, decay start, decay steps]


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       *, quiet: bool = False, train_pairs=None,
                       eval_pairs=None) -> TrainResult:
  """Trains `config` in `workdir`, resuming from its last checkpoint if any.

  `train_pairs` / `eval_pairs` (sequences of (source, target) strings) replace
  the data source of `config.data`, e.g. for sentence pairs held in memory.

  Before anything is written the workdir is held for this run
  (`run_lock.hold`) and, before anything is loaded or compiled, the config is
  compared with the one it was trained with (`workdir.check_config`); the
  run's log and a fatal error's traceback go to <workdir>/train.log.
  Raises (besides ValueError for a bad config): run_lock.WorkdirLocked,
  workdir.ConfigMismatch, disk_space.DiskFullError, TrainingDiverged.
  """
  started = time.monotonic()
  run_setup.check_train_config(config)
  path = workdir_lib.resolve(workdir)  # a local path made absolute, or gs://... as it is
  path.mkdir(parents=True, exist_ok=True)
  shared = multihost.workdirs_shared(path, config.get("shared_workdir", "auto"))
  if not shared and config.get("state_sharding", "replicated") == "fsdp":
    raise ValueError(
        f"config.state_sharding='fsdp' needs one workdir that every process sees (a shared"
        f" disk, gs://...): {workdir} is this process's own, and each checkpoint there would"
        f" hold only this process's slices. Give all processes a shared --workdir, or use"
        f" --config.state_sharding=replicated.")
  workdir = str(path)
  with contextlib.ExitStack() as stack:
    stack.enter_context(run_lock.hold(workdir, shared=shared))
    stack.enter_context(run_log.run_log(workdir))
    config = budget_model.model_for_budget(config, workdir)  # (timed: in the budget, logged)
    return _run(config, workdir, stack, quiet=quiet, train_pairs=train_pairs,
                eval_pairs=eval_pairs, started=started, shared=shared)


def _run(config, workdir: str, stack: contextlib.ExitStack, *, quiet: bool, train_pairs,
         eval_pairs, started: float, shared: bool = True) -> TrainResult:
  """`train_and_evaluate` in a held workdir: what it opens is closed by `stack`,
  on every way out (a checkpointer left open on an error would keep writing
  from its threads). `shared`: whether the processes share the workdir
  (`multihost.workdirs_shared`); if not, each keeps its own vocabulary,
  configs and checkpoints."""
  is_main = jax.process_index() == 0
  for name, stored, requested in workdir_lib.check_config(workdir, config.to_dict()):
    logger.info("config.%s: %s -> %s (allowed on resume)", name, stored, requested)

  use_prepared = bool(config.data.get("prepared", False))
  if train_pairs is None:  # (prepared: streamed, for the vocabulary and the check of the shards)
    train_pairs = (data_sources.stream_split(config.data, "train") if use_prepared
                   else data_sources.load_split(config.data, "train"))
  elif use_prepared:
    train_pairs = data_sources.stream_pairs(train_pairs)
  if eval_pairs is None:
    eval_pairs = data_sources.load_split(config.data, "eval")
  init_from = config.get("init_from", "")
  if init_from:  # (checked before its vocabulary is read)
    source_config = run_setup.load_init_from_config(config)
  tokenizer = run_setup.get_tokenizer(config, workdir, train_pairs, shared=shared)
  if use_prepared:  # token shards on disk instead of the text (training/prepare.py)
    train_pairs = prepare_lib.train_corpus(config, workdir, tokenizer, train_pairs,
                                           may_prepare=jax.process_count() == 1)
  if init_from:
    model_config = run_setup.init_from_model_config(config, source_config,
                                                    tokenizer.vocab_size)
  else:
    model_config = run_setup.model_config_from(config, tokenizer.vocab_size)
  logger.info("%s", attention_choice.attention_implementation_name(model_config))
  if is_main or not shared:
    workdir_lib.save_configs(workdir, config.to_dict(), model_config)

  mesh = parallel.make_mesh()
  optimizer, schedule = steps_lib.make_optimizer(config, model_config.d_model)
  state, state_shardings = steps_lib.init_train_state(config, model_config, optimizer, mesh)
  train_iter = _train_iterator(config, train_pairs, tokenizer)
  stack.callback(train_iter.close)
  ckpt = stack.enter_context(checkpoints.Checkpointer(
      workdir, keep=config.keep_checkpoints, save_every=config.checkpoint_every,
      per_process=not shared))
  state, start_step = _resume(ckpt, state, train_iter, workdir)
  if init_from and not start_step:
    state = _start_from(init_from, state)

  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
  stack.callback(writer.close)
  test_pairs = (data_sources.load_split(config.data, "test")
                if config.get("test_report", True) and data_sources.has_split(config.data, "test")
                else [])
  evaluate = evaluation.Evaluator(config, model_config, tokenizer, eval_pairs, mesh, writer,
                                  minutes=lambda: budget.spent() / 60)
  budget = _time_budget(config, ckpt, evaluate, test_pairs, started)
  planner = _budget_planner(config, state, budget)
  monitor = run_monitor.RunMonitor(config, model_config, tokenizer, train_pairs, budget)
  with preemption.PreemptionWatch() as watch:
    state, step, train_summary = _train_steps(
        state, start_step, config=config, workdir=workdir, watch=watch,
        step_fn=steps_lib.jit_local_train_step(config, model_config, optimizer, schedule,
                                               mesh, state_shardings),
        train_iter=train_iter, ckpt=ckpt, evaluate=evaluate, writer=writer, monitor=monitor,
        planner=planner,
        progress=metrics_lib.progress_bar(start_step, config.num_train_steps,
                                          enabled=is_main and not quiet,
                                          budgeted=budget.enabled))

  final_params, eval_summary, final_choice = final_model.choose(
      config, workdir, ckpt, state, step, mesh, evaluate, planner)
  test_summary, fits = {}, budget.test_fits()
  length_penalty = length_choice.tuned(config, evaluate, final_params, workdir, fits=fits)
  if test_pairs and not fits:
    logger.warning(
        "The test split's translation (about %.0f s) does not fit in the %.0f s the budget "
        "has left: skipped, so that the run ends within config.train_minutes=%g. Translate it "
        "with decode.py --workdir=%s, or give the run more minutes.", budget.test_seconds(),
        max(0.0, budget.remaining()), budget.seconds / 60, workdir)
  elif test_pairs:
    method = config.get("test_decode_method", "beam")
    test_summary = report.test_report(evaluate.translator(final_params), test_pairs, workdir,
                                      method=method, beam_size=config.eval_beam_size,
                                      length_penalty=length_penalty)
    writer.write(step, dict(test_summary, minutes=budget.spent() / 60), prefix="test")
    logger.info(report.format_test(test_summary, method))
  if is_main:
    report.save_curves(workdir)
  if budget.enabled:
    logger.info("The run took %.1f of its %g minutes.", budget.spent() / 60, budget.seconds / 60)
  return TrainResult(step=step, train=train_summary, eval=eval_summary,
                     samples=evaluate.samples, workdir=workdir, test=test_summary,
                     minutes=budget.spent() / 60, stopped_by_time=monitor.stopped_by_time,
                     warnings=monitor.warnings, final_model=final_choice,
                     budget_minutes=budget.seconds / 60,
                     schedule=None if planner is None else planner.plan.tolist())


def _start_from(source: str, state: dict) -> dict:
  """`state` with the parameters of the workdir `source` (its "auto"
  checkpoint), laid out as `state`'s own, and its fresh optimizer: fine-tuning."""
  model = workdir_lib.read(source, "auto")
  params, info = averaging.load_params(str(model.path), state["params"],
                                       which=model.checkpoint, with_info=True)
  logger.info("Starting from the parameters of %s (%s), with a fresh optimizer.", source,
              f"averaged steps {info['averaged_steps']}" if info["kind"] == "averaged"
              else f"step {info['step']}")
  return dict(state, params=params)


def _time_budget(config, ckpt: checkpoints.Checkpointer, evaluate: evaluation.Evaluator,
                 test_pairs, started: float) -> time_budget_lib.TimeBudget:
  """config.train_minutes as a TimeBudget, counting from `started` (this run's
  start, time.monotonic) plus the seconds the latest checkpoint records."""
  spent = 0.0
  if ckpt.latest_step():
    spent = float(ckpt.restore_metadata().get(time_budget_lib.SPENT_KEY, 0.0))
  minutes = config.get("train_minutes", 0.0)
  if not minutes:  # (no budget: the minutes spent are still recorded)
    return time_budget_lib.TimeBudget(0.0, spent + (time.monotonic() - started))
  cost = time_budget_lib.decode_cost
  test_method = config.get("test_decode_method", "beam")
  averaging, tuning = config.average_last > 1, config.get("length_penalty_candidates", ())
  return time_budget_lib.TimeBudget(
      minutes, spent + (time.monotonic() - started),
      test_tokens=(evaluate.reference_tokens(test_pairs) if test_pairs else 0)
      + len(tuning) * evaluate.reference_tokens(),  # (+ the length penalties' searches)
      eval_tokens=evaluate.reference_tokens(),
      test_cost=cost(test_method) / cost(config.eval_decode_method),
      test_compile_cost=(time_budget_lib.TEST_COMPILE_COST if test_pairs else 0)
      + (time_budget_lib.TUNING_COMPILE_COST if tuning else 0),
      final_evaluations=2 if averaging else 1,
      checkpoints_to_average=config.average_last if averaging else 0)


def _budget_planner(config, state: dict, budget) -> time_budget_lib.BudgetPlanner | None:
  """The planner of config.lr_schedule="budget" (None for the paper's
  schedule), starting from the plan in `state` (a resumed run's)."""
  if "schedule" not in state:
    return None
  return time_budget_lib.BudgetPlanner(
      budget, np.asarray(jax.device_get(state["schedule"])),
      warmup_fraction=config.warmup_fraction, decay_fraction=config.decay_fraction,
      eval_minutes=config.budget_eval_minutes, checkpoints_in_decay=max(1, config.average_last))


def _train_iterator(config, train_pairs, tokenizer):
  """This process's shard of the training data, packed into token batches."""
  process_index, process_count = parallel.process_info()
  workers = data_workers(config)
  if workers:
    logger.info("Training batches are built in %d grain worker processes.", workers)
  return data.train_iterator(
      train_pairs, tokenizer, batch_size=config.batch_size // process_count,
      max_length=config.max_length, seed=config.seed, shard_index=process_index,
      shard_count=process_count, pack=config.pack, workers=workers)


def data_workers(config) -> int:
  """config.data.workers, with -1 ("auto") resolved: on GPUs / TPUs 4 worker
  processes per local accelerator, leaving one core for the training loop
  (one core packs ~0.6 of what an H100 trains transformer-base on:
  docs/benchmarks.md); 0 on a CPU, whose cores train the model."""
  workers = int(config.data.get("workers", 0))
  if workers != -1:
    return workers
  if jax.default_backend() == "cpu":
    return 0
  return max(0, min(4 * jax.local_device_count(), available_cores() - 1))


def _resume(ckpt: checkpoints.Checkpointer, state: dict, train_iter, workdir: str):
  """(state, step) of the last checkpoint, the data position restored with
  it; (state, 0) as given when there is none."""
  start_step = ckpt.latest_step() or 0
  if start_step:
    state, data_state = ckpt.restore(state)
    if data_state is not None:
      data.check_position_workers(data_state, getattr(train_iter, "workers", 0))
      train_iter.set_state(data_state)
    logger.info("Resumed from step %d in %s", start_step, workdir)
  return state, start_step


def _train_steps(state: dict, step: int, *, config, workdir: str, step_fn, train_iter,
                 ckpt: checkpoints.Checkpointer, evaluate: evaluation.Evaluator,
                 writer: metrics_lib.MetricsWriter, monitor: run_monitor.RunMonitor,
                 progress, watch: preemption.PreemptionWatch | None = None,
                 planner: time_budget_lib.BudgetPlanner | None = None,
                 ) -> tuple[dict, int, dict]:
  """Trains from `step` to `config.num_train_steps`, or until the time budget
  (`monitor.budget`) leaves only what the end of the run needs: metrics every
  `log_every` steps (with MFU; the monitor's warnings printed), evaluation
  every `eval_every`, a checkpoint every `checkpoint_every` and at the end.
  Returns (state, step, the last train metrics) once the last checkpoint is
  complete.

  Never loses work: interrupted (KeyboardInterrupt), it saves what was trained
  so far (if it is sane) before stopping; on any other error the caller's
  `ckpt.close()` lets a save in flight finish. A NaN/inf loss raises
  TrainingDiverged without saving. On a preemption notice (`watch`, asked
  after every step; runtime/preemption.py) it skips that step's evaluation,
  saves the step, waits for the checkpoint and raises preemption.Preempted.

  With a budget `planner` (config.lr_schedule="budget") the first updates
  are timed, the plan it fixes goes into the state, evaluations and the
  decay's checkpoints follow it, and the loop ends when its decay does.
  """
  train_summary: dict[str, float] = {}
  window, window_start, last_log_step = None, time.perf_counter(), step
  metrics = None
  budget = monitor.budget
  step_seconds = 0.0  # of the last logging window, per step
  timer = time_budget_lib.FirstStepsTimer() if planner is not None else None

  def save(force=False):
    _check_finite(float(metrics["loss"]), step, ckpt, workdir)
    start = time.perf_counter()
    # A run stopped by its budget has spent it all (what it kept for its end
    # included): run again with the same budget, it trains no further.
    spent = budget.seconds if monitor.stopped_by_time else budget.spent()
    ckpt.save(step, state, data_state=train_iter.get_state(), force=force,
              metadata={time_budget_lib.SPENT_KEY: spent})
    budget.measured(save_seconds=time.perf_counter() - start)

  try:
    if budget.should_stop(0.0):
      monitor.stopped_by_time = True
      logger.info("The time budget (config.train_minutes=%g) is spent: no more steps.",
                  budget.seconds / 60)
    elif planner is not None and planner.finished(step):
      monitor.stopped_by_time = True
      logger.warning(
          "The learning rate's decay ended at step %d, which this workdir reached: a larger "
          "config.train_minutes trains no further with lr_schedule=budget. To train on, "
          "fine-tune from it in a new workdir (--config.init_from=%s).", step, workdir)
    while step < config.num_train_steps and not monitor.stopped_by_time:
      state, metrics = step_fn(state, _stack_micro_batches(train_iter, config.grad_accum_steps))
      step += 1
      if planner is not None:
        step_seconds = step_seconds or timer.after_step(metrics)
        if planner.after_step(step, step_seconds):
          state = dict(state, schedule=jax.device_put(planner.plan.astype(np.int32),
                                                      state["schedule"].sharding))
          progress.write(time_budget_lib.plan_message(planner, step, step_seconds))
      if planner is not None and planner.finished(step):
        monitor.stopped_by_time = True
        progress.write(f"step {step}: the learning rate's decay has ended (config.train_"
                       f"minutes={budget.seconds / 60:g}); {budget.reserve_seconds():.0f} s "
                       "kept to save, average and evaluate.")
      elif budget.should_stop(step_seconds):
        monitor.stopped_by_time = True
        progress.write(f"step {step}: stopping for the time budget "
                       f"(config.train_minutes={budget.seconds / 60:g}); "
                       f"{budget.reserve_seconds():.0f} s kept to save, average and evaluate.")
      last = step == config.num_train_steps or monitor.stopped_by_time
      preempted = watch is not None and watch.reached(step)
      window = metrics if window is None else jax.tree_util.tree_map(jnp.add, window, metrics)
      progress.update(1)
      if step % config.log_every == 0 or last or preempted:
        window = jax.device_get(window)
        _check_finite(float(window["loss"]), step, ckpt, workdir)
        train_summary = _train_summary(window, metrics, time.perf_counter() - window_start,
                                       step - last_log_step)
        step_seconds = 1.0 / train_summary["steps_per_second"]
        train_summary.update(mfu=monitor.mfu(train_summary["steps_per_second"]),
                             minutes=budget.spent() / 60)
        if budget.enabled:  # (the bar's total: the steps the budget affords)
          metrics_lib.set_progress_total(progress, time_budget_lib.estimated_total(
              planner, budget, step, step_seconds, config.num_train_steps))
        writer.write(step, train_summary, prefix="train")
        postfix = dict(loss=f"{train_summary['loss']:.3f}",
                       acc=f"{train_summary['accuracy']:.3f}", mfu=f"{train_summary['mfu']:.0%}")
        if budget.enabled:  # (the budget's own clock: evaluations and the end included)
          postfix["left"] = f"{max(0.0, budget.remaining()) / 60:.1f} min"
        progress.set_postfix(**postfix)
        for warning in monitor.after_log(step, train_summary):
          logger.warning("%s", warning)  # (the console and train.log)
        window, window_start, last_log_step = None, time.perf_counter(), step
      due = (planner.should_evaluate(step) if planner is not None
             else step % config.eval_every == 0)
      if due and not last and not preempted:
        eval_start = time.perf_counter()
        progress.write(metrics_lib.format_eval(step, evaluate(state["params"], step)))
        logger.info("The evaluation took %.1f s (%.1f s compiling; %.3f s a sentence).",
                    evaluate.seconds, evaluate.compile_seconds, evaluate.seconds_per_sentence)
        budget.measured(eval_seconds=evaluate.seconds, compile_seconds=evaluate.compile_seconds,
                        translate_seconds=evaluate.translate_seconds,
                        generated_tokens=evaluate.generated_tokens)
        # (the logging window's speed leaves the evaluation out, not its steps)
        window_start += time.perf_counter() - eval_start
      in_decay = planner is not None and planner.should_save(step)  # (to average)
      if ckpt.should_save(step) or last or preempted or in_decay:
        save(force=last or preempted or in_decay)
      if preempted:
        break
  except KeyboardInterrupt:
    if metrics is not None and step > (ckpt.latest_step() or 0):
      progress.write(f"Interrupted: saving a checkpoint at step {step} ...")
      save(force=True)
    raise
  finally:
    progress.close()
  ckpt.wait()
  if watch is not None and (watch.reason or watch.signalled):
    # (Also SIGTERM during the last step's save: the steps are all saved, but the
    # scheduler wants the machine now; the next run averages and evaluates.)
    raise preemption.Preempted(step, ckpt.directory, watch.reason or "SIGTERM")
  return state, step, train_summary


def _train_summary(window: dict, metrics: dict, seconds: float, steps: int) -> dict[str, float]:
  """The train metrics of a logging window: per-token averages of its summed
  metrics, the last step's learning rate and gradient norm, and speeds."""
  summary = steps_lib.summarize_sums(window)
  summary.update(learning_rate=float(metrics["learning_rate"]),
                 grad_norm=float(metrics["grad_norm"]),
                 tokens_per_second=float(window["weight"]) / max(seconds, 1e-9),
                 steps_per_second=steps / max(seconds, 1e-9))
  return summary


def _check_finite(loss: float, step: int, ckpt: checkpoints.Checkpointer, workdir: str) -> None:
  """Raises TrainingDiverged, naming the last good checkpoint, if `loss` is NaN or inf."""
  if math.isfinite(loss):
    return
  # An async save of an earlier (finite) step may still be in flight: let it
  # commit, so that the checkpoint named below exists when we stop.
  ckpt.wait()
  last = ckpt.latest_step()
  raise TrainingDiverged(
      f"The training loss became {loss} at step {step}. Stopped without saving; the "
      f"last good checkpoint is {'step %d' % last if last else 'none'} in "
      f"{os.path.join(workdir, checkpoints.CHECKPOINT_DIR)}. Lower the learning rate "
      "(--config.learning_rate_scale), lengthen warm-up (--config.warmup_steps) or "
      "set --config.grad_clip_norm, then run again: training resumes from there.")
