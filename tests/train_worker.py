"""Helpers for tests/test_training.py and tests/test_train_cli.py, and a worker
that runs `training.train_and_evaluate` in its own process:

    python tests/train_worker.py --workdir=DIR --overrides='{"num_train_steps": 4}' \
        [--num_cpu_devices=8] [--num_processes=2 --process_id=0 --port=12345] \
        [--out=result.json] [--kill='{"phase": "save", "nth": 1, "delay": 0.01}']

JAX fixes its devices when the backend starts, so runs with 8 simulated CPU
devices, or with several processes, need a process of their own. The worker
writes the `TrainResult` (step, train/eval summaries) as JSON to --out; the
tests read the params from the workdir's checkpoint. With --kill it SIGKILLs
itself in the middle of a phase of the run (`arm_kill`), for the soak test.
Stopped by a preemption notice, it writes {"preempted_at": step, "reason"}
and exits with status 143, as train.py does.

Importing this module does not import JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

# A tiny model and data set: compiles in seconds and trains ~20 steps/s on a CPU.
TINY_OVERRIDES: dict[str, Any] = {
    "data.demo_num_train": 1000,
    "data.demo_num_eval": 64,
    "data.demo_num_test": 8,
    "test_report": False,   # on in the tests of the report (it decodes the test split)
    "vocab_size": 128,
    "batch_size": 16,
    "max_length": 32,
    "model.d_model": 32,
    "model.num_heads": 2,
    "model.d_ff": 64,
    "model.num_encoder_layers": 1,
    "model.num_decoder_layers": 1,
    "model.max_len": 64,
    "warmup_steps": 50,
    "learning_rate_scale": 2.0,
    "log_every": 5,
    "eval_every": 1_000_000,
    "eval_batch_size": 32,
    "num_eval_examples": 32,
    "num_bleu_examples": 0,
    "checkpoint_every": 1_000_000,
    "keep_checkpoints": 3,
    "average_last": 1,
}


def tiny_config(overrides: dict[str, Any] | None = None):
  """configs/default.py with TINY_OVERRIDES, then `overrides` ("a.b" keys)."""
  from transformer.configs import default
  config = default.get_config()
  config.update_from_flattened_dict(dict(TINY_OVERRIDES))
  if overrides:
    config.update_from_flattened_dict(dict(overrides))
  return config


def config_file_text(overrides: dict[str, Any] | None = None) -> str:
  """Source of a config file for `train.py --config=<file>` giving tiny_config(overrides)."""
  merged = dict(TINY_OVERRIDES)
  merged.update(overrides or {})
  return (
      "import sys\n"
      f"sys.path.insert(0, {REPO!r})\n"
      "from transformer.configs import default\n\n"
      "def get_config():\n"
      "  config = default.get_config()\n"
      f"  config.update_from_flattened_dict({merged!r})\n"
      "  return config\n")


def eval_loss_sums(vocab_path: str, overrides: dict[str, Any]) -> dict[str, float]:
  """`Evaluator.loss_sums` of the tiny model at its initial parameters (seed
  0) on the validation pairs of tiny_config(overrides), with the vocabulary
  at `vocab_path`, over this process's devices (and with several processes,
  all of theirs): the split evaluation's test compares one process with two."""
  import jax
  from transformer.data import sources
  from transformer.data import tokenizer as tokenizer_lib
  from transformer.model.transformer import init_params
  from transformer.runtime import parallel
  from transformer.training import evaluation, run_setup
  config = tiny_config(overrides)
  tokenizer = tokenizer_lib.load_tokenizer(vocab_path)
  model_config = run_setup.model_config_from(config, tokenizer.vocab_size)
  params = init_params(model_config, jax.random.key(0))
  evaluator = evaluation.Evaluator(config, model_config, tokenizer,
                                   sources.load_split(config.data, "eval"),
                                   parallel.make_mesh(), writer=None)
  return evaluator.loss_sums(params)


KILL_PHASES = ("step", "save", "eval", "average")


def arm_kill(phase: str, nth: int, delay: float) -> None:
  """Makes this process SIGKILL itself in the `nth` occurrence (from 1) of
  `phase` of the training run, `delay` seconds into it:
    step     a train step dispatched (its computation in flight);
    save     an orbax save half-way: its background thread, writing the data
             state while the arrays are written, in `<step>.orbax-checkpoint-tmp`;
    eval     an evaluation (`Evaluator.__call__`), at its end at the latest;
    average  the averaging of the last checkpoints (reading them, writing
             the average), at its end at the latest.
  """
  import signal
  import threading
  import time
  from transformer.runtime import averaging
  from transformer.runtime import orbax_items
  from transformer.training import evaluation, steps as steps_lib
  assert phase in KILL_PHASES, phase
  seen = [0]

  def due() -> bool:
    seen[0] += 1
    return seen[0] == nth

  def kill():
    os.kill(os.getpid(), signal.SIGKILL)

  if phase == "step":
    make_step_fn = steps_lib.jit_local_train_step

    def jit_train_step(*args, **kwargs):
      step_fn = make_step_fn(*args, **kwargs)

      def step(state, batch):
        out = step_fn(state, batch)
        if due():
          time.sleep(delay)
          kill()
        return out
      return step
    steps_lib.jit_local_train_step = jit_train_step
  elif phase == "save":
    save_fn = orbax_items.ProcessJsonCheckpointHandler._save_fn

    async def save_data_state(self, text, directory):
      if due():
        time.sleep(delay)
        kill()
      return await save_fn(self, text, directory)
    orbax_items.ProcessJsonCheckpointHandler._save_fn = save_data_state
  else:
    owner, name = {"eval": (evaluation.Evaluator, "__call__"),
                   "average": (averaging, "save_averaged")}[phase]
    original = getattr(owner, name)

    def killed_within(*args, **kwargs):
      if not due():
        return original(*args, **kwargs)
      threading.Timer(delay, kill).start()
      original(*args, **kwargs)
      kill()
    setattr(owner, name, killed_within)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--overrides", default="{}", help="JSON dict of 'a.b' config overrides")
  parser.add_argument("--num_cpu_devices", type=int, default=None)
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--out", default=None)
  parser.add_argument("--kill", default=None,
                      help='JSON {"phase", "nth", "delay"}: SIGKILL in that phase (arm_kill)')
  args = parser.parse_args()

  from transformer.runtime import parallel
  if args.num_processes > 1:
    assert parallel.maybe_initialize_distributed(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
        process_id=args.process_id, num_cpu_devices=args.num_cpu_devices,
        initialization_timeout=60)
  else:
    assert not parallel.maybe_initialize_distributed(num_cpu_devices=args.num_cpu_devices)

  import jax
  from transformer.training import loop as training
  if args.kill:
    arm_kill(**json.loads(args.kill))
  from transformer.runtime import preemption
  config = tiny_config(json.loads(args.overrides))
  try:
    result = training.train_and_evaluate(config, args.workdir, quiet=True)
  except preemption.Preempted as e:   # (as train.py: the step saved, then 143)
    if args.out:
      with open(args.out, "w") as f:
        json.dump({"preempted_at": e.step, "reason": e.reason}, f)
    sys.exit(preemption.PREEMPTED_EXIT_STATUS)
  out = {"step": result.step, "train": result.train, "eval": result.eval,
         "process_index": jax.process_index(), "process_count": jax.process_count(),
         "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f)
  if args.num_processes > 1:
    parallel.shutdown_distributed()


if __name__ == "__main__":
  main()
