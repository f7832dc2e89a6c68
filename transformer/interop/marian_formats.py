"""Reading a Marian / OPUS-MT model from its files, in either format, into a
`MarianModel` (Marian-NMT's parameter names, this project's model config, the
vocabulary, the SentencePiece models), without torch. `marian.py` maps it
onto this project's parameters and writes the workdir.

  * a Hugging Face Marian model (`config.json`, `model.safetensors` read with
    `safetensors.numpy`, `source.spm`, `target.spm`, `vocab.json`): a local
    directory, or a hub id downloaded with `huggingface_hub`; also a pre-LN
    model in Pegasus' classes with Marian's vocabulary, as `hf_export.py`
    writes one;
  * an OPUS-MT release of Marian-NMT (`decoder.yml` naming the model `.npz`,
    its options in `special:model.yml`, and its vocabulary `.yml`):
    `marian_release.py`.

`marian.read_model` chooses between them (or downloads a hub id).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from transformer.data import marian_tokenizer, received
from transformer.model.config import TransformerConfig
from transformer.runtime import model_memory

LAYER_NORM_EPSILON = 1e-5  # torch's, which Hugging Face's Marian and CTranslate2 use
MAX_LEN = 512              # Hugging Face's max_position_embeddings for OPUS-MT
HF_FILES = ("config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json")
# model.safetensors may hold up to twice the parameters' float32 bytes (an
# untied copy of the embedding, float64 at worst) and this much more: its
# header, position tables, final_logits_bias.
WEIGHTS_MARGIN_BYTES = 64 << 20

@dataclasses.dataclass
class MarianModel:
  """A Marian model read from either format, in Marian-NMT's own terms.

  weights: Marian-NMT's parameter names (`Wemb`, `encoder_l1_self_Wq`, ...;
    matrices `[in, out]`, biases `[1, out]`), float32, Marian's vocabulary
    (no `<pad>` row).
  config: this project's model config (ids and vocab_size already ours).
  pieces: the vocabulary in Marian's id order (`</s>`, `<unk>`, ...).
  decoder_start: `[d_model]` float32 in Marian's layout (before the
    residual permutation, before the sqrt(d_model) scale): the embedding row
    the decoder starts from. Hugging Face: the row of `decoder_start_token_id`
    (`<pad>`) in the decoder's embedding, whatever training left there;
    Marian-NMT: zeros (it starts from a zero vector).
  """
  weights: dict[str, np.ndarray]
  config: TransformerConfig
  pieces: list[str]
  source_spm: bytes
  target_spm: bytes
  origin: str
  decoder_start: np.ndarray


class MarianImportError(ValueError):
  """A model this importer cannot read, with what to do (subclass of ValueError)."""


def marian_config(*, vocab_size: int, d_model: int, num_heads: int, d_ff: int,
                  num_encoder_layers: int, num_decoder_layers: int, activation: str,
                  normalization: str, share_embeddings: bool, logits_via_embedding: bool,
                  dropout_rate: float = 0.1,
                  attention_dropout_rate: float = 0.0) -> TransformerConfig:
  """The TransformerConfig of a Marian model of `vocab_size` Marian ids."""
  return TransformerConfig(
      vocab_size=vocab_size + 2, d_model=d_model, num_heads=num_heads, d_ff=d_ff,
      num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers,
      max_len=MAX_LEN, dropout_rate=dropout_rate,
      attention_dropout_rate=attention_dropout_rate, share_embeddings=share_embeddings,
      logits_via_embedding=logits_via_embedding, normalization=normalization,
      activation=activation, logits_bias=True, positional="sinusoidal",
      layer_norm_epsilon=LAYER_NORM_EPSILON, pad_id=0, eos_id=1, bos_id=2)


def _activation(name: str, where: str) -> str:
  if name in ("swish", "silu"):
    return "swish"
  if name == "relu":
    return "relu"
  if name in ("gelu_pytorch_tanh", "gelu_new"):  # (flax's nn.gelu: the tanh approximation)
    return "gelu"
  raise MarianImportError(f"{where}: the FFN activation {name!r} is not one this model computes "
                     "exactly (swish, relu, gelu_pytorch_tanh)")


# ----------------------------------------------------------------------------
# Hugging Face Marian (config.json, model.safetensors, vocab.json, *.spm)
# ----------------------------------------------------------------------------


def read_hf_directory(path: str) -> MarianModel:
  """A Hugging Face Marian model directory, read with safetensors.numpy."""
  from safetensors.numpy import load_file

  _check_hf_files(path)
  where = os.path.join(path, "config.json")
  hf = _json_object(where, path, "config")
  try:
    config, pieces, share, tied, pad = _hf_config(path, hf, where)
  except MarianImportError:
    raise
  except (KeyError, TypeError, ValueError) as e:  # (a field missing or of another type)
    raise MarianImportError(f"{where}: not the config of a Marian model this importer reads "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
  size = model_memory.check_fits(config, where, "importing")  # (before a weight is read)
  weights_file = os.path.join(path, "model.safetensors")
  # (regular, inside the model's folder, at most the parameters' own bytes
  # in float32 plus its header and position tables: what safetensors maps)
  received.open_file(weights_file, root=path, kind="weights",
                     limit=2 * size.bytes + WEIGHTS_MARGIN_BYTES).close()
  try:
    tensors = load_file(weights_file)
  except Exception as e:  # (safetensors' SafetensorError: a header or size that is wrong)
    raise MarianImportError(f"{weights_file} is not a safetensors file this importer can "
                            f"read ({type(e).__name__}: {str(e)[:200]})") from None
  weights = _marian_names(tensors, config, share, tied, weights_file)
  start_id = hf.get("decoder_start_token_id")
  start = _decoder_start(tensors, share, pad if start_id is None else start_id,
                         len(pieces) + 1, weights_file)
  return MarianModel(weights, config, pieces, _read(path, "source.spm"),
                     _read(path, "target.spm"), origin=os.path.abspath(path),
                     decoder_start=start)


def _hf_config(path: str, hf: dict, where: str):
  """(config, pieces without <pad>, share, tied, pad id) of a Hugging Face
  Marian directory's config.json (`hf`) and vocab.json."""
  # "pegasus": Marian's code with pre-LN, as interop/hf_export.py writes pre-LN models
  # (Marian's ids and tokenizer; a Pegasus model of Google's has other ids: refused below).
  if hf.get("model_type") not in ("marian", "pegasus"):
    raise MarianImportError(f"{where}: model_type {hf.get('model_type')!r}, not 'marian' (or "
                            "'pegasus' with Marian's vocabulary)")
  vocab = _json_object(os.path.join(path, "vocab.json"), path, "vocabulary")
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
    raise MarianImportError(f"{os.path.join(path, 'vocab.json')}: expected piece: id pairs, "
                            "the ids integers")
  pieces = [piece for piece, _ in sorted(vocab.items(), key=lambda item: item[1])]
  if sorted(vocab.values()) != list(range(len(vocab))):
    raise MarianImportError(f"{os.path.join(path, 'vocab.json')}: its ids are not 0 ... "
                       f"{len(vocab) - 1}")
  if os.path.exists(os.path.join(path, "target_vocab.json")) or (
      hf.get("decoder_vocab_size") not in (None, hf["vocab_size"])):
    raise MarianImportError(f"{path}: separate source and target vocabularies (target_vocab."
                       "json, decoder_vocab_size) are not supported: this model has one "
                       "vocabulary for both sides")
  # Hugging Face's conversion appends <pad> (pad = decoder start = the last id).
  pad = hf.get("pad_token_id", len(pieces) - 1)
  if pad != len(pieces) - 1 or pieces[pad] != "<pad>" or hf.get("eos_token_id", 0) != 0:
    raise MarianImportError(f"{where}: expected Marian's ids (eos 0, <pad> the last id "
                       f"{len(pieces) - 1}), got eos {hf.get('eos_token_id')}, pad {pad}")
  if hf.get("vocab_size") != len(pieces):
    raise MarianImportError(f"{where}: vocab_size {hf.get('vocab_size')} but vocab.json has "
                       f"{len(pieces)} pieces")
  pieces = pieces[:-1]
  marian_tokenizer.check_marian_pieces(pieces, os.path.join(path, "vocab.json"))
  if not hf.get("scale_embedding", False):
    raise MarianImportError(f"{where}: scale_embedding is false; this model always scales the "
                       "embeddings by sqrt(d_model), as Marian does")
  for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"),
                   ("encoder_ffn_dim", "decoder_ffn_dim")):
    if hf[enc] != hf[dec]:
      raise MarianImportError(f"{where}: {enc}={hf[enc]} but {dec}={hf[dec]}; this model has "
                         "one value for both")
  pre_norm = hf["model_type"] == "pegasus"  # (Pegasus always shares one embedding)
  share = pre_norm or bool(hf.get("share_encoder_decoder_embeddings", True))
  tied = bool(hf.get("tie_word_embeddings", True))
  config = marian_config(
      vocab_size=len(pieces), d_model=hf["d_model"], num_heads=hf["encoder_attention_heads"],
      d_ff=hf["encoder_ffn_dim"], num_encoder_layers=hf["encoder_layers"],
      num_decoder_layers=hf["decoder_layers"],
      activation=_activation(hf.get("activation_function", "swish"), where),
      normalization="pre" if pre_norm else "post", share_embeddings=share,
      logits_via_embedding=tied,
      dropout_rate=float(hf.get("dropout", 0.1)),
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)))
  return config, pieces, share, tied, pad


def _check_hf_files(path: str) -> None:
  missing = [name for name in HF_FILES if not os.path.exists(os.path.join(path, name))]
  if "model.safetensors" in missing and os.path.exists(os.path.join(path, "pytorch_model.bin")):
    raise MarianImportError(
        f"{path} has pytorch_model.bin but no model.safetensors: the .bin file is a torch "
        "pickle, which this importer does not read (no torch here). Use a revision that has "
        "model.safetensors (on the hub, --revision=refs/pr/<N> of the safetensors "
        "conversion), or convert it where torch is installed: "
        "transformers.MarianMTModel.from_pretrained(dir).save_pretrained(dir, "
        "safe_serialization=True)")
  if missing:
    raise MarianImportError(f"{path} is not a Hugging Face Marian model directory: missing "
                       f"{', '.join(missing)}")


def _marian_names(tensors: dict, config: TransformerConfig, share: bool, tied: bool,
                  where: str) -> dict[str, np.ndarray]:
  """Hugging Face Marian tensors -> Marian-NMT names, `[in, out]` matrices, no
  `<pad>` row (Hugging Face's conversion adds it as the last id)."""
  def get(name):
    for candidate in (name, name.removeprefix("model.")):
      if candidate in tensors:
        return np.asarray(tensors[candidate], np.float32)
    raise MarianImportError(f"{where}: no tensor {name!r}")

  out = {}

  def linear(hf, marian, suffix):
    out[f"{marian}_W{suffix}"] = get(f"{hf}.weight").T  # torch [out, in] -> [in, out]
    out[f"{marian}_b{suffix}"] = get(f"{hf}.bias")[None]

  suffix = "_pre" if config.normalization == "pre" else ""  # (Marian-NMT's pre-LN names)

  def norm(hf, marian):
    out[f"{marian}_ln_scale{suffix}"] = get(f"{hf}.weight")[None]
    out[f"{marian}_ln_bias{suffix}"] = get(f"{hf}.bias")[None]

  for side, count in (("encoder", config.num_encoder_layers),
                      ("decoder", config.num_decoder_layers)):
    _check_positions(tensors, side, config.d_model, where)
    for i in range(count):
      hf, marian = f"model.{side}.layers.{i}", f"{side}_l{i + 1}"
      attentions = [("self_attn", "self")] + ([("encoder_attn", "context")]
                                              if side == "decoder" else [])
      for hf_attn, marian_attn in attentions:
        for x in "qkv":
          linear(f"{hf}.{hf_attn}.{x}_proj", f"{marian}_{marian_attn}", x)
        linear(f"{hf}.{hf_attn}.out_proj", f"{marian}_{marian_attn}", "o")
        norm(f"{hf}.{hf_attn}_layer_norm", f"{marian}_{marian_attn}_Wo")
      linear(f"{hf}.fc1", f"{marian}_ffn", "1")
      linear(f"{hf}.fc2", f"{marian}_ffn", "2")
      norm(f"{hf}.final_layer_norm", f"{marian}_ffn_ffn")
    if config.normalization == "pre":  # (Pegasus: a LayerNorm after each stack)
      out[f"{side}_top_ln_scale"] = get(f"model.{side}.layer_norm.weight")[None]
      out[f"{side}_top_ln_bias"] = get(f"model.{side}.layer_norm.bias")[None]
  if share:
    out["Wemb"] = get("model.shared.weight")[:-1]
  else:
    out["encoder_Wemb"] = get("model.encoder.embed_tokens.weight")[:-1]
    out["decoder_Wemb"] = get("model.decoder.embed_tokens.weight")[:-1]
  if not tied:
    out["decoder_ff_logit_out_Wt"] = get("lm_head.weight")[:-1]
  if "final_logits_bias" in tensors:
    out["decoder_ff_logit_out_b"] = np.asarray(tensors["final_logits_bias"],
                                               np.float32).reshape(1, -1)[:, :-1]
  return out


def _decoder_start(tensors: dict, share: bool, start_id: int, vocab_size: int,
                   where: str) -> np.ndarray:
  """The decoder's start row `[d_model]`: transformers feeds the embedding of
  `decoder_start_token_id` (Marian's `<pad>`, the last id) as the decoder's
  first input. Its conversion of a Marian-NMT model appends a zero `<pad>`
  row, but a model trained or fine-tuned in transformers has whatever its
  training left there, so the row is read, not assumed zero."""
  if not isinstance(start_id, int) or not 0 <= start_id < vocab_size:
    raise MarianImportError(f"{where}: decoder_start_token_id {start_id!r} is not an id of "
                            f"the {vocab_size} in vocab.json")
  name = "model.shared.weight" if share else "model.decoder.embed_tokens.weight"
  table = tensors.get(name, tensors.get(name.removeprefix("model.")))
  if table is None:
    raise MarianImportError(f"{where}: no tensor {name!r}")
  return np.asarray(table[start_id], np.float32)


def _check_positions(tensors: dict, side: str, d_model: int, where: str) -> None:
  """A stored position table must be Marian's sinusoid (not learned positions)."""
  name = f"model.{side}.embed_positions.weight"
  if name not in tensors:
    return
  table = np.asarray(tensors[name], np.float32)
  if table.ndim != 2 or table.shape[1] != d_model:
    raise MarianImportError(f"{where}: {name} has shape {table.shape}, not [positions, "
                            f"d_model={d_model}]")
  if not np.allclose(table, marian_position_table(table.shape[0], d_model), atol=1e-4):
    raise MarianImportError(f"{where}: {name} is not Marian's sinusoidal table (learned "
                       "positions are not imported)")


def marian_position_table(length: int, d_model: int) -> np.ndarray:
  """Marian's `[length, d_model]` table: sin(pos / 10000^(2i/d)) in the first
  half, cos(...) in the second, positions from 0."""
  angles = (np.arange(length)[:, None]
            / np.power(10000.0, 2 * np.arange(d_model // 2) / d_model)[None])
  return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


# ----------------------------------------------------------------------------
# Either format
# ----------------------------------------------------------------------------


def _json_object(path: str, root: str, kind: str) -> dict:
  """The JSON object in `path`, a file of the model's folder `root` and of
  `kind` (`received.LIMITS`); MarianImportError naming it otherwise."""
  document = received.read_bytes(path, root=root, kind=kind)
  try:
    value = json.loads(document)
  except ValueError as e:  # (UnicodeDecodeError among them)
    raise MarianImportError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise MarianImportError(f"{path} is not a JSON object")
  return value


def _read(path: str, name: str) -> bytes:
  """The SentencePiece model `name` of the model's folder `path`."""
  return received.read_bytes(os.path.join(path, name), root=path, kind="vocabulary",
                             what="a SentencePiece model")
