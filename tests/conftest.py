"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc
import os
import sys
import tempfile

# Python keeps the project's modules compiled (transformer/ and tests/
# __pycache__, which git ignores), for these processes and the test
# subprocesses, even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1: this project's CI machines): each of the
# suite's ~110 subprocesses otherwise compiled the project's sources again,
# 0.15-0.4 s of its start (`import transformer.training.loop`: 1.85-2.24 s ->
# 1.70-1.81 s, 2-core CPU); nothing a test checks depends on it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Python's cyclic garbage collector at its default threshold (a young
# collection every 700 new objects) ran ~2,800 times in test_api.py alone,
# mostly through the objects JAX's tracing makes, 4.3 s of its 119 s (gc
# callbacks, 2-core CPU); every 20,000: ~400 times, 0.8 s. Only when
# unreachable cycles are freed changes; no test depends on it (decode.py's own
# settings are checked in its subprocesses, tests/test_decode_cli.py).
gc.set_threshold(20_000, *gc.get_threshold()[1:])

from helpers import CACHE_SETTINGS, TEST_CACHE_MAX_BYTES, fast_compile_flags  # noqa: E402
from helpers import shared_compilation_cache  # noqa: E402

# Before JAX starts its backend: this process's programs compiled as the
# subprocesses' are (helpers.FAST_COMPILE_FLAGS says why; only the flags this
# XLA knows).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fast_compile_flags()}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# train.py, decode.py and the API cache compiled programs in ~/.cache by
# default (transformer/runtime/compile_cache.py); tests never write there. A test that
# wants a cache passes one (the fixture below, helpers.subprocess_env).
os.environ["TRANSFORMER_COMPILATION_CACHE"] = "off"
# Nor compiled decoders kept in workdirs (the repository's fixtures among them);
# tests/test_executable_cache.py turns it on for a copy of one.
os.environ["TRANSFORMER_WORKDIR_DECODERS"] = "off"
# Nor a signing key in ~/.cache (runtime/signing.py): each worker process makes
# one of its own on first use, in a directory of its own, removed at exit;
# subprocesses inherit it (the same machine's key).
_KEY_DIR = tempfile.TemporaryDirectory(prefix="transformer-test-key-")
os.environ["TRANSFORMER_SIGNING_KEY"] = os.path.join(_KEY_DIR.name, "signing.key")

# Comparisons against float64 numpy hold to ~1e-5 only if a float32 matmul is
# a float32 matmul: TPUs default to bfloat16 passes and GPUs to TF32. Pinned
# for every in-process test; helpers.subprocess_env passes it to subprocesses.
# (On CPU it changes nothing: XLA's CPU matmuls are always full float32.)
jax.config.update("jax_default_matmul_precision", "highest")

# Every program compiled once per machine, not once per run: JAX's persistent
# compilation cache in the tests' folder of the user's cache directory
# (helpers.shared_compilation_cache, shared with the subprocesses through
# helpers.subprocess_env), and the product's caches of whole compiled
# decoders and serving copies off (executable_cache.DECODER_CACHE_ENV), so
# that a test's decoders are traced, lowered and compiled as on a first start
# (XLA's compile read back from the cache). The modules that test those
# caches give them folders of their own (`caches_of_their_own`).
os.environ["TRANSFORMER_DECODER_CACHE"] = "off"
TEST_CACHE = shared_compilation_cache()
if TEST_CACHE is not None:
  try:
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
  except OSError:  # (a read-only home: each run compiles into a cache of its own)
    TEST_CACHE = None
    os.environ["TRANSFORMER_TEST_CACHE"] = "off"  # (the subprocesses too)
if TEST_CACHE is not None:
  jax.config.update("jax_compilation_cache_dir", str(TEST_CACHE))
  for _name, _value in CACHE_SETTINGS.items():
    jax.config.update(_name, _value)


def pytest_configure(config):
  """Once per run, in the controlling process (not in each worker): the
  shared cache kept under TEST_CACHE_MAX_BYTES, least recently used first."""
  if TEST_CACHE is not None and not hasattr(config, "workerinput"):
    from transformer.runtime import compile_cache
    compile_cache.prune_least_recently_used(TEST_CACHE, TEST_CACHE_MAX_BYTES,
                                            names=compile_cache.JAX_ENTRY)



MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pyproject.toml): one worker process per core, at most
  MAX_WORKERS. Most of a test's time is compiling, one core per compile, so
  two workers on 2 cores ran the default suite in 9 min 13 s instead of
  11 min 54 s - 13 min 37 s (2026-11-26); each worker holds its own jax and
  compiled programs (1-3 GB), hence the cap."""
  from transformer.data.tokenizer import available_cores
  return min(MAX_WORKERS, available_cores())


# The test files that take longest (seconds summed over their tests, 2 cores,
# 2026-11-29: 234, 134, 101, 98, 92, 66, 49, 48 of the suite's 1,174), run
# first. With `--dist loadfile` a worker takes the next file in collection
# order when it is done with one, so a long file collected late (alphabetical
# order put test_training.py among the last) ends the run alone.
SLOWEST_FILES_FIRST = ("test_training.py", "test_api.py", "test_decode_cli.py", "test_model.py",
                       "test_executable_cache.py", "test_train_cli.py", "test_decoding.py",
                       "test_streaming.py")


def pytest_collection_modifyitems(config, items):
  """The files of SLOWEST_FILES_FIRST first, in that order; each file's
  tests, and the other files, in their own order."""
  rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory, worker_id):
  """The persistent XLA compilation cache the tests share (`TEST_CACHE`,
  kept across runs), for the subprocesses a module starts; where it is off
  ($TRANSFORMER_TEST_CACHE=off), one for this run, shared by its workers and
  switched on for the module's in-process runs. The cache changes how long
  a compile takes, never what runs."""
  if TEST_CACHE is not None:
    yield TEST_CACHE
    return
  from jax.experimental.compilation_cache import compilation_cache as cc
  base = tmp_path_factory.getbasetemp()
  path = (base if worker_id == "master" else base.parent) / "jax_compilation_cache"
  names = ["jax_compilation_cache_dir", *CACHE_SETTINGS]
  old = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", str(path))
  for name, value in CACHE_SETTINGS.items():
    jax.config.update(name, value)
  cc.reset_cache()
  yield path
  for name, value in old.items():
    jax.config.update(name, value)
  cc.reset_cache()


@pytest.fixture(scope="module")
def caches_of_their_own():
  """For the modules that test the caches themselves (JAX's, the compiled
  decoders', the serving copies'): no compilation cache unless a test gives
  one of its own, and the decoder cache switched by JAX's alone, as a user's
  process has them; restored after."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  old_dir, old_env = jax.config.jax_compilation_cache_dir, os.environ.pop(
      "TRANSFORMER_DECODER_CACHE", None)
  jax.config.update("jax_compilation_cache_dir", None)
  cc.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", old_dir)
  if old_env is not None:
    os.environ["TRANSFORMER_DECODER_CACHE"] = old_env
  cc.reset_cache()
