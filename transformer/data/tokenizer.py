"""SentencePiece vocabulary: train, load, encode, decode.

One vocabulary is shared by source and target (the paper shares the embedding
between encoder, decoder and pre-softmax projection, so both languages must live
in one id space). The special ids are fixed for the whole project:

    PAD_ID = 0   padding; also the segment id of padding in packed batches
    EOS_ID = 1   end of sequence; appended to every source and target
    BOS_ID = 2   beginning of sequence; the decoder's first input token
    UNK_ID = 3   unknown piece

Typical use::

    tok = train_tokenizer(sentences, f"{workdir}/vocab.model", vocab_size=8000)
    tok = load_tokenizer(f"{workdir}/vocab.model")       # later, e.g. decode.py
    ids = tok.encode("Hello world")                      # no BOS / EOS added
    tok.decode(ids + [EOS_ID, 17, 42])                   # -> "Hello world"
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from transformer.data import received
from transformer.data.text_io import write_atomically

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

# Enough sentences for a good vocabulary; SentencePiece itself samples 1M.
DEFAULT_MAX_SENTENCES = 1_000_000


def available_cores() -> int:
  """The CPU cores this process may run on (its affinity mask where the OS has
  one, e.g. a Slurm or container limit; else all of the machine's)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # (macOS, Windows)
    return os.cpu_count() or 1


class Tokenizer:
  """A SentencePiece model with the project's fixed special ids.

  Attributes:
    vocab_size: number of ids, including the 4 special ones. Every id the model
      can emit must be < vocab_size (the model may use a larger, padded
      embedding; `decode` maps ids >= vocab_size to UNK).
    pad_id, eos_id, bos_id, unk_id: 0, 1, 2, 3.
  """

  def __init__(self, model_proto: bytes, model_path: str | None = None):
    self._proto = bytes(model_proto)
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
    ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
    if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
      where = model_path or "the given SentencePiece model"
      raise ValueError(
          f"{where} has special ids pad/eos/bos/unk = {ids}, but this project "
          f"needs {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}. Train the vocabulary with "
          "transformer.data.tokenizer.train_tokenizer (or delete it from the workdir "
          "and let train.py retrain it)."
      )
    self.vocab_size: int = self._sp.get_piece_size()
    self.pad_id, self.eos_id, self.bos_id, self.unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID

  # Pickling (e.g. for grain worker processes): the processor itself is C++.
  def __getstate__(self):
    return {"proto": self._proto, "model_path": self.model_path}

  def __setstate__(self, state):
    self.__init__(state["proto"], state["model_path"])

  def __repr__(self) -> str:
    return f"Tokenizer(vocab_size={self.vocab_size}, model_path={self.model_path!r})"

  def encode(self, text: str) -> list[int]:
    """Text -> piece ids. No BOS or EOS is added."""
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Encodes many texts at once (no BOS / EOS added)."""
    return self._sp.encode(list(texts), out_type=int)

  # The target side: the same model here (one shared vocabulary); an imported
  # Marian vocabulary (marian_tokenizer.py) has one model for each side.
  encode_target = encode
  encode_target_batch = encode_batch

  def _clean(self, ids) -> list[int]:
    out = []
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
      if i == EOS_ID:
        break
      if i in (PAD_ID, BOS_ID):
        continue
      out.append(i if 0 <= i < self.vocab_size else UNK_ID)
    return out

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text. Stops at the first EOS; PAD and BOS are ignored.

    Accepts a list or a 1-D numpy / jax array. Ids outside [0, vocab_size)
    (possible when the model's embedding is padded) decode as UNK (" ⁇ ").
    """
    return self._sp.decode(self._clean(ids))

  def decode_batch(self, batch_ids) -> list[str]:
    """Decodes each row of a `[batch, length]` array (or list of lists)."""
    return [self.decode(row) for row in batch_ids]

  def id_to_piece(self, i: int) -> str:
    """The piece of one id, e.g. '▁Hello'; special ids give '<pad>', '</s>', ..."""
    return self._sp.id_to_piece(int(i))

  def piece_to_id(self, piece: str) -> int:
    return self._sp.piece_to_id(piece)

  def pieces(self, ids: Iterable[int]) -> list[str]:
    """One piece string per id (no EOS cut, nothing dropped): axis labels for plots."""
    return [self.id_to_piece(i) for i in np.asarray(ids).reshape(-1).tolist()]

  def serialized_model(self) -> bytes:
    return self._proto


def train_tokenizer(
    sentences: Iterable[str],
    model_path: str | None,
    vocab_size: int,
    *,
    character_coverage: float = 1.0,
    model_type: str = "unigram",
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    num_threads: int = 1,
) -> Tokenizer:
  """Trains a SentencePiece model in-process and writes it to `model_path`.

  Long for its documentation and the trainer's options, each one set on purpose.

  Args:
    sentences: training text, one sentence per item (source and target
      sentences mixed: the vocabulary is shared). Only the first
      `max_sentences` items are used, in order; for a large corpus pass a
      spread-out sample (see `transformer.data.sample_sentences`).
    model_path: where to write the model, e.g. `<workdir>/vocab.model`. The
      file is written atomically (temp file + rename); parent dirs are created.
      None: not written (`Tokenizer.serialized_model()` holds it).
    vocab_size: the wanted number of ids including the 4 special ones. This is
      a *soft* limit (`hard_vocab_limit=False`): on a tiny corpus that cannot
      fill it, SentencePiece stops early and the vocabulary is smaller; read the
      real size from `Tokenizer.vocab_size`. It must still be at least the
      number of distinct characters + 4, else a ValueError says so.
    character_coverage: fraction of characters covered by the vocabulary
      (1.0 keeps every character: right for European languages; 0.9995 is the
      usual choice for CJK).
    model_type: "unigram" (default), "bpe", "char" or "word".
    max_sentences: at most this many sentences are read from `sentences`.
    num_threads: SentencePiece trainer threads (`available_cores()` for all).
      Training is deterministic for a given corpus and thread count. BPE
      learns the same pieces whatever the count; unigram's expectation sums
      are split over the threads, so with another count its piece scores
      differ in the last float bits (~1e-6) and pieces of near-equal score
      may swap ids.

  Returns:
    The trained Tokenizer (PAD=0, EOS=1, BOS=2, UNK=3).
  """
  if vocab_size <= 4:
    raise ValueError(f"vocab_size must be > 4 (4 ids are special), got {vocab_size}.")
  corpus = [s for s in itertools.islice(iter(sentences), max_sentences)]
  # SentencePiece skips empty lines; a corpus with no text cannot be trained on.
  if not any(s.strip() for s in corpus):
    raise ValueError(
        f"Cannot train the vocabulary{f' for {model_path}' if model_path else ''}: "
        "the training text is "
        "empty. Check the training data source (config.data)."
    )
  buf = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        bos_id=BOS_ID,
        unk_id=UNK_ID,
        pad_piece="<pad>",
        eos_piece="</s>",
        bos_piece="<s>",
        unk_piece="<unk>",
        hard_vocab_limit=False,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        max_sentence_length=1 << 16,
        num_threads=num_threads,
        minloglevel=2,
    )
  except RuntimeError as e:
    msg = str(e)
    if "smaller than required_chars" in msg:
      raise ValueError(
          f"vocab_size={vocab_size} is too small for this corpus: it must hold "
          f"every character plus 4 special ids ({msg.strip()}). Increase "
          "vocab_size."
      ) from e
    raise
  tokenizer = Tokenizer(buf.getvalue(), model_path=model_path)
  if model_path is not None:
    write_atomically(model_path, buf.getvalue())
  return tokenizer


def load_tokenizer(model_path: str, root: str | os.PathLike | None = None) -> Tokenizer:
  """Loads a vocabulary written by `train_tokenizer` (or an imported Marian
  one: `tokenizer_from_bytes`), from a local path or an
  address such as gs://bucket/run/vocab.model (read through etils.epath).
  `root`: the received folder it belongs to (a workdir), which it may not
  lead out of (`received.read_bytes`: a regular file of at most 64 MiB).

  Raises:
    FileNotFoundError: `model_path` does not exist (train first: `python
      train.py --workdir=...` writes `<workdir>/vocab.model`).
  """
  if not received.exists(model_path):
    raise FileNotFoundError(
        f"No SentencePiece vocabulary at {model_path}. Train first: "
        "`python train.py --workdir=<dir>` writes <dir>/vocab.model, or call "
        "transformer.data.tokenizer.train_tokenizer(...)."
    )
  return tokenizer_from_bytes(
      received.read_bytes(model_path, root=root, kind="vocabulary", what="the vocabulary"),
      model_path)


def tokenizer_from_bytes(model: bytes, model_path: str | None = None):
  """The vocabulary whose file holds `model` (`serialized_model()`): a
  SentencePiece model (`Tokenizer`) or an imported Marian vocabulary
  (`marian_tokenizer.MarianTokenizer`, one JSON document)."""
  from transformer.data import marian_tokenizer
  if marian_tokenizer.is_serialized_marian(model):
    return marian_tokenizer.MarianTokenizer.from_serialized(model, model_path)
  try:
    return Tokenizer(model, model_path=model_path)
  except RuntimeError as e:
    raise ValueError(
        f"{model_path} is not a valid SentencePiece model ({e}). Delete it and "
        "train the vocabulary again."
    ) from e
