"""The vocabulary of an imported Marian / OPUS-MT model: two SentencePiece models
(one for the source language, one for the target) whose pieces map to ids
through one shared piece -> id table (Marian's `vocab.yml`, Hugging Face's
`vocab.json`).

Marian's own ids are `</s>` = 0, `<unk>` = 1, the pieces from 2, and (Hugging
Face's conversion) `<pad>` = the last id, which is also the decoder's start
in transformers; Marian-NMT itself starts the decoder from a zero vector. On
import they are moved into this project's layout (`tokenizer.py`: pad 0, eos
1, bos 2, unk 3, pieces from 4), the model's embedding rows permuted to
match, so that the data pipeline, the loss, the search and the exporter see
one id layout:

    Marian id          ->  id here
    </s>  0                1 (EOS)
    <unk> 1                3 (UNK)
    piece k >= 2           k + 2
    (none)                 0 (PAD) and 2 (BOS): never predicted; PAD's embedding
                           zero, BOS's the decoder's start row (transformers'
                           <pad> row, or Marian-NMT's zero: interop/marian.py)

`MARIAN_TO_OURS` below is that map. A workdir keeps the whole vocabulary in
its `vocab.model` as one JSON document (both SentencePiece models, base64, and
the pieces in this project's id order), which `tokenizer.load_tokenizer`
recognises, so that every tool that reads a workdir's vocabulary reads this
one; `source.spm`, `target.spm` are also written beside it, as they came.

Typical use::

    tok = MarianTokenizer(source_spm_bytes, target_spm_bytes, marian_pieces)
    ids = tok.encode("Hello world")           # source side, no EOS added
    tok.decode(model_output_ids)              # target side, stops at EOS
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

# This project's special ids: tokenizer.py's PAD_ID, EOS_ID, BOS_ID, UNK_ID,
# repeated rather than imported, since tokenizer.load_tokenizer imports this
# module (tests/test_marian.py checks that they are equal).
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

FORMAT = "transformer.marian-vocabulary/1"
SPECIAL_PIECES = {PAD_ID: "<pad>", EOS_ID: "</s>", BOS_ID: "<s>", UNK_ID: "<unk>"}
_EXTRA_IDS = 2  # PAD and BOS have no Marian id


def marian_to_ours(marian_ids: np.ndarray) -> np.ndarray:
  """Marian ids (</s> 0, <unk> 1, pieces from 2) -> this project's ids."""
  marian_ids = np.asarray(marian_ids)
  return np.where(marian_ids == 0, EOS_ID,
                  np.where(marian_ids == 1, UNK_ID, marian_ids + _EXTRA_IDS))


def ours_from_marian_rows(rows: np.ndarray, fill: float) -> np.ndarray:
  """A per-id array of Marian's (`[marian_vocab, ...]`: an embedding, a logits
  bias) laid out in this project's ids (`[marian_vocab + 2, ...]`), the rows
  of PAD and BOS set to `fill`."""
  rows = np.asarray(rows)
  out = np.full((rows.shape[0] + _EXTRA_IDS,) + rows.shape[1:], fill, rows.dtype)
  out[marian_to_ours(np.arange(rows.shape[0]))] = rows
  return out


def check_marian_pieces(pieces: Sequence[str], where: str) -> None:
  """ValueError naming `where` unless the vocabulary has Marian's special ids."""
  if len(pieces) < 3 or pieces[0] != "</s>" or pieces[1] != "<unk>":
    raise ValueError(f"{where}: a Marian vocabulary has '</s>' at id 0 and '<unk>' at "
                     f"id 1, this one has {list(pieces[:2])!r}")


class MarianTokenizer:
  """Marian's two SentencePiece models and its piece table, in this project's ids.

  Same interface as `tokenizer.Tokenizer`: `encode` / `encode_batch` use the
  source model, `encode_target` / `encode_target_batch` the target model and
  `decode` the target model; pieces not in the table become UNK, as in Marian.

  Attributes:
    vocab_size: Marian's vocabulary + 2 (PAD and BOS).
    pad_id, eos_id, bos_id, unk_id: 0, 1, 2, 3.
  """

  def __init__(self, source_spm: bytes, target_spm: bytes, marian_pieces: Sequence[str],
               model_path: str | None = None):
    """marian_pieces: the table's pieces in Marian's id order (</s>, <unk>, ...)."""
    check_marian_pieces(marian_pieces, model_path or "MarianTokenizer")
    self._source_proto, self._target_proto = bytes(source_spm), bytes(target_spm)
    self._marian_pieces = list(marian_pieces)
    self.model_path = model_path
    self._source = spm.SentencePieceProcessor(model_proto=self._source_proto)
    self._target = spm.SentencePieceProcessor(model_proto=self._target_proto)
    self.vocab_size = len(marian_pieces) + _EXTRA_IDS
    self._pieces = [""] * self.vocab_size
    for marian_id, ours in enumerate(marian_to_ours(np.arange(len(marian_pieces))).tolist()):
      self._pieces[ours] = marian_pieces[marian_id]
    for i, piece in SPECIAL_PIECES.items():
      self._pieces[i] = piece
    self._ids = {piece: i for i, piece in enumerate(self._pieces)
                 if i not in (PAD_ID, BOS_ID)}
    self.pad_id, self.eos_id, self.bos_id, self.unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID

  # -- one file: the workdir's vocab.model ------------------------------------

  def serialized_model(self) -> bytes:
    """The whole vocabulary as one JSON document (`load_tokenizer` reads it)."""
    return json.dumps({
        "format": FORMAT,
        "source_spm": base64.b64encode(self._source_proto).decode("ascii"),
        "target_spm": base64.b64encode(self._target_proto).decode("ascii"),
        "marian_pieces": self._marian_pieces,
    }, ensure_ascii=False).encode("utf-8")

  @classmethod
  def from_serialized(cls, data: bytes, model_path: str | None = None) -> "MarianTokenizer":
    where = model_path or "the Marian vocabulary"
    try:
      doc = json.loads(data.decode("utf-8"))
      if not isinstance(doc, dict):
        raise ValueError(f"a JSON object is expected, not {type(doc).__name__}")
      pieces = doc.get("marian_pieces")
      if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        raise ValueError("marian_pieces must be a list of strings")
      if doc.get("format") != FORMAT:
        raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
      return cls(base64.b64decode(doc["source_spm"]), base64.b64decode(doc["target_spm"]),
                 doc["marian_pieces"], model_path=model_path)
    except (UnicodeDecodeError, KeyError, TypeError, ValueError, RuntimeError) as e:
      raise ValueError(f"{where} is not a valid Marian vocabulary ({e}); import the "
                       "model again (python -m transformer.interop.marian)") from None

  def source_model(self) -> bytes:
    return self._source_proto

  def target_model(self) -> bytes:
    return self._target_proto

  # Pickling (e.g. for grain worker processes): the processors are C++.
  def __getstate__(self):
    return {"data": self.serialized_model(), "model_path": self.model_path}

  def __setstate__(self, state):
    other = MarianTokenizer.from_serialized(state["data"], state["model_path"])
    self.__dict__.update(other.__dict__)

  def __repr__(self) -> str:
    return f"MarianTokenizer(vocab_size={self.vocab_size}, model_path={self.model_path!r})"

  # -- text <-> ids ----------------------------------------------------------

  def _to_ids(self, pieces: Iterable[str]) -> list[int]:
    return [self._ids.get(piece, UNK_ID) for piece in pieces]

  def encode(self, text: str) -> list[int]:
    """Source text -> ids (the source SentencePiece model). No EOS added."""
    return self._to_ids(self._source.encode(text, out_type=str))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self._to_ids(p) for p in self._source.encode(list(texts), out_type=str)]

  def encode_target(self, text: str) -> list[int]:
    """Target text -> ids (the target SentencePiece model). No EOS added."""
    return self._to_ids(self._target.encode(text, out_type=str))

  def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self._to_ids(p) for p in self._target.encode(list(texts), out_type=str)]

  def decode(self, ids: Iterable[int]) -> str:
    """Target ids -> text: stops at the first EOS; PAD and BOS are skipped; ids
    outside the vocabulary decode as UNK."""
    pieces = []
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
      if i == EOS_ID:
        break
      if i in (PAD_ID, BOS_ID):
        continue
      pieces.append(self._pieces[i] if 0 <= i < self.vocab_size else "<unk>")
    # SentencePiece decodes the piece "<unk>" of Marian's table as " ⁇ ", as
    # it does its own unknown id.
    return self._target.decode_pieces(pieces)

  def decode_batch(self, batch_ids) -> list[str]:
    return [self.decode(row) for row in batch_ids]

  def id_to_piece(self, i: int) -> str:
    return self._pieces[int(i)]

  def piece_to_id(self, piece: str) -> int:
    return self._ids.get(piece, UNK_ID)

  def pieces(self, ids: Iterable[int]) -> list[str]:
    return [self.id_to_piece(i) for i in np.asarray(ids).reshape(-1).tolist()]


def is_serialized_marian(data: bytes) -> bool:
  """Whether `data` (a vocab.model's bytes) is a Marian vocabulary document
  (a SentencePiece model is a protobuf, which never starts with '{')."""
  return data[:1] == b"{"
