"""The model's width for a time budget, chosen by timing its training step.

config.model_for_budget="auto" (the small-corpus recipe's): of BUDGET_MODELS,
largest first, the first whose measured step leaves MIN_BUDGET_STEPS in
TRAINING_SHARE of config.train_minutes. On a slow machine a smaller model
that takes more steps learns more in the same minutes (gettext-en-fr, two
cores: d_model 128 at 1,042 steps reached 47.6 test BLEU in 20 minutes
where d_model 256 at 725 steps reached 46.5 in 10 minutes on a faster CPU;
docs/benchmarks.md).

A candidate is timed, not estimated: an estimate from the matmul peak at a
fixed MFU was 1.4-2.8x too pessimistic on one CPU and 1.1x too optimistic on
another (a step's MFU ranges 38-75% with the CPU and the width). Timing a
candidate costs its compile and three steps (about 15 s for d_model 256 on a
2-core CPU); the chosen one's compile is then read back from the persistent
compilation cache by the loop. A candidate that could not reach
MIN_BUDGET_STEPS even at the full matmul peak is not timed, so a short
budget on a slow machine pays nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import jax
import numpy as np
from etils import epath

from transformer.model.config import TransformerConfig
from transformer.runtime import multihost, parallel
from transformer.runtime import workdir as workdir_lib
from transformer.training import flops, run_setup
from transformer.training import steps as steps_lib

logger = logging.getLogger(__name__)

# Largest first. d_model 512 is the paper's base width (3 + 3 layers here, as
# config.model has them): a GPU or a long budget scales up to it.
BUDGET_MODELS = (dict(d_model=512, num_heads=8, d_ff=2048),
                 dict(d_model=256, num_heads=4, d_ff=1024),
                 dict(d_model=128, num_heads=4, d_ff=512))
MIN_BUDGET_STEPS = 700
TRAINING_SHARE = 0.75   # of the budget that trains (the rest: setup, evaluations, the end)
TIMED_STEPS = 3         # after the compiling one; the fastest counts


def model_for_budget(config, workdir: str, *, peak_flops: float | None = None,
                     step_seconds: Callable[[object, TransformerConfig], float] | None = None,
                     candidates=BUDGET_MODELS):
  """`config` with config.model's size chosen for its time budget when
  config.model_for_budget is "auto" (else `config` as it is): the workdir's
  model when it has one (a resumed run), otherwise the first of `candidates`
  whose step, timed by `step_seconds(config, model_config)` (default
  `time_training_step`), leaves at least MIN_BUDGET_STEPS in TRAINING_SHARE
  of config.train_minutes; the last if none does. A candidate whose steps at
  `peak_flops` (default `flops.peak_flops()`, measured on a CPU) fall short
  is not timed. The choice and its numbers are logged (train.log) and the
  sizes recorded with the run's config."""
  if config.get("model_for_budget", "") != "auto" or not config.get("train_minutes"):
    return config
  config = config.copy_and_resolve_references()
  fields = ("d_model", "num_heads", "d_ff")
  if epath.Path(workdir, workdir_lib.MODEL_CONFIG_FILE).exists():
    stored = workdir_lib.load_model_config(workdir)
    config.model.update({name: getattr(stored, name) for name in fields})
    return config
  if peak_flops is None:
    peak_flops, _ = flops.peak_flops()
  step_seconds = step_seconds or time_training_step
  seconds = float(config.train_minutes) * 60 * TRAINING_SHARE
  rows = config.batch_size * config.grad_accum_steps
  chosen, notes = len(candidates) - 1, []
  for index, size in enumerate(candidates[:-1]):
    model = run_setup.model_config_from(config, config.vocab_size).replace(**size)
    step_flops = flops.training_flops_per_step(model, rows, config.max_length,
                                               config.max_length)
    at_peak = int(seconds * peak_flops / step_flops)
    if at_peak < MIN_BUDGET_STEPS:
      notes.append(f"d_model {size['d_model']}: at most {at_peak} steps at the peak, not timed")
      continue
    measured = step_seconds(config, model)
    # Every process builds the same model: process 0's measurement decides.
    measured = float(multihost.broadcast_bytes(
        repr(measured).encode() if jax.process_index() == 0 else None).decode())
    steps = int(seconds / measured)
    notes.append(f"d_model {size['d_model']}: {measured:.3f} s a step, {steps} steps")
    if steps >= MIN_BUDGET_STEPS:
      chosen = index
      break
  size = candidates[chosen]
  config.model.update(size)
  logger.info("config.model_for_budget=auto: %g minutes (%.0f s of training) at this machine's "
              "%.0f GFLOP/s peak: %s. Chosen: d_model %d, %d heads, d_ff %d (the largest with "
              "at least %d steps, else the smallest; config.json records it).",
              config.train_minutes, seconds, peak_flops / 1e9, "; ".join(notes) or "-",
              size["d_model"], size["num_heads"], size["d_ff"], MIN_BUDGET_STEPS)
  return config


def time_training_step(config, model_config: TransformerConfig) -> float:
  """Seconds of one training step of `model_config` as the loop runs it (the
  same jitted step, state layout and batch shape, on this process's share of
  a batch of random tokens): compiled, then the fastest of TIMED_STEPS.
  Every process must call it together (the step spans them all)."""
  mesh = parallel.make_mesh()
  optimizer, schedule = steps_lib.make_optimizer(config, model_config.d_model)
  state, shardings = steps_lib.init_train_state(config, model_config, optimizer, mesh)
  step_fn = steps_lib.jit_local_train_step(config, model_config, optimizer, schedule, mesh,
                                           shardings)
  batch = _random_batch(config, model_config.vocab_size)
  state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)
  fastest = float("inf")
  for _ in range(TIMED_STEPS):
    start = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    fastest = min(fastest, time.perf_counter() - start)
  return fastest


def _random_batch(config, vocab_size: int) -> dict[str, np.ndarray]:
  """This process's `[accumulation, rows, max_length]` batch: random tokens
  filling every position, one sentence a row (a packed row costs the same)."""
  rows = config.batch_size // jax.process_count()
  shape = (config.grad_accum_steps, rows, config.max_length)
  tokens = np.random.default_rng(0).integers(4, vocab_size, (2,) + shape, dtype=np.int32)
  positions = np.broadcast_to(np.arange(config.max_length, dtype=np.int32), shape).copy()
  ones = np.ones(shape, np.int32)
  return {"inputs": tokens[0], "targets": tokens[1], "inputs_segment_ids": ones,
          "targets_segment_ids": ones.copy(), "inputs_positions": positions,
          "targets_positions": positions.copy()}
