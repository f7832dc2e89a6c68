"""The decoding options (`Translator.translate_hypotheses`' and decode.py's) and
their check: an OptionError naming the first option that cannot be used."""

from __future__ import annotations

from transformer.runtime.errors import OptionError

METHODS = ("greedy", "beam", "sample")
BEAM_STOPS = ("exact", "current")  # beam search's early-exit bounds (beam_search.beam_search)
# Beam search's alpha where neither the caller nor the workdir's decoding.json
# (`runtime/workdir_records.py`) gives one: the paper's.
PAPER_LENGTH_PENALTY = 0.6

# With early exit (`loops.py`), decode steps run between two "is everything
# finished?" checks. 2: a batch runs at most 1 step past its end, and shrinks
# as soon as it may (read where used, so that a benchmark may set it); on 1,000
# real sentences the decoder's row-steps that generate a token went from 76%
# to 81% at batch 32 (74% -> 78% at 128) against checks every 4 steps, and
# decoding 1.05-1.09x faster greedy at 32, 1.00-1.04x at 128, 1.02-1.04x
# beam 4, the same translations and compile times (4 had been 1.17x greedy /
# 1.15x beam 4 over 8; docs/benchmarks.md "Wasted rows"). A check costs a
# reduction over the rows; a one-step loop (1) measured slower per step
# than a scan.
EARLY_EXIT_CHUNK = 2


def rows_per_input(method: str, beam_size: int, n_best: int) -> int:
  """The decoder rows one input takes: its beams (beam search), its samples
  (sampling: one row per sample), or one (greedy search)."""
  return {"beam": beam_size, "sample": n_best}.get(method, 1)


def check_options(*, method: str = "beam", beam_size: int = 4,
                  length_penalty: float | None = PAPER_LENGTH_PENALTY,
                  beam_stop: str = "exact",
                  max_len: int | None = None, min_len: int = 0, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, n_best: int = 1,
                  batch_size: int = 32, batch_tokens: int = 0,
                  concurrent_batches: int = 0) -> None:
  """Raises OptionError naming the first of `Translator.translate`'s options
  (same names and defaults) whose value cannot be used, and what to do."""
  if method not in METHODS:
    raise OptionError("method", method,
                      f"unknown decoding method; choose one of {', '.join(METHODS)}")
  if beam_stop not in BEAM_STOPS:
    raise OptionError("beam_stop", beam_stop, f"must be one of {', '.join(BEAM_STOPS)}")
  if beam_size < 1:
    raise OptionError("beam_size", beam_size, "must be >= 1")
  if n_best < 1:
    raise OptionError("n_best", n_best, "must be >= 1")
  if method == "beam" and n_best > beam_size:
    raise OptionError("n_best", n_best, f"must be <= beam_size={beam_size} (beam search "
                      "keeps beam_size hypotheses); raise beam_size or lower n_best")
  if method == "greedy" and n_best > 1:
    raise OptionError("n_best", n_best, "greedy search has one hypothesis; use "
                      "method=beam or method=sample for several")
  if not 0.0 < top_p <= 1.0:
    raise OptionError("top_p", top_p, "must be in (0, 1] (1 = no nucleus filtering)")
  if top_k < 0:
    raise OptionError("top_k", top_k, "must be >= 0 (0 = no top-k filtering)")
  if temperature < 0:
    raise OptionError("temperature", temperature, "must be >= 0 (0 = greedy)")
  if length_penalty is not None and length_penalty < 0:  # (None: the workdir's)
    raise OptionError("length_penalty", length_penalty,
                      "must be >= 0 (0 = no length penalty)")
  if max_len is not None and max_len < 1:
    raise OptionError("max_len", max_len, "must be >= 1")
  if min_len < 0:
    raise OptionError("min_len", min_len, "must be >= 0")
  if max_len is not None and min_len >= max_len:
    raise OptionError("min_len", min_len, f"must be < max_len={max_len}")
  if batch_size < 1:
    raise OptionError("batch_size", batch_size, "must be >= 1")
  if batch_tokens < 0:
    raise OptionError("batch_tokens", batch_tokens, "must be >= 0 (0: batches of batch_size)")
  if concurrent_batches < 0:
    raise OptionError("concurrent_batches", concurrent_batches,
                      "must be >= 0 (0: one per CPU core, 1 on a GPU or TPU)")
