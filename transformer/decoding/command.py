"""decode.py's work, in the package where the API gets it too: its checks (cheap
ones first, before the input is read or anything is loaded), the workdir read
once, the Translator loaded, the file decoded window by window
(`streaming.py`), the attention plots, and the summary on stderr.

    from transformer.decoding import command
    command.decode(command.Request(workdir="runs/demo", input_path="in.txt",
                                   output_path="out.txt", options={"method": "greedy"}))

Errors: `UsageError` for a bad option value or unreadable input (decode.py's
exit status 2), `WorkdirError` when the workdir cannot be used or decoding
fails (exit status 1); each is one line that names the option, file or line
at fault and what to do.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

import jax

from transformer.data import text_io
from transformer.decoding import batch_plan, loader, output, streaming
from transformer.decoding import options as decoding_options
from transformer.runtime import errors
from transformer.runtime import workdir as workdir_lib

# Batches of at least this many rows (inputs x beams, or x samples) run each
# computation on the thread that calls it (`uses_calling_threads`): the main
# thread, which decodes a lane of batches (`runner._decode_in_lanes`), then
# keeps their temporaries in its heap, where a thread's own keeps no block
# over 64 MB (host_memory.py). Beam 4 at batch 128 (512 rows, 100-400 MB a
# batch) on gettext lines: 20,000 lines 1.07x faster, 5,000 1.02x, 1,000 the
# same. Smaller batches keep JAX's asynchronous dispatch, which lets a lane
# queue its next batch while one runs: beam 4 at 32 was 4-6% slower on 1,000
# lines without it (docs/benchmarks.md).
CALLING_THREAD_MIN_ROWS = 512


class UsageError(Exception):
  """A bad option value or unreadable input (decode.py's exit status 2)."""


class WorkdirError(Exception):
  """The workdir cannot be used, or decoding failed (exit status 1)."""


@dataclasses.dataclass(frozen=True)
class Request:
  """What one decode asks for (decode.py's flags of the same names)."""
  workdir: str
  input_path: str | None = None  # None: standard input
  output_path: str | None = None  # None: standard output
  options: dict = dataclasses.field(default_factory=dict)  # `translate_hypotheses`'
  checkpoint: str = "auto"
  output_format: str = "text"
  window_lines: int = streaming.WINDOW_LINES
  param_sharding: str = "replicated"
  weights_dtype: str | None = None
  trust_compiled: str | None = None  # --trust_compiled=KEY: `loader.load_translator`'s
  plot_dir: str | None = None  # --plot_attention
  quiet: bool = False
  score: bool = False  # --score: the input's source<TAB>target pairs scored, not translated
  alignment: bool = False  # --alignment: with --score, each target token's source token


def option_error(error) -> str:
  """A library error about an option (`option`, `value`, `problem`), in flag words."""
  return f"--{error.option}={error.value}: {error.problem}"


def check_options(request: Request) -> None:
  """UsageError naming the first option with a bad value: the request's own,
  then the translation options and the checkpoint."""
  if not request.workdir:
    raise UsageError("--workdir is required: the directory train.py wrote "
                     "(e.g. --workdir=runs/demo)")
  if request.window_lines < 1:
    raise UsageError(f"--window_lines={request.window_lines}: must be >= 1")
  if request.alignment and not request.score:
    raise UsageError("--alignment: the alignment of a scored target; add --score")
  if request.score and request.options.get("n_best", 1) != 1:
    raise UsageError(f"--n_best={request.options['n_best']}: --score scores the one target "
                     "each line gives")
  if request.score and request.plot_dir:
    raise UsageError("--plot_attention draws translations: leave it out with --score "
                     "(--alignment gives each target token's source token)")
  try:
    decoding_options.check_options(
        **{k: v for k, v in request.options.items() if k != "seed"})
    workdir_lib.checkpoint_choice(request.checkpoint)
    loader.trusted_keys(request.trust_compiled)  # (read again by the loader: 32 bytes)
  except errors.OptionError as e:
    raise UsageError(option_error(e)) from None


def uses_calling_threads(options: dict) -> bool:
  """Whether a decode with these options has batches of at least
  CALLING_THREAD_MIN_ROWS rows (never with batch_tokens: they vary)."""
  if options.get("batch_tokens"):
    return False
  rows = options.get("batch_size", 32) * decoding_options.rows_per_input(
      options.get("method", "beam"), options.get("beam_size", 4), options.get("n_best", 1))
  return rows >= CALLING_THREAD_MIN_ROWS


def read_workdir(request: Request) -> workdir_lib.Workdir:
  """The workdir read once (`loader.read_workdir`), once it is known to hold
  what decoding needs. Nothing is loaded: this runs before the input is read.
  WorkdirError names what is missing and what to do."""
  try:
    return loader.read_workdir(request.workdir, request.checkpoint)
  except workdir_lib.CheckpointNotFound as e:
    raise WorkdirError(option_error(e)) from None
  except (OSError, ValueError) as e:
    raise WorkdirError(str(e)) from None


def check_files(request: Request) -> None:
  """UsageError if the output cannot be written, the plot directory cannot
  be created or the input cannot be read: found before the model is loaded,
  not after decoding."""
  if request.output_path:
    try:
      text_io.check_writable(request.output_path)
    except text_io.TextFileError as e:
      raise UsageError(f"--output={e.path}: {e.problem}") from None
  if request.plot_dir:
    try:
      os.makedirs(request.plot_dir, exist_ok=True)
    except OSError as e:
      raise UsageError(f"--plot_attention={request.plot_dir}: cannot create it "
                       f"({e.strerror})") from None
  if request.input_path is None and jax.process_count() > 1:
    raise UsageError("--input=FILE is needed with several processes (standard input is "
                     "process 0's alone)")
  if request.input_path is not None:
    try:
      text_io.check_readable(request.input_path)
    except text_io.TextFileError as e:
      raise UsageError(f"--input={e.path}: {e.problem}") from None


def load(request: Request, model: workdir_lib.Workdir):
  """(Translator, a description of its checkpoint); WorkdirError if a file
  of the workdir cannot be read."""
  try:
    translator, info = loader.load_translator(model, with_info=True,
                                              param_sharding=request.param_sharding,
                                              weights_dtype=request.weights_dtype,
                                              trust_compiled=request.trust_compiled)
  except errors.OptionError as e:  # (a key file changed since `check_options`)
    raise UsageError(option_error(e)) from None
  except (OSError, ValueError) as e:
    raise WorkdirError(str(e)) from None
  if info["kind"] == "averaged":
    return translator, f"averaged steps {info['averaged_steps']}"
  return translator, f"step {info['step']}"


def decode(request: Request, keep: list | None = None) -> dict:
  """Checks the request (cheap checks first: options, workdir, files), then
  loads the model and decodes the input window by window into the output.
  Returns `streaming.decode_file`'s stats. `keep`: a list the Translator is
  appended to (decode.py lets the process end with it rather than free it)."""
  check_options(request)
  model = read_workdir(request)
  if model.checkpoint_note:
    print(model.checkpoint_note, file=sys.stderr)
  check_files(request)
  if request.input_path is None and sys.stdin.isatty() and not request.quiet:
    print("Reading sentences from standard input (end with Ctrl-D) ...", file=sys.stderr)

  translator, described = load(request, model)
  if keep is not None:
    keep.append(translator)
  # One command, one file: its decoders are loaded for it alone, so on a CPU
  # those with few rows to decode are built small (less to load, a little
  # slower per row: batch_plan.Policy.small_decoders_for_few_rows).
  translator.policy = batch_plan.Policy.for_command(translator.platform,
                                                    translator.decoders.devices)
  if not gc.isenabled():  # (decode.py turns it off while it starts)
    gc.freeze()  # what exists now lives to the end: never walked again
    gc.enable()
  plots = 0 if request.plot_dir else None

  def plot(first_line, sources, results):  # (matplotlib: imported only when asked for)
    nonlocal plots
    from transformer import plotting
    for k, hyps in enumerate(results):  # (None: a line another process decoded)
      if hyps is not None:
        plots += plotting.save_cross_attention_plots(
            translator, sources[k:k + 1], [hyps[0].text], request.plot_dir,
            first_line=first_line + k)
  run_key = {"workdir": os.path.abspath(request.workdir), "checkpoint": described}
  try:
    stats = streaming.decode_file(
        translator, request.input_path, request.output_path, options=request.options,
        run=run_key, output_format=request.output_format, window_lines=request.window_lines,
        progress=not request.quiet, on_results=plot if request.plot_dir else None,
        score=request.score, alignment=request.alignment)
  except streaming.ResumeMismatch as e:
    raise UsageError(str(e)) from None
  except (text_io.NotUtf8Error, streaming.NotAPair) as e:
    done = "scores" if request.score else "translations"
    raise UsageError(f"{e} (the {done} of the lines before it are written)") from None
  except text_io.TextFileError as e:
    raise WorkdirError(f"--output={e.path}: {e.problem}") from None
  if not request.quiet and jax.process_index() == 0:
    if request.score:
      line = output.score_summary_line(stats, checkpoint=described,
                                       weights_dtype=request.weights_dtype)
    else:
      line = output.summary_line(stats, method=request.options.get("method", "beam"),
                                 checkpoint=described, plots=plots,
                                 weights_dtype=request.weights_dtype)
    if stats["resumed_at"]:
      line += f"; resumed after line {stats['resumed_at']}"
    print(line, file=sys.stderr)
  if warning := output.truncation_warning(stats, translator.config.max_len):
    print(warning, file=sys.stderr)
  return stats
