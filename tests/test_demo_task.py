"""Tests for transformer/data/demo_task.py: the number phrases, their German, the splits."""

import collections

import pytest

from transformer.data import pipeline as data
from transformer.data import sources as data_sources
from transformer.data import demo_task
from transformer.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def demo():
  return demo_task.demo_splits(seed=0, num_train=2000, num_eval=100, num_test=100)


@pytest.fixture(scope="module")
def tok(demo, tmp_path_factory):
  """The vocabulary the module docstring recommends."""
  path = str(tmp_path_factory.mktemp("vocab") / "vocab.model")
  return tokenizer_lib.train_tokenizer(
      data_sources.sample_sentences(demo["train"]), path, vocab_size=400, model_type="bpe")


@pytest.mark.parametrize("n, english, german", [
    (1, "one", "eins"),
    (7, "seven", "sieben"),
    (11, "eleven", "elf"),
    (12, "twelve", "zwölf"),
    (16, "sixteen", "sechzehn"),
    (17, "seventeen", "siebzehn"),
    (21, "twenty-one", "einundzwanzig"),
    (30, "thirty", "dreißig"),
    (42, "forty-two", "zweiundvierzig"),
    (77, "seventy-seven", "siebenundsiebzig"),
    (100, "one hundred", "einhundert"),
    (110, "one hundred ten", "einhundertzehn"),
    (342, "three hundred forty-two", "dreihundertzweiundvierzig"),
    (705, "seven hundred five", "siebenhundertfünf"),
    (999, "nine hundred ninety-nine", "neunhundertneunundneunzig"),
])
def test_number_words(n, english, german):
  assert demo_task.english_number(n) == english
  assert demo_task.german_number(n) == german


@pytest.mark.parametrize("args, expected", [
    ((1, "big", "dog"), ("one big dog", "ein großer Hund")),
    ((1, "red", "cat"), ("one red cat", "eine rote Katze")),
    ((1, "old", "house"), ("one old house", "ein altes Haus")),
    ((342, "red", "apple"), ("three hundred forty-two red apples",
                             "dreihundertzweiundvierzig rote Äpfel")),
    ((21, "white", "book"), ("twenty-one white books", "einundzwanzig weiße Bücher")),
    ((2, "small", "child"), ("two small children", "zwei kleine Kinder")),
])
def test_demo_phrases_hand_checked(args, expected):
  assert demo_task.demo_phrase(*args) == expected


def test_demo_is_deterministic_and_seeded(demo):
  again = demo_task.demo_splits(seed=0, num_train=2000, num_eval=100, num_test=100)
  assert again == demo
  other = demo_task.demo_splits(seed=1, num_train=2000, num_eval=100, num_test=100)
  assert other["train"] != demo["train"]
  assert {k: len(v) for k, v in demo.items()} == {"train": 2000, "eval": 100, "test": 100}


def test_demo_splits_are_disjoint_and_unique(demo):
  sources = {k: [src for src, _ in v] for k, v in demo.items()}
  for name, srcs in sources.items():
    assert len(set(srcs)) == len(srcs), name
  assert not set(sources["train"]) & set(sources["eval"])
  assert not set(sources["train"]) & set(sources["test"])
  assert not set(sources["eval"]) & set(sources["test"])


_EN_VALUES = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_EN_VALUES.update({w: 10 * i for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)})
_PLURAL_TO_SINGULAR = {"children": "child"}


def _parse_english_phrase(phrase):
  """'three hundred forty-two red apples' -> (342, 'red', 'apple'), independently."""
  *number_words, adjective, noun = phrase.split(" ")
  value = 0
  for word in number_words:
    if word == "hundred":
      value *= 100
    else:
      value += sum(_EN_VALUES[part] for part in word.split("-"))
  singular = _PLURAL_TO_SINGULAR.get(noun, noun[:-1] if value != 1 else noun)
  return value, adjective, singular


def test_demo_sentences_are_consistent_translations(demo):
  numbers = collections.Counter()
  for src, tgt in demo["train"]:
    en_phrases = src.split(" and ")
    assert 1 <= len(en_phrases) <= 2
    parsed = [_parse_english_phrase(p) for p in en_phrases]
    numbers.update(n for n, _, _ in parsed)
    assert tgt == " und ".join(demo_task.demo_phrase(*p)[1] for p in parsed)
    assert src == " and ".join(demo_task.demo_phrase(*p)[0] for p in parsed)
  assert all(1 <= n <= 999 and not (n > 100 and n % 100 == 1) for n in numbers)
  assert 0.05 < numbers[1] / sum(numbers.values()) < 0.15  # "one" is drawn often
  assert len(numbers) > 700  # and most other numbers occur


def test_demo_vocabulary_is_not_trivial(demo, tok):
  src_words = {w for s, _ in demo["train"] for w in s.replace("-", " ").split()}
  tgt_words = {w for _, t in demo["train"] for w in t.split()}
  assert len(src_words) >= 50 and len(tgt_words) >= 200
  assert tok.vocab_size >= 300
  summary = data.summarize(demo["train"], tok, max_length=32)
  assert summary.num_too_long == 0 and summary.longest_source <= 30
  # Exact match is reachable: every sentence survives encode -> decode.
  for src, tgt in demo["eval"]:
    assert tok.decode(tok.encode(src)) == src and tok.decode(tok.encode(tgt)) == tgt
  # Re-ordering: German puts units before tens, so piece order differs.
  assert demo_task.german_number(42).index("zwei") < demo_task.german_number(42).index("vierzig")
