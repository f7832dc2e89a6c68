"""The product as a user meets it: `python train.py` on the demo, then
`decode.py` on the demo test set. Slow (a few minutes): run with `pytest -m slow`."""

import os
import subprocess
import sys

import pytest
import sacrebleu

from transformer.data import demo_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_train_py_then_decode_py_on_the_demo(tmp_path):
  workdir = tmp_path / "demo"
  env = dict(os.environ)
  train = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
                          "--quiet"], capture_output=True, text=True, env=env, timeout=1200)
  assert train.returncode == 0, train.stderr[-3000:]
  assert "exact match" in train.stdout

  test_pairs = demo_task.demo_splits()["test"]
  sources = [s for s, _ in test_pairs]
  # Empty lines stay in place.
  lines = sources[:100] + [""] + sources[100:200]
  (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
  decode = subprocess.run(
      [sys.executable, os.path.join(ROOT, "decode.py"), f"--workdir={workdir}",
       f"--input={tmp_path / 'in.txt'}", f"--output={tmp_path / 'out.txt'}", "--quiet"],
      capture_output=True, text=True, env=env, timeout=1200)
  assert decode.returncode == 0, decode.stderr[-3000:]
  out = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")
  assert out[-1] == "" and len(out) - 1 == len(lines)
  out = out[:-1]
  assert out[100] == ""
  hyps = out[:100] + out[101:]
  refs = [t for _, t in test_pairs[:200]]
  bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
  exact = sum(h == r for h, r in zip(hyps, refs)) / len(refs)
  assert bleu > 90.0, (bleu, list(zip(hyps, refs))[:5])
  assert exact > 0.9, exact
