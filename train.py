"""Train the Transformer.

    python train.py                                   # the embedded demo (CPU, minutes)
    python train.py --config=configs/wmt14_base.py --workdir=runs/base \
        --config.num_train_steps=100000
    python train.py --config.model.d_model=256 --config.batch_size=128   # any field

Running again with the same --workdir resumes from its last checkpoint.
A fatal error prints one line; the full traceback is in <workdir>/train.log.
On SIGTERM (a scheduler's preemption notice) it saves a checkpoint and exits
with status 143 (128 + SIGTERM); run the same command again to resume.
"""

import logging
import os
import re
import sys
import traceback

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags


def _exit_if_unknown_config_field(error: Exception) -> None:
  """ml_collections raises a bare AttributeError/KeyError (a traceback) for
  --config.<field>=... naming a field the config lacks: say which, in one line."""
  text = str(error).replace("\\n", "\n").replace("\\", "")
  key = re.search(r"'([^'\n]+)'", text)
  options = [arg.split("=", 1)[0] for arg in sys.argv[1:]
             if re.match(r"--?(no)?config\.", arg) and key
             and key.group(1) in re.split(r"[.=]", arg.split("=", 1)[0])[1:]]
  if not options:
    return  # not an unknown override: let the error through
  suggestion = re.search(r'Did you mean "([^"]+)"', text)
  print(f"error: {options[0]}: the config has no field {key.group(1)!r}"
        + (f" (did you mean {suggestion.group(1)!r}?)" if suggestion else "."),
        file=sys.stderr)
  sys.exit(1)


try:  # (without --config on the command line, overrides are applied right here)
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"),
      "Training configuration file (configs/*.py); override fields with --config.<field>=...")
except (AttributeError, KeyError) as e:
  _exit_if_unknown_config_field(e)
  raise

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for the vocabulary, checkpoints and metrics "
    "(default: runs/demo for the demo, runs/<config name> otherwise).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Multi-host: host:port of process 0 (or $JAX_COORDINATOR_ADDRESS). Not needed in a "
    "Slurm job step of several tasks, an Open MPI job or a Cloud TPU pod slice: JAX finds "
    "the processes itself (--num_processes=1 runs one alone there).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-host: number of processes (or $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index (or $JAX_PROCESS_ID).")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress bar.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "Directory of JAX's persistent compilation cache, or 'off' "
    "(default: $TRANSFORMER_COMPILATION_CACHE or ~/.cache/transformer/jax).")


def _no_library_errors(record: logging.LogRecord) -> bool:
  """The console's filter: no error records of libraries (orbax logs, with
  tracebacks, what fails in its background threads, then raises it in ours);
  train.py reports that error in one line, and the run's log keeps them all."""
  return record.levelno < logging.ERROR or record.name.startswith("transformer")


def _user_error_message(error: Exception, workdir: str) -> str | None:
  """The console's message for an error a user can meet and fix (its words
  say what to do); None for anything else, a bug."""
  from transformer.runtime import disk_space
  from transformer.runtime import run_lock
  from transformer.training import loop as training
  if not isinstance(error, disk_space.DiskFullError) and disk_space.is_disk_full(error):
    return (f"the disk is full ({error}). Free space on the disk of {workdir}, then run "
            "the same command again: training resumes from its last checkpoint.")
  expected = (ValueError, FileNotFoundError, training.TrainingDiverged,
              run_lock.WorkdirLocked, disk_space.DiskFullError)
  if isinstance(error, expected):
    return str(error)
  if isinstance(error, OSError) and error.filename:  # e.g. a workdir that cannot be made
    return (f"{error.filename}: {error.strerror or error}; check the path and its "
            f"permissions (--workdir={workdir})")
  return None


def _report_bug(error: Exception, workdir: str) -> str:
  """The console's message for a bug: where its traceback is, or, when the
  run failed before writing its log, the traceback itself (printed here)."""
  from transformer.runtime import run_log
  from transformer.runtime import workdir as workdir_lib
  log = run_log.log_path(str(workdir_lib.resolve(workdir)))
  if os.path.exists(log):
    where = f"; the full traceback is in {log}"
  else:
    traceback.print_exc()
    where = ""
  return f"{type(error).__name__}: {error}{where} (include it in a bug report)"


def default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path))[0]
  return os.path.join("runs", "demo" if name == "default" else name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from transformer.runtime import compile_cache, multihost, xla_flags
  # orbax logs every save at INFO; keep the console for our own messages.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("transformer").setLevel(logging.INFO)
  try:  # $XLA_FLAGS before JAX starts (XLA stops a process on a flag it lacks); the hosts
    xla_flags.check_environment(compile_cache.chosen_directory(_COMPILATION_CACHE.value))
    multihost.start_processes(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  from transformer.runtime import preemption
  from transformer.training import loop as training

  compile_cache.enable(_COMPILATION_CACHE.value)
  absl_logging.get_absl_handler().addFilter(_no_library_errors)
  config_path = flags.FLAGS["config"].config_filename
  workdir = _WORKDIR.value or default_workdir(config_path)
  try:
    result = training.train_and_evaluate(_CONFIG.value, workdir, quiet=_QUIET.value)
  except KeyboardInterrupt:
    print(f"\nInterrupted. Run the same command again to resume from {workdir}.",
          file=sys.stderr)
    return 130
  except preemption.Preempted as e:  # (a scheduler's SIGTERM: saved, then 128 + SIGTERM)
    print(f"\n{e}.", file=sys.stderr)
    return preemption.PREEMPTED_EXIT_STATUS
  except Exception as e:  # one line; the traceback is in the run's log
    message = _user_error_message(e, workdir) or _report_bug(e, workdir)
    print(f"error: {message}", file=sys.stderr)
    return 1
  ev = result.eval
  stopped = " (stopped by --config.train_minutes)" if result.stopped_by_time else ""
  budget = f" of a {result.budget_minutes:g}-minute budget" if result.budget_minutes else ""
  print(f"\nTrained {result.step} steps into {result.workdir} in {result.minutes:.1f} "
        f"minutes{budget}{stopped}")
  if result.final_model:
    print(f"final model: {result.final_model}")
  if "mfu" in result.train:
    print(f"speed: {result.train['tokens_per_second']:,.0f} target tokens/s, "
          f"MFU {result.train['mfu']:.0%} (last logging window)")
  summary = f"validation: loss {ev['loss']:.4f}, token accuracy {ev['accuracy']:.4f}"
  if "bleu" in ev:
    summary += (f", BLEU {ev['bleu']:.2f}, chrF {ev['chrf']:.2f}, "
                f"exact match {ev['exact_match']:.1%}")
  print(summary)
  if result.test:
    from transformer.training import report
    print(report.format_test(result.test, _CONFIG.value.get("test_decode_method", "beam"))
          + f"; translations in {os.path.join(result.workdir, report.TEST_TRANSLATIONS_FILE)}")
  for warning in result.warnings:
    print(f"warning: {warning}")
  for source, reference, hypothesis in result.samples[:5]:
    print(f"  {source}\n    -> {hypothesis}\n    (reference: {reference})")
  print(f"\nTranslate: echo \"{result.samples[0][0] if result.samples else 'text'}\" | "
        f"python decode.py --workdir={workdir}")
  return 0


def _parse_flags(argv):
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:
    _exit_if_unknown_config_field(e)
    raise


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # before any computation: see host_memory.py
  app.run(lambda argv: sys.exit(main(argv)), flags_parser=_parse_flags)
