"""Beam search's length penalty chosen on validation at the end of training
(training/length_choice.py), kept in <workdir>/decoding.json and used as the
workdir's default by `load_translator` and decode.py (runtime/workdir_records.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import sacrebleu

sys.path.insert(0, os.path.dirname(__file__))
from helpers import hostile_pickle  # noqa: E402

from transformer.runtime import workdir_records  # noqa: E402
from transformer.runtime import workdir as workdir_lib  # noqa: E402
from transformer.training import length_choice  # noqa: E402

FIXTURE_WORKDIR = Path(__file__).parent / "fixtures" / "workdir_d26a6fb"  # a trained tiny model

REFERENCES = ["the red cat sat on the mat today", "a small dog ran into the old house",
              "one green lamp and two white books", "nine tall trees stood in the cold wind"]


class FakeTranslator:
  """Translates each source to its reference, cut (alpha 0.6: its last two
  words), exact (1.0) or with an extra word (1.4): what a length penalty
  does to beam search's choice, made plain."""

  def __init__(self):
    self.calls = []

  def translate(self, sources, *, method, beam_size, length_penalty, share):
    self.calls.append((method, beam_size, length_penalty, share))
    refs = [REFERENCES[int(s)] for s in sources]
    if length_penalty < 0.8:
      return [" ".join(r.split()[:-2]) for r in refs]
    if length_penalty < 1.2:
      return refs
    return [r + " again" for r in refs]


def test_choose_keeps_the_best_bleu_and_records_every_candidates_scores(
    tmp_path):
  pairs = [(str(i), r) for i, r in enumerate(REFERENCES)]
  translator = FakeTranslator()
  best = length_choice.choose(translator, pairs, (0.6, 1.0, 1.4), str(tmp_path), beam_size=3)
  assert best == 1.0
  assert [c[:3] for c in translator.calls] == [("beam", 3, 0.6), ("beam", 3, 1.0),
                                               ("beam", 3, 1.4)]
  record = json.loads((tmp_path / "decoding.json").read_text())
  assert record["length_penalty"] == 1.0
  assert record["chosen_on"] == "4 validation pairs, beam 3"
  # The scores, against sacrebleu on the same hypotheses computed here.
  cut = [" ".join(r.split()[:-2]) for r in REFERENCES]
  bleu = sacrebleu.corpus_bleu(cut, [REFERENCES])
  assert record["validation"]["0.6"]["bleu"] == pytest.approx(bleu.score, abs=1e-4)
  assert record["validation"]["0.6"]["brevity_penalty"] == pytest.approx(bleu.bp, abs=1e-4)
  assert bleu.bp < 0.8
  assert record["validation"]["1"]["bleu"] == pytest.approx(100.0)
  assert record["validation"]["1.4"]["brevity_penalty"] == 1.0
  assert workdir_records.read_decoding(tmp_path) == {"length_penalty": 1.0}


def test_a_tie_keeps_the_earliest_candidate(tmp_path):
  pairs = [(str(i), r) for i, r in enumerate(REFERENCES)]
  # 0.9 and 1.0 translate the same (exact): the first listed is kept.
  assert length_choice.choose(FakeTranslator(), pairs, (0.9, 1.0, 0.6), str(tmp_path)) == 0.9
  assert length_choice.choose(FakeTranslator(), pairs, (1.0, 0.9), str(tmp_path)) == 1.0


def test_without_candidates_or_time_the_configs_alpha_is_used_and_recorded(tmp_path):
  """No candidates, or no time for them: config.length_penalty, recorded in
  decoding.json where it is not the paper's 0.6 (an older record removed)."""
  class Evaluate:
    bleu_pairs = [("0", REFERENCES[0])]

    def translator(self, params):
      raise AssertionError("nothing is translated")

  import ml_collections
  config = ml_collections.ConfigDict({"length_penalty": 0.6, "length_penalty_candidates": (),
                                      "eval_beam_size": 4})
  (tmp_path / "decoding.json").write_text('{"length_penalty": 1.4}')
  assert length_choice.tuned(config, Evaluate(), None, str(tmp_path), fits=True) == 0.6
  assert not (tmp_path / "decoding.json").exists()
  assert length_choice.tuned(config, Evaluate(), None, str(tmp_path), fits=True) == 0.6
  config.length_penalty = 1.0
  assert length_choice.tuned(config, Evaluate(), None, str(tmp_path), fits=True) == 1.0
  assert workdir_records.read_decoding(tmp_path) == {"length_penalty": 1.0}
  config.length_penalty_candidates = (0.6, 1.4)   # (no time for them: the config's)
  assert length_choice.tuned(config, Evaluate(), None, str(tmp_path), fits=False) == 1.0
  assert json.loads((tmp_path / "decoding.json").read_text()) == {
      "length_penalty": 1.0, "chosen_on": "config.length_penalty"}


@pytest.mark.parametrize("overrides, named", [
    ({"length_penalty": -0.1}, "config.length_penalty: -0.1 is not a number in"),
    ({"length_penalty": 5.5}, "config.length_penalty: 5.5 is not a number in"),
    ({"length_penalty_candidates": (0.6, 9.0)}, "config.length_penalty_candidates: 9.0 is"),
    ({"length_penalty_candidates": (True,)}, "config.length_penalty_candidates: True is"),
])
def test_a_length_penalty_outside_what_decoding_json_holds_is_refused(overrides, named):
  from transformer.configs import small_corpus
  from transformer.training import run_setup
  config = small_corpus.get_config()
  run_setup.check_train_config(config)
  config.update(overrides)
  with pytest.raises(ValueError, match=named):
    run_setup.check_train_config(config)


@pytest.mark.parametrize("content, problem", [
    (b'{"length_penalty": "1.0"}', "not a number in"),
    (b'{"length_penalty": true}', "not a number in"),
    (b'{"length_penalty": NaN}', "not a number in"),
    (b'{"length_penalty": 1e300}', "not a number in"),
    (b'{"length_penalty": -0.5}', "not a number in"),
    (b'[1.0]', "a JSON object is expected"),
    (b'{"length_penalty": 1.0', "not valid JSON"),
    (b'\xff\xfe', "not valid JSON"),
    (None, "not valid JSON"),   # a pickle that runs a command when unpickled
])
def test_a_received_decoding_record_is_data(tmp_path, content, problem):
  """decoding.json is read as JSON and checked: anything else is one
  sentence naming the file (through `workdir.read`, the one door), and a
  planted pickle runs nothing."""
  marker = tmp_path / "ran"
  workdir = tmp_path / "run"
  shutil.copytree(FIXTURE_WORKDIR, workdir)
  (workdir / "decoding.json").write_bytes(hostile_pickle(marker) if content is None else content)
  with pytest.raises(ValueError, match=problem) as raised:
    workdir_lib.read(workdir, None)
  assert str(workdir / "decoding.json") in str(raised.value)
  assert "\n" not in str(raised.value)
  assert not marker.exists()


def test_the_workdirs_length_penalty_is_the_translators_and_decode_pys_default(tmp_path):
  """With decoding.json, beam search's default alpha is the workdir's: the
  scores are log p / ((5 + length) / 6)^alpha at its alpha (numpy, here),
  from `load_translator` and from decode.py's command alike; an explicit
  alpha still wins."""
  import transformer
  from transformer.decoding import command
  workdir = tmp_path / "run"
  shutil.copytree(FIXTURE_WORKDIR, workdir)
  inputs = json.loads((FIXTURE_WORKDIR / "expected.json").read_text())["inputs"][:4]
  inputs = [s for s in inputs if s]

  def gnmt(alpha, hyp):
    return hyp.log_prob / ((5.0 + hyp.length) / 6.0) ** alpha

  with jax.default_matmul_precision("highest"):
    plain = transformer.load_translator(str(workdir))
    assert plain.length_penalty == 0.6
    (workdir / "decoding.json").write_text(json.dumps({"length_penalty": 2.5, "chosen_on": "x"}))
    translator = transformer.load_translator(str(workdir))
    assert translator.length_penalty == 2.5
    default = translator.translate_hypotheses(inputs, n_best=2)
    for hyps in default:
      for hyp in hyps:
        assert hyp.score == pytest.approx(gnmt(2.5, hyp), rel=1e-5)
    explicit = translator.translate_hypotheses(inputs, n_best=2, length_penalty=0.6)
    for hyps in explicit:
      for hyp in hyps:
        assert hyp.score == pytest.approx(gnmt(0.6, hyp), rel=1e-5)
    source = tmp_path / "in.txt"
    source.write_text("".join(s + "\n" for s in inputs))
    command.decode(command.Request(
        workdir=str(workdir), input_path=str(source), output_path=str(tmp_path / "out.jsonl"),
        options=dict(n_best=2, length_penalty=None), output_format="jsonl", quiet=True))
  lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert len(lines) == len(inputs)
  for line, hyps in zip(lines, default):
    got = line["hypotheses"]
    assert [h["text"] for h in got] == [h.text for h in hyps]
    for h in got:
      assert h["score"] == pytest.approx(h["log_prob"] / ((5.0 + h["length"]) / 6.0) ** 2.5,
                                         rel=1e-5)
  assert not np.allclose([h.score for hyps in default for h in hyps],
                         [h.score for hyps in explicit for h in hyps])
