"""How a workdir exported to transformers (interop/hf_export.py) agrees with
decode.py on real text: the share of lines translated identically, and the
largest difference of a log-probability. Needs torch and transformers
(docs/testing.md says how to install them beside the project).

    python benchmarks/bench_hf_export.py --workdir=runs/gettext        # 1,000 test lines

The workdir is exported to a temporary folder and loaded with transformers'
Auto classes. The first `--lines` sources of `--pairs` (default
../shared/corpora/gettext-en-fr/test.tsv) are translated by the Translator
(decode.py's engine, decode.py's options) and by `generate`, in batches of
`--batch_size`:
  * greedy;
  * beam 4 at length penalty 0 (the same search but for which candidates
    may finish: transformers admits a finished hypothesis only from the best
    4 of a step's candidates);
  * beam 4 with each side's default: the workdir's alpha, GNMT's penalty
    here, length^alpha there (generation_config.json).
Then decode.py's greedy translations are scored by both (`Translator.score`,
transformers' teacher-forced log-softmax): the largest difference per pair
and per token, and whether transformers' is the higher (PAD has no id there).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks import common
from transformer.decoding import loader
from transformer.interop import hf_export


def _batches(items, size):
  return [items[i:i + size] for i in range(0, len(items), size)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--pairs", default=common.GETTEXT_TEST)
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--batch_size", type=int, default=32)
  args = parser.parse_args()
  import torch
  from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

  with open(args.pairs, encoding="utf-8") as f:
    sources = [line.rstrip("\n").split("\t")[0] for line in f][:args.lines]
  sources = [s for s in sources if s.strip()]
  translator = loader.load_translator(args.workdir)
  with tempfile.TemporaryDirectory() as tmp:
    out = hf_export.export_workdir(args.workdir, os.path.join(tmp, "hf"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
  torch.set_num_threads(os.cpu_count() or 1)
  alpha = model.generation_config.length_penalty  # (the workdir's, as exported)

  def generate(**options):
    texts = []
    for batch in _batches(sources, args.batch_size):
      encoded = tokenizer(batch, return_tensors="pt", padding=True)
      with torch.no_grad():
        ids = model.generate(**encoded, do_sample=False, **options)
      texts += tokenizer.batch_decode(ids, skip_special_tokens=True)
    return texts

  def transformers_scores(targets):
    """transformers' teacher-forced log-probability of each target (+ </s>)."""
    sums = []
    for batch, labels_text in zip(_batches(sources, args.batch_size),
                                  _batches(targets, args.batch_size)):
      encoded = tokenizer(batch, return_tensors="pt", padding=True)
      labels = tokenizer(text_target=labels_text, return_tensors="pt",
                         padding=True)["input_ids"]
      with torch.no_grad():
        logits = model(**encoded, labels=labels).logits
      log_probs = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
      sums += ((labels != tokenizer.pad_token_id) * log_probs).sum(-1).tolist()
    return np.asarray(sums)

  runs = {"greedy": (dict(method="greedy"), dict(num_beams=1)),
          "beam 4, length penalty 0": (dict(length_penalty=0.0),
                                       dict(num_beams=4, length_penalty=0.0)),
          f"beam 4, each side's default (alpha {alpha:g})": (dict(), dict(num_beams=4))}
  print(f"{args.workdir}: {len(sources)} lines of {args.pairs}, batch {args.batch_size}")
  print("| search | identical lines | of the others, decode.py's the more probable "
        "(transformers' scores) |\n|---|---|---|")
  ours_greedy = None
  for name, (ours_options, their_options) in runs.items():
    with jax.default_matmul_precision("highest"):
      ours = translator.translate(sources, batch_size=args.batch_size, **ours_options)
    theirs = generate(**their_options)
    ours_greedy = ours if ours_greedy is None else ours_greedy
    differ = np.array([a != b for a, b in zip(ours, theirs)])
    better = int((transformers_scores(ours) > transformers_scores(theirs))[differ].sum())
    same = len(sources) - int(differ.sum())
    print(f"| {name} | {same} of {len(sources)} ({100 * same / len(sources):.1f}%) | "
          f"{better} of {int(differ.sum())} |")

  with jax.default_matmul_precision("highest"):
    scores = translator.score(sources, ours_greedy, batch_size=args.batch_size)
  ours_sum = np.array([s.log_prob for s in scores])
  tokens = np.array([s.tokens for s in scores])
  theirs_sum = transformers_scores(ours_greedy)
  difference = np.asarray(theirs_sum) - ours_sum
  print(f"\nscores of the greedy lines: largest |difference| {np.abs(difference).max():.2e} "
        f"a pair, {np.abs(difference / tokens).max():.2e} a token; transformers' the "
        f"higher in {int((difference > 0).sum())} of {len(sources)} pairs")


if __name__ == "__main__":
  main()
