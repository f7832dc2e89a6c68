"""Tests for transformer/data/tokenizer.py (SentencePiece train / load / encode / decode)."""

import pickle

import numpy as np
import pytest

from transformer.data import tokenizer as tokenizer_lib
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def _corpus(n=400, seed=0):
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "mat", "die", "Katze", "saß", "auf", "der",
           "Matte", "große", "Straße", "Äpfel", "café", "naïve", "über", "dog", "Hund"]
  return [" ".join(rng.choice(words, size=int(rng.integers(2, 9)))) for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vocab") / "vocab.model")
  tok = tokenizer_lib.train_tokenizer(_corpus(), path, vocab_size=60)
  return tok, path


def test_special_ids_are_fixed(trained):
  tok, _ = trained
  assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
  assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "</s>", "<s>", "<unk>"]
  assert tok.pieces([0, 1, 2, 3]) == ["<pad>", "</s>", "<s>", "<unk>"]


def test_vocab_size_and_file_written(trained):
  tok, path = trained
  assert 4 < tok.vocab_size <= 60
  loaded = tokenizer_lib.load_tokenizer(path)
  assert loaded.vocab_size == tok.vocab_size
  assert [loaded.id_to_piece(i) for i in range(loaded.vocab_size)] == [
      tok.id_to_piece(i) for i in range(tok.vocab_size)]


def test_round_trip_including_non_ascii(trained):
  tok, path = trained
  loaded = tokenizer_lib.load_tokenizer(path)
  for sentence in _corpus(50, seed=1) + ["große Straße über café", "naïve Äpfel"]:
    ids = tok.encode(sentence)
    assert ids and all(isinstance(i, int) for i in ids)
    assert all(4 <= i < tok.vocab_size for i in ids)  # no BOS/EOS/PAD added
    assert tok.decode(ids) == sentence
    assert loaded.encode(sentence) == ids
    # Pieces concatenate back to the sentence ('▁' marks a space).
    assert "".join(tok.pieces(ids)).replace("\u2581", " ").strip() == sentence


def test_encode_batch_matches_encode(trained):
  tok, _ = trained
  sentences = ["the cat sat", "", "die Katze saß auf der Matte"]
  assert tok.encode_batch(sentences) == [tok.encode(s) for s in sentences]
  assert tok.encode("") == []


def test_decode_stops_at_eos_and_skips_pad_and_bos(trained):
  tok, _ = trained
  ids = tok.encode("the cat sat on the mat")
  other = tok.encode("Hund")
  assert tok.decode([BOS_ID] + ids + [EOS_ID] + other) == "the cat sat on the mat"
  padded = [PAD_ID, ids[0], PAD_ID] + ids[1:] + [EOS_ID, PAD_ID, PAD_ID]
  assert tok.decode(padded) == "the cat sat on the mat"
  assert tok.decode(np.asarray(ids + [EOS_ID] + other, np.int32)) == "the cat sat on the mat"
  assert tok.decode([EOS_ID] + ids) == ""
  assert tok.decode([]) == ""
  assert tok.decode_batch([ids + [EOS_ID], other]) == ["the cat sat on the mat", "Hund"]


def test_ids_beyond_vocab_decode_as_unknown(trained):
  tok, _ = trained
  ids = tok.encode("Hund")
  text = tok.decode(ids + [tok.vocab_size + 5])
  assert text.startswith("Hund") and text != "Hund"


def test_training_is_deterministic(tmp_path):
  corpus = _corpus(300, seed=3)
  a = tokenizer_lib.train_tokenizer(corpus, str(tmp_path / "a.model"), vocab_size=50)
  b = tokenizer_lib.train_tokenizer(iter(corpus), str(tmp_path / "b.model"), vocab_size=50)
  assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
  assert a.encode(corpus[0]) == b.encode(corpus[0])


def test_tiny_corpus_gets_a_smaller_vocabulary(tmp_path):
  # 2 sentences cannot fill 1000 pieces: the soft limit gives fewer, no error.
  tok = tokenizer_lib.train_tokenizer(
      ["hello world", "hallo welt"], str(tmp_path / "tiny" / "vocab.model"), vocab_size=1000)
  assert 4 + len(set("helloworldhallowelt")) <= tok.vocab_size < 1000
  assert tok.decode(tok.encode("hello welt")) == "hello welt"
  assert (tmp_path / "tiny" / "vocab.model").exists()


def test_max_sentences_limits_the_corpus(tmp_path):
  corpus = ["aaa bbb"] * 20 + ["zzz qqq"] * 20
  tok = tokenizer_lib.train_tokenizer(corpus, str(tmp_path / "v.model"), vocab_size=30,
                                      max_sentences=20)
  assert tok.encode("zzz") == [UNK_ID] or UNK_ID in tok.encode("zzz")


def test_too_small_vocab_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="vocab_size=8"):
    tokenizer_lib.train_tokenizer(_corpus(), str(tmp_path / "v.model"), vocab_size=8)
  assert not (tmp_path / "v.model").exists()


def test_empty_corpus_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="empty"):
    tokenizer_lib.train_tokenizer(["", "  "], str(tmp_path / "v.model"), vocab_size=50)


def test_missing_model_file(tmp_path):
  path = str(tmp_path / "nowhere" / "vocab.model")
  with pytest.raises(FileNotFoundError) as info:
    tokenizer_lib.load_tokenizer(path)
  assert path in str(info.value)
  assert "train" in str(info.value).lower()


def test_corrupt_model_file(tmp_path):
  path = tmp_path / "vocab.model"
  path.write_bytes(b"not a model")
  with pytest.raises(ValueError, match=str(path)):
    tokenizer_lib.load_tokenizer(str(path))


def test_pickle_round_trip(trained):
  tok, _ = trained
  clone = pickle.loads(pickle.dumps(tok))
  assert clone.vocab_size == tok.vocab_size
  assert clone.encode("die Katze saß") == tok.encode("die Katze saß")
