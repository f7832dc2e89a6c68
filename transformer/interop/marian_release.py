"""Reading an OPUS-MT release of Marian-NMT (`decoder.yml` naming the model
`.npz`, its options in `special:model.yml`, its vocabulary `.yml` and the
two SentencePiece models) into a `marian_formats.MarianModel`. Every file is
data: YAML through `yaml.safe_load`, the `.npz` with `allow_pickle=False`,
the files `decoder.yml` names only inside the release (docs/security.md)."""

from __future__ import annotations

import contextlib
import io
import math
import os
import zipfile
import zlib

import numpy as np

from transformer.data import marian_tokenizer, received
from transformer.interop.marian_formats import (MarianImportError, MarianModel, _activation,
                                                _read, marian_config)
from transformer.model.config import TransformerConfig
from transformer.model.param_size import ParameterSize
from transformer.runtime import model_memory

OPTIONS = "special:model.yml"  # the .npz member that holds the model's options
MAX_OPTIONS_BYTES = 1 << 20    # (Marian writes a few KiB)
MAX_MEMBERS = 1 << 16          # (512 + 512 layers have about 21,500 parameters)
NPY_HEADER_BYTES = 1 << 10     # a member's .npy header, at most (numpy writes 128 bytes)


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
  vocabs = [load_marian_vocab(v, path) for v in vocab_files]
  if any(v != vocabs[0] for v in vocabs):
    raise MarianImportError(f"{decoder_yml}: separate source and target vocabularies are not "
                       "supported: this model has one vocabulary for both sides")
  marian_tokenizer.check_marian_pieces(vocabs[0], vocab_files[0])
  # Sizes before contents: the options and the config they give, what that
  # model weighs against this machine, then every array's declared size, and
  # only then are the arrays inflated (`_check_arrays`: a zip bomb).
  with _open_npz(model_file, path) as npz:
    members = _members(npz, model_file)
    options = _npz_options(npz, members, model_file)
    config = _release_config(options, len(vocabs[0]), members, model_file)
    size = model_memory.check_fits(config, model_file, "importing")
    _check_arrays(npz, members, size, config, model_file)
    weights = _read_arrays(npz, members)
  # Marian-NMT starts the decoder from a zero vector (no start token).
  return MarianModel(weights, config, vocabs[0], _read(path, "source.spm"),
                     _read(path, "target.spm"), origin=os.path.abspath(path),
                     decoder_start=np.zeros(config.d_model, np.float32))


@contextlib.contextmanager
def _open_npz(model_file: str, root: str):
  """The .npz `model_file` of the release folder `root` opened
  (`received.open_file`: inside it, a regular file; np.load reads only its
  zip directory, and every member is bounded by the config before it is
  inflated); never a pickle: allow_pickle=False refuses one, and object
  arrays, unread. What the zip or numpy raise while it is read is one
  sentence naming it."""
  try:
    npz = np.load(received.open_file(model_file, root=root, kind="weights",
                                     what="the Marian model"), allow_pickle=False)
    if not isinstance(npz, np.lib.npyio.NpzFile):
      raise ValueError("an .npy array, not an .npz archive")
    with npz:
      yield npz
  except (MarianImportError, model_memory.ModelTooLarge, received.RefusedFile):
    raise
  except (OSError, ValueError, AttributeError, EOFError, zipfile.BadZipFile, zlib.error) as e:
    raise MarianImportError(f"{model_file} is not a Marian .npz model this importer can "
                            f"read ({type(e).__name__}: {str(e)[:200]})") from None


def _members(npz, where: str) -> dict[str, zipfile.ZipInfo]:
  """The archive's members by array name (np.load's: without ".npy"), from
  its zip directory; refused: more than MAX_MEMBERS, or more compressed
  bytes than the file holds (truncated, or not what it says)."""
  infos = npz.zip.infolist()
  if len(infos) > MAX_MEMBERS:
    raise MarianImportError(f"{where} has {len(infos):,} members, more than the "
                            f"{MAX_MEMBERS:,} a Marian model of any size has")
  compressed, file_bytes = sum(i.compress_size for i in infos), os.path.getsize(where)
  if compressed > file_bytes:
    raise MarianImportError(f"{where}: its members claim {compressed:,} bytes, more than the "
                            f"file's {file_bytes:,}: it is truncated or not an .npz archive")
  return {i.filename.removesuffix(".npy"): i for i in infos}


def _npz_options(npz, members: dict, where: str) -> dict:
  import yaml

  if OPTIONS not in members:
    raise MarianImportError(f"{where}: no '{OPTIONS}' (the model's options)")
  _check_array(npz, members[OPTIONS], MAX_OPTIONS_BYTES, where, floats=False)
  raw = np.asarray(npz[OPTIONS]).astype(np.uint8).tobytes().rstrip(b"\0")
  try:
    options = yaml.safe_load(raw.decode("utf-8"))
  except (UnicodeDecodeError, yaml.YAMLError) as e:
    raise MarianImportError(f"{where}: its '{OPTIONS}' is not YAML "
                            f"({' '.join(str(e).split())[:200]})") from None
  if not isinstance(options, dict):
    raise MarianImportError(f"{where}: its '{OPTIONS}' is not a mapping of options")
  return options


def _release_config(options: dict, vocab_size: int, names, where: str) -> TransformerConfig:
  """`_config_from_options`, whose errors name `where`."""
  try:
    return _config_from_options(options, vocab_size, names, where)
  except MarianImportError:
    raise
  except (KeyError, TypeError, ValueError) as e:  # (an option missing or of another type)
    raise MarianImportError(f"{where}: its options ({OPTIONS}) are not those of a Marian "
                            f"transformer ({type(e).__name__}: {str(e)[:200]})") from None


def _check_arrays(npz, members: dict, size: ParameterSize, config: TransformerConfig,
                  where: str) -> None:
  """Refuses, before any is inflated, arrays that declare more bytes than the
  parameters `config` describes (`size`, this project's model, which has a
  few more rows than Marian's, plus each member's .npy header), or that are
  not floating-point .npy arrays of exactly their declared size."""
  arrays = {name: info for name, info in members.items() if not name.startswith("special:")}
  declared = sum(info.file_size for info in arrays.values())
  most = size.bytes + NPY_HEADER_BYTES * len(arrays)
  if declared > most:
    largest = max(arrays, key=lambda name: arrays[name].file_size)
    raise MarianImportError(
        f"{where}: its arrays inflate to {model_memory.format_bytes(declared)} (the largest, "
        f"{largest}, to {model_memory.format_bytes(arrays[largest].file_size)} from "
        f"{model_memory.format_bytes(arrays[largest].compress_size)}), more than the "
        f"{model_memory.format_bytes(most)} of the parameters its options describe "
        f"({model_memory.describe(config)}): it is not that model's parameter file (a zip "
        "bomb?); use the release's own model file.")
  for info in arrays.values():
    _check_array(npz, info, most, where, floats=True)


def _check_array(npz, info: zipfile.ZipInfo, most: int, where: str, *, floats: bool) -> None:
  """Refuses the member `info` unless it declares at most `most` bytes and its
  .npy header (read alone: numpy allocates what the header declares before it
  reads a byte) declares an array of exactly the member's size, of
  floating-point numbers with `floats`."""
  name = info.filename.removesuffix(".npy")
  if info.file_size > most:
    raise MarianImportError(
        f"{where}: its member {name} inflates to {model_memory.format_bytes(info.file_size)}, "
        f"more than the {model_memory.format_bytes(most)} it may hold (a zip bomb?); use "
        "the release's own model file.")
  readers = {(1, 0): np.lib.format.read_array_header_1_0,
             (2, 0): np.lib.format.read_array_header_2_0}
  with npz.zip.open(info) as member:
    version = np.lib.format.read_magic(member)
    if version not in readers:
      raise ValueError(f"{name}: .npy format version {version}")
    shape, _, dtype = readers[version](member)
    header_bytes = member.tell()
  data_bytes = math.prod(shape) * dtype.itemsize
  if header_bytes + data_bytes != info.file_size:
    raise MarianImportError(
        f"{where}: its member {name} declares a {dtype} array of shape {shape[:8]} "
        f"({data_bytes:,} bytes) but holds {info.file_size - header_bytes:,} bytes")
  if floats and dtype.kind != "f":
    raise MarianImportError(f"{where}: its member {name} is an array of {dtype}; the "
                            "parameters must be floating-point arrays")


def _read_arrays(npz, members: dict) -> dict[str, np.ndarray]:
  """The parameters, inflated now that their sizes are known (`_check_arrays`)."""
  return {name: npz[name] for name in members if not name.startswith("special:")}


def _config_from_options(options: dict, vocab_size: int, names, where: str) -> TransformerConfig:
  """Marian-NMT's model options -> TransformerConfig, refusing what differs;
  `names`: the parameters' names (which embeddings and outputs it has)."""
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
      share_embeddings="Wemb" in names,
      logits_via_embedding="decoder_ff_logit_out_Wt" not in names,
      dropout_rate=float(options.get("transformer-dropout", 0.1)),
      attention_dropout_rate=float(options.get("transformer-dropout-attention", 0.0)))


def load_marian_vocab(path: str, root: str | None = None) -> list[str]:
  """A Marian vocabulary `.yml` (piece: id per line) -> pieces in id order;
  `root`: the release folder it must lie in (default: its own folder).

  Parsed line by line, as Marian writes it (PyYAML reads some pieces, e.g.
  'yes', '~' or '1.0', as other things than strings)."""
  import yaml

  entries, complex_key = {}, None
  text = received.read_text(path, root=root or os.path.dirname(path), kind="vocabulary",
                            what="a Marian vocabulary")
  for number, line in enumerate(io.StringIO(text, newline=None), 1):  # (as open() splits)
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

  text = received.read_text(path, root=os.path.dirname(path), kind="config",
                            what="a Marian config")
  try:
    value = yaml.safe_load(text)
  except yaml.YAMLError as e:
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
