"""Export to Hugging Face transformers (transformer/interop/hf_export.py).

Checked against computations nobody here wrote for this model:
  * transformers' MarianMTModel / PegasusForConditionalGeneration written
    again in float64 numpy from their source (tests/hf_reference.py), reading
    only the exported files: the exported model's log-probabilities are this
    model's, PAD (which has no id there) left out of the softmax;
  * SentencePiece's pieces through vocab.json, as transformers'
    MarianTokenizer maps them;
  * the importer (interop/marian.py), already checked against models
    transformers itself wrote: import(export(W)) translates as W;
  * where transformers and torch are installed (docs/testing.md), the Auto
    classes themselves: the same greedy and beam translations as decode.py,
    and the log-probabilities of decode.py --score.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import sentencepiece as spm
from helpers import REPO, run_checked, subprocess_env
from hf_reference import hf_log_probs

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from transformer.data import marian_tokenizer  # noqa: E402
from transformer.data.tokenizer import load_tokenizer  # noqa: E402
from transformer.interop import hf_export, marian  # noqa: E402
from transformer.model import Transformer, init_params  # noqa: E402
from transformer.model.config import TransformerConfig  # noqa: E402
from transformer.runtime import averaging  # noqa: E402
from transformer.runtime import workdir as workdir_lib  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "workdir_d26a6fb"  # trained: post-LN, eps 1e-6
EXPECTED = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))
SENTENCES = [s for s in EXPECTED["inputs"] if s] + [
    "three hundred five blue cars", "eleven old books and two green birds", "seven"]

# Models no trained workdir here has: the fixture's sizes, other options,
# random weights (perturbed, so that no bias is zero and no scale one).
VARIANTS = {
    "pre_gelu": dict(normalization="pre", activation="gelu"),
    "post_swish_untied_unshared": dict(activation="swish", share_embeddings=False,
                                       logits_via_embedding=False, logits_bias=True),
    "pre_scanned_untied_bias": dict(normalization="pre", scan_layers=True,
                                    logits_via_embedding=False, logits_bias=True),
}


def _copy_fixture(path: Path, **changes) -> Path:
  """The trained fixture in `path`, its model config changed by `changes`
  (its weights kept: only what does not change the parameters' shapes)."""
  shutil.copytree(FIXTURE, path)
  config = json.loads((path / "model_config.json").read_text())
  config.update(changes)
  (path / "model_config.json").write_text(json.dumps(config))
  return path


def _random_workdir(path: Path, seed: int, **changes) -> Path:
  """A workdir of the fixture's vocabulary and sizes, eps 1e-5, `changes`
  to its model, random weights: init_params plus noise on every leaf."""
  config = workdir_lib.load_model_config(str(FIXTURE)).replace(layer_norm_epsilon=1e-5,
                                                                **changes)
  params = init_params(config, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  params = jax.tree.unflatten(tree, [np.asarray(x) + rng.normal(0, 0.1, np.shape(x))
                                     .astype(np.float32) for x in leaves])
  path.mkdir()
  (path / "model_config.json").write_text(json.dumps(config.to_dict()))
  shutil.copy(FIXTURE / "vocab.model", path / "vocab.model")
  averaging.save_averaged(str(path), params, [0])
  return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{name: (workdir, its export)}: the trained fixture at eps 1e-5 ("trained")
  and the VARIANTS."""
  root = tmp_path_factory.mktemp("hf_export")
  workdirs = {"trained": _copy_fixture(root / "trained", layer_norm_epsilon=1e-5)}
  for seed, (name, changes) in enumerate(VARIANTS.items()):
    workdirs[name] = _random_workdir(root / name, seed, **changes)
  return {name: (w, Path(hf_export.export_workdir(str(w), str(root / f"{name}_hf"))))
          for name, w in workdirs.items()}


def _to_marian(ids) -> list[int]:
  """This project's ids -> Marian's (the inverse of `marian_to_ours`)."""
  table = {int(ours): m for m, ours in enumerate(marian_tokenizer.marian_to_ours(
      np.arange(400 - 2)))}
  return [table[i] for i in ids]


@pytest.mark.parametrize("name", ["trained", *VARIANTS])
def test_the_exported_files_compute_the_model(models, name):
  """For sentence pairs, the numpy transformers model of the exported files
  gives this model's log-softmax, but for PAD's entry, which it has not:
  ours renormalised over every id but PAD, in Marian's id order, BOS's as
  <pad>'s (the decoder start's row goes there)."""
  workdir, hf = models[name]
  config = workdir_lib.load_model_config(str(workdir))
  params = averaging.load_params(str(workdir), jax.eval_shape(
      lambda: init_params(config, jax.random.key(0))), "averaged")
  tensors = {k: np.asarray(v, np.float64)
             for k, v in safetensors_numpy.load_file(str(hf / "model.safetensors")).items()}
  hf_config = json.loads((hf / "config.json").read_text())
  assert hf_config["model_type"] == ("pegasus" if config.normalization == "pre" else "marian")
  tokenizer = load_tokenizer(str(workdir / "vocab.model"))
  order = list(marian_tokenizer.marian_to_ours(np.arange(config.vocab_size - 2))) + [
      config.bos_id]
  pairs = [(tokenizer.encode(source) + [1], tokenizer.encode(target)) for source, target in
           zip(SENTENCES[:4], [e for e in EXPECTED["greedy"] if e][:4])]
  # One batch (one program): sources padded with PAD, whose keys are masked;
  # decoder inputs padded after the sentence, which the causal mask hides.
  inputs = np.zeros((len(pairs), max(len(s) for s, _ in pairs)), np.int32)
  decoder_inputs = np.zeros((len(pairs), 1 + max(len(t) for _, t in pairs)), np.int32)
  for row, (src, tgt) in enumerate(pairs):
    inputs[row, :len(src)], decoder_inputs[row, :len(tgt) + 1] = src, [config.bos_id] + tgt
  with jax.default_matmul_precision("highest"):
    logits = np.asarray(jax.jit(Transformer(config).apply)({"params": params}, inputs,
                                                           decoder_inputs), np.float64)
  for row, (src, tgt) in enumerate(pairs):
    ours = logits[row, :len(tgt) + 1][:, order]  # (PAD's column left out, float64)
    ours = ours - ours.max(-1, keepdims=True)
    ours -= np.log(np.exp(ours).sum(-1, keepdims=True))
    theirs = hf_log_probs(tensors, hf_config, _to_marian(src),
                          [hf_config["decoder_start_token_id"]] + _to_marian(tgt),
                          ban_pad=False)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-4)


def test_the_files_are_what_transformers_reads(models):
  """Names, dtypes, ids and fields as transformers' Marian classes read them."""
  workdir, hf = models["trained"]
  assert sorted(p.name for p in hf.iterdir()) == sorted(
      ["README.md", "config.json", "generation_config.json", "model.safetensors",
       "source.spm", "target.spm", "tokenizer_config.json", "vocab.json"])
  tensors = safetensors_numpy.load_file(str(hf / "model.safetensors"))
  assert {str(x.dtype) for x in tensors.values()} == {"float32"}
  assert tensors["model.shared.weight"].shape == (399, 32)  # 398 pieces and <pad>
  assert tensors["final_logits_bias"].shape == (1, 399)
  assert "lm_head.weight" not in tensors  # (tied: transformers ties it to model.shared)
  assert len(tensors) == 2 + 2 * 16 + 2 * 26  # (per layer: encoder 16 tensors, decoder 26)
  config = json.loads((hf / "config.json").read_text())
  assert (config["vocab_size"], config["pad_token_id"], config["decoder_start_token_id"],
          config["eos_token_id"]) == (399, 398, 398, 0)
  assert (config["d_model"], config["encoder_layers"], config["decoder_attention_heads"],
          config["encoder_ffn_dim"], config["max_position_embeddings"]) == (32, 2, 4, 64, 128)
  assert config["architectures"] == ["MarianMTModel"] and config["scale_embedding"]
  assert config["activation_function"] == "relu" and config["tie_word_embeddings"]
  generation = json.loads((hf / "generation_config.json").read_text())
  assert generation["bad_words_ids"] == [[398]] and generation["num_beams"] == 4
  assert generation["length_penalty"] == 0.6  # (the fixture has no decoding.json: the paper's)
  tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
  assert tokenizer_config["tokenizer_class"] == "MarianTokenizer"
  vocab = json.loads((hf / "vocab.json").read_text(encoding="utf-8"))
  assert (vocab["</s>"], vocab["<unk>"], vocab["<pad>"], len(vocab)) == (0, 1, 398, 399)
  card = (hf / "README.md").read_text()
  assert "pipeline_tag: translation" in card and "MarianMTModel" in card
  assert "average of the checkpoints of steps 300, 600" in card and "Approximate" not in card
  # Pre-LN goes to Pegasus; untied and unshared embeddings travel as such.
  _, pre = models["pre_scanned_untied_bias"]
  config = json.loads((pre / "config.json").read_text())
  assert config["architectures"] == ["PegasusForConditionalGeneration"]
  assert not config["tie_word_embeddings"]
  assert "lm_head.weight" in safetensors_numpy.load_file(str(pre / "model.safetensors"))
  _, unshared = models["post_swish_untied_unshared"]
  names = safetensors_numpy.load_file(str(unshared / "model.safetensors"))
  assert "model.shared.weight" not in names and "model.encoder.embed_tokens.weight" in names
  assert not json.loads((unshared / "config.json").read_text())[
      "share_encoder_decoder_embeddings"]


def test_the_tokenizer_files_give_this_models_ids(models):
  """transformers' MarianTokenizer: source.spm's pieces, through vocab.json,
  then </s>. They must be this model's ids, in Marian's order."""
  workdir, hf = models["trained"]
  ours = load_tokenizer(str(workdir / "vocab.model"))
  vocab = json.loads((hf / "vocab.json").read_text(encoding="utf-8"))
  source = spm.SentencePieceProcessor(model_file=str(hf / "source.spm"))
  for sentence in SENTENCES + ["a word it never saw: Zürich ⚡"]:
    theirs = [vocab.get(p, vocab["<unk>"]) for p in source.encode(sentence, out_type=str)]
    assert theirs + [vocab["</s>"]] == _to_marian(ours.encode(sentence) + [1])


@pytest.mark.parametrize("name", ["trained", "pre_gelu"])
def test_the_import_of_the_export_is_the_model(models, tmp_path, name):
  """interop.marian reads the folder back: every parameter equal, but for what
  Marian's ids have not (PAD's rows: zero; PAD's and BOS's logits bias:
  never predicted); the trained model translates to the same lines."""
  workdir, hf = models[name]
  back = marian.import_model(str(hf), str(tmp_path / "back"))
  config = workdir_lib.load_model_config(str(workdir))
  imported = workdir_lib.load_model_config(back)
  assert imported.normalization == config.normalization
  assert imported.activation == config.activation
  load = lambda w, c: averaging.load_params(w, jax.eval_shape(  # noqa: E731
      lambda: init_params(c, jax.random.key(0))), "averaged")
  original, again = load(str(workdir), config), load(back, imported)
  again_leaves = dict(jax.tree_util.tree_flatten_with_path(again)[0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(original)[0]:
    leaf, other = np.asarray(leaf), np.asarray(again_leaves[path])
    if "embedding" in jax.tree_util.keystr(path):
      np.testing.assert_allclose(other[1:], leaf[1:], rtol=0, atol=1e-6)
      assert not other[0].any()
    else:
      np.testing.assert_allclose(other, leaf, rtol=0, atol=1e-6)
  bias = np.asarray(again["decoder"]["logits_bias"])
  assert not bias[[1, 3, 4, 399]].any() and (bias[[0, 2]] <= marian.NEVER).all()
  if name == "trained":
    import transformer
    with jax.default_matmul_precision("highest"):
      a, b = transformer.load_translator(str(workdir)), transformer.load_translator(back)
      for method in ("greedy", "beam"):
        assert b.translate(SENTENCES, method=method) == a.translate(SENTENCES, method=method)


def test_what_transformers_cannot_hold_is_refused_in_one_sentence(tmp_path, capsys):
  """Each refusal names the option; nothing is written to --out."""
  out = tmp_path / "out"
  cases = [(FIXTURE, "--config.model.layer_norm_epsilon=1e-5"),
           (_copy_fixture(tmp_path / "learned", layer_norm_epsilon=1e-5,
                          positional="learned"), "config.model.positional='learned'"),
           (_copy_fixture(tmp_path / "pre_unshared", layer_norm_epsilon=1e-5,
                          normalization="pre", share_embeddings=False),
            "config.model.share_embeddings=False")]
  for workdir, named in cases:
    assert hf_export.main([f"--workdir={workdir}", f"--out={out}"]) == 2
    err = capsys.readouterr().err
    assert named in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()
  # --approximate_epsilon writes it, and says so; an existing folder needs --force.
  assert hf_export.main([f"--workdir={FIXTURE}", f"--out={out}", "--approximate_epsilon"]) == 0
  assert "**Approximate:** trained with LayerNorm epsilon 1e-06" in (out / "README.md").read_text()
  (out / "mine.txt").write_text("kept")
  assert hf_export.main([f"--workdir={FIXTURE}", f"--out={out}", "--approximate_epsilon"]) == 2
  assert "pass --force" in capsys.readouterr().err and (out / "mine.txt").exists()
  assert hf_export.main([f"--workdir={FIXTURE}", f"--out={out}", "--approximate_epsilon",
                         "--force"]) == 0
  assert not (out / "mine.txt").exists() and (out / "model.safetensors").exists()


@pytest.mark.parametrize("plant", ["link_out", "too_large", "fifo"])
def test_a_received_workdirs_training_config_is_read_as_data(tmp_path, capsys, plant):
  """The model card reads the workdir's config.json, which may come from
  anyone: a link out of the workdir, a file past its size limit or a FIFO is
  one sentence naming it; nothing outside is read or changed, nothing is
  written to --out."""
  workdir = _copy_fixture(tmp_path / "received", layer_norm_epsilon=1e-5)
  outside = tmp_path / "outside.json"
  outside.write_text(json.dumps({"data": {"source": "demo"}}))
  (workdir / "config.json").unlink()
  if plant == "link_out":
    (workdir / "config.json").symlink_to(outside)
  elif plant == "too_large":
    (workdir / "config.json").write_text(" " * (2 << 20) + "{}")
  else:
    os.mkfifo(workdir / "config.json")  # (a read would wait forever)
  out = tmp_path / "out"
  assert hf_export.main([f"--workdir={workdir}", f"--out={out}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and "config.json" in err, err
  assert not out.exists() and outside.read_text() == json.dumps({"data": {"source": "demo"}})


def test_a_config_that_transformers_cannot_hold_names_its_option():
  config = TransformerConfig(vocab_size=400, d_model=32, num_heads=4, d_ff=64,
                             layer_norm_epsilon=1e-5)
  hf_export.check_exportable(config)
  with pytest.raises(hf_export.NotExportable, match="--approximate_epsilon"):
    hf_export.check_exportable(config.replace(layer_norm_epsilon=1e-6))
  hf_export.check_exportable(config.replace(layer_norm_epsilon=1e-6), approximate_epsilon=True)


# ----------------------------------------------------------------------------
# transformers itself (installed by hand: docs/testing.md)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers_models(models, tmp_path_factory):
  """transformers and torch, or a skip; the trained post-LN export and a
  pre-LN model trained here (the demo task, 300 steps), exported."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  root = tmp_path_factory.mktemp("transformers")
  overrides = dict(batch_size=16, num_train_steps=300, warmup_steps=50, num_bleu_examples=0,
                   vocab_size=128, eval_every=10**6, checkpoint_every=300, average_last=1,
                   test_report=False, **{
                       "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64,
                       "model.num_encoder_layers": 2, "model.num_decoder_layers": 2,
                       "model.normalization": "pre", "model.layer_norm_epsilon": 1e-5,
                       "data.demo_num_train": 2000, "data.demo_num_eval": 32,
                       "data.demo_num_test": 32})
  run_checked([sys.executable, "train.py", "--config=configs/default.py",
               f"--workdir={root / 'pre'}", "--quiet",
               *(f"--config.{k}={v}" for k, v in overrides.items())],
              subprocess_env(), timeout=600)
  pre_hf = hf_export.export_workdir(str(root / "pre"), str(root / "pre_hf"))
  return {"post": models["trained"], "pre": (root / "pre", Path(pre_hf))}


def _decode(workdir: Path, lines: list[str], tmp_path: Path, *flags: str) -> list[str]:
  source = tmp_path / "in.txt"
  source.write_text("\n".join(lines) + "\n", encoding="utf-8")
  out = tmp_path / "out.txt"
  run_checked([sys.executable, "decode.py", f"--workdir={workdir}", f"--input={source}",
               f"--output={out}", *flags], subprocess_env(), timeout=300)
  return out.read_text(encoding="utf-8").split("\n")[:-1]


def _transformers_scores(model, tokenizer, sources, targets):
  """transformers' teacher-forced log-probability of each target (its tokens
  and </s>), float64 log-softmax of the model's logits -> (sums, token counts)."""
  import torch
  batch = tokenizer(sources, return_tensors="pt", padding=True)
  labels = tokenizer(text_target=targets, return_tensors="pt", padding=True)["input_ids"]
  with torch.no_grad():
    logits = model(**batch, labels=labels).logits
  log_probs = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
  mask = labels != tokenizer.pad_token_id
  return (log_probs * mask).sum(-1).numpy(), mask.sum(-1).numpy()


@pytest.mark.parametrize("kind", ["post", "pre"])
def test_transformers_translates_and_scores_as_decode_py(transformers_models, kind, tmp_path):
  """AutoModelForSeq2SeqLM and AutoTokenizer on the exported folder:
  * greedy gives decode.py's lines;
  * beam 4 (length_penalty 0: the two length penalties differ otherwise)
    gives decode.py's lines, or where not, a line transformers itself scores
    lower: its beam search admits a finished hypothesis only from the best 4
    candidates of a step, decode.py's from all 8, so it can miss one;
  * decode.py --score gives transformers' log-probabilities within 1e-3 per
    token (PAD, which the export has no id for, takes ~1e-4 a token of the
    trained fixture's softmax)."""
  import torch
  from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
  workdir, hf = transformers_models[kind]
  tokenizer = AutoTokenizer.from_pretrained(str(hf))
  model = AutoModelForSeq2SeqLM.from_pretrained(str(hf)).eval()
  batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
  translations = {}
  for method, options in (("greedy", dict(num_beams=1)),
                          ("beam", dict(num_beams=4, length_penalty=0.0))):
    flags = ["--method=greedy"] if method == "greedy" else ["--length_penalty=0"]
    ours = _decode(workdir, SENTENCES, tmp_path, *flags)
    with torch.no_grad():
      generated = model.generate(**batch, do_sample=False, max_new_tokens=64, **options)
    translations[method] = ours, tokenizer.batch_decode(generated, skip_special_tokens=True)
  assert translations["greedy"][0] == translations["greedy"][1]
  ours, theirs = translations["beam"]
  differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
  assert len(differ) <= len(SENTENCES) // 4, (ours, theirs)
  if differ:
    better, _ = _transformers_scores(model, tokenizer, [SENTENCES[i] for i in differ],
                                     [ours[i] for i in differ])
    worse, _ = _transformers_scores(model, tokenizer, [SENTENCES[i] for i in differ],
                                    [theirs[i] for i in differ])
    assert (better > worse).all(), (differ, better, worse)
  pairs = [f"{s}\t{t}" for s, t in zip(SENTENCES, ours)]
  scored = [json.loads(line) for line in _decode(workdir, pairs, tmp_path, "--score",
                                                  "--output_format=jsonl")]
  expected, tokens = _transformers_scores(model, tokenizer, SENTENCES, ours)
  assert [s["tokens"] for s in scored] == tokens.tolist()
  np.testing.assert_array_less(np.abs([s["logprob"] for s in scored] - expected),
                               1e-3 * tokens)
