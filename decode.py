"""Translate text with a model trained by train.py.

    python decode.py --workdir=runs/demo --input=in.txt --output=out.txt --beam_size=4
    echo "twenty-one old houses" | python decode.py --workdir=runs/demo
    python decode.py --workdir=runs/demo --method=sample --top_p=0.9 --n_best=3 < in.txt
    python decode.py --workdir=runs/demo --input=in.txt --plot_attention=plots/

One line in, one line out: N input lines give exactly N output lines, in input
order; an empty (or blank) line gives an empty line. With --n_best > 1 the
hypotheses of one input share its output line, tab-separated, best first;
--output_format=jsonl gives a JSON object per line (scores and lengths too).

Files of any size: the input is read --window_lines at a time, and each
window's translations are appended as soon as they are done. Beside an
--output file, <output>.progress.json records how far it got: after a kill,
the same command continues there (and refuses, naming it, another model,
option or input); the finished file is the one an uninterrupted run writes.
Several processes (hosts) split each window (--num_processes, ... as train.py).

The workdir is what train.py wrote (--checkpoint says which parameters); it
is data (docs/security.md). --score scores given source<TAB>target lines
instead of translating (docs/decoding.md, "Scoring given translations").

Progress and a one-line summary (sentences, generated tokens, seconds and how
many of them compiling, tokens/s of the decoding itself, truncated over-long
inputs) go to stderr. Exit status: 0 on success, 2 for a bad flag value or
unreadable input, 1 when the workdir cannot be used (missing files or
checkpoint) or decoding fails; the error is one line on stderr that names the
flag, file or line at fault and what to do.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

if __name__ == "__main__":  # (the command's alone: importing this module changes neither)
  # No garbage collection while the command starts (its objects live to the
  # end; walking them cost 0.09 s of a 2.4 s decode.py): `run` freezes them.
  gc.disable()
  # numpy's OpenBLAS starts a spinning thread per core, and this command makes
  # no BLAS call: 0.1 s of a core taken from loading the decoders.
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
from absl import app, flags
from absl import logging as absl_logging

from transformer.decoding import command
from transformer.decoding import options as decoding_options
from transformer.runtime import host_memory

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory written by train.py (model_config.json, vocab.model, "
    "checkpoints/). Required.")
_INPUT = flags.DEFINE_string(
    "input", None, "Text file to translate, one sentence per line (UTF-8). Default "
    "(or '-'): standard input.")
_OUTPUT = flags.DEFINE_string(
    "output", None, "Where to write the translations, one line per input line. Default "
    "(or '-'): standard output. A file is appended window by window, with a progress "
    "record: the same command resumes an interrupted run.")
_METHOD = flags.DEFINE_string(
    "method", "beam", f"Decoding strategy: {' | '.join(decoding_options.METHODS)}.")
_BEAM_SIZE = flags.DEFINE_integer(
    "beam_size", 4, "Beam search: hypotheses kept per sentence (the paper: 4).")
_BEAM_STOP = flags.DEFINE_string(
    "beam_stop", "exact", f"Beam search: when an input is done, "
    f"{' | '.join(decoding_options.BEAM_STOPS)}. "
    "exact: once no live hypothesis could beat its n-best at any length it can still "
    "reach (what searching to --max_len gives); current: once none could were it to end "
    "at the next step (HuggingFace's rule; faster, may miss a longer hypothesis).")
_LENGTH_PENALTY = flags.DEFINE_float(
    "length_penalty", None, "Beam search: alpha of the GNMT length penalty ((5 + length) "
    "/ 6)^alpha (0 = none). Default: the one the workdir's training run recorded in its "
    "decoding.json (e.g. the small-corpus recipe's 1.0), else the paper's 0.6.")
_MAX_LEN = flags.DEFINE_integer(
    "max_len", None, "Most tokens generated per sentence (EOS included). Default: the "
    "input length + 50, as in the paper (input length rounded up to its bucket).")
_MIN_LEN = flags.DEFINE_integer(
    "min_len", 0, "Fewest tokens generated before EOS is allowed.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Sampling: divide the logits by this (0 = greedy).")
_TOP_K = flags.DEFINE_integer(
    "top_k", 0, "Sampling: draw only from the k most probable tokens (0 = off).")
_TOP_P = flags.DEFINE_float(
    "top_p", 1.0, "Sampling: draw only from the smallest set of tokens whose "
    "probability reaches p (nucleus sampling), in (0, 1]; 1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling: random seed.")
_N_BEST = flags.DEFINE_integer(
    "n_best", 1, "Hypotheses per sentence, tab-separated on its line, best first "
    "(beam: <= --beam_size; sample: that many samples, ranked by model score).")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 32, "Sentences decoded together by this process (its batch is split "
    "over its local devices).")
_BATCH_TOKENS = flags.DEFINE_integer(
    "batch_tokens", 0, "Instead of --batch_size: source tokens (padded length x sentences) "
    "per batch of this process, so short sentences go in larger batches. 0: off.")
_CONCURRENT_BATCHES = flags.DEFINE_integer(
    "concurrent_batches", 0, "Batches decoded at once, side by side (the same output). "
    "0: one per CPU core on a CPU (faster: a decoding step is many small ops that one "
    "batch cannot spread over the cores), 1 on a GPU or TPU.")
_OUTPUT_FORMAT = flags.DEFINE_enum(
    "output_format", "text", ["text", "jsonl"], "text: one line per input line (n-best "
    "tab-separated); jsonl: one JSON object per input line with the line number, the "
    "source and each hypothesis' text, score, log_prob and length.")
_WINDOW_LINES = flags.DEFINE_integer(
    "window_lines", 20_000, "Input lines read, sorted by length and decoded together; each "
    "window's output is written (and the progress record updated) as soon as it is done.")
_PARAM_SHARDING = flags.DEFINE_enum(
    "param_sharding", "replicated", ["replicated", "fsdp"], "replicated: the parameters "
    "on every device; fsdp: each array split over this process's devices (a model larger "
    "than one device, e.g. trained with --config.state_sharding=fsdp).")
_WEIGHTS_DTYPE = flags.DEFINE_enum(
    "weights_dtype", None, ["bfloat16"], "bfloat16: the projections' weights kept in "
    "bfloat16 and multiplied with their inputs in bfloat16, summed in float32 (attention, "
    "LayerNorm, softmax and the search as the model says): 1.2-1.4x faster on a CPU with "
    "AVX512-BF16 or AMX, the same BLEU, translations that may differ in a word here and "
    "there. Default: the model's own dtype.")
_TRUST_COMPILED = flags.DEFINE_string(
    "trust_compiled", "", "KEY: a copy of your own workdir from the machine whose "
    "signing.key (or folder of *.key files) KEY is: the compiled decoders sealed under it "
    "are loaded; the rest is compiled afresh (docs/security.md). Default: off.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (or "
    "$JAX_COORDINATOR_ADDRESS). Slurm, Open MPI and Cloud TPU jobs of several processes "
    "start them without it (--num_processes=1 runs one alone there).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-host: number of processes (or $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index (or $JAX_PROCESS_ID).")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "auto", "Which parameters: auto (the averaged checkpoint unless a "
    "later step was saved after it, else the latest) | averaged | latest | <step number>.")
_PLOT_ATTENTION = flags.DEFINE_string(
    "plot_attention", None, "Directory: write <DIR>/<line number>.png for each non-empty "
    "input line, the encoder-decoder attention of its translation as heat maps, one "
    "panel per decoder layer (heads averaged), source pieces on x, target pieces on y.")
_SCORE = flags.DEFINE_bool("score", False, "Score instead of translate: each input line is "
                           "source<TAB>target, each output line the target's log-probability.")
_ALIGNMENT = flags.DEFINE_bool("alignment", False, "With --score: also each target token's "
                               "most attended source token.")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress bar and no summary line "
                           "(warnings and errors are still printed).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "Directory of JAX's persistent compilation cache, or 'off' "
    "(default: $TRANSFORMER_COMPILATION_CACHE or ~/.cache/transformer/jax): a second "
    "decode of the same workdir compiles (almost) nothing.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "On a CPU: split it into this many JAX devices, one per core, each "
    "batch sharded over them: faster for small models with beam search, slower for large "
    "memory-bound ones. 0: JAX's default (one device).")


def translate_options() -> dict:
  """`Translator.translate_hypotheses`' options from the flags of the same names."""
  return dict(method=_METHOD.value, beam_size=_BEAM_SIZE.value,
              length_penalty=_LENGTH_PENALTY.value, beam_stop=_BEAM_STOP.value,
              max_len=_MAX_LEN.value, min_len=_MIN_LEN.value,
              temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
              top_p=_TOP_P.value, seed=_SEED.value, n_best=_N_BEST.value,
              batch_size=_BATCH_SIZE.value, batch_tokens=_BATCH_TOKENS.value,
              concurrent_batches=_CONCURRENT_BATCHES.value)


def request() -> command.Request:
  """The decode the flags ask for."""
  input_path, output_path = (None if flag.value in (None, "-") else flag.value
                             for flag in (_INPUT, _OUTPUT))  # None: stdin, stdout
  return command.Request(
      workdir=_WORKDIR.value, input_path=input_path, output_path=output_path,
      options=translate_options(), checkpoint=_CHECKPOINT.value,
      output_format=_OUTPUT_FORMAT.value, window_lines=_WINDOW_LINES.value,
      param_sharding=_PARAM_SHARDING.value, weights_dtype=_WEIGHTS_DTYPE.value,
      trust_compiled=_TRUST_COMPILED.value, plot_dir=_PLOT_ATTENTION.value, quiet=_QUIET.value,
      score=_SCORE.value, alignment=_ALIGNMENT.value)


# Objects `main_then_exit` lets the process end with instead of freeing them:
# the Translator, whose compiled decoders took 0.1 s to free when `main` returned.
_KEPT_UNTIL_EXIT: list = []


def main(argv) -> int:
  """Starts the processes and the compilation cache, decodes; the exit status."""
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}; the input is --input=FILE or "
          "standard input", file=sys.stderr)
    return 2
  # orbax logs at INFO; keep stderr for the progress bar and the summary.
  absl_logging.set_verbosity(absl_logging.WARNING)
  if _CPU_DEVICES.value < 0:
    print(f"error: --cpu_devices={_CPU_DEVICES.value}: must be >= 0 (0 = JAX's default)",
          file=sys.stderr)
    return 2
  from transformer.runtime import compile_cache, multihost, xla_flags
  try:  # $XLA_FLAGS checked before JAX starts; several processes start as train.py's do
    xla_flags.check_environment(compile_cache.chosen_directory(_COMPILATION_CACHE.value))
    multihost.start_processes(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                              num_cpu_devices=_CPU_DEVICES.value or None)
  except ValueError as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  compile_cache.enable(_COMPILATION_CACHE.value)
  try:
    command.decode(request(), keep=_KEPT_UNTIL_EXIT)
  except (command.UsageError, command.WorkdirError) as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)  # one line
    return 2 if isinstance(e, command.UsageError) else 1
  except KeyboardInterrupt:
    print("\nInterrupted: the same command continues after the last finished window "
          "(an --output file's progress record says where).", file=sys.stderr)
    return 130
  return 0


def main_then_exit(argv) -> int:
  """`main`, then, when this is the only process, the process ends at once:
  the interpreter's own teardown (freeing the compiled decoders' XLA
  programs, a garbage collection of everything jax imported) took 0.3-0.5 s
  of a 5 s decode.py of 1,000 lines (2-core CPU, docs/benchmarks.md), and
  nothing is left to do by then: the output is closed, stdout and stderr are
  flushed here, and logging is shut down. Several processes exit normally
  (JAX's distributed runtime shuts down at exit).

  Before anything starts JAX's backend: large batches' computations run on
  the threads that call them (`command.CALLING_THREAD_MIN_ROWS`)."""
  if command.uses_calling_threads(translate_options()):
    host_memory.run_computations_on_calling_threads()
  code = main(argv)
  if not jax.distributed.is_initialized():  # (asks no backend to start)
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):  # (a reader that went away: nothing more to say)
        pass
    logging.shutdown()
    os._exit(code)
  return code


if __name__ == "__main__":
  # Freed memory stays in the process (`host_memory`): a batch's temporaries
  # are not faulted in afresh for every batch (10,000 lines at batch 128: 1.05x
  # faster, 2-core CPU). A heap per thread: on one, the threads that load the
  # decoders and decode in lanes waited on its lock.
  host_memory.keep_freed_memory(one_heap=False)
  app.run(main_then_exit)
