"""A run's learning curves from its metrics.jsonl: loss against steps, BLEU
against minutes (`report.py` writes them as <workdir>/curves.png)."""

from __future__ import annotations

import json
import os
from typing import Sequence

from transformer.plotting.figures import Figure, new_figure


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """The records of a metrics.jsonl (`metrics.MetricsWriter`), in order; a
  last line cut short by a killed run is skipped."""
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def plot_training_curves(records: Sequence[dict], title: str = "") -> Figure:
  """Loss and validation BLEU of a run, from its metrics.jsonl records
  (`read_metrics`): left, the training loss (per logging window) and the
  validation loss against the step; right, validation BLEU against the
  minutes of training (the records' "minutes", earlier runs of a resumed
  workdir included; else the time since the first record), the averaged
  checkpoints' and the test split's BLEU as separate points. The x axes are steps and minutes so a learning curve reads
  both ways."""
  def series(split, key):
    return [(r["step"], r.get("minutes", (r.get("time", start) - start) / 60), r[key])
            for r in records if r.get("split") == split and key in r]
  start = min((r["time"] for r in records if "time" in r), default=0.0)
  fig = new_figure(10.0, 3.8)
  loss_ax, bleu_ax = fig.subplots(1, 2)
  for split, label, style in (("train", "train", "-"), ("eval", "validation", "o-")):
    points = series(split, "loss")
    if points:
      loss_ax.plot([p[0] for p in points], [p[2] for p in points], style, label=label,
                   markersize=3)
  loss_ax.set(xlabel="step", ylabel="loss (label-smoothed cross-entropy)", title="loss")
  loss_ax.grid(alpha=0.3)
  if loss_ax.lines:
    loss_ax.legend()
  for split, label, style in (("eval", "validation", "o-"),
                              ("eval_averaged", "validation, averaged", "s"),
                              ("test", "test", "*")):
    points = series(split, "bleu")
    if points:
      bleu_ax.plot([p[1] for p in points], [p[2] for p in points], style,
                   label=label, markersize=6 if split != "eval" else 3)
  bleu_ax.set(xlabel="minutes", ylabel="BLEU", title="BLEU")
  bleu_ax.grid(alpha=0.3)
  if bleu_ax.lines:
    bleu_ax.legend()
  if title:
    fig.suptitle(title)
  return fig
