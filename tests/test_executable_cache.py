"""Compiled decoders kept on disk (transformer/decoding/executable_cache.py): a
later Translator loads them instead of tracing and compiling, translates the
same, and never runs a decoder whose code, model or shape differs."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from helpers import CACHE_SETTINGS
from transformer.decoding import executable_cache, loader
from transformer.decoding import translator as translator_lib

FIXTURE_WORKDIR = Path(__file__).resolve().parent / "fixtures" / "workdir_d26a6fb"
SENTENCES = ["one red cat", "three hundred and two blue birds and seven green frogs",
             "", "a cat"]


@pytest.fixture
def cache_dir(tmp_path):
  """A compilation cache of this test's own (the decoders' home) that keeps
  every program however quickly it compiles, as decode.py's does; restored after."""
  names = ["jax_compilation_cache_dir", *CACHE_SETTINGS]
  old = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  for name, value in CACHE_SETTINGS.items():
    jax.config.update(name, value)
  cc.reset_cache()
  yield tmp_path / "cache" / executable_cache.SUBDIRECTORY
  for name, value in old.items():
    jax.config.update(name, value)
  cc.reset_cache()


def _translate(**options):
  translator = loader.load_translator(str(FIXTURE_WORKDIR))
  out = translator.translate(SENTENCES, **options)
  return out, translator.last_stats


def _never_trace(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError("a decoder was traced")
  monkeypatch.setattr(translator_lib.Translator, "_decode_fn", fail)


def test_a_new_translator_loads_the_decoders_and_translates_the_same(cache_dir,
                                                                     monkeypatch):
  first, stats = _translate(method="beam")
  stored = sorted(cache_dir.iterdir())
  assert stats["decoders_loaded"] == 0 and len(stored) == 2  # two length buckets
  _never_trace(monkeypatch)
  second, stats = _translate(method="beam")
  assert second == first and stats["decoders_loaded"] == 2
  assert sorted(cache_dir.iterdir()) == stored


@pytest.mark.slow  # (15-25 s on 2 cores: `python -m pytest -m slow`)
def test_other_code_or_options_are_other_decoders(cache_dir, monkeypatch):
  _translate(method="greedy")
  stored = set(cache_dir.iterdir())
  _, stats = _translate(method="greedy", max_len=20)  # another program
  assert stats["decoders_loaded"] == 0 and len(set(cache_dir.iterdir()) - stored) == 2
  monkeypatch.setattr(executable_cache, "source_hash", lambda: "the code changed")
  _, stats = _translate(method="greedy")
  assert stats["decoders_loaded"] == 0


def test_a_file_that_does_not_load_is_compiled_again(cache_dir, caplog):
  """... and kept again whole, although JAX's persistent cache now holds the
  program (a decoder read from there would not serialize whole)."""
  first, _ = _translate(method="greedy")
  for path in cache_dir.iterdir():
    path.write_bytes(path.read_bytes()[:100])  # truncated
  hits = executable_cache._persistent_cache_hits
  with caplog.at_level(logging.WARNING):
    second, stats = _translate(method="greedy")
  assert second == first and stats["decoders_loaded"] == 0
  assert "did not load" in caplog.text
  assert executable_cache._persistent_cache_hits > hits  # (the premise)
  third, stats = _translate(method="greedy")  # written again, whole: it runs
  assert third == first and stats["decoders_loaded"] == 2


def test_off_with_the_compilation_cache():
  assert not jax.config.jax_compilation_cache_dir  # (tests run with it off: conftest.py)
  assert executable_cache.directory() is None
  compiled, loaded = executable_cache.load_or_compile({}, lambda: "compiled")
  assert (compiled, loaded) == ("compiled", False)
