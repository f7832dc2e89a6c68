"""Marian / OPUS-MT import (transformer/interop/marian.py, data/marian_tokenizer.py),
checked against an implementation nobody here wrote: CTranslate2's own Marian
converter reads the same files, and its teacher-forced log-probabilities
(`score_batch`) and greedy translations must be the imported model's.

The tests write their own small random-weight models in both formats (no
download): an OPUS-MT release (`decoder.yml`, a `.npz` with `special:model.yml`,
`vocab.yml`, `source.spm`, `target.spm`) and the same weights under Hugging
Face's names (`config.json`, `model.safetensors`, `vocab.json`)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_reference import hf_greedy as _np_greedy
from hf_reference import hf_log_probs as _np_marian_log_probs
from scoring import teacher_forced_log_probs
import sentencepiece as spm

ctranslate2 = pytest.importorskip("ctranslate2")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from transformer.data import demo_task, marian_tokenizer  # noqa: E402
from transformer.data import tokenizer as tokenizer_lib  # noqa: E402
from transformer.data.tokenizer import load_tokenizer  # noqa: E402
from transformer.interop import marian, marian_formats, marian_release  # noqa: E402
from transformer.model import init_params  # noqa: E402
from transformer.model.transformer import sinusoidal_positional_encoding  # noqa: E402
from transformer.runtime import averaging  # noqa: E402
from transformer.runtime import workdir as workdir_lib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
D_MODEL, HEADS, D_FF = 16, 2, 32


# ----------------------------------------------------------------------------
# A small Marian model written by hand, in both formats
# ----------------------------------------------------------------------------


def _spm(sentences, path: Path) -> list[str]:
  """A small SentencePiece model at `path` (Marian's own special ids do not
  matter: its table maps the pieces); returns its ordinary pieces."""
  spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(path),
                                 vocab_size=48, minloglevel=2, hard_vocab_limit=False)
  Path(f"{path}.model").rename(path)
  sp = spm.SentencePieceProcessor(model_file=str(path))
  return [sp.id_to_piece(i) for i in range(sp.get_piece_size())
          if not (sp.is_control(i) or sp.is_unknown(i))]


def _random_weights(rng, pieces, *, pre_norm=False, shared=True, tied=True, layers=(2, 2),
                    d_model=D_MODEL, d_ff=D_FF):
  """Marian-NMT's parameter names and shapes, random values (no constant
  scale, bias or logits bias, which a wrong mapping could leave unnoticed)."""
  d, f, v = d_model, d_ff, len(pieces)
  w = {}

  def mat(*shape, scale=0.25):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  def norm(prefix):
    suffix = "_pre" if pre_norm else ""
    w[f"{prefix}_ln_scale{suffix}"] = (1 + mat(1, d, scale=0.2))
    w[f"{prefix}_ln_bias{suffix}"] = mat(1, d, scale=0.2)

  def attention(prefix):
    for x in "qkvo":
      w[f"{prefix}_W{x}"], w[f"{prefix}_b{x}"] = mat(d, d), mat(1, d, scale=0.2)
    norm(f"{prefix}_Wo")

  for side, count in zip(("encoder", "decoder"), layers):
    for i in range(1, count + 1):
      attention(f"{side}_l{i}_self")
      if side == "decoder":
        attention(f"{side}_l{i}_context")
      w[f"{side}_l{i}_ffn_W1"], w[f"{side}_l{i}_ffn_b1"] = mat(d, f), mat(1, f, scale=0.2)
      w[f"{side}_l{i}_ffn_W2"], w[f"{side}_l{i}_ffn_b2"] = mat(f, d), mat(1, d, scale=0.2)
      norm(f"{side}_l{i}_ffn_ffn")
    if pre_norm:
      w[f"{side}_top_ln_scale"], w[f"{side}_top_ln_bias"] = 1 + mat(1, d, scale=0.2), mat(1, d)
  if shared:
    w["Wemb"] = mat(v, d)
  else:
    w["encoder_Wemb"], w["decoder_Wemb"] = mat(v, d), mat(v, d)
  if not tied:
    w["decoder_ff_logit_out_Wt"] = mat(v, d)
  bias = mat(1, v)
  bias[0, 0] += 4.0  # </s> likely enough that greedy translations end
  w["decoder_ff_logit_out_b"] = bias
  return w


def _model_yml(pre_norm: bool, activation: str, layers=(2, 2)) -> str:
  pre, post, top = ("n", "da", "n") if pre_norm else ('""', "dan", '""')
  return "\n".join([
      "type: transformer", f"dim-emb: {D_MODEL}", f"enc-depth: {layers[0]}",
      f"dec-depth: {layers[1]}", f"transformer-heads: {HEADS}",
      f"transformer-dim-ffn: {D_FF}", "transformer-ffn-depth: 2",
      f"transformer-ffn-activation: {activation}",
      f"transformer-preprocess: {pre}", f"transformer-postprocess: {post}",
      f"transformer-postprocess-top: {top}",
      "transformer-postprocess-emb: d", "transformer-decoder-autoreg: self-attention",
      "transformer-no-projection: false", "transformer-guided-alignment-layer: last",
      "transformer-dropout: 0.1", ""])


def write_release(directory: Path, seed=0, *, pre_norm=False, shared=True, tied=True,
                  activation="swish") -> tuple[Path, dict, list[str]]:
  """An OPUS-MT Marian-NMT release; returns (directory, weights, pieces)."""
  directory.mkdir(parents=True)
  pairs = demo_task.demo_splits(0, num_train=300, num_eval=1, num_test=1)["train"]
  source_pieces = _spm([s for s, _ in pairs], directory / "source.spm")
  target_pieces = _spm([t for _, t in pairs], directory / "target.spm")
  pieces = ["</s>", "<unk>"] + sorted(set(source_pieces) | set(target_pieces))
  # Quoted as Marian writes pieces YAML would misread.
  (directory / "vocab.yml").write_text("".join(
      f"{json.dumps(p, ensure_ascii=False)}: {i}\n" if i % 2 else f"{p}: {i}\n"
      for i, p in enumerate(pieces)), encoding="utf-8")
  weights = _random_weights(np.random.default_rng(seed), pieces, pre_norm=pre_norm,
                            shared=shared, tied=tied)
  options = _model_yml(pre_norm, activation).encode() + b"\0"
  np.savez(directory / "model.npz", **weights,
           **{"special:model.yml": np.frombuffer(options, np.int8)})
  (directory / "decoder.yml").write_text(
      "models:\n  - model.npz\nvocabs:\n  - vocab.yml\n  - vocab.yml\nbeam-size: 4\n")
  return directory, weights, pieces


def write_hf(directory: Path, weights: dict, pieces: list[str], release: Path, *,
             layers=(2, 2), heads=HEADS, pad_row=None, pad_bias=0.0) -> Path:
  """The same model as Hugging Face's conversion writes it: torch `[out, in]`
  matrices, `<pad>` appended as the last id (the decoder's start): a zero row
  and a zero logits bias, or `pad_row` `[d_model]` and `pad_bias`, as a model
  trained in transformers has them."""
  directory.mkdir(parents=True)
  d_model, d_ff = weights["encoder_l1_ffn_W1"].shape
  t = {}

  def with_pad(x, row):
    return np.concatenate([x, np.reshape(row, (1,) + x.shape[1:]).astype(x.dtype)])

  for side, count in zip(("encoder", "decoder"), layers):
    for i in range(count):
      hf, m = f"model.{side}.layers.{i}", f"{side}_l{i + 1}"
      for hf_attn, m_attn in [("self_attn", "self")] + (
          [("encoder_attn", "context")] if side == "decoder" else []):
        for x, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
          t[f"{hf}.{hf_attn}.{name}.weight"] = weights[f"{m}_{m_attn}_W{x}"].T.copy()
          t[f"{hf}.{hf_attn}.{name}.bias"] = weights[f"{m}_{m_attn}_b{x}"][0]
        t[f"{hf}.{hf_attn}_layer_norm.weight"] = weights[f"{m}_{m_attn}_Wo_ln_scale"][0]
        t[f"{hf}.{hf_attn}_layer_norm.bias"] = weights[f"{m}_{m_attn}_Wo_ln_bias"][0]
      for k in ("1", "2"):
        t[f"{hf}.fc{k}.weight"] = weights[f"{m}_ffn_W{k}"].T.copy()
        t[f"{hf}.fc{k}.bias"] = weights[f"{m}_ffn_b{k}"][0]
      t[f"{hf}.final_layer_norm.weight"] = weights[f"{m}_ffn_ffn_ln_scale"][0]
      t[f"{hf}.final_layer_norm.bias"] = weights[f"{m}_ffn_ffn_ln_bias"][0]
    t[f"model.{side}.embed_positions.weight"] = marian_formats.marian_position_table(
        512, d_model).astype(np.float32)
  t["model.shared.weight"] = with_pad(weights["Wemb"], np.zeros(d_model) if pad_row is None
                                      else pad_row)
  t["final_logits_bias"] = with_pad(weights["decoder_ff_logit_out_b"][0], pad_bias)[None]
  safetensors_numpy.save_file(t, str(directory / "model.safetensors"))
  vocab = {p: i for i, p in enumerate(pieces + ["<pad>"])}
  (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
  (directory / "config.json").write_text(json.dumps({
      "model_type": "marian", "architectures": ["MarianMTModel"], "d_model": d_model,
      "encoder_layers": layers[0], "decoder_layers": layers[1],
      "encoder_attention_heads": heads, "decoder_attention_heads": heads,
      "encoder_ffn_dim": d_ff, "decoder_ffn_dim": d_ff,
      "activation_function": "swish", "vocab_size": len(vocab), "pad_token_id": len(pieces),
      "decoder_start_token_id": len(pieces), "eos_token_id": 0, "scale_embedding": True,
      "max_position_embeddings": 512, "share_encoder_decoder_embeddings": True,
      "dropout": 0.1, "attention_dropout": 0.0}))
  for name in ("source.spm", "target.spm"):
    (directory / name).write_bytes((release / name).read_bytes())
  return directory


def marian_weights_of(params: dict, config) -> dict[str, np.ndarray]:
  """This project's parameters (post-LN, tied, unstacked) under Marian-NMT's
  names and layout: the inverse of the import's mapping, written out here
  (the d_model permutation undone, ids in Marian's order, PAD/BOS dropped)."""
  inv = np.argsort(marian.residual_permutation(config.d_model))
  d = config.d_model
  w = {}

  def attention(tree, prefix, norm):
    for x, name in (("q", "query"), ("k", "key"), ("v", "value")):
      w[f"{prefix}_W{x}"] = np.asarray(tree[name]["kernel"]).reshape(d, d)[inv]
      w[f"{prefix}_b{x}"] = np.asarray(tree[name]["bias"]).reshape(1, d)
    w[f"{prefix}_Wo"] = np.asarray(tree["out"]["kernel"]).reshape(d, d)[:, inv]
    w[f"{prefix}_bo"] = np.asarray(tree["out"]["bias"])[inv][None]
    w[f"{prefix}_Wo_ln_scale"] = np.asarray(norm["norm"]["scale"])[inv][None]
    w[f"{prefix}_Wo_ln_bias"] = np.asarray(norm["norm"]["bias"])[inv][None]

  for side, count in (("encoder", config.num_encoder_layers),
                      ("decoder", config.num_decoder_layers)):
    for i in range(count):
      layer, prefix = params[side][f"layers_{i}"], f"{side}_l{i + 1}"
      attention(layer["self_attention"], f"{prefix}_self", layer["self_attention_norm"])
      if side == "decoder":
        attention(layer["cross_attention"], f"{prefix}_context", layer["cross_attention_norm"])
      ffn, norm = layer["feed_forward"], layer["feed_forward_norm"]["norm"]
      w[f"{prefix}_ffn_W1"] = np.asarray(ffn["inner"]["kernel"])[inv]
      w[f"{prefix}_ffn_b1"] = np.asarray(ffn["inner"]["bias"])[None]
      w[f"{prefix}_ffn_W2"] = np.asarray(ffn["outer"]["kernel"])[:, inv]
      w[f"{prefix}_ffn_b2"] = np.asarray(ffn["outer"]["bias"])[inv][None]
      w[f"{prefix}_ffn_ffn_ln_scale"] = np.asarray(norm["scale"])[inv][None]
      w[f"{prefix}_ffn_ffn_ln_bias"] = np.asarray(norm["bias"])[inv][None]
  embedding = np.asarray(params["embeddings"]["embedding"]["embedding"])
  marian_ids = np.arange(config.vocab_size - 2)
  w["Wemb"] = embedding[marian_tokenizer.marian_to_ours(marian_ids)][:, inv]
  return {k: np.ascontiguousarray(v, np.float32) for k, v in w.items()}


@pytest.fixture(scope="module")
def trained_release(tmp_path_factory):
  """The trained fixture model written as an OPUS-MT release (its pieces from
  id 4 are Marian's from id 2; Marian starts the decoder from a zero vector,
  not the fixture's learned BOS), and CTranslate2's conversion of it: a model
  whose greedy translations are sentences, not a random model's loops."""
  fixture = REPO / "tests" / "fixtures" / "workdir_d26a6fb"
  config = workdir_lib.load_model_config(str(fixture))
  target = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  params = jax.device_get(averaging.load_params(str(fixture), target, "averaged"))
  directory = tmp_path_factory.mktemp("trained") / "release"
  directory.mkdir()
  sp = spm.SentencePieceProcessor(model_file=str(fixture / "vocab.model"))
  pieces = ["</s>", "<unk>"] + [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]
  (directory / "vocab.yml").write_text("".join(f"{json.dumps(p, ensure_ascii=False)}: {i}\n"
                                               for i, p in enumerate(pieces)), encoding="utf-8")
  for name in ("source.spm", "target.spm"):
    (directory / name).write_bytes((fixture / "vocab.model").read_bytes())
  options = _model_yml(False, "relu").replace(f"dim-emb: {D_MODEL}", f"dim-emb: {config.d_model}")
  options = options.replace(f"transformer-heads: {HEADS}", f"transformer-heads: {config.num_heads}")
  options = options.replace(f"transformer-dim-ffn: {D_FF}", f"transformer-dim-ffn: {config.d_ff}")
  np.savez(directory / "model.npz", **marian_weights_of(params, config),
           **{"special:model.yml": np.frombuffer(options.encode() + b"\0", np.int8)})
  (directory / "decoder.yml").write_text("models: [model.npz]\nvocabs: [vocab.yml, vocab.yml]\n")
  ct2 = ctranslate2.converters.OpusMTConverter(str(directory)).convert(
      str(directory.parent / "ct2"))
  return directory, ct2, params


@pytest.fixture(scope="module")
def release(tmp_path_factory):
  """(release dir, weights, pieces, CTranslate2 model dir converted by CTranslate2)."""
  root = tmp_path_factory.mktemp("marian")
  directory, weights, pieces = write_release(root / "release")
  ct2 = ctranslate2.converters.OpusMTConverter(str(directory)).convert(str(root / "ct2"))
  return directory, weights, pieces, ct2


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _check_scores(model: marian_formats.MarianModel, ct2_dir, pieces):
  """score_batch of random piece sequences == the imported model's."""
  config = model.config
  params = marian.params_from_marian(model.weights, config, model.decoder_start)
  rng = np.random.default_rng(1)
  sources = [list(rng.integers(2, len(pieces), size=n)) for n in (3, 7, 12)]
  targets = [list(rng.integers(2, len(pieces), size=n)) for n in (5, 2, 9)]
  scored = ctranslate2.Translator(str(ct2_dir), intra_threads=1).score_batch(
      [[pieces[i] for i in s] for s in sources], [[pieces[i] for i in t] for t in targets])
  assert [len(r.log_probs) for r in scored] == [len(t) + 1 for t in targets]  # + EOS
  ours = [marian_tokenizer.marian_to_ours(np.asarray(s)).tolist() for s in sources]
  ours_t = [marian_tokenizer.marian_to_ours(np.asarray(t)).tolist() for t in targets]
  np.testing.assert_allclose(teacher_forced_log_probs(config, params, ours, ours_t),
                             [sum(r.log_probs) for r in scored], rtol=1e-5, atol=1e-4)


def _ct2_greedy(ct2_dir, release_dir, sentences):
  source = spm.SentencePieceProcessor(model_file=str(release_dir / "source.spm"))
  target = spm.SentencePieceProcessor(model_file=str(release_dir / "target.spm"))
  results = ctranslate2.Translator(str(ct2_dir), intra_threads=1).translate_batch(
      [source.encode(s, out_type=str) for s in sentences], beam_size=1,
      max_decoding_length=100, min_decoding_length=0)
  lengths = [len(r.hypotheses[0]) for r in results]
  assert max(lengths) < 100 and len(set(lengths)) > 3, lengths  # they end, not all alike
  return [target.decode_pieces(r.hypotheses[0]) for r in results]


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------


def test_the_permutation_turns_marians_position_table_into_the_papers():
  """Marian's table is [sin | cos]; dimension k here is Marian's perm[k]."""
  perm = marian.residual_permutation(D_MODEL)
  table = marian_formats.marian_position_table(50, D_MODEL)
  np.testing.assert_allclose(table[:, perm], sinusoidal_positional_encoding(
      np.arange(50), D_MODEL), atol=1e-5)
  assert not np.allclose(table, sinusoidal_positional_encoding(np.arange(50), D_MODEL),
                         atol=1e-2)  # (the premise: the layouts do differ)


def test_a_release_scores_and_translates_as_ctranslate2s_marian_converter_reads_it(release):
  directory, weights, pieces, ct2 = release
  model = marian_release.read_marian_release(str(directory))
  assert model.pieces == pieces  # vocab.yml read back, quoted and plain lines alike
  assert (model.config.activation, model.config.normalization) == ("swish", "post")
  _check_scores(model, ct2, pieces)


@pytest.mark.parametrize("variant", [
    {"pre_norm": True, "activation": "relu"},
    {"shared": False, "tied": False},
])
def test_other_marian_layouts_score_as_ctranslate2(variant, tmp_path):
  directory, _, pieces = write_release(tmp_path / "release", seed=3, **variant)
  ct2 = ctranslate2.converters.OpusMTConverter(str(directory)).convert(str(tmp_path / "ct2"))
  model = marian_release.read_marian_release(str(directory))
  assert model.config.share_embeddings == variant.get("shared", True)
  _check_scores(model, ct2, pieces)


def test_the_hugging_face_format_gives_the_same_model(release, tmp_path):
  directory, weights, pieces, ct2 = release
  hf = marian_formats.read_hf_directory(str(write_hf(tmp_path / "hf", weights, pieces, directory)))
  npz = marian_release.read_marian_release(str(directory))
  assert hf.config == npz.config and hf.pieces == npz.pieces
  # Hugging Face's conversion appends a zero <pad> row: the start Marian-NMT has.
  assert not hf.decoder_start.any() and not npz.decoder_start.any()
  for a, b in zip(jax.tree.leaves(marian.params_from_marian(hf.weights, hf.config,
                                                            hf.decoder_start)),
                  jax.tree.leaves(marian.params_from_marian(npz.weights, npz.config,
                                                            npz.decoder_start))):
    np.testing.assert_array_equal(a, b)
  _check_scores(hf, ct2, pieces)


def test_the_import_of_a_trained_model_is_that_model(trained_release):
  """Written out under Marian's names and read back: every parameter is the
  fixture's, but for the rows of PAD and BOS (zero: Marian has none, and
  Marian-NMT starts the decoder from a zero vector) and the logits bias
  (NEVER on PAD and BOS, else the fixture's none: 0)."""
  directory, _, params = trained_release
  model = marian_release.read_marian_release(str(directory))
  imported = marian.params_from_marian(model.weights, model.config, model.decoder_start)
  embedding = imported["embeddings"]["embedding"]["embedding"]
  fixture_embedding = params["embeddings"]["embedding"]["embedding"]
  np.testing.assert_array_equal(embedding[[1, 3, 4, 399]], fixture_embedding[[1, 3, 4, 399]])
  assert not embedding[[0, 2]].any() and fixture_embedding[2].any()
  bias = imported["decoder"].pop("logits_bias")
  assert (bias[[0, 2]] == marian.NEVER).all() and not np.delete(bias, [0, 2]).any()
  for tree in (imported, params):
    tree["embeddings"]["embedding"]["embedding"] = np.asarray(
        tree["embeddings"]["embedding"]["embedding"])[4:]
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(imported)[0],
                          jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


SENTENCES = [s for s, _ in demo_task.demo_splits(5, num_train=12, num_eval=1,
                                                 num_test=1)["train"]]
SENTENCES[3] = ""  # a blank line gives a blank line


def test_an_imported_workdir_decodes_as_ctranslate2_from_the_command_line(trained_release,
                                                                          tmp_path):
  """python -m transformer.interop.marian, then decode.py: N lines in, N out,
  each CTranslate2's greedy translation of the same files."""
  directory, ct2, _ = trained_release
  workdir = tmp_path / "imported"
  run = subprocess.run([sys.executable, "-m", "transformer.interop.marian",
                        f"--model={directory}", f"--workdir={workdir}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n")
  run = subprocess.run([sys.executable, "decode.py", f"--workdir={workdir}",
                        f"--input={tmp_path / 'in.txt'}", f"--output={tmp_path / 'out.txt'}",
                        "--method=greedy"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  ours = (tmp_path / "out.txt").read_text().split("\n")[:-1]
  expected = _ct2_greedy(ct2, directory, SENTENCES)
  assert len(ours) == len(SENTENCES)
  assert [o for o, s in zip(ours, SENTENCES) if s] == [e for e, s in zip(expected, SENTENCES) if s]
  assert ours[SENTENCES.index("")] == ""
  # Served elsewhere: this project's export of the imported workdir translates
  # as CTranslate2's conversion of the original files.
  run = subprocess.run([sys.executable, "-m", "transformer.interop.ctranslate2_export",
                        f"--workdir={workdir}", f"--output_dir={tmp_path / 'exported'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "source.spm, target.spm" in run.stdout
  assert _ct2_greedy(tmp_path / "exported", tmp_path / "exported", SENTENCES) == expected


def test_the_marian_vocabulary(release, tmp_path):
  directory, _, pieces, _ = release
  workdir = marian.import_model(str(directory), str(tmp_path / "w"))
  tok = load_tokenizer(workdir_lib.vocab_path(workdir))
  assert isinstance(tok, marian_tokenizer.MarianTokenizer)
  assert tok.vocab_size == len(pieces) + 2
  assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "</s>", "<s>", "<unk>"]
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (
      tokenizer_lib.PAD_ID, tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID, tokenizer_lib.UNK_ID)
  source = spm.SentencePieceProcessor(model_file=str(directory / "source.spm"))
  target = spm.SentencePieceProcessor(model_file=str(directory / "target.spm"))
  text = "seven green frogs"
  # Each side through its own SentencePiece model, then the shared table (+2).
  assert tok.encode(text) == [pieces.index(p) + 2 for p in source.encode(text, out_type=str)]
  assert tok.encode_target(text) == [pieces.index(p) + 2
                                     for p in target.encode(text, out_type=str)]
  assert tok.decode(tok.encode_target(text) + [tok.eos_id, 9]) == text
  assert tok.encode("Ω") == [pieces.index("▁") + 2, tok.unk_id]  # not in the table
  assert pickle.loads(pickle.dumps(tok)).encode(text) == tok.encode(text)
  assert (Path(workdir) / "source.spm").read_bytes() == (directory / "source.spm").read_bytes()


def test_import_refusals_name_the_problem(release, tmp_path, monkeypatch):
  directory, weights, pieces, _ = release
  hf = write_hf(tmp_path / "hf", weights, pieces, directory)
  (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
  with pytest.raises(ValueError, match="pytorch_model.bin but no model.safetensors.*torch"):
    marian.read_model(str(hf))
  workdir = marian.import_model(str(directory), str(tmp_path / "w"))
  with pytest.raises(FileExistsError, match="--force"):
    marian.import_model(str(directory), workdir)
  marian.import_model(str(directory), workdir, force=True)
  with pytest.raises(ValueError, match="holds an imported model.*init_from"):
    workdir_lib.check_config(workdir, {})
  other = tmp_path / "release2"
  write_release(other, activation="gelu")
  with pytest.raises(ValueError, match="activation 'gelu'"):
    marian.read_model(str(other))
  # A hub id goes through huggingface_hub (here a stand-in: no network in tests).
  import huggingface_hub
  hf_ok = write_hf(tmp_path / "hub", weights, pieces, directory)
  monkeypatch.setattr(huggingface_hub, "snapshot_download",
                      lambda repo_id, revision=None, allow_patterns=None: str(hf_ok))
  model = marian.read_model("Helsinki-NLP/opus-mt-xx-yy")
  assert model.pieces == pieces


def test_fine_tuning_starts_from_the_imported_model(release, tmp_path):
  """--config.init_from=<imported>: the model (swish, logits bias, epsilon) and
  the Marian vocabulary are the imported ones; with a learning rate of 0 the
  run's checkpoint holds exactly the imported parameters."""
  import train_worker
  from transformer.training import loop
  directory, _, _, _ = release
  imported = marian.import_model(str(directory), str(tmp_path / "imported"))
  tuned = tmp_path / "tuned"
  loop.train_and_evaluate(train_worker.tiny_config(dict(
      init_from=imported, num_train_steps=2, checkpoint_every=2, average_last=1,
      learning_rate_scale=0.0, test_report=False)), str(tuned), quiet=True)
  config = workdir_lib.load_model_config(str(tuned))
  source = workdir_lib.load_model_config(imported)
  assert config.replace(dropout_rate=source.dropout_rate) == source
  assert (tuned / "vocab.model").read_bytes() == (Path(imported) / "vocab.model").read_bytes()
  target = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  for a, b in zip(jax.tree.leaves(averaging.load_params(str(tuned), target, 2)),
                  jax.tree.leaves(averaging.load_params(imported, target, "averaged"))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------
# The decoder's start row: transformers starts from the embedding of <pad>
# ----------------------------------------------------------------------------

TRANSFORMERS_FIXTURE = REPO.parent / "shared" / "fixtures" / "marian-transformers"


@pytest.mark.parametrize("copy", ["zero", "raw"])
def test_a_model_transformers_trained_translates_as_transformers_does(copy, tmp_path,
                                                                   compilation_cache):
  """The shared fixture (its README): a MarianMTModel that transformers built,
  trained and saved, its <pad> row (the decoder's start) zeroed (`zero`) or as
  training left it (`raw`), beside transformers' own greedy translations
  (max_new_tokens=24, <pad> banned). Imported, and decoded as `decode.py
  --method=greedy --max_len=24` decodes: every line is transformers' line,
  every line that ends has its log-prob. (The raw copy gave 0 of 63 lines
  while the import started the decoder from a zero row.)"""
  if not TRANSFORMERS_FIXTURE.is_dir():
    pytest.skip(f"{TRANSFORMERS_FIXTURE} is missing: the shared fixtures sit beside the "
                "checkout (../shared), as in CI")
  import transformer
  folder = TRANSFORMERS_FIXTURE / copy
  lines = (TRANSFORMERS_FIXTURE / "in.txt").read_text(encoding="utf-8").split("\n")[:-1]
  expected = [json.loads(line) for line in
              (folder / "hf.jsonl").read_text(encoding="utf-8").splitlines()]
  assert [e["source"] for e in expected] == lines
  tensors = safetensors_numpy.load_file(str(folder / "hf" / "model.safetensors"))
  assert tensors["model.shared.weight"][-1].any() == (copy == "raw")  # (the premise)
  workdir = marian.import_model(str(folder / "hf"), str(tmp_path / "imported"))
  with jax.default_matmul_precision("highest"):
    ours = [h[0] for h in transformer.load_translator(workdir).translate_hypotheses(
        lines, method="greedy", max_len=24)]
  assert [h.text for h in ours] == [e["text"] for e in expected]
  assert [h.length for h in ours] == [e["length"] for e in expected]
  ended = [(h.log_prob, e["log_prob"]) for h, e in zip(ours, expected) if e["ended"]]
  assert len(ended) >= 20
  np.testing.assert_allclose(*zip(*ended), rtol=0, atol=1e-3)


@pytest.fixture(scope="module")
def started(release, tmp_path_factory, compilation_cache):
  """A random transformers-format model of another size than the others
  (d_model 24, 3 heads, FFN 40, 1 + 3 layers) whose <pad> row, transformers'
  decoder start, is not zero (and whose <pad> logits bias is large, as
  nothing has to keep it small where <pad> is banned), imported. -> (its
  directory, its tensors in float64, its config.json, the Translator of the
  imported workdir, the workdir)."""
  import transformer
  directory, _, pieces, _ = release
  rng = np.random.default_rng(11)
  weights = _random_weights(rng, pieces, layers=(1, 3), d_model=24, d_ff=40)
  weights["decoder_ff_logit_out_b"][0, 0] -= 2.0  # some lines end, others run to max_len
  root = tmp_path_factory.mktemp("started")
  hf = write_hf(root / "hf", weights, pieces, directory, layers=(1, 3), heads=3,
                pad_row=rng.normal(0.0, 0.5, 24), pad_bias=3.0)
  tensors = {name: np.asarray(x, np.float64) for name, x in
             safetensors_numpy.load_file(str(hf / "model.safetensors")).items()}
  hf_config = json.loads((hf / "config.json").read_text())
  workdir = marian.import_model(str(hf), str(root / "imported"))
  return hf, tensors, hf_config, transformer.load_translator(workdir), workdir


def test_teacher_forcing_starts_from_the_start_row(started):
  """Each position's log-softmax over Marian's ids, teacher-forced, is that of
  the float64 numpy MarianMTModel fed its <pad> row first; PAD and BOS stay
  below NEVER (never predicted, as <pad> is banned there)."""
  from transformer.model import Transformer
  _, t, hf_config, translator, _ = started
  config, vocab = translator.config, hf_config["vocab_size"] - 1  # Marian's ids, no <pad>
  rng = np.random.default_rng(2)
  sources = [list(rng.integers(2, vocab, size=n)) + [0] for n in (3, 7, 12)]
  targets = [list(rng.integers(2, vocab, size=n)) for n in (5, 2, 9)]
  inputs = np.zeros((3, 13), np.int32)   # this project's ids, PAD 0 after each row
  decoder_inputs = np.zeros((3, 10), np.int32)
  for row, (source, target) in enumerate(zip(sources, targets)):
    inputs[row, :len(source)] = marian_tokenizer.marian_to_ours(np.asarray(source))
    decoder_inputs[row, :len(target) + 1] = [config.bos_id] + list(
        marian_tokenizer.marian_to_ours(np.asarray(target)))
  with jax.default_matmul_precision("highest"):
    logits = np.asarray(jax.jit(Transformer(config).apply)(
        {"params": translator.params}, inputs, decoder_inputs))
  assert (logits[..., [config.pad_id, config.bos_id]] <= marian.NEVER).all()
  ours = np.asarray(jax.nn.log_softmax(logits), np.float64)
  columns = marian_tokenizer.marian_to_ours(np.arange(vocab))
  for row, (source, target) in enumerate(zip(sources, targets)):
    expected = _np_marian_log_probs(t, hf_config, source,
                                    [hf_config["decoder_start_token_id"]] + target)
    np.testing.assert_allclose(ours[row, :len(target) + 1][:, columns], expected[:, :vocab],
                               rtol=1e-5, atol=1e-4)


def _started_sentences(hf: Path):
  """Real sentences, and their source ids as transformers' MarianTokenizer
  makes them: source.spm's pieces through vocab.json, <unk> 1 for the rest, </s>."""
  sp = spm.SentencePieceProcessor(model_file=str(hf / "source.spm"))
  vocab = json.loads((hf / "vocab.json").read_text(encoding="utf-8"))
  sentences = [s for s in SENTENCES if s]
  return sentences, [[vocab.get(p, 1) for p in sp.encode(s, out_type=str)] + [0]
                     for s in sentences]


def _np_translations(started, max_len):
  """`_np_greedy`'s (text, log_prob, length) of each of `_started_sentences`."""
  hf, t, hf_config, _, _ = started
  pieces = [p for p, _ in sorted(json.loads((hf / "vocab.json").read_text(
      encoding="utf-8")).items(), key=lambda item: item[1])]
  target = spm.SentencePieceProcessor(model_file=str(hf / "target.spm"))
  out = []
  for source in _started_sentences(hf)[1]:
    ids, log_prob = _np_greedy(t, hf_config, source, max_len)
    text = target.decode_pieces([pieces[i] for i in ids if i != hf_config["eos_token_id"]])
    out.append((text, log_prob, len(ids)))
  return out


def test_incremental_decoding_starts_from_the_start_row(started):
  """Greedy decoding (the cached, one-position-per-step path) translates as
  the float64 numpy MarianMTModel does from its <pad> row: the same texts,
  lengths and log-probs."""
  hf, _, _, translator, _ = started
  expected = _np_translations(started, max_len=20)
  assert len({text for text, _, _ in expected}) > 3  # (not one loop for all)
  with jax.default_matmul_precision("highest"):
    ours = [h[0] for h in translator.translate_hypotheses(_started_sentences(hf)[0],
                                                          method="greedy", max_len=20)]
  assert [(h.text, h.length) for h in ours] == [(text, n) for text, _, n in expected]
  np.testing.assert_allclose([h.log_prob for h in ours], [lp for _, lp, _ in expected],
                             rtol=0, atol=1e-4)


def test_the_ctranslate2_export_starts_from_the_start_row(started, tmp_path):
  """This project's CTranslate2 export of the imported workdir translates as
  decode.py's Translator does (greedy), and as the float64 numpy
  MarianMTModel does from its <pad> row: the export carries the start row."""
  from transformer.interop import ctranslate2_export
  hf, _, _, translator, workdir = started
  sentences = _started_sentences(hf)[0]
  out = ctranslate2_export.export_workdir(workdir, str(tmp_path / "ct2"))
  source = spm.SentencePieceProcessor(model_file=str(Path(out) / "source.spm"))
  target = spm.SentencePieceProcessor(model_file=str(Path(out) / "target.spm"))
  results = ctranslate2.Translator(out, intra_threads=1).translate_batch(
      [source.encode(s, out_type=str) for s in sentences], beam_size=1,
      max_decoding_length=20, min_decoding_length=0, return_scores=True)
  theirs = [target.decode_pieces(r.hypotheses[0]) for r in results]
  with jax.default_matmul_precision("highest"):
    ours = [h[0] for h in translator.translate_hypotheses(sentences, method="greedy",
                                                          max_len=20)]
  assert theirs == [h.text for h in ours] == [text for text, _, _ in
                                              _np_translations(started, max_len=20)]
  # Its greedy score is log p / length (EOS counted), float32 sums in another order.
  np.testing.assert_allclose([r.scores[0] for r in results],
                             [h.log_prob / h.length for h in ours], rtol=0, atol=2e-4)


def test_a_start_row_cannot_lift_bos_above_never(started):
  """BOS's logit is y . (its row) + its bias, and its row (tied output) is
  the start row: whatever the decoder's output y, a LayerNorm's, the logit
  stays <= NEVER. The y that makes it largest, built here, reaches the bound
  within float rounding, so the bias is lowered by no more than it must be."""
  hf, _, _, _, _ = started
  model = marian.read_model(str(hf))
  params = marian.params_from_marian(model.weights, model.config, model.decoder_start)
  config = model.config
  row = params["embeddings"]["embedding"]["embedding"][config.bos_id].astype(np.float64)
  norm = params["decoder"][f"layers_{config.num_decoder_layers - 1}"]["feed_forward_norm"]
  scale, bias = (np.asarray(norm["norm"][k], np.float64) for k in ("scale", "bias"))
  # y = scale * n + bias, n = LayerNorm's normalised x: the x along
  # scale * row (centred, large so that epsilon does not matter) maximises y . row.
  x = 1e3 * (scale * row - (scale * row).mean())
  n = (x - x.mean()) / np.sqrt(x.var() + config.layer_norm_epsilon)
  highest = (scale * n + bias) @ row + params["decoder"]["logits_bias"][config.bos_id]
  assert marian.NEVER - 1e-3 < highest <= marian.NEVER + 1e-6
  for seed in range(100):  # and no other y goes higher
    n = np.random.default_rng(seed).standard_normal(row.size)
    n = (n - n.mean()) / n.std()
    assert (scale * n + bias) @ row + params["decoder"]["logits_bias"][config.bos_id] <= highest
