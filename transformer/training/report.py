"""The end of a training run: the final model's scores on the test split, its
translations, and a picture of the learning curves, all in the workdir.

    <workdir>/test_translations.txt   one translation per test source line
    <workdir>/curves.png              loss and validation BLEU (plotting.plot_training_curves)
    <workdir>/metrics.jsonl           + a "test" record: BLEU, chrF, brevity penalty, ...
"""

from __future__ import annotations

import contextlib
import os
import time

from transformer.decoding import batch_plan, executable_cache, loader
from transformer.training import metrics as metrics_lib
from transformer.runtime import multihost
from transformer.runtime import workdir as workdir_lib

TEST_TRANSLATIONS_FILE = "test_translations.txt"
CURVES_FILE = "curves.png"


@contextlib.contextmanager
def translating_as_decode_py(translator, workdir: str):
  """`translator` translating, inside the block, as decode.py translates a
  file (its policy: `batch_plan.Policy.for_command`), the decoders it
  compiles kept in `<workdir>/compiled/` (`executable_cache.model_directory`):
  the first decode.py of the same lengths after training loads them instead
  of compiling."""
  policy, kept_in = translator.policy, translator.decoders.model_dir
  translator.policy = batch_plan.Policy.for_command(translator.platform,
                                                    translator.decoders.devices)
  model_dir = executable_cache.model_directory(workdir)
  translator.decoders.keep_in(model_dir)
  if model_dir is not None:  # (what decode.py's start reads besides: the parameters' shapes)
    loader.param_shapes(translator.config, model_dir)
  try:
    yield translator
  finally:
    translator.policy = policy
    translator.decoders.keep_in(kept_in)


def test_report(translator, pairs, workdir: str, *, method: str = "beam",
                beam_size: int = 4, length_penalty: float | None = None) -> dict[str, float]:
  """Translates the sources of `pairs` with `translator` (a
  `translation.Translator` holding the final, averaged when there is one,
  parameters), writes the translations to TEST_TRANSLATIONS_FILE and returns
  `metrics.translation_scores` against the targets, with the number of
  sentences, the seconds the translation took and those it compiled. With several processes
  each translates its share of the batches (`multihost.split_across_processes`), and every
  process scores them all and writes them to its workdir.

  The test split is translated as decode.py translates a file
  (`translating_as_decode_py`), beam search with `length_penalty` (None:
  the translator's)."""
  sources = [source for source, _ in pairs]
  references = [target for _, target in pairs]
  start = time.perf_counter()
  with translating_as_decode_py(translator, workdir):
    hypotheses = multihost.split_across_processes(
        lambda sources, share: translator.translate(
            sources, method=method, beam_size=beam_size, length_penalty=length_penalty,
            share=share),
        sources, what="test sentences")
  seconds = time.perf_counter() - start
  path = os.path.join(workdir, TEST_TRANSLATIONS_FILE)
  workdir_lib.write_file(path, "".join(line + "\n" for line in hypotheses))
  scores = metrics_lib.translation_scores(hypotheses, references)
  scores.update(sentences=float(len(pairs)), seconds=seconds,
                compile_seconds=float(translator.last_stats.get("compile_seconds", 0.0)))
  return scores


def save_curves(workdir: str) -> str | None:
  """Draws <workdir>/metrics.jsonl into <workdir>/curves.png; returns its path
  (None when there are no metrics yet). matplotlib is imported here, when a
  run ends, not when train.py starts (0.5 s of its start, 2-core CPU)."""
  from transformer import plotting
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  if not os.path.exists(path):
    return None
  records = plotting.read_metrics(path)
  if not records:
    return None
  fig = plotting.plot_training_curves(records, title=os.path.basename(workdir.rstrip("/")))
  return plotting.save_figure(fig, os.path.join(workdir, CURVES_FILE))


def format_test(scores: dict[str, float], method: str) -> str:
  """One line for the end-of-run summary."""
  return (f"test ({int(scores['sentences'])} sentences, {method}): BLEU {scores['bleu']:.2f}, "
          f"chrF {scores['chrf']:.2f}, brevity penalty {scores['brevity_penalty']:.3f}, "
          f"exact match {scores['exact_match']:.1%}")
