"""The compilation cache's bound (transformer/runtime/compile_cache.py): JAX's
own entries beyond MAX_JAX_BYTES go, least recently used (read or written)
first, when a process turns the cache on; the decoders' and serving copies'
subdirectories are left to their modules."""

from __future__ import annotations

import os
import time

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from helpers import CACHE_SETTINGS
from transformer.runtime import compile_cache


# JAX's compilation cache off unless a test gives one of its own, and the
# decoders kept whenever it is on, as in a user's process (conftest.py).
pytestmark = pytest.mark.usefixtures("caches_of_their_own")


def write(path, size: int, used_seconds_ago: float, read_seconds_ago: float | None = None):
  """A file of `size` bytes last written `used_seconds_ago`, last read
  `read_seconds_ago` (default: when written)."""
  path.write_bytes(b"x" * size)
  now = time.time()
  read = used_seconds_ago if read_seconds_ago is None else read_seconds_ago
  os.utime(path, (now - read, now - used_seconds_ago))
  return path


@pytest.fixture
def jax_cache_settings():
  """Restores JAX's cache settings that `enable()` changes."""
  names = ["jax_compilation_cache_dir", *CACHE_SETTINGS]
  old = {name: getattr(jax.config, name) for name in names}
  yield
  for name, value in old.items():
    jax.config.update(name, value)
  cc.reset_cache()


def test_the_least_recently_used_go_first_a_read_counts_as_a_use(tmp_path):
  oldest = write(tmp_path / "jit_a-cache", 400, 500)
  read_lately = write(tmp_path / "jit_b-cache", 400, 400, read_seconds_ago=10)
  old = write(tmp_path / "jit_c-cache", 400, 300)
  new = write(tmp_path / "jit_d-cache", 400, 100)
  in_progress = write(tmp_path / ".jit_e-tmp", 400, 900)
  compile_cache.prune_least_recently_used(tmp_path, 1000, names=compile_cache.JAX_ENTRY)
  # 1,600 bytes of entries: the two least recently used go (a, then c), b stays
  # for its read, d for its write; a write in progress is not counted or touched.
  assert not oldest.exists() and not old.exists()
  assert read_lately.exists() and new.exists() and in_progress.exists()
  compile_cache.prune_least_recently_used(tmp_path, 0, names=compile_cache.JAX_ENTRY, keep=new)  # never `keep`
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith("jit")] == ["jit_d-cache"]


def test_enable_bounds_jax_entries_and_leaves_everything_else_alone(tmp_path, monkeypatch,
                                                                   jax_cache_settings):
  decoders = tmp_path / "decoders"
  decoders.mkdir()
  kept_decoder = write(decoders / "old.bin", 5000, 10_000)
  entries = [write(tmp_path / f"jit_{i}-cache", 100, 1000 - i) for i in range(10)]
  not_jax = write(tmp_path / "notes.txt", 100, 100_000)  # the oldest, but not JAX's
  monkeypatch.setattr(compile_cache, "MAX_JAX_BYTES", 450)
  assert compile_cache.enable(str(tmp_path)) == str(tmp_path)
  assert [p.exists() for p in entries] == [False] * 6 + [True] * 4  # the 4 newest
  assert kept_decoder.exists() and not_jax.exists()
