"""Tests for transformer/decoding/translator.py's option check, batch layout and output
text (the Translator itself is exercised on a trained model in test_api.py and
test_decode_cli.py)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from transformer.decoding import options as decoding_options
from transformer.decoding import batching, options, output, translator as translation
from transformer.runtime import errors


@pytest.mark.parametrize("options,option", [
    (dict(method="viterbi"), "method"),
    (dict(beam_size=0), "beam_size"),
    (dict(n_best=0), "n_best"),
    (dict(n_best=5), "n_best"),                        # > beam_size=4
    (dict(method="greedy", n_best=2), "n_best"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(temperature=-0.5), "temperature"),
    (dict(length_penalty=-1.0), "length_penalty"),
    (dict(beam_stop="soon"), "beam_stop"),
    (dict(max_len=0), "max_len"),
    (dict(min_len=-1), "min_len"),
    (dict(max_len=5, min_len=5), "min_len"),
    (dict(batch_size=0), "batch_size"),
    (dict(concurrent_batches=-1), "concurrent_batches"),
])
def test_check_options_names_the_option_and_its_value(options, option):
  with pytest.raises(errors.OptionError) as info:
    decoding_options.check_options(**options)
  error = info.value
  assert isinstance(error, ValueError)
  assert (error.option, error.value) == (option, options[option])
  assert str(error) == f"{option}={options[option]}: {error.problem}"


def test_check_options_accepts_every_usable_value():
  decoding_options.check_options()                       # translate()'s defaults
  decoding_options.check_options(method="beam", beam_size=4, n_best=4)
  decoding_options.check_options(method="sample", n_best=3, top_p=1.0, top_k=0,
                            temperature=0.0, length_penalty=0.0, min_len=4, max_len=5)
  for method in decoding_options.METHODS:
    decoding_options.check_options(method=method)


def test_length_batches_take_inputs_shortest_first_and_skip_empty_ones():
  """Consecutive inputs by length fill each batch, padded to its longest's
  bucket (the next power of two, at least 8, capped at max_length): a batch
  may span buckets; only the last one is short."""
  encoded = [[5] * 3, [], [5] * 10, [5] * 9, [5] * 2, [5] * 40, [5] * 7]
  two = lambda src_len: 2
  assert batching.length_batches(encoded, 32, two) == [
      (8, [4, 0]), (16, [6, 3]), (32, [2, 5])]           # 40 tokens: capped at 32
  assert batching.length_batches(encoded, 32, lambda src_len: 4) == [
      (16, [4, 0, 6, 3]), (32, [2, 5])]
  assert batching.length_batches([[], []], 32, two) == []


def test_length_batches_by_tokens_close_a_batch_before_it_outgrows_them():
  """With `--batch_tokens`, the inputs a batch holds depend on its padded
  length: a batch closes when the next input would pad it to a length at
  which it is already full."""
  encoded = [[5] * n for n in (2, 3, 4, 5, 9, 10, 11, 20)]
  per_batch = lambda src_len: 64 // src_len                 # 8 at 8, 4 at 16, 2 at 32
  # 4 inputs of bucket 8, then the 9-token one would pad them to 16: full.
  assert batching.length_batches(encoded, 64, per_batch) == [
      (8, [0, 1, 2, 3]), (16, [4, 5, 6]), (32, [7])]


def test_length_batches_cut_where_they_pad_the_least_when_that_halves_the_padding(
    monkeypatch):
  """With one batch size, as many batches as filling each in turn makes, cut
  where padding each input to its batch's longest costs the least (sum of
  L_batch^2 - L^2), if that is at most half of what filling in turn pads."""
  tokens = lambda *lengths: [[5] * n for n in lengths]
  three = lambda src_len: 3
  # Buckets 8 x5, 32 x2, 3 a batch: filled in turn, inputs 3 and 4 are padded
  # to 32 (2 x (1024 - 64) = 1,920); the rows left over let them end a batch.
  encoded = tokens(3, 4, 5, 6, 7, 20, 25)
  assert batching.length_batches(encoded, 32, three) == [
      (8, [0, 1, 2]), (8, [3, 4]), (32, [5, 6])]
  assert batching.length_batches(encoded, 32, three, least_padding=False) == [
      (8, [0, 1, 2]), (32, [3, 4, 5]), (32, [6])]
  monkeypatch.setattr(batching, "LEAST_PADDING_MAX_BATCH", 2)   # (batches too large for it)
  assert batching.length_batches(encoded, 32, three) == [
      (8, [0, 1, 2]), (32, [3, 4, 5]), (32, [6])]
  monkeypatch.undo()
  # Buckets 8 x4, 32 x2, 64 x1, 5 a batch: in turn pads the four 8s to 32 and
  # a 32 to 64 (4 x 960 + 3,072 = 6,912); cut after the 8s, the two 32s to 64
  # (6,144): not half, so filled in turn.
  encoded = tokens(3, 4, 5, 6, 20, 25, 40)
  assert batching.length_batches(encoded, 64, lambda src_len: 5) == [
      (32, [0, 1, 2, 3, 4]), (64, [5, 6])]
  # Sizes that depend on the length (`--batch_tokens`): filled in turn.
  assert batching.length_batches(tokens(3, 4, 5, 6, 7, 20, 25), 32,
                                 lambda src_len: 4 if src_len == 8 else 3) == [
      (8, [0, 1, 2, 3]), (32, [4, 5, 6])]


@pytest.mark.parametrize("seed", range(5))
def test_least_padding_cuts_match_a_brute_force_search(seed):
  """`_least_padding_cuts` against every way of cutting sorted lengths into
  the same number of runs of at most `capacity`: the least padding, and of
  equally good cuts the latest."""
  rng = np.random.default_rng(seed)
  for _ in range(40):
    n, capacity = int(rng.integers(2, 11)), int(rng.integers(1, 5))
    lengths = sorted(int(x) for x in rng.choice([8, 16, 32, 64], n))
    runs = -(-n // capacity)
    best = None
    for inner in itertools.combinations(range(1, n), runs - 1):
      cuts = [0, *inner, n]
      if all(0 < b - a <= capacity for a, b in zip(cuts, cuts[1:])):
        key = (batching._padding(lengths, cuts), [-c for c in cuts])
        best = key if best is None or key < best else best
    got = batching._least_padding_cuts(lengths, capacity, runs)
    assert (batching._padding(lengths, got), [-c for c in got]) == best, (lengths, capacity)


def test_shared_buckets_keep_the_buckets_of_least_decoders_plus_padding():
  """A bucket costs `decoder_cost`; an input padded from bucket L to L' costs
  its rows times L'^2 - L^2. The costs below are worked out by hand."""
  tokens = lambda *counts: [[5] * n for n, count in counts for _ in range(count)]
  # 3 inputs of bucket 8, 1 of 64: one decoder (64) costs D + 3 * (4096 - 64)
  # = D + 12,096; two cost 2D.
  few_short = tokens((5, 3), (40, 1))
  assert batching.shared_buckets(few_short, 64, 1, decoder_cost=12_097) == {8: 64}
  assert batching.shared_buckets(few_short, 64, 1, decoder_cost=12_095) == {}
  assert batching.shared_buckets(few_short, 64, 1) == {8: 64}   # (DECODER_COST: 2^20)
  # 4 beams an input: 4 x 12,096 = 48,384.
  assert batching.shared_buckets(few_short, 64, 4, decoder_cost=48_385) == {8: 64}
  assert batching.shared_buckets(few_short, 64, 4, decoder_cost=48_383) == {}
  # 1,000 inputs of bucket 8, 2 of 16, 1 of 64, D = 2^20: {8, 64} costs 2D +
  # 2 * (4096 - 256) = 2D + 7,680; {16, 64} 2D + 1,000 * (256 - 64) = 2D +
  # 192,000; {64} D + 4,032,000 + 7,680; all three 3D.
  assert batching.shared_buckets(tokens((5, 1000), (12, 2), (40, 1)), 64, 1) == {16: 64}
  # 2 inputs each of 8 and 16, 1,000 of 32, 1 of 64 (the longest: kept,
  # whatever it holds): {32, 64} costs 2D + 2 * (1024 - 64) + 2 * (1024 - 256).
  assert batching.shared_buckets(tokens((5, 2), (12, 2), (20, 1000), (40, 1)), 64, 1) == {
      8: 32, 16: 32}
  assert batching.shared_buckets(tokens((5, 3)), 64, 1) == {}   # one bucket
  assert batching.shared_buckets([[], []], 64, 1) == {}


def test_length_batches_pad_a_shared_bucket_to_the_one_it_shares():
  """`shared` {8: 16}: the inputs of bucket 8 are batched as if 16 long
  (`inputs_per_batch` asked at 16) and padded to 16."""
  encoded = [[5] * 3, [], [5] * 10, [5] * 9, [5] * 2, [5] * 40, [5] * 7]
  assert batching.length_batches(encoded, 32, lambda src_len: 2, {8: 16}) == [
      (16, [4, 0]), (16, [6, 3]), (32, [2, 5])]
  asked = []
  per_batch = lambda src_len: asked.append(src_len) or 64 // src_len   # 4 at 16, 2 at 32
  assert batching.length_batches(encoded, 32, per_batch, {8: 16}) == [
      (16, [4, 0, 6, 3]), (32, [2, 5])]
  assert 8 not in asked


def test_pack_batch_and_unpack_hypotheses_agree_on_the_row_layout():
  inputs = [[7, 8, 1], [9, 1]]
  batch = batching.pack_batch(inputs, rows=6, length=4, copies=2)
  np.testing.assert_array_equal(batch, [[7, 8, 1, 0], [7, 8, 1, 0], [9, 1, 0, 0],
                                        [9, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
  # Decoder output [rows, n, length]: row r's k-th hypothesis is r * 10 + k.
  seqs = np.arange(6)[:, None, None] * 10 + np.arange(3)[None, :, None] + np.zeros((1, 1, 2))
  scores = seqs[..., 0] / 100
  samples = batching.unpack_hypotheses(seqs, scores, count=2, copies=2, n_best=2)
  assert [[int(ids[0]) for ids, _ in hyps] for hyps in samples] == [[0, 10], [20, 30]]
  beams = batching.unpack_hypotheses(seqs, scores, count=2, copies=1, n_best=2)
  assert [[int(ids[0]) for ids, _ in hyps] for hyps in beams] == [[0, 1], [10, 11]]
  assert [score for _, score in beams[1]] == [0.1, 0.11]


def _hyps(*texts):
  return [translation.Hypothesis(text, -1.0 - k, -2.0 - k, 3) for k, text in enumerate(texts)]


def test_output_lines_one_per_source_whatever_the_translations_hold():
  sources = ["a", "", "   ", "b"]
  one = [_hyps("x\ty"), _hyps(""), _hyps(""), _hyps("two\nlines\r")]
  assert output.format_lines(0, sources, one, 1, "text") == [
      "x\ty", "", "", "two lines "]                  # a tab is kept with one hypothesis
  two = [_hyps("x", "x\ty"), _hyps("", ""), _hyps("", ""), _hyps("p\nq", "r")]
  assert output.format_lines(0, sources, two, 2, "text") == [
      "x\tx y", "", "", "p q\tr"]                     # tabs only between hypotheses


def test_json_lines_name_the_line_the_source_and_every_hypothesis():
  sources = ["a\tb", "", "c"]
  lines = output.format_lines(10, sources, [_hyps("x\ny", "z"), _hyps("", ""), _hyps("w", "v")],
                              2, "jsonl")
  records = [json.loads(line) for line in lines]
  assert all("\n" not in line for line in lines)
  assert [r["line"] for r in records] == [11, 12, 13]   # 1-based, after line 10
  assert [r["source"] for r in records] == sources
  assert records[0]["hypotheses"] == [
      {"text": "x\ny", "score": -1.0, "log_prob": -2.0, "length": 3},
      {"text": "z", "score": -2.0, "log_prob": -3.0, "length": 3}]
  assert records[1]["hypotheses"] == []                # an empty line has none


STATS = {"sentences": 8, "decoded": 6, "truncated": 0, "generated_tokens": 120,
         "seconds": 3.04, "compile_seconds": 2.01, "devices": 1,
         "tokens_per_second": 116.5}


def test_summary_line():
  assert output.summary_line(STATS, method="beam", checkpoint="step 300") == (
      "decoded 8 sentences (6 non-empty), 120 tokens generated in 3.0 s (compiling "
      "2.0 s; 116.5 tokens/s decoding), beam, step 300")
  line = output.summary_line(dict(STATS, devices=2), method="sample",
                                  checkpoint="averaged steps [200, 300]", plots=6)
  assert line.endswith("sample, averaged steps [200, 300], on 2 devices, 6 attention plots")
  assert output.summary_line(STATS, method="beam", checkpoint="", plots=0).endswith(
      ", 0 attention plots")
  assert "(compiling 2.0 s; 3 searched again in full; 116.5 tokens/s" in output.summary_line(
      dict(STATS, searched_again=3), method="beam", checkpoint="")
  assert output.summary_line(STATS, method="greedy", checkpoint="step 300",
                             weights_dtype="bfloat16").endswith(
      "decoding), greedy, bfloat16 weights, step 300")


@pytest.mark.parametrize("src_len,out_len,min_len,first", [
    (8, 58, 0, 24),     # 8 + 16: at least 16 more tokens
    (16, 66, 0, 32),
    (32, 82, 0, 48),    # 32 + 32 / 2
    (64, 114, 0, 114),  # 96 > 3/4 of 114: the whole search
    (64, 128, 0, 96),   # 96 = 3/4 of 128
    (7, 57, 0, 24),     # 7 + 16 = 23, whole early-exit chunks (2)
    (8, 58, 5, 30),     # 5 + 8 + 16 = 29 -> 30
    (8, 20, 0, 20),     # never past the search itself
    (8, 30, 0, 30),     # 24 > 3/4 of 30
    (128, 178, 0, 178),
])
def test_first_search_length_is_the_source_and_half_of_it_at_least_16_more(
    src_len, out_len, min_len, first):
  """... where that is at most 3/4 of the search; else the whole search."""
  assert options.EARLY_EXIT_CHUNK == 2 and batching.FIRST_SEARCH_EXTRA == 16
  assert batching.FIRST_SEARCH_MAX_SHARE == 0.75
  assert batching.first_search_length(src_len, out_len, min_len) == first


def test_truncation_warning_counts_in_words():
  assert output.truncation_warning(STATS, max_len=128) is None
  assert output.truncation_warning(dict(STATS, truncated=1), max_len=128) == (
      "warning: 1 input line longer than the model's max_len=128 tokens was truncated")
  assert output.truncation_warning(dict(STATS, truncated=3), max_len=64) == (
      "warning: 3 input lines longer than the model's max_len=64 tokens were truncated")
