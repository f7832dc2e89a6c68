"""The notebook-level API (`transformer.demo_config / train / load_translator`)
and the README's API example, run as tests.

README.md holds the example between the markers

    <!-- api-example-start -->
    ```python
    ...
    ```
    <!-- api-example-end -->

`API_EXAMPLE` below is the same example. Both are executed (a README example
identical to `API_EXAMPLE` is run once) and their results checked: a README
example that stops working fails here.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

import transformer
from transformer.data import demo_task
from transformer.training import loop as training
from transformer.decoding import batch_plan, batching, translator as translation
from transformer.runtime import workdir as workdir_lib
from transformer.data.tokenizer import UNK_ID

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
START_MARKER = "<!-- api-example-start -->"
END_MARKER = "<!-- api-example-end -->"
FIXTURE_WORKDIR = REPO / "tests" / "fixtures" / "workdir_d26a6fb"  # a trained tiny model

# The README's example: a smoke run (seconds). For real translations use
# transformer.demo_config() as it is (1200 steps, a few minutes on a CPU).
API_EXAMPLE = '''\
import transformer

# A 30-step smoke run of a tiny model, without translating the test split at the end
# (transformer.demo_config() as it is learns the task, then reports its test BLEU).
config = transformer.demo_config(num_train_steps=30, num_bleu_examples=8, log_every=10,
                                 eval_every=1000, checkpoint_every=30, test_report=False)
config.model.update(d_model=32, num_heads=2, d_ff=64,
                    num_encoder_layers=1, num_decoder_layers=1)
result = transformer.train(config, "runs/api-example", quiet=True)
print(result.eval["loss"], result.eval["bleu"])

translator = transformer.load_translator("runs/api-example")
sentences = ["forty-two red apples", "one small cat"]
beams = translator.translate(sentences, method="beam")   # beam 4, the workdir's alpha (0.6)
samples = translator.translate(sentences, method="sample", top_k=5, seed=1)
print(beams, samples)
source, target, weights = translator.cross_attention(sentences[0])
print(weights.shape)   # [decoder layers, heads, target pieces, source pieces]
'''

@pytest.fixture(scope="module")
def run_example(tmp_path_factory, compilation_cache):
  """run_example(code) -> (namespace, cwd): executes `code` in a fresh
  namespace with a temporary current directory; each distinct code once."""
  done: dict[str, tuple[dict, Path]] = {}

  def run(code: str):
    if code not in done:
      cwd = tmp_path_factory.mktemp("api_example")
      old = os.getcwd()
      os.chdir(cwd)
      try:
        namespace = {"__name__": "__api_example__"}
        exec(compile(code, "<api example>", "exec"), namespace)
      finally:
        os.chdir(old)
      done[code] = (namespace, cwd)
    return done[code]

  return run


def readme_example() -> str:
  """The fenced python block between the README's markers (fails if absent)."""
  assert README.exists(), "README.md is missing"
  text = README.read_text(encoding="utf-8")
  assert START_MARKER in text and END_MARKER in text, (
      f"README.md lost its {START_MARKER} ... {END_MARKER} API example block")
  section = text.split(START_MARKER, 1)[1].split(END_MARKER, 1)[0]
  blocks = re.findall(r"^[ \t]*```(?:python|py)[ \t]*\n(.*?)^[ \t]*```", section,
                      flags=re.DOTALL | re.MULTILINE)
  assert len(blocks) == 1, (f"README.md: expected one ```python block between "
                            f"{START_MARKER} and {END_MARKER}, found {len(blocks)}")
  return textwrap.dedent(blocks[0])


def check_example(namespace: dict, cwd: Path) -> None:
  """What an API example promises. It must define `config`, `result`,
  `translator` and `source, target, weights`; `sentences`, `beams` and
  `samples` are checked when it defines them."""
  for name in ("config", "result", "translator", "source", "target", "weights"):
    assert name in namespace, f"the API example defines no `{name}`"
  config, result = namespace["config"], namespace["result"]
  assert isinstance(result, training.TrainResult)
  assert result.step == config.num_train_steps
  workdir = Path(result.workdir)
  assert workdir.is_absolute() and workdir.is_relative_to(cwd.resolve()), workdir
  assert np.isfinite(result.eval["loss"]) and 0.0 <= result.eval["accuracy"] <= 1.0
  if config.num_bleu_examples:
    assert 0.0 <= result.eval["bleu"] <= 100.0
    assert len(result.samples) == config.num_bleu_examples
  for name in ("vocab.model", "model_config.json", "metrics.jsonl"):
    assert (workdir / name).exists(), name
  saved = json.loads((workdir / "model_config.json").read_text())
  for field, value in config.model.items():
    assert saved[field] == value, (field, saved[field], value)

  translator = namespace["translator"]
  assert isinstance(translator, transformer.Translator)
  assert translator.config == workdir_lib.load_model_config(str(workdir))
  sentences = namespace.get("sentences")
  for name in ("beams", "samples"):
    if name in namespace:
      out = namespace[name]
      assert isinstance(out, list) and all(isinstance(s, str) for s in out), (name, out)
      assert len(out) == len(sentences), (name, out)
  # Whatever the example printed, its translator keeps count, order and empty lines.
  out = translator.translate(["forty-two red apples", "", "one small cat"], method="beam")
  assert len(out) == 3 and out[1] == "" and all(isinstance(s, str) for s in out), out

  cfg = translator.config
  source, target, weights = namespace["source"], namespace["target"], namespace["weights"]
  assert isinstance(weights, np.ndarray)
  assert weights.shape == (cfg.num_decoder_layers, cfg.num_heads, len(target), len(source))
  assert source[-1] == "</s>" and target[-1] == "</s>"
  if sentences:
    assert "".join(source[:-1]).replace("\u2581", " ").strip() == sentences[0]
  assert np.all(weights >= 0.0)
  np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-4)


def test_api_example(run_example):
  namespace, cwd = run_example(API_EXAMPLE)
  check_example(namespace, cwd)


def test_readme_api_example(run_example):
  code = readme_example()
  namespace, cwd = run_example(code)   # run once if identical to API_EXAMPLE
  check_example(namespace, cwd)


def test_translator_keeps_order_count_and_empty_lines(run_example):
  namespace, _ = run_example(API_EXAMPLE)
  translator = namespace["translator"]
  # Short sentences (one padded length) and the example's settings: few compilations.
  sentences = ["forty-two red apples", "", "one small cat", "  ", "seven new cars"]
  for kwargs in (dict(method="greedy"), dict(method="beam"),
                 dict(method="beam", beam_stop="current"),
                 dict(method="sample", top_k=5, top_p=0.9, temperature=0.7, seed=3)):
    out = translator.translate(sentences, **kwargs)
    assert len(out) == len(sentences), kwargs
    assert all(isinstance(s, str) for s in out), kwargs
    assert out[1] == "" and out[3] == "", kwargs
  # Without a length penalty, stopping at the next step's bound is exact.
  assert (translator.translate(sentences, method="beam", length_penalty=0.0,
                               beam_stop="current")
          == translator.translate(sentences, method="beam", length_penalty=0.0))
  # Greedy decoding is deterministic, and one sentence alone decodes as in a batch.
  greedy = translator.translate(sentences, method="greedy")
  assert translator.translate([sentences[2]], method="greedy") == [greedy[2]]
  assert translator.last_stats["sentences"] == 1

  n_best = translator.translate(sentences[:3], method="beam", n_best=2)
  assert len(n_best) == 3 and all(len(h) == 2 for h in n_best)
  assert all(isinstance(t, str) and isinstance(s, float) for h in n_best for t, s in h)
  assert n_best[1] == [("", 0.0), ("", 0.0)]

  with pytest.raises(ValueError, match="method"):
    translator.translate(sentences, method="nucleus")


def test_set_params_translates_as_a_fresh_translator_without_recompiling(run_example):
  """Training's evaluation keeps one Translator and swaps in new parameters."""
  import jax
  from transformer.decoding.translator import Translator
  namespace, _ = run_example(API_EXAMPLE)
  translator = namespace["translator"]
  sentences = ["forty-two red apples", "one small cat", "seven new cars"]
  trained = translator.params
  before = translator.translate(sentences, method="beam")  # compiles these shapes
  compiled = dict(translator.decoders.executables)
  other = jax.tree_util.tree_map(lambda x: x * 0.5 + 0.01, trained)
  want = Translator(translator.config, other, translator.tokenizer).translate(
      sentences, method="beam")
  translator.set_params(other)
  try:
    got = translator.translate(sentences, method="beam")
    # Nothing compiled again (new decoders only for the inputs that the
    # other parameters' first search leaves unfinished: `first_search_length`).
    assert all(translator.decoders.executables[shape] is decoder
               for shape, decoder in compiled.items())
    assert all(decoder_option(shape, "max_len") == decoder_option(shape, "search_len")
               for shape in set(translator.decoders.executables) - set(compiled))
  finally:
    translator.set_params(trained)  # the module's other tests use it
  assert got == want
  assert got != before  # the new parameters did change the translations
  assert translator.translate(sentences, method="beam") == before


def decoder_option(shape: batch_plan.DecoderShape, name: str):
  """The field `name` of a decoder's shape (`Decoders.executables`' keys)."""
  return getattr(shape, name)


def with_option(shape: batch_plan.DecoderShape, name: str, value) -> batch_plan.DecoderShape:
  """`shape` with its field `name` set to `value`."""
  return shape._replace(**{name: value})


def shrink_sizes(translator, batch: int, method="greedy", beam_size=1, **fields) -> list[int]:
  """The batch sizes (inputs) a decoder of `batch` inputs and these
  `DecoderShape` fields shrinks through (`Decoders.shrink`)."""
  shape = batch_plan.DecoderShape(method, batch, 8, 24, beam_size, 0, **fields)
  return translator.decoders.shrink(shape).sizes(batch)


def test_batches_shrink_on_cpu_only_and_translate_the_same_whole(run_example):
  """`Policy.shrink_batches`: on by default on a CPU, where it pays (off
  on accelerators: class docstring); off, a batch runs all its rows to its
  end, through decoders of their own (compiled anew, not the shrinking
  ones), with the same translations."""
  translator = run_example(API_EXAMPLE)[0]["translator"]
  sentences = ["forty-two red apples", "one small cat", "seven new cars and one cat"] * 4
  assert translator.policy.shrink_batches and shrink_sizes(translator, 32) == [32, 8]
  # Beam search's floor is in rows too: 8 rows are 2 inputs of 4 beams, 4 of 2.
  assert shrink_sizes(translator, 32, "beam", 4) == [32, 8, 2]
  assert shrink_sizes(translator, 32, "beam", 2) == [32, 8]
  assert shrink_sizes(translator, 32, "beam", 4, shrink_factor=2) == [32, 16, 8, 4, 2]
  shrunk = translator.translate(sentences, method="greedy", batch_size=32)
  compiled = set(translator.decoders.executables)
  translator.policy.shrink_batches = False
  try:
    whole = translator.translate(sentences, method="greedy", batch_size=32)
    new = set(translator.decoders.executables) - compiled
    assert new and all(decoder_option(shape, "shrink") is False for shape in new)
  finally:
    translator.policy.shrink_batches = True
  assert whole == shrunk


def test_decoders_with_many_rows_to_decode_shrink_by_halves(run_example, monkeypatch):
  """`batch_plan.Policy.shrink_factor`: a beam search decoder with at least
  FINE_SHRINK_MIN_ROWS rows to decode in a call (its inputs times their
  beams) shrinks by halves (32 -> 16 -> 8), one with fewer by quarters
  (32 -> 8), and greedy search's whatever its rows; the rows are counted
  over all the shares of the batches (every process makes the same
  decoders); the translations are those of batches that never shrink."""
  example = run_example(API_EXAMPLE)[0]["translator"]
  translator = translation.Translator(example.config, example.params, example.tokenizer)
  sentences = ["forty-two red apples", "one small cat", "seven new cars and one cat"] * 4
  monkeypatch.setattr(batch_plan, "FINE_SHRINK_MIN_ROWS", 12)  # 12 inputs: 48 beam rows
  factors = {}
  for method in ("greedy", "beam"):
    compiled = set(translator.decoders.executables)
    shrunk = translator.translate(sentences, method=method, batch_size=32)
    new = set(translator.decoders.executables) - compiled
    factors[method] = {decoder_option(shape, "shrink_factor") for shape in new}
    translator.policy.shrink_batches = False  # (then one decoder, whatever the rows)
    try:
      assert translator.translate(sentences, method=method, batch_size=32) == shrunk, method
    finally:
      translator.policy.shrink_batches = True
    factors[method, "whole"] = {decoder_option(shape, "shrink_factor") for shape in
                                set(translator.decoders.executables) - compiled - new}
  assert factors == {"greedy": {4}, "beam": {2}, ("greedy", "whole"): {4},
                     ("beam", "whole"): {4}}, factors
  monkeypatch.setattr(batch_plan, "FINE_SHRINK_MIN_ROWS", 49)
  compiled = set(translator.decoders.executables)
  translator.translate(sentences, method="beam", batch_size=32)  # (48 rows: by quarters)
  new = set(translator.decoders.executables) - compiled
  assert new and {decoder_option(shape, "shrink_factor") for shape in new} == {4}
  assert shrink_sizes(translator, 32, shrink_factor=2) == [32, 16, 8]
  # A share of the batches of 4 (16 rows): its decoder counts all 12 inputs' 48.
  monkeypatch.setattr(batch_plan, "FINE_SHRINK_MIN_ROWS", 40)
  compiled = set(translator.decoders.executables)
  translator.translate_hypotheses(sentences, method="beam", batch_size=4, share=(1, 2))
  new = set(translator.decoders.executables) - compiled
  assert new and {decoder_option(shape, "shrink_factor") for shape in new} == {2}


def test_decoders_with_few_rows_to_decode_are_built_small(run_example, monkeypatch):
  """`batch_plan.Policy.small_decoder`: a greedy or sampling decoder's first search
  with at most SMALL_DECODER_MAX_ROWS rows to decode in a call is built
  small: its steps read the whole self-attention cache (its compiled program
  holds none of the prefix switch's conditionals that the others hold) and
  its batch shrinks once (128 -> 32, one step size fewer: fewer while
  loops); one with more rows, a whole search or beam search is not; rows
  are counted over all the shares; the translations are the same either
  way (greedy, 2 samples)."""
  example = run_example(API_EXAMPLE)[0]["translator"]
  translator = translation.Translator(example.config, example.params, example.tokenizer)
  # (False: the API's default; decode.py's on a CPU: test_decode_cli.py)
  assert translator.policy.small_decoders_for_few_rows is False
  translator.policy.small_decoders_for_few_rows = True
  sentences = ["forty-two red apples", "one small cat", "seven new cars and one cat"] * 4
  runs = {"greedy": dict(method="greedy"), "sample": dict(method="sample", n_best=2, seed=3)}

  def decode(limit, **options):
    """-> (translations, {new first-search decoder's `small`: its (conditionals,
    while loops)}); the decoders searching again in full are never small."""
    monkeypatch.setattr(batch_plan, "SMALL_DECODER_MAX_ROWS", limit)
    compiled = set(translator.decoders.executables)
    out = translator.translate_hypotheses(sentences, batch_size=128, **options)
    new = set(translator.decoders.executables) - compiled
    first = {shape for shape in new
             if decoder_option(shape, "max_len") < decoder_option(shape, "search_len")}
    assert len(first) == 1, options
    assert not any(decoder_option(shape, "small") for shape in new - first)
    program = lambda shape: translator.decoders.executables[shape].as_text()
    return [[h.text for h in hyps] for hyps in out], {
        decoder_option(shape, "small"): (program(shape).count(" conditional("),
                                         program(shape).count(" while("))
        for shape in first}

  for name, options in runs.items():
    rows = 12 * options.get("n_best", 1)
    few, small = decode(rows, **options)         # as many rows as the limit
    many, not_small = decode(rows - 1, **options)  # one more than the limit
    assert few == many, name
    assert list(small) == [True] and list(not_small) == [False], (name, small, not_small)
    (small_conditionals, small_loops), = small.values()
    (conditionals, loops), = not_small.values()
    assert small_conditionals < conditionals and small_loops < loops, (name, small, not_small)
  assert shrink_sizes(translator, 128, small=True) == [128, 32]
  assert shrink_sizes(translator, 128) == [128, 32, 8]
  assert set(decode(1000, method="beam")[1]) == {False}  # (its whole cache anyway)
  # Off (the API's default, and on accelerators): never small.
  translator.policy.small_decoders_for_few_rows = False
  try:
    assert translator.policy.small_decoder("greedy", 1, True) is False
  finally:
    translator.policy.small_decoders_for_few_rows = True
  assert translator.policy.small_decoder("greedy", 1, True) is True
  # A whole search (no first search) is not small, whatever its rows.
  translator.policy.first_search = False
  try:
    compiled = set(translator.decoders.executables)
    translator.translate(sentences, method="greedy", batch_size=32)
    new = set(translator.decoders.executables) - compiled
    assert new and not any(decoder_option(shape, "small") for shape in new)
  finally:
    translator.policy.first_search = True
  # A share (1 of 2) of the batches of 4 counts all 12 inputs, not its 6 (or 8).
  monkeypatch.setattr(batch_plan, "SMALL_DECODER_MAX_ROWS", 11)
  compiled = set(translator.decoders.executables)
  translator.translate_hypotheses(sentences, method="greedy", batch_size=4, share=(1, 2))
  new = set(translator.decoders.executables) - compiled
  assert new and not any(decoder_option(shape, "small") for shape in new)


def test_inputs_a_first_search_leaves_unfinished_are_searched_again_in_full(monkeypatch):
  """A batch decodes the first `first_search_length` steps of its search (a
  cache that long), and searches again in full, in batches of 8 rows of
  their own, only the inputs that did not finish in them. Made 8 steps
  here (12 for beam search), which the longer translations need more than
  (6 of 14 greedy; beam 4; 1 of 2 samples): the same translations and scores
  as the whole search at once (`first_search` off; greedy, beam 4 with its
  2-best, 2 samples), and `last_stats` counts the inputs searched again."""
  translator = transformer.load_translator(str(FIXTURE_WORKDIR))
  sentences = ["seven", "ten white lamps", "forty-two red apples and one small cat",
               "one hundred seventy-six red bottles and four hundred eighty-one green flowers",
               "", "one new child and one yellow book", "nine hundred ninety-nine old houses",
               "three cats"] * 2
  runs = [("greedy", {}), ("beam", dict(n_best=2)),
          ("sample", dict(n_best=2, top_k=5, seed=1))]

  def translate_all(first_len):
    out = []
    for method, options in runs:
      steps = first_len and first_len[method]
      monkeypatch.setattr(batching, "first_search_length",
                          lambda src_len, out_len, min_len: min(out_len, steps))
      hyps = translator.translate_hypotheses(sentences, method=method, batch_size=16,
                                             **options)
      out.append((hyps, translator.last_stats["searched_again"]))
    return out

  translator.policy.first_search = False
  whole = translate_all(None)
  assert all(decoder_option(shape, "max_len") == decoder_option(shape, "search_len")
             for shape in translator.decoders.executables)
  whole_decoders = set(translator.decoders.executables)
  translator.policy.first_search = True
  first_part = translate_all(dict(greedy=8, beam=12, sample=8))
  for (method, _), (want, none_again), (got, again) in zip(runs, whole, first_part):
    assert none_again == 0
    assert 0 < again < 14, method  # (14 non-empty inputs)
    assert [[h.text for h in hyps] for hyps in got] == [[h.text for h in hyps] for hyps in want]
    np.testing.assert_allclose([[h.score for h in hyps] for hyps in got],
                               [[h.score for h in hyps] for hyps in want], rtol=1e-5)
  # Searched again by one decoder per first search's decoder, of 8 rows
  # (sampling: 2 per input) however many inputs each left: greedy's 6 in one
  # batch of 8 rows.
  again = [shape for shape in set(translator.decoders.executables) - whole_decoders
           if decoder_option(shape, "max_len") == decoder_option(shape, "search_len")]
  first = [shape for shape in set(translator.decoders.executables) - whole_decoders
           if decoder_option(shape, "max_len") < decoder_option(shape, "search_len")]
  assert len(again) == len(first) and {decoder_option(s, "batch") for s in again} == {8}


def test_packed_sources_translate_the_same_as_padded_ones(run_example):
  """`Policy.pack_sources` (on by default on a CPU with one device): the
  encoder reads the sentences packed several to a row; off, each padded to
  its batch's length, through decoders of their own; greedy and sampled
  translations (n_best 2: one row per sample) are the same (beam search
  encodes as greedy does)."""
  translator = run_example(API_EXAMPLE)[0]["translator"]
  sentences = ["forty-two red apples", "", "one small cat", "seven new cars and one cat",
               "one cat"] * 3
  assert translator.policy.pack_sources
  runs = [("greedy", {}), ("sample", dict(n_best=2, top_k=5, seed=1))]
  packed = [translator.translate(sentences, method=method, batch_size=8, **options)
            for method, options in runs]
  assert all(decoder_option(shape, "packed") for shape in translator.decoders.executables)
  translator.policy.pack_sources = False
  try:
    padded = [translator.translate(sentences, method=method, batch_size=8, **options)
              for method, options in runs]
    assert any(not decoder_option(shape, "packed") for shape in translator.decoders.executables)
  finally:
    translator.policy.pack_sources = True
  for (method, _), got, want in zip(runs, packed, padded):
    if method == "greedy":
      assert got == want
    else:  # (pairs with scores: the same texts, scores up to float rounding)
      assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in hyps] for hyps in want]
      np.testing.assert_allclose([[s for _, s in hyps] for hyps in got],
                                 [[s for _, s in hyps] for hyps in want], rtol=1e-4)


def test_texts_alone_leave_the_log_probabilities_out_and_translate_the_same(run_example):
  """`translate_hypotheses(scores=False)` (what `translate` and decode.py's text
  output ask for): greedy search and one sample per input compile without the
  per-step log-sum-exp over the vocabulary (fewer exponentials in the
  program), translate the same, and say NaN for the scores they did not
  compute; ranked samples (n_best > 1) keep theirs."""
  translator = run_example(API_EXAMPLE)[0]["translator"]
  sentences = ["forty-two red apples", "one small cat", "seven new cars and one cat"]

  def exponentials(shape):
    return translator.decoders.executables[shape].as_text().count(" exponential(")

  for method, options in (("greedy", {}), ("sample", dict(top_k=5, seed=1))):
    full = translator.translate_hypotheses(sentences, method=method, **options)
    texts = translator.translate_hypotheses(sentences, method=method, scores=False, **options)
    assert [h[0].text for h in texts] == [h[0].text for h in full]
    assert all(math.isfinite(h[0].score) and math.isfinite(h[0].log_prob) for h in full)
    assert all(math.isnan(h[0].score) and math.isnan(h[0].log_prob) for h in texts)
    assert translator.translate(sentences, method=method, **options) == [
        h[0].text for h in full]
  executables = translator.decoders.executables
  pairs = [(shape, with_option(shape, "log_probs", True)) for shape in executables
           if decoder_option(shape, "log_probs") is False
           and with_option(shape, "log_probs", True) in translator.decoders.executables]
  assert {shape[0] for shape, _ in pairs} == {"greedy", "sample"}
  assert all(0 < exponentials(without) < exponentials(with_) for without, with_ in pairs)
  ranked = translator.translate_hypotheses(sentences, method="sample", n_best=2, top_k=5,
                                           seed=1, scores=False)
  assert all(math.isfinite(h.score) for hyps in ranked for h in hyps)


def _record_padded_lengths(monkeypatch) -> list[int]:
  """A list that every Translator appends each batch's padded source length
  to as it dispatches it (first searches only, not searches again)."""
  from transformer.decoding import decoders as decoders_lib
  lengths = []
  dispatch = decoders_lib.Decoders.dispatch

  def recording(self, shape, inputs):
    if decoder_option(shape, "max_len") < decoder_option(shape, "search_len"):
      lengths.append(shape.src_len)
    return dispatch(self, shape, inputs)

  monkeypatch.setattr(decoders_lib.Decoders, "dispatch", recording)
  return lengths


def test_a_bucket_too_small_for_a_decoder_of_its_own_shares_a_longer_one(run_example,
                                                                         monkeypatch):
  """`Policy.share_buckets` (on by default on a CPU): two short inputs
  and a long one, a batch each, go through one decoder, the long one's
  (`batching.shared_buckets`); off, through two. Greedy search, sampling
  and beam search give the same hypotheses either way, each input's search
  ending at its own bucket's length (this smoke-trained model's
  greedy translations run to it; beam search's row limits are tested in
  test_decoding.py)."""
  translator = run_example(API_EXAMPLE)[0]["translator"]
  lengths = _record_padded_lengths(monkeypatch)
  sentences = ["one cat", "forty-two red apples and seven new cars and one small cat and "
               "three old dogs and nine green birds", "seven new cars"]
  assert translator.policy.share_buckets
  runs = [("greedy", {}), ("sample", dict(n_best=2, top_k=5, seed=1)), ("beam", {})]
  for method, options in runs:
    options = dict(method=method, batch_size=1, concurrent_batches=1, **options)
    lengths.clear()
    shared = translator.translate_hypotheses(sentences, **options)
    buckets = len(set(lengths))
    translator.policy.share_buckets = False
    try:
      lengths.clear()
      own = translator.translate_hypotheses(sentences, **options)
      assert len(set(lengths)) == 2 and max(lengths) == lengths[0]  # (longest first)
    finally:
      translator.policy.share_buckets = True
    assert buckets == 1, method
    assert [[(h.text, h.length) for h in hyps] for hyps in shared] == [
        [(h.text, h.length) for h in hyps] for hyps in own], method
    np.testing.assert_allclose([[h.score for h in hyps] for hyps in shared],
                               [[h.score for h in hyps] for hyps in own], rtol=1e-4)
  short = translator.translate_hypotheses(sentences[:1], method="greedy")[0][0]
  assert short.length == 8 + 50  # (the premise: no EOS; its bucket, 8, + extra_len)


def test_batches_are_decoded_longest_first_and_translate_the_same(run_example, monkeypatch):
  """`batch_plan.LONGEST_FIRST`: lanes take the longest batches first (so
  they end together); shortest first gives the same translations. (Buckets
  of their own: shared, these 4 inputs would all be padded to the longest.)"""
  translator = run_example(API_EXAMPLE)[0]["translator"]
  monkeypatch.setattr(translator.policy, "share_buckets", False)
  lengths = _record_padded_lengths(monkeypatch)
  sentences = ["one small cat", "forty-two red apples and seven new cars and one small cat",
               "a cat", "seven new cars"]
  options = dict(method="greedy", batch_size=1, concurrent_batches=1)
  longest_first = translator.translate(sentences, **options)
  assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
  lengths.clear()
  monkeypatch.setattr(batch_plan, "LONGEST_FIRST", False)
  assert translator.translate(sentences, **options) == longest_first
  assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_cross_attention_of_a_given_target(run_example):
  namespace, _ = run_example(API_EXAMPLE)
  translator = namespace["translator"]
  source, target, weights = translator.cross_attention("forty-two red apples",
                                                       "zweiundvierzig rote Äpfel")
  cfg = translator.config
  assert weights.shape == (cfg.num_decoder_layers, cfg.num_heads, len(target), len(source))
  assert "".join(target[:-1]).replace("\u2581", " ").strip() == "zweiundvierzig rote Äpfel"
  assert np.all(weights >= 0.0)
  np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-4)


def test_load_translator_of_a_missing_workdir_says_so(tmp_path):
  with pytest.raises(FileNotFoundError, match="train"):
    transformer.load_translator(str(tmp_path / "nothing-here"))


def _toy_pairs(count: int, seed: int) -> list[tuple[str, str]]:
  """A toy task over a small alphabet: reverse a sequence of colour words."""
  words = ["red", "green", "blue", "pink", "grey", "teal"]
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(count):
    seq = [words[i] for i in rng.integers(len(words), size=int(rng.integers(2, 6)))]
    pairs.append((" ".join(seq), " ".join(reversed(seq)).upper()))
  return pairs


def test_train_from_pairs_in_memory(tmp_path, compilation_cache):
  train_pairs, eval_pairs = _toy_pairs(400, seed=0), _toy_pairs(12, seed=1)
  # (no test report: it would translate the demo's 500 test sentences with a
  # 10-step model, to max_len each; tests/test_training.py checks the report)
  config = transformer.demo_config(num_train_steps=10, num_bleu_examples=4, vocab_size=64,
                                   batch_size=16, eval_every=1000, checkpoint_every=1000,
                                   test_report=False)
  config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                      num_decoder_layers=1)
  workdir = tmp_path / "mine"
  result = transformer.train(config, str(workdir), train_pairs=train_pairs,
                             eval_pairs=eval_pairs, quiet=True)
  assert result.step == 10
  assert np.isfinite(result.eval["loss"])
  # The evaluation used eval_pairs, not the demo task of config.data.
  assert [(s, r) for s, r, _ in result.samples] == eval_pairs[:4]

  translator = transformer.load_translator(str(workdir))
  assert translator.config.num_encoder_layers == 1 and translator.config.d_model == 32
  # The vocabulary was learnt from train_pairs: their characters are known, the
  # demo task's German ones (never seen here) are not.
  tok = translator.tokenizer
  assert UNK_ID not in tok.encode(" ".join(s + " " + t for s, t in train_pairs[:50]))
  demo_german = demo_task.demo_phrase(1, "big", "house")[1] + " Äpfel"   # 'ein großes Haus Äpfel'
  assert UNK_ID in tok.encode(demo_german)

  sources = [s for s, _ in eval_pairs]
  out = translator.translate(sources + [""], method="greedy")
  assert len(out) == len(sources) + 1 and out[-1] == ""
  assert all(isinstance(s, str) for s in out)
  assert isinstance(translator, translation.Translator)
  assert isinstance(translator, transformer.Translator)


# The recipes: `transformer.configs`, never a top-level `configs` package.
RECIPES_FROM_A_COPY = """
import sys
# Only what a checkout on sys.path gives: no installed package's finders.
sys.meta_path[:] = [f for f in sys.meta_path
                    if "editable" not in (getattr(f, "__module__", "") or "").lower()]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
sys.path_importer_cache.clear()
sys.path.insert(0, sys.argv[1])
import transformer
from transformer.configs import small_corpus
print(transformer.__file__)
print(small_corpus.__file__)
print(transformer.demo_config().model.d_model)
"""


def test_recipes_are_transformer_configs_installed_or_from_a_checkout(tmp_path):
  """Installed (this suite's editable install), the recipes are
  `transformer.configs` and there is no top-level `configs`; a copy of the
  checkout put on sys.path without being installed finds its own configs/."""
  import importlib.util
  import shutil
  import subprocess
  import sys
  from transformer.configs import default
  assert Path(default.__file__).resolve() == REPO / "configs" / "default.py"
  outside = subprocess.run([sys.executable, "-c", "import configs"], cwd=tmp_path,
                           capture_output=True, text=True)
  assert "No module named 'configs'" in outside.stderr
  assert importlib.util.find_spec("transformer.configs") is not None

  copy = tmp_path / "checkout"
  shutil.copytree(REPO / "transformer", copy / "transformer",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copytree(REPO / "configs", copy / "configs", ignore=shutil.ignore_patterns("__pycache__"))
  out = subprocess.run([sys.executable, "-c", RECIPES_FROM_A_COPY, str(copy)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  package, recipe, d_model = out.stdout.split()
  assert Path(package).parent == copy / "transformer"  # (the copy, not the install)
  assert Path(recipe) == copy / "configs" / "small_corpus.py"
  assert d_model == str(default.get_config().model.d_model)
