"""Scoring given pairs: `Translator.score` against CTranslate2's `score_batch`
on the same weights, on the same machine, in one run.

    python benchmarks/bench_score.py --workdir=runs/gettext          # 1,000 test pairs
    python benchmarks/bench_score.py --workdir=W --pairs=FILE.tsv --lines=1000 --batch_size=32

The workdir is exported to CTranslate2 (float32) in a temporary folder. Each
engine scores the same `source<TAB>target` pairs (default: the first
`--lines` of ../shared/corpora/gettext-en-fr/test.tsv) in batches of
`--batch_size`, on all of this machine's cores; ours once cold (compiling
each batch shape) and then `--repeats` times warm, CTranslate2 `--repeats`
times. Prints the pairs/s of each, the ratio (above 1: ours is faster), and
the largest difference of a pair's log-probability and of a token's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks import common
from transformer.decoding import loader
from transformer.interop import ctranslate2_export


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--pairs", default=common.GETTEXT_TEST)
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  import ctranslate2

  with open(args.pairs, encoding="utf-8") as f:
    pairs = [line.rstrip("\n").split("\t", 1) for _, line in zip(range(args.lines), f)]
  sources, targets = [p[0] for p in pairs], [p[1] for p in pairs]
  translator = loader.load_translator(args.workdir)
  tok = translator.tokenizer
  start = time.perf_counter()
  ours = translator.score(sources, targets, batch_size=args.batch_size)
  cold = time.perf_counter() - start
  warm = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    translator.score(sources, targets, batch_size=args.batch_size)
    warm.append(time.perf_counter() - start)

  with tempfile.TemporaryDirectory() as scratch:
    out = ctranslate2_export.export_workdir(args.workdir, os.path.join(scratch, "ct2"))
    engine = ctranslate2.Translator(out, intra_threads=os.cpu_count() or 1)
    src_pieces = [tok.pieces(tok.encode(s)) for s in sources]
    tgt_pieces = [tok.pieces(tok.encode_target(t)) for t in targets]
    theirs, timed = None, []
    for _ in range(args.repeats):
      start = time.perf_counter()
      theirs = engine.score_batch(src_pieces, tgt_pieces, max_batch_size=args.batch_size)
      timed.append(time.perf_counter() - start)

  pair_diff = max(abs(o.log_prob - sum(t.log_probs)) for o, t in zip(ours, theirs))
  token_diff = max(float(np.max(np.abs(np.asarray(o.token_log_probs) - np.asarray(t.log_probs))))
                   for o, t in zip(ours, theirs) if len(t.log_probs) == o.tokens)
  same_length = sum(len(t.log_probs) == o.tokens for o, t in zip(ours, theirs))
  n = len(pairs)
  ours_s, theirs_s = statistics.median(warm), statistics.median(timed)
  print(f"\n{n} pairs, batch {args.batch_size}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"ctranslate2 {ctranslate2.__version__}\n")
  print("| engine | seconds (median) | pairs/s |\n|---|---|---|")
  print(f"| Translator.score, warm | {ours_s:.3f} | {n / ours_s:,.0f} |")
  print(f"| Translator.score, cold (compiling its shapes) | {cold:.3f} | {n / cold:,.0f} |")
  print(f"| CTranslate2 score_batch | {theirs_s:.3f} | {n / theirs_s:,.0f} |")
  print(f"\nspeed ratio, warm (ours / CTranslate2's pairs/s): {theirs_s / ours_s:.2f}")
  print(f"largest difference: a pair's log p {pair_diff:.2e}, a token's {token_diff:.2e} "
        f"(same token counts: {same_length} of {n})")


if __name__ == "__main__":
  main()
