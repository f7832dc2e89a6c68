"""Decoding a file of any size: lines read in windows, each window decoded
(sorted by length inside it, `Translator.translate_hypotheses`) and written in
input order as soon as it is done, so that host memory holds one window, not
the file; a progress record beside the output lets the same command continue
after a kill.

    decode_file(translator, "in.txt", "out.txt", options=..., run=...)

The progress record, <output>.progress.json, written whole (rename) after each
window's lines are on disk (fsync):

    {"lines_done": N, "output_bytes": B, "input_sha256": sha256 of the first
     N input lines' bytes, "run": {the model and every option that shapes
     the output}}

Started again with a record present, decoding continues after line N: the
output is cut back to B bytes (a window written after the last record is
written again), the first N input lines are read and hashed (a changed input
is refused), and `run` must equal the record's (a changed model or option is
refused, naming the difference). The finished output is byte-identical to an
uninterrupted run's: the windows start at the same lines, so a line is decoded
in the same batch (sampling keys are per line). The record is removed at the end. No
record, no resume: an output file is then written afresh. Standard input and
output stream the same way, without a record.

Several processes (hosts): every process reads the input and forms the same
batches of each window; each decodes every count-th batch
(`multihost.split_across_processes`), so the output is byte-identical to one
process's; process 0 writes the output and the record.

Output formats: "text", one line per input line (n-best: the hypotheses
tab-separated, best first); "jsonl", one JSON object per input line:
{"line": 1-based number, "source": ..., "hypotheses": [{"text", "score",
"log_prob", "length"}, ...]}.

With `score`, each input line is a `source<TAB>target` pair, and its output
line the target's log-probability under the model (`Translator.score`,
`output.format_scores`); windows, batches, records and processes as above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import jax

from transformer.data import text_io
from transformer.decoding.output import format_lines, format_scores
from transformer.decoding.translator import Translator
from transformer.runtime import multihost

WINDOW_LINES = 20_000  # lines read, sorted and decoded together
OUTPUT_FORMATS = ("text", "jsonl")
# The Translator's counts and times, summed over the windows this process decodes.
_COUNTS = ("sentences", "decoded", "truncated", "generated_tokens", "seconds",
           "compile_seconds", "host_seconds", "decoders_loaded", "searched_again")


class ResumeMismatch(ValueError):
  """A progress record made by another model, option or input than this run's."""


class NotAPair(ValueError):
  """A line to score that is not `source<TAB>target`."""


def progress_path(output_path: str) -> str:
  return output_path + ".progress.json"


@dataclasses.dataclass
class Progress:
  """What the progress record holds (see the module docstring)."""

  lines_done: int
  output_bytes: int
  input_sha256: str
  run: dict

  def save(self, path: str) -> None:
    text_io.write_atomically(path, json.dumps(dataclasses.asdict(self), sort_keys=True))

  @classmethod
  def load(cls, path: str) -> "Progress":
    """The record at `path`, read as JSON and checked field by field (it sits
    beside an output that may have come from elsewhere): ResumeMismatch, one
    sentence naming the file, for anything else."""
    try:
      with open(path, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
      if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"larger than {MAX_RECORD_BYTES:,} bytes")
      record = json.loads(raw.decode("utf-8"))
      if not isinstance(record, dict) or set(record) != _FIELDS:
        raise ValueError(f"expected a JSON object with the fields {sorted(_FIELDS)}")
      problem = _record_problem(record)
      if problem:
        raise ValueError(problem)
      return cls(**record)
    except (OSError, ValueError) as e:  # (UnicodeDecodeError, JSONDecodeError among them)
      raise ResumeMismatch(f"{path} is not a progress record ({e}); delete it to start "
                           "the output afresh") from None


MAX_RECORD_BYTES = 1 << 20  # a record holds a few counts, a hash and the run's options
_FIELDS = {f.name for f in dataclasses.fields(Progress)}
_MAX_COUNT = 1 << 62        # lines or bytes: past any file, yet an int64


def _record_problem(record: dict) -> str | None:
  """Why a progress record's fields are absurd, or None."""
  for name in ("lines_done", "output_bytes"):
    value = record[name]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_COUNT:
      return f"{name} must be a count (an integer >= 0), not {json.dumps(value)[:40]}"
  digest = record["input_sha256"]
  if (not isinstance(digest, str) or len(digest) != 64
      or any(c not in "0123456789abcdef" for c in digest)):
    return "input_sha256 must be a SHA-256 in hexadecimal"
  if not isinstance(record["run"], dict):
    return "run must be a JSON object (the model and options of that run)"
  return None


def _differences(stored: dict, requested: dict, prefix: str = "") -> list[str]:
  names = sorted(set(stored) | set(requested))
  out = []
  for name in names:
    a, b = stored.get(name), requested.get(name)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{name}.")
    elif a != b:
      out.append(f"{prefix}{name}: {json.dumps(a)} then, {json.dumps(b)} now")
  return out


def decode_file(translator: Translator, input_path: str | None, output_path: str | None, *,
                options: dict, run: dict, output_format: str = "text",
                window_lines: int = WINDOW_LINES, progress: bool = False,
                on_results=None, score: bool = False, alignment: bool = False) -> dict:
  """Translates the lines of `input_path` (None: standard input) into
  `output_path` (None: standard output), window by window, resuming from the
  progress record if there is one.

  Args:
    translator: the model.
    options: `translate_hypotheses`' options (method, beam_size, n_best, ...).
    run: what the output depends on besides `options` (the workdir, the
      checkpoint, ...); stored in the record and compared on resume.
    output_format: "text" or "jsonl".
    window_lines: lines decoded together (sorted by length among themselves).
    progress: a tqdm bar per window on stderr.
    on_results: called as on_results(first line number (0-based), sources,
      hypotheses) with each window (e.g. to plot its attention); with several
      processes the hypotheses of the lines another process decoded are None.
    score: the lines are `source<TAB>target` pairs, scored (`Translator.score`,
      with `alignment`: each target token's most attended source token).
  Returns:
    {"lines": input lines, "resumed_at": lines found done, "sentences",
     "decoded", "truncated", "generated_tokens", "seconds", "compile_seconds",
     "host_seconds", "decoders_loaded", "devices", "tokens_per_second"}: this process's work in
    this run (`output.summary_line` prints it).
  Raises:
    text_io.NotUtf8Error at a line that is not UTF-8, or (`score`) NotAPair
    at a line without a tab, the lines before it written; ResumeMismatch;
    text_io.TextFileError.
  """
  n_best = options.get("n_best", 1)
  run = dict(run, options=options, output_format=output_format, input=input_path)
  if score:
    run.update(score=True, alignment=alignment)
  run = json.loads(json.dumps(run))  # (as it reads back from JSON)
  is_main = jax.process_index() == 0
  record_path = progress_path(output_path) if output_path else None
  record = _plan(record_path, run) if record_path else None
  lines = text_io.iter_lines(input_path)
  hasher = hashlib.sha256()
  line_no = record.lines_done if record else 0
  for _ in range(line_no):
    raw, _ = next(lines, (None, None))
    if raw is None:
      raise ResumeMismatch(f"{input_path} has fewer lines than the {line_no} that "
                           f"{record_path} records as done: not the same input")
    hasher.update(raw)
  if record and hasher.hexdigest() != record.input_sha256:
    raise ResumeMismatch(f"{input_path} changed in its first {line_no} lines since "
                         f"{output_path} was started ({record_path}); delete both to start "
                         "afresh")
  out = _open_output(output_path, record) if is_main else None
  output_bytes = record.output_bytes if record else 0
  stats = dict.fromkeys(_COUNTS, 0) | {"lines": line_no, "resumed_at": line_no}

  def translate_share(window: list[tuple[int, str]], share: tuple[int, int]) -> list[str | None]:
    """This process's share of a window's batches: (line number, text) pairs
    -> an output line for each line it decoded, None for the others."""
    first, texts = window[0][0], [text for _, text in window]
    if score:
      pairs = [text.split("\t", 1) for text in texts]
      scores = translator.score([p[0] for p in pairs], [p[1] for p in pairs],
                                alignment=alignment, share=share,
                                batch_size=options.get("batch_size", 32))
      for key in _COUNTS:
        stats[key] += translator.last_stats.get(key, 0)
      return [None if result is None else
              format_scores(first + k, pair, result, output_format)
              for k, (pair, result) in enumerate(zip(pairs, scores))]
    # Text output prints no scores: greedy search and sampling leave them out.
    results = translator.translate_hypotheses(texts, first_line=first, progress=progress,
                                              share=share, scores=output_format == "jsonl",
                                              **options)
    for key in _COUNTS:
      stats[key] += translator.last_stats.get(key, 0)
    if on_results is not None:
      on_results(first, texts, results)
    return [None if hyps is None else format_lines(first + k, [text], [hyps], n_best,
                                                   output_format)[0]
            for k, (text, hyps) in enumerate(zip(texts, results))]

  try:
    while True:
      raws, window, error = _read_window(lines, window_lines)
      if score and (unpaired := next((k for k, text in enumerate(window) if "\t" not in text),
                                     None)) is not None:
        number = line_no + unpaired + 1  # (the lines before it are scored and written)
        raws, window = raws[:unpaired], window[:unpaired]
        error = NotAPair(f"{input_path or '<stdin>'}:{number}: line {number} has no tab: "
                         "--score reads source<TAB>target lines")
      if window:
        formatted = multihost.split_across_processes(
            translate_share, list(enumerate(window, start=line_no)), what="lines")
        if is_main:
          data = "".join(line + "\n" for line in formatted).encode("utf-8")
          _write(out, data, output_path)
          output_bytes += len(data)
        for raw in raws:
          hasher.update(raw)
        line_no = stats["lines"] = line_no + len(window)
        if is_main and record_path:
          Progress(line_no, output_bytes, hasher.hexdigest(), run).save(record_path)
      if error is not None:
        raise error
      if len(window) < window_lines:
        break
  finally:
    if out is not None and out is not sys.stdout.buffer:
      out.close()
  if is_main and record_path and os.path.exists(record_path):
    os.remove(record_path)
  stats["devices"] = translator.last_stats.get("devices", 1)
  stats["tokens_per_second"] = stats["generated_tokens"] / max(
      stats["seconds"] - stats["compile_seconds"], 1e-9)
  return stats


def _read_window(lines, size: int) -> tuple[list[bytes], list[str], Exception | None]:
  """Up to `size` lines from `text_io.iter_lines`: (their bytes, their texts,
  the NotUtf8Error that stopped the window early, if one did; the lines
  before it are kept, to be decoded)."""
  raws, texts = [], []
  try:
    for raw, text in lines:
      raws.append(raw)
      texts.append(text)
      if len(texts) == size:
        break
  except text_io.NotUtf8Error as e:
    return raws, texts, e
  return raws, texts, None


def _plan(record_path: str, run: dict) -> Progress | None:
  """The record to resume from (process 0 reads it, every process gets it),
  or None; ResumeMismatch, on every process, if it is not this run's."""
  message = b""
  if jax.process_index() == 0:
    record, problem = None, ""
    if os.path.exists(record_path):
      output_path = record_path[:-len(".progress.json")]
      try:
        record = Progress.load(record_path)
        if differences := _differences(record.run, run):
          problem = (f"{record_path} records a run with another model or options, so "
                     f"{output_path} cannot be continued: "
                     f"{'; '.join(differences)}. Run the same command as then, or delete "
                     "the record to start the output afresh.")
        elif (os.path.exists(output_path)
              and os.path.getsize(output_path) < record.output_bytes):
          problem = (f"{record_path} records {record.output_bytes} bytes of {output_path} "
                     f"done, but it holds {os.path.getsize(output_path)}: not that output; "
                     "delete the record to start the output afresh")
      except ResumeMismatch as e:
        problem = str(e)
    message = json.dumps({"problem": problem,
                          "record": dataclasses.asdict(record) if record else None}).encode()
  plan = json.loads(multihost.broadcast_bytes(message))
  if plan["problem"]:
    raise ResumeMismatch(plan["problem"])
  return Progress(**plan["record"]) if plan["record"] else None


def _open_output(output_path: str | None, record: Progress | None):
  """The output, binary: standard output, a file cut back to the recorded
  bytes (resuming), or a new file."""
  if output_path is None:
    return sys.stdout.buffer
  try:
    if record is None:
      return open(output_path, "wb")
    out = open(output_path, "r+b")
    out.truncate(record.output_bytes)
    out.seek(record.output_bytes)
    return out
  except FileNotFoundError:
    if record is not None:
      raise ResumeMismatch(f"{output_path} is missing but {progress_path(output_path)} "
                           "records part of it done; delete the record to start "
                           "afresh") from None
    raise text_io.TextFileError(output_path, "cannot create it") from None
  except OSError as e:
    raise text_io.TextFileError(output_path, f"cannot write it ({e.strerror or e})") from None


def _write(out, data: bytes, output_path: str | None) -> None:
  """Appends a window's lines and puts them on disk before the record says so."""
  try:
    out.write(data)
    out.flush()
    if output_path is not None:
      os.fsync(out.fileno())
  except BrokenPipeError:  # the reader of standard output left (`| head`)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
  except OSError as e:
    raise text_io.TextFileError(output_path or "<stdout>",
                                f"cannot write it ({e.strerror or e})") from None
