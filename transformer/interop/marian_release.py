"""Reading an OPUS-MT release of Marian-NMT (`decoder.yml` naming the model
`.npz`, its options in `special:model.yml`, its vocabulary `.yml` and the
two SentencePiece models) into a `marian_formats.MarianModel`. Every file is
data: YAML through `yaml.safe_load`, the `.npz` with `allow_pickle=False`,
the files `decoder.yml` names only inside the release (docs/security.md)."""

from __future__ import annotations

import os
import zipfile

import numpy as np

from transformer.data import marian_tokenizer
from transformer.interop.marian_formats import (MarianImportError, MarianModel, _activation,
                                                _read, marian_config)
from transformer.model.config import TransformerConfig


def read_marian_release(path: str) -> MarianModel:
  """An OPUS-MT Marian-NMT release directory (its decoder.yml names the rest)."""
  decoder_yml = os.path.join(path, "decoder.yml")
  decoder = _yaml(decoder_yml)
  try:
    model_file = _inside(path, decoder["models"][0], decoder_yml)
    vocab_files = [_inside(path, v, decoder_yml) for v in decoder["vocabs"]]
  except (KeyError, IndexError, TypeError):
    raise MarianImportError(f"{decoder_yml}: expected 'models: [<file>.npz]' and 'vocabs: "
                       "[<source>.yml, <target>.yml]'") from None
  for name in [model_file, *vocab_files, os.path.join(path, "source.spm"),
               os.path.join(path, "target.spm")]:
    if not os.path.exists(name):
      raise MarianImportError(f"{path}: {os.path.basename(name)} is missing (named by "
                         f"{decoder_yml}, or the SentencePiece model of a side)")
  vocabs = [load_marian_vocab(v) for v in vocab_files]
  if any(v != vocabs[0] for v in vocabs):
    raise MarianImportError(f"{decoder_yml}: separate source and target vocabularies are not "
                       "supported: this model has one vocabulary for both sides")
  marian_tokenizer.check_marian_pieces(vocabs[0], vocab_files[0])
  try:  # (never a pickle: allow_pickle=False refuses one, and object arrays, unread)
    with np.load(model_file, allow_pickle=False) as npz:
      weights = {name: npz[name] for name in npz.files if not name.startswith("special:")}
      options = _npz_options(npz, model_file)
  except MarianImportError:
    raise
  except (OSError, ValueError, AttributeError, EOFError, zipfile.BadZipFile) as e:
    raise MarianImportError(f"{model_file} is not a Marian .npz model this importer can "
                            f"read ({type(e).__name__}: {str(e)[:200]})") from None
  if not all(w.dtype.kind == "f" for w in weights.values()):
    raise MarianImportError(f"{model_file}: its parameters must be floating-point arrays")
  try:
    config = _config_from_options(options, len(vocabs[0]), weights, model_file)
  except MarianImportError:
    raise
  except (KeyError, TypeError, ValueError) as e:  # (an option missing or of another type)
    raise MarianImportError(f"{model_file}: its options (special:model.yml) are not those of "
                            f"a Marian transformer ({type(e).__name__}: {str(e)[:200]})") from None
  # Marian-NMT starts the decoder from a zero vector (no start token).
  return MarianModel(weights, config, vocabs[0], _read(path, "source.spm"),
                     _read(path, "target.spm"), origin=os.path.abspath(path),
                     decoder_start=np.zeros(config.d_model, np.float32))


def _npz_options(npz, where: str) -> dict:
  import yaml

  if "special:model.yml" not in npz.files:
    raise MarianImportError(f"{where}: no 'special:model.yml' (the model's options)")
  raw = np.asarray(npz["special:model.yml"]).astype(np.uint8).tobytes().rstrip(b"\0")
  try:
    options = yaml.safe_load(raw.decode("utf-8"))
  except (UnicodeDecodeError, yaml.YAMLError) as e:
    raise MarianImportError(f"{where}: its 'special:model.yml' is not YAML "
                            f"({' '.join(str(e).split())[:200]})") from None
  if not isinstance(options, dict):
    raise MarianImportError(f"{where}: its 'special:model.yml' is not a mapping of options")
  return options


def _config_from_options(options: dict, vocab_size: int, weights: dict,
                         where: str) -> TransformerConfig:
  """Marian-NMT's model options -> TransformerConfig, refusing what differs."""
  def need(ok, problem):
    if not ok:
      raise MarianImportError(f"{where}: {problem}")

  need(options.get("type") == "transformer", f"--type {options.get('type')!r}, not transformer")
  need(options.get("transformer-decoder-autoreg", "self-attention") == "self-attention",
       "only --transformer-decoder-autoreg self-attention is imported")
  need(int(options.get("transformer-ffn-depth", 2)) == 2 and
       int(options.get("transformer-decoder-ffn-depth", 0) or 2) == 2,
       "only a two-layer FFN (--transformer-ffn-depth 2) is imported")
  d_ff = int(options["transformer-dim-ffn"])
  need(int(options.get("transformer-decoder-dim-ffn", 0) or d_ff) == d_ff,
       "the decoder's FFN width differs from the encoder's")
  need(not options.get("transformer-train-position-embeddings", False),
       "learned positions (--transformer-train-position-embeddings) are not imported")
  need(options.get("transformer-postprocess-emb", "d") in ("d", ""),
       "a LayerNorm on the embeddings (--transformer-postprocess-emb n) is not imported")
  need(not options.get("transformer-tied-layers"), "tied layers are not imported")
  layout = (options.get("transformer-preprocess", ""),
            options.get("transformer-postprocess", "dan"),
            options.get("transformer-postprocess-top", ""))
  need(layout in (("", "dan", ""), ("n", "da", "n")),
       f"pre/post-processing {layout} is neither post-LN ('', 'dan', '') nor pre-LN "
       "('n', 'da', 'n')")
  heads = int(options["transformer-heads"])
  return marian_config(
      vocab_size=vocab_size, d_model=int(options["dim-emb"]), num_heads=heads, d_ff=d_ff,
      num_encoder_layers=int(options["enc-depth"]), num_decoder_layers=int(options["dec-depth"]),
      activation=_activation(options.get("transformer-ffn-activation", "swish"), where),
      normalization="pre" if layout[0] == "n" else "post",
      share_embeddings="Wemb" in weights,
      logits_via_embedding="decoder_ff_logit_out_Wt" not in weights,
      dropout_rate=float(options.get("transformer-dropout", 0.1)),
      attention_dropout_rate=float(options.get("transformer-dropout-attention", 0.0)))


def load_marian_vocab(path: str) -> list[str]:
  """A Marian vocabulary `.yml` (piece: id per line) -> pieces in id order.

  Parsed line by line, as Marian writes it (PyYAML reads some pieces, e.g.
  'yes', '~' or '1.0', as other things than strings)."""
  import yaml

  entries, complex_key = {}, None
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      line = line.rstrip("\n\r")
      if not line.strip():
        continue
      if line.startswith("? "):  # a long key: "? <piece>", then ": <id>"
        complex_key = line[2:]
        continue
      if complex_key is not None:
        key, sep, value = complex_key, ":", line.removeprefix(":")
        complex_key = None
      else:
        key, sep, value = line.rpartition(":")
      try:
        index = int(value)
      except ValueError:
        index = None
      if not sep or index is None:
        raise MarianImportError(f"{path}, line {number}: expected '<piece>: <id>', got {line!r}")
      if key.startswith(('"', "'")):  # quoted: YAML's own rules for the string
        try:
          key = yaml.safe_load(key)
        except yaml.YAMLError:
          key = None
        if not isinstance(key, str):
          raise MarianImportError(f"{path}, line {number}: {line[:80]!r} is not a quoted "
                                  "piece")
      entries[index] = key
  if sorted(entries) != list(range(len(entries))):
    raise MarianImportError(f"{path}: its ids are not 0 ... {len(entries) - 1}")
  return [entries[i] for i in range(len(entries))]


def _yaml(path: str) -> dict:
  """The YAML mapping in `path` (yaml.safe_load: plain data, no Python objects)."""
  import yaml

  try:
    with open(path, encoding="utf-8") as f:
      value = yaml.safe_load(f)
  except (UnicodeDecodeError, yaml.YAMLError) as e:
    raise MarianImportError(f"{path} is not YAML ({' '.join(str(e).split())[:200]})") from None
  if not isinstance(value, dict):
    raise MarianImportError(f"{path} is not a YAML mapping")
  return value


def _inside(directory: str, name, where: str) -> str:
  """`directory`/`name` for a file `where` names: a relative path that stays in
  `directory` (no absolute path, no ..); MarianImportError otherwise."""
  if not isinstance(name, str):
    raise TypeError(name)
  parts = name.replace("\\", "/").split("/")
  if not name or os.path.isabs(name) or ".." in parts:
    raise MarianImportError(f"{where} names {name[:200]!r}, which is not a file of {directory} "
                            "(an absolute path or one that climbs out with ..)")
  return os.path.join(directory, name)
