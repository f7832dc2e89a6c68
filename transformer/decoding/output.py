"""decode.py's text: the output lines (one per input line, N in -> N out; text
or JSON lines), the summary line on stderr and the truncation warning, from
`Translator.translate_hypotheses`' (or `Translator.score`'s) results and `last_stats`."""

from __future__ import annotations

import json
from typing import Sequence

from transformer.decoding.scoring import Score
from transformer.decoding.translator import Hypothesis


def format_lines(first_line: int, sources: Sequence[str], results: Sequence[list[Hypothesis]],
                 n_best: int, output_format: str) -> list[str]:
  """One output line per source (sources[0] is input line `first_line` + 1)."""
  if output_format == "jsonl":
    return [json.dumps({"line": first_line + k + 1, "source": source,
                        "hypotheses": [h._asdict() for h in hyps] if source.strip() else []},
                       ensure_ascii=False)
            for k, (source, hyps) in enumerate(zip(sources, results))]
  if n_best == 1:
    return [one_line(hyps[0].text, tabs=False) for hyps in results]
  return ["\t".join(one_line(h.text, tabs=True) for h in hyps) if source.strip() else ""
          for source, hyps in zip(sources, results)]


def format_scores(line_index: int, pair: Sequence[str], score: Score, output_format: str) -> str:
  """The output line of a scored `source<TAB>target` pair (input line
  `line_index` + 1). Text: the log-probability (the sum), the token count
  (the EOS included), the tokens' log-probabilities, and with an alignment
  the source token each target token attends to most, tab-separated; jsonl:
  {"line", "source", "target", "logprob", "tokens", "token_logprobs"[, "alignment"]}."""
  if output_format == "jsonl":
    record = {"line": line_index + 1, "source": pair[0], "target": pair[1],
              "logprob": score.log_prob, "tokens": score.tokens,
              "token_logprobs": score.token_log_probs}
    if score.alignment is not None:
      record["alignment"] = score.alignment
    return json.dumps(record, ensure_ascii=False)
  fields = [f"{score.log_prob:.6f}", str(score.tokens),
            " ".join(f"{x:.6f}" for x in score.token_log_probs)]
  if score.alignment is not None:
    fields.append(" ".join(map(str, score.alignment)))
  return "\t".join(fields)


def one_line(text: str, tabs: bool) -> str:
  """A translation that cannot break the one-line-per-input format."""
  text = text.replace("\r", " ").replace("\n", " ")
  return text.replace("\t", " ") if tabs else text


def summary_line(stats: dict, *, method: str, checkpoint: str, plots: int | None = None,
                 weights_dtype: str | None = None) -> str:
  """One line about a `translate` call from its `last_stats`: sentences,
  tokens, seconds (compiling apart), the decoders loaded from disk and the
  inputs searched again in full (if any), tokens/s of the decoding itself, the
  method (and `weights_dtype` if one was chosen), which `checkpoint` (its
  description), the devices if several, and how many attention `plots` were
  written (None: none asked for)."""
  loaded, again = stats.get("decoders_loaded", 0), stats.get("searched_again", 0)
  line = (f"decoded {stats['sentences']} sentences ({stats['decoded']} non-empty), "
          f"{stats['generated_tokens']} tokens generated in {stats['seconds']:.1f} s "
          f"(compiling {stats['compile_seconds']:.1f} s; "
          f"{f'{loaded} compiled decoders loaded; ' if loaded else ''}"
          f"{f'{again} searched again in full; ' if again else ''}"
          f"{stats['tokens_per_second']:.1f} tokens/s decoding), {method}, "
          f"{f'{weights_dtype} weights, ' if weights_dtype else ''}{checkpoint}")
  if stats.get("devices", 1) > 1:
    line += f", on {stats['devices']} devices"
  if plots is not None:
    line += f", {plots} attention plots"
  return line


def score_summary_line(stats: dict, *, checkpoint: str,
                       weights_dtype: str | None = None) -> str:
  """`summary_line` for `Translator.score`'s `last_stats` (decode.py --score)."""
  loaded = stats.get("decoders_loaded", 0)
  line = (f"scored {stats['sentences']} pairs, {stats['generated_tokens']} target tokens "
          f"in {stats['seconds']:.1f} s (compiling {stats['compile_seconds']:.1f} s; "
          f"{f'{loaded} compiled scorers loaded; ' if loaded else ''}"
          f"{stats['tokens_per_second']:.1f} tokens/s scoring), "
          f"{f'{weights_dtype} weights, ' if weights_dtype else ''}{checkpoint}")
  return line + (f", on {stats['devices']} devices" if stats.get("devices", 1) > 1 else "")


def truncation_warning(stats: dict, max_len: int) -> str | None:
  """The warning for `last_stats["truncated"]` inputs longer than the
  model's `max_len` tokens (truncated before decoding); None if there were none."""
  n = stats.get("truncated", 0)
  if not n:
    return None
  return (f"warning: {n} input line{'s' if n != 1 else ''} longer than the model's "
          f"max_len={max_len} tokens {'were' if n != 1 else 'was'} truncated")
