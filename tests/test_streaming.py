"""Decoding files of any size (transformer/decoding/streaming.py): windows
written in input order, a resume that ends in the bytes of an uninterrupted run,
refusals that name what changed; the streaming reader against the whole-file
one; per-line sampling; the options that cost nothing when off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from transformer.data import demo_task, text_io
from transformer.decoding import streaming
from transformer.decoding.translator import Hypothesis
from transformer.runtime import workdir as workdir_lib

REPO = Path(__file__).resolve().parents[1]
FIXTURE_WORKDIR = REPO / "tests" / "fixtures" / "workdir_d26a6fb"
sys.path.insert(0, str(REPO / "tests"))
from helpers import subprocess_env  # noqa: E402


# ----------------------------------------------------------------------------
# The streaming reader
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    b"", b"a", b"a\n", b"\n", b"a\n\n", b"a\r\nb", b"a\r\nb\r\n",
    b"\xef\xbb\xbfx\n\ny\n", "zwölf Äpfel\nfünf\n".encode(), b"a\nb\xffc\nd\n",
    b"ok\n\xe2\x82\n"])
def test_iter_lines_reads_what_read_lines_reads(tmp_path, data):
  """Line by line, the same lines as the whole-file reader (the reference),
  and a bad byte named at the same line and column."""
  path = tmp_path / "in.txt"
  path.write_bytes(data)
  try:
    want = text_io.read_lines(str(path))
  except text_io.NotUtf8Error as e:
    want = ("not utf-8", e.line, e.column)
  got, raws = [], []
  try:
    for raw, text in text_io.iter_lines(str(path)):
      raws.append(raw)
      got.append(text)
  except text_io.NotUtf8Error as e:
    got = ("not utf-8", e.line, e.column)
  assert got == want
  if not isinstance(want, tuple):
    assert b"".join(raws) == data  # every byte is accounted for (the resume hash)


# ----------------------------------------------------------------------------
# decode_file with a stand-in translator (the logic of windows and resume)
# ----------------------------------------------------------------------------


class ReversingTranslator:
  """Translates a sentence to its reverse (the score: minus its length);
  `fail_at_window` raises inside that window, as a run killed while
  decoding it would stop."""

  def __init__(self, fail_at_window: int | None = None):
    self.windows, self.fail_at_window, self.last_stats = 0, fail_at_window, {}

  def translate_hypotheses(self, sentences, *, n_best=1, first_line=0, progress=False,
                           **options):
    self.windows += 1
    if self.windows == self.fail_at_window:
      raise KeyboardInterrupt("killed")
    self.last_stats = {"sentences": len(sentences), "decoded": len(sentences)}
    return [[Hypothesis(s[::-1] + "!" * k, -len(s) - k, -len(s) - k, len(s) + 1)
             for k in range(n_best)] for s in sentences]


LINES = [f"line {i}" if i % 7 else "" for i in range(1, 24)]  # 23 lines, some empty


def _decode(tmp_path, translator, *, window=5, options=None, lines=LINES,
            output_format="text", name="out.txt"):
  src = tmp_path / "in.txt"
  if not src.exists():
    src.write_text("".join(line + "\n" for line in lines))
  out = tmp_path / name
  return out, streaming.decode_file(
      translator, str(src), str(out), options=options or {"method": "greedy"},
      run={"workdir": "w", "checkpoint": "step 1"}, window_lines=window,
      output_format=output_format)


def test_windows_give_one_line_per_input_line_in_order(tmp_path):
  out, stats = _decode(tmp_path, ReversingTranslator(), window=5)
  assert out.read_text().splitlines() == [line[::-1] for line in LINES]
  assert stats["lines"] == len(LINES) and stats["resumed_at"] == 0
  assert not Path(streaming.progress_path(str(out))).exists()  # removed at the end
  # The same with n-best, tab-separated, and as JSON lines numbered from 1.
  out, _ = _decode(tmp_path, ReversingTranslator(), options={"n_best": 2}, name="n.txt")
  assert out.read_text().splitlines()[:2] == ["1 enil\t1 enil!", "2 enil\t2 enil!"]
  out, _ = _decode(tmp_path, ReversingTranslator(), output_format="jsonl", name="j.jsonl")
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["line"] for r in records] == list(range(1, 24))
  assert records[0]["hypotheses"] == [{"text": "1 enil", "score": -6, "log_prob": -6,
                                       "length": 7}]
  assert records[6] == {"line": 7, "source": "", "hypotheses": []}


def test_a_stopped_run_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path):
  whole, _ = _decode(tmp_path, ReversingTranslator(), name="whole.txt")
  with pytest.raises(KeyboardInterrupt):
    _decode(tmp_path, ReversingTranslator(fail_at_window=3))
  out = tmp_path / "out.txt"
  record = json.loads(Path(streaming.progress_path(str(out))).read_text())
  assert record["lines_done"] == 10 and record["output_bytes"] == out.stat().st_size
  with open(out, "ab") as f:
    f.write(b"half a window written before the kill")  # beyond the record: cut off
  resumed = ReversingTranslator()
  out, stats = _decode(tmp_path, resumed)
  assert stats["resumed_at"] == 10 and resumed.windows == 3  # lines 11-15, 16-20, 21-23
  assert out.read_bytes() == whole.read_bytes()


def test_a_resume_refuses_another_option_or_input_naming_it(tmp_path):
  with pytest.raises(KeyboardInterrupt):
    _decode(tmp_path, ReversingTranslator(fail_at_window=2),
            options={"method": "beam", "beam_size": 4})
  with pytest.raises(streaming.ResumeMismatch, match=r"options.beam_size: 4 then, 5 now"):
    _decode(tmp_path, ReversingTranslator(), options={"method": "beam", "beam_size": 5})
  src = tmp_path / "in.txt"
  src.write_text("changed\n" + "".join(line + "\n" for line in LINES[1:]))
  with pytest.raises(streaming.ResumeMismatch, match="changed in its first 5 lines"):
    _decode(tmp_path, ReversingTranslator(), options={"method": "beam", "beam_size": 4})


def test_empty_input_gives_empty_output(tmp_path):
  out, stats = _decode(tmp_path, ReversingTranslator(), lines=[])
  assert out.read_bytes() == b"" and stats["lines"] == 0


# ----------------------------------------------------------------------------
# The Translator: per-line sampling, n-best order, batches, options off
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def translator():
  import transformer
  with jax.default_matmul_precision("highest"):
    yield transformer.load_translator(str(FIXTURE_WORKDIR))


SENTENCES = ["forty-two red apples and one small cat", "", "ten white lamps",
             "seven old houses", "one small cat"]


def test_a_lines_sample_depends_only_on_the_seed_and_its_line_number(translator):
  options = dict(method="sample", top_k=5, temperature=1.3, seed=7, n_best=3)
  together = translator.translate_hypotheses(SENTENCES, batch_size=2, **options)
  alone = [translator.translate_hypotheses([s], first_line=i, batch_size=8, **options)[0]
           for i, s in enumerate(SENTENCES)]
  # The same tokens; scores agree to float32 rounding (other batch shapes).
  assert [[(h.text, h.length) for h in hyps] for hyps in together] == [
      [(h.text, h.length) for h in hyps] for hyps in alone]
  np.testing.assert_allclose([[h.score for h in hyps] for hyps in together],
                             [[h.score for h in hyps] for hyps in alone], rtol=0, atol=1e-5)
  for hyps in together:  # n-best samples come best first
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
  other_seed = translator.translate_hypotheses(SENTENCES, **dict(options, seed=8))
  assert other_seed != together


def test_beam_scores_are_log_probs_over_the_length_penalty(translator):
  """log_prob is the beam score times lp(length) = ((5 + length) / 6)^alpha,
  and equals what sampling reports for the same text (its plain log p)."""
  beam = translator.translate_hypotheses(SENTENCES, method="beam", length_penalty=0.6)
  greedy = translator.translate_hypotheses(SENTENCES, method="greedy")
  compared = 0
  for b, g in zip(beam, greedy):
    h = b[0]
    np.testing.assert_allclose(h.log_prob, h.score * ((5 + h.length) / 6) ** 0.6, rtol=1e-6)
    if b[0].text == g[0].text and b[0].text:
      np.testing.assert_allclose(h.log_prob, g[0].log_prob, rtol=1e-4)
      assert h.length == g[0].length
      compared += 1
  assert compared >= 3  # (the premise: beam and greedy agree on most of these)


def test_batches_by_tokens_translate_as_batches_by_sentences(translator):
  rows = translator.policy.batch_rows(32, 1, batch_tokens=256, src_len=16)
  assert rows == 16
  assert translator.policy.batch_rows(32, 1, batch_tokens=256, src_len=64) == 4
  by_tokens = translator.translate(SENTENCES, method="greedy", batch_tokens=40)
  assert by_tokens == translator.translate(SENTENCES, method="greedy", batch_size=3)


def _decoder_hlo(translator, temperature: float, top_p: float) -> str:
  options = dict(method="sample", top_k=0, temperature=temperature, top_p=top_p, seed=0)
  translator.translate_hypotheses(["one small cat"], **options)
  shape = [s for s in translator.decoders.executables if s.method == "sample"][-1]
  return translator.decoders.executables[shape].as_text()


def test_temperature_and_top_p_cost_nothing_when_off(translator):
  """Off (1 and 1): no sort of the vocabulary and no division of the logits in
  the compiled decoder; on: both are there (the premise)."""
  off = _decoder_hlo(translator, 1.0, 1.0)
  on = _decoder_hlo(translator, 0.7, 0.9)
  assert " sort(" in on and " sort(" not in off
  assert on.count(" divide(") > off.count(" divide(")


# ----------------------------------------------------------------------------
# Which checkpoint "auto" means
# ----------------------------------------------------------------------------


def test_auto_takes_the_latest_step_over_an_older_average(monkeypatch, tmp_path):
  from transformer.runtime import checkpoint_names
  steps = {checkpoint_names.CHECKPOINT_DIR: [100, 200], checkpoint_names.AVERAGED_DIR: [200]}
  monkeypatch.setattr(checkpoint_names, "checkpoint_steps",
                      lambda workdir, subdir=checkpoint_names.CHECKPOINT_DIR: steps[subdir])
  monkeypatch.setattr(checkpoint_names, "averaged_info",
                      lambda workdir: {"averaged_steps": [100, 200], "step": 200})
  assert workdir_lib.resolve_checkpoint(str(tmp_path)) == "averaged"
  assert workdir_lib.stale_average_note(str(tmp_path)) is None
  steps[checkpoint_names.CHECKPOINT_DIR] = [100, 200, 300]  # resumed, trained on, killed
  assert workdir_lib.resolve_checkpoint(str(tmp_path)) == 300
  note = workdir_lib.stale_average_note(str(tmp_path))
  assert "steps up to 200" in note and "latest step 300" in note
  assert workdir_lib.resolve_checkpoint(str(tmp_path), "averaged") == "averaged"


# ----------------------------------------------------------------------------
# decode.py killed with SIGKILL, then the same command
# ----------------------------------------------------------------------------


def test_decode_py_killed_then_resumed_writes_the_uninterrupted_bytes(tmp_path):
  """Killed once two windows of 400 lines are written (of 5: it is still
  decoding, which the test checks), then run again: the output is the
  uninterrupted run's, byte for byte, and the progress record is gone."""
  pairs = demo_task.demo_splits(0, num_train=2000, num_eval=1, num_test=1)["train"]
  src = tmp_path / "in.txt"
  src.write_text("".join(source + "\n" for source, _ in pairs))
  env = subprocess_env(tmp_path / "cache")
  flags = [f"--workdir={FIXTURE_WORKDIR}", f"--input={src}", "--window_lines=400",
           "--method=beam", "--quiet"]
  whole = tmp_path / "whole.txt"
  subprocess.run([sys.executable, "decode.py", *flags, f"--output={whole}"], cwd=REPO,
                 env=env, check=True, timeout=600)
  out = tmp_path / "out.txt"
  record = Path(streaming.progress_path(str(out)))
  proc = subprocess.Popen([sys.executable, "decode.py", *flags, f"--output={out}"], cwd=REPO,
                          env=env, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    if record.exists() and json.loads(record.read_text() or "{}").get("lines_done", 0) >= 800:
      break
    time.sleep(0.05)
  assert proc.poll() is None, "decode.py finished before it could be killed"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  done = json.loads(record.read_text())["lines_done"]
  assert 800 <= done < len(pairs)
  result = subprocess.run([sys.executable, "decode.py", *flags, f"--output={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert out.read_bytes() == whole.read_bytes()
  assert not record.exists()
