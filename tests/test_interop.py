"""Export to CTranslate2 (transformer/interop/ctranslate2_export.py), checked
against CTranslate2's own implementation: its teacher-forced log-probabilities
(`score_batch`) against this model's log-softmax, for every layout a config
can choose, and its greedy translations against the Translator's on a
trained model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from scoring import teacher_forced_log_probs

ctranslate2 = pytest.importorskip("ctranslate2")

from transformer.data import demo_task  # noqa: E402
from transformer.data.tokenizer import load_tokenizer  # noqa: E402
from transformer.interop import ctranslate2_export  # noqa: E402
from transformer.model import TransformerConfig, init_params  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURE_WORKDIR = REPO / "tests" / "fixtures" / "workdir_d26a6fb"


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(str(FIXTURE_WORKDIR / "vocab.model"))


def _pieces(tokenizer, ids):
  return [tokenizer.id_to_piece(i) for i in ids]


VARIANTS = {
    "paper (post-LN, tied, relu, sinusoidal)": {},
    "pre-LN": {"normalization": "pre"},
    "untied, own output projection": {"share_embeddings": False,
                                      "logits_via_embedding": False},
    "gelu, learned positions": {"activation": "gelu", "positional": "learned"},
    "scan_layers, 3 + 2 layers": {"scan_layers": True, "num_encoder_layers": 3,
                                  "num_decoder_layers": 2},
    "swish, logits bias (Marian's)": {"activation": "swish", "logits_bias": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ctranslate2_scores_what_this_model_scores(variant, tokenizer, tmp_path):
  fields = dict(vocab_size=tokenizer.vocab_size, d_model=32, num_heads=4, d_ff=64,
                num_encoder_layers=2, num_decoder_layers=2, max_len=64)
  config = TransformerConfig(**{**fields, **VARIANTS[variant]})
  params = init_params(config, jax.random.key(1))
  # Sharper than the init's near-uniform logits, and no bias, scale or logits
  # bias left at a constant (a constant logits bias would not show).
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree.unflatten(treedef, [
      x * 3.0 if x.ndim >= 2 else x + 0.5 * jax.random.normal(k, x.shape)
      for x, k in zip(leaves, keys)])
  out = ctranslate2_export.export(config, params, tokenizer, str(tmp_path / "ct2"))
  rng = np.random.default_rng(0)
  sources = [list(rng.integers(4, tokenizer.vocab_size, size=n)) for n in (3, 7, 12)]
  targets = [list(rng.integers(4, tokenizer.vocab_size, size=n)) for n in (5, 2, 9)]
  scored = ctranslate2.Translator(out, intra_threads=1).score_batch(
      [_pieces(tokenizer, s) for s in sources], [_pieces(tokenizer, t) for t in targets])
  theirs = np.asarray([sum(r.log_probs) for r in scored])
  assert [len(r.log_probs) for r in scored] == [len(t) + 1 for t in targets]  # + EOS
  np.testing.assert_allclose(theirs,
                             teacher_forced_log_probs(config, params, sources, targets),
                             rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  out = tmp_path_factory.mktemp("ct2") / "model"
  result = subprocess.run(
      [sys.executable, "-m", "transformer.interop.ctranslate2_export",
       f"--workdir={FIXTURE_WORKDIR}", f"--output_dir={out}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  return out


def test_a_trained_workdir_translates_the_same_in_ctranslate2(trained):
  import sentencepiece as spm
  import transformer
  sources = [s for s, _ in demo_task.demo_splits(3, num_train=60, num_eval=1,
                                                 num_test=1)["train"]]
  with jax.default_matmul_precision("highest"):
    ours = transformer.load_translator(str(FIXTURE_WORKDIR)).translate_hypotheses(
        sources, method="greedy")
  sp = spm.SentencePieceProcessor(model_file=str(trained / "vocab.model"))
  translator = ctranslate2.Translator(str(trained), intra_threads=1)
  results = translator.translate_batch([sp.encode(s, out_type=str) for s in sources],
                                       beam_size=1, max_decoding_length=100,
                                       return_scores=True)
  assert [sp.decode(r.hypotheses[0]) for r in results] == [h[0].text for h in ours]
  # Its greedy score is log p / length: float32 sums in another order.
  np.testing.assert_allclose([r.scores[0] for r in results],
                             [h[0].log_prob / h[0].length for h in ours], rtol=0, atol=2e-4)


def test_quantized_exports_translate(tmp_path):
  import sentencepiece as spm
  sources = [s for s, _ in demo_task.demo_splits(4, num_train=40, num_eval=1,
                                                 num_test=1)["train"]]
  sp = spm.SentencePieceProcessor(model_file=str(FIXTURE_WORKDIR / "vocab.model"))
  tokens = [sp.encode(s, out_type=str) for s in sources]
  outputs = {}
  for quantization in ("float32", "int8", "int8_float32", "float16"):
    out = ctranslate2_export.export_workdir(str(FIXTURE_WORKDIR),
                                            str(tmp_path / quantization),
                                            quantization=quantization)
    translator = ctranslate2.Translator(out, intra_threads=1)
    outputs[quantization] = [sp.decode(r.hypotheses[0]) for r in
                             translator.translate_batch(tokens, beam_size=1)]
  for quantization in ("int8", "int8_float32", "float16"):  # lossy, but the same model
    same = np.mean([a == b for a, b in zip(outputs[quantization], outputs["float32"])])
    assert same >= 0.8, (quantization, same)


def test_the_command_names_a_missing_workdir(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "transformer.interop.ctranslate2_export",
       f"--workdir={tmp_path / 'nowhere'}", f"--output_dir={tmp_path / 'out'}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert "nowhere" in result.stderr and "Traceback" not in result.stderr


def test_without_the_interop_extra_each_command_says_what_to_install(tmp_path, monkeypatch,
                                                                     capsys):
  """A module of the `interop` extra missing: one line naming it and the
  install command, not a traceback (sys.modules[name] = None: its import fails)."""
  from transformer.interop import marian
  monkeypatch.setitem(sys.modules, "ctranslate2", None)
  code = ctranslate2_export.main([f"--workdir={FIXTURE_WORKDIR}",
                                  f"--output_dir={tmp_path / 'ct2'}"])
  err = capsys.readouterr().err
  assert code == 1 and err.splitlines() == [
      'error: ctranslate2 is not installed; the interop extra installs it: '
      'pip install -e ".[interop]" (or pip install "ctranslate2")'], err
  hf = tmp_path / "hf"  # (a Hugging Face Marian folder's names: read with safetensors)
  hf.mkdir()
  for name in marian.HF_FILES:
    (hf / name).write_bytes(b"{}" if name.endswith(".json") else b"")
  monkeypatch.setitem(sys.modules, "safetensors", None)
  monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
  code = marian.main([f"--model={hf}", f"--workdir={tmp_path / 'w'}"])
  err = capsys.readouterr().err
  assert code == 2 and err.splitlines() == [
      'error: safetensors is not installed; the interop extra installs it: '
      'pip install -e ".[interop]" (or pip install "safetensors")'], err
  assert not (tmp_path / "w").exists() and not (tmp_path / "ct2").exists()


def test_a_fixed_step_run_decodes_every_row_exactly_that_many_steps(trained, tmp_path):
  """bench_vs_ctranslate2 --fixed_steps compares the engines' step alone: under
  its options every hypothesis of ours (greedy, beam n-best) holds exactly N
  tokens, and CTranslate2's N (N - 1 where it left out a final EOS), on
  inputs whose own translations are shorter or longer than N."""
  import transformer
  sys.path.insert(0, str(REPO))
  from benchmarks import bench_vs_ctranslate2 as bench
  sources = [s for s, _ in demo_task.demo_splits(5, num_train=12, num_eval=1,
                                                 num_test=1)["train"]]
  steps = 7
  translator = transformer.load_translator(str(FIXTURE_WORKDIR))
  free = translator.translate_hypotheses(sources, method="greedy")
  assert {h[0].length for h in free} - {steps}  # unconstrained: other lengths
  for method, n_best in (("greedy", 1), ("beam", 2)):
    hypotheses = translator.translate_hypotheses(sources, method=method, n_best=n_best,
                                                 **bench.fixed_step_options(steps))
    assert {h.length for hs in hypotheses for h in hs} == {steps}, method
  src_file = tmp_path / "src.txt"
  src_file.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
  for beam in (1, 4):
    _, _, hyps = bench.ct2_run(trained, src_file, tmp_path / "out.txt", batch=4, beam=beam,
                               threads=1, fixed_steps=steps)
    assert len(hyps) == len(sources)


def test_the_models_lazy_names_are_listed_by_dir():
  """transformer.model hands on model/transformer.py's names on first use
  (`__getattr__`, so that importing the package does not import flax); its
  `__dir__` lists them too, so that dir(), completion and tools that look
  names up (as this file's `from transformer.model import init_params` does)
  find them, and listing them imports nothing."""
  import transformer.model as model
  listed = dir(model)
  assert set(model.__all__) <= set(listed), sorted(set(model.__all__) - set(listed))
  assert all(getattr(model, name) is not None for name in model.__all__)
  check = ("import sys, transformer.model as m; names = dir(m); "
           "assert 'Transformer' in names and 'init_params' in names, names; "
           "assert 'flax' not in sys.modules, 'dir() imported flax'")
  result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
