"""Metrics out: TensorBoard event files, metrics.jsonl, a tqdm progress bar,
BLEU / chrF (sacrebleu)."""

from __future__ import annotations

import json
import os
import sys
import time

import sacrebleu
import tqdm
from etils import epath

from transformer.data import text_io
from transformer.runtime import workdir as workdir_lib

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def translation_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
  """sacrebleu's corpus BLEU and chrF (0..100; 13a tokenisation, its defaults),
  BLEU's brevity penalty and length ratio (hypothesis / reference length: a
  value under 1 means translations shorter than the references), and the share
  of translations equal to their reference."""
  bleu_score = sacrebleu.corpus_bleu(hypotheses, [references])
  return {"bleu": float(bleu_score.score),
          "chrf": float(sacrebleu.corpus_chrf(hypotheses, [references]).score),
          "brevity_penalty": float(bleu_score.bp),
          "length_ratio": float(bleu_score.sys_len / max(bleu_score.ref_len, 1)),
          "exact_match": sum(h == r for h, r in zip(hypotheses, references))
          / max(len(references), 1)}


class MetricsWriter:
  """Writes scalars to `<workdir>/tensorboard/` (event files) and appends them,
  one JSON object per line, to `<workdir>/metrics.jsonl`. Only process 0 writes.
  On an object store (gs://...: tensorboardX writes there itself) metrics.jsonl,
  which cannot be appended to, is written whole at each write."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self._tb = None
    self._jsonl = None
    if enabled:
      # metrics.jsonl first: a workdir that refuses it (a planted link, a
      # read-only disk) leaves no event writer open, whose cleanup at exit
      # cannot start its thread on Python 3.12 and prints a traceback.
      path = os.path.join(workdir, METRICS_FILE)
      self._jsonl = (text_io.open_for_append(path) if workdir_lib.is_local(path)
                     else _WrittenWhole(path))
      from tensorboardX import SummaryWriter
      try:
        self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))
      except BaseException:
        self._jsonl.close()
        raise

  def write(self, step: int, scalars: dict[str, float], prefix: str) -> None:
    if not self.enabled:
      return
    for name, value in scalars.items():
      self._tb.add_scalar(f"{prefix}/{name}", value, step)
    self._tb.flush()
    record = {"step": int(step), "split": prefix, "time": time.time(),
              **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


class _WrittenWhole:
  """An object (gs://...) appended to as a file is: kept in memory (with what
  it held before) and written whole at each flush."""

  def __init__(self, path: str):
    self._path = epath.Path(path)
    self._text = self._path.read_text() if self._path.exists() else ""

  def write(self, text: str) -> None:
    self._text += text

  def flush(self) -> None:
    workdir_lib.write_file(self._path, self._text)

  def close(self) -> None:
    pass


class _NoProgress:
  def update(self, n=1): pass
  def set_postfix(self, **kw): pass
  def write(self, text): print(text, file=sys.stderr)
  def close(self): pass


def progress_bar(start: int, total: int, enabled: bool = True, budgeted: bool = False):
  """A tqdm bar over training steps on stderr (a silent stand-in when disabled).
  `budgeted` (a time budget): no total until the speed tells how many steps
  the budget affords (`set_progress_total`)."""
  if not enabled:
    return _NoProgress()
  return tqdm.tqdm(initial=start, total=None if budgeted else total, unit="step",
                   dynamic_ncols=True, file=sys.stderr, desc="train")


def set_progress_total(progress, total: int) -> None:
  """Makes `total` steps the bar's end (an estimate that the run refines)."""
  if isinstance(progress, tqdm.tqdm) and progress.total != total:
    progress.total = total
    progress.refresh()


def format_eval(step: int, summary: dict) -> str:
  parts = [f"step {step}: eval loss {summary['loss']:.4f}",
           f"accuracy {summary['accuracy']:.4f}", f"perplexity {summary['perplexity']:.3f}"]
  if "bleu" in summary:
    parts.append(f"BLEU {summary['bleu']:.2f}")
    if "chrf" in summary:
      parts.append(f"chrF {summary['chrf']:.2f}")
    parts.append(f"exact match {summary['exact_match']:.3f}")
  return ", ".join(parts)
