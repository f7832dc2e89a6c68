"""decode.py's text: the output lines (one per input line, N in -> N out), the
summary line on stderr and the truncation warning, from `Translator.translate`'s
results and `last_stats`."""

from __future__ import annotations

from typing import Sequence


def output_lines(sources: Sequence[str], results, n_best: int) -> list[str]:
  """`translate`'s results as one line per source: the translation, or (n_best
  > 1) its hypotheses joined by tabs, in the order given; a blank source gives
  an empty line. Line breaks (and, between hypotheses, tabs) inside a
  translation become spaces, so that N sources always give N lines."""
  if n_best == 1:
    return [_one_line(text, tabs=False) for text in results]
  return ["\t".join(_one_line(text, tabs=True) for text, _ in hyps) if source.strip() else ""
          for source, hyps in zip(sources, results)]


def _one_line(text: str, tabs: bool) -> str:
  """A translation that cannot break the one-line-per-input format."""
  text = text.replace("\r", " ").replace("\n", " ")
  return text.replace("\t", " ") if tabs else text


def summary_line(stats: dict, *, method: str, checkpoint: str, plots: int | None = None) -> str:
  """One line about a `translate` call from its `last_stats`: sentences,
  tokens, seconds (compiling apart), tokens/s of the decoding itself, the
  method, which `checkpoint` (its description), the devices if several, and
  how many attention `plots` were written (None: none asked for)."""
  line = (f"decoded {stats['sentences']} sentences ({stats['decoded']} non-empty), "
          f"{stats['generated_tokens']} tokens generated in {stats['seconds']:.1f} s "
          f"(compiling {stats['compile_seconds']:.1f} s; "
          f"{stats['tokens_per_second']:.1f} tokens/s decoding), {method}, {checkpoint}")
  if stats.get("devices", 1) > 1:
    line += f", on {stats['devices']} devices"
  if plots is not None:
    line += f", {plots} attention plots"
  return line


def truncation_warning(stats: dict, max_len: int) -> str | None:
  """The warning for `last_stats["truncated"]` inputs longer than the
  model's `max_len` tokens (truncated before decoding); None if there were none."""
  n = stats.get("truncated", 0)
  if not n:
    return None
  return (f"warning: {n} input line{'s' if n != 1 else ''} longer than the model's "
          f"max_len={max_len} tokens {'were' if n != 1 else 'was'} truncated")
