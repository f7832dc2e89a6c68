"""transformer/training/metrics.py: the translation scores a run reports."""

import math

import pytest

from transformer.training import metrics


def test_translation_scores_against_the_formulas():
  references = ["the cat sat on the mat", "a b c d e f g h"]
  # One exact, one with its last 4 words missing: 10 hypothesis words, 14 reference words.
  hypotheses = ["the cat sat on the mat", "a b c d"]
  scores = metrics.translation_scores(hypotheses, references)
  assert scores["exact_match"] == 0.5
  assert scores["length_ratio"] == pytest.approx(10 / 14)
  assert scores["brevity_penalty"] == pytest.approx(math.exp(1 - 14 / 10))  # BLEU's BP
  assert 0 < scores["bleu"] < 100 and 0 < scores["chrf"] < 100
  perfect = metrics.translation_scores(references, references)
  assert perfect["bleu"] == pytest.approx(100) and perfect["chrf"] == pytest.approx(100)
  assert perfect["brevity_penalty"] == 1.0 and perfect["exact_match"] == 1.0
