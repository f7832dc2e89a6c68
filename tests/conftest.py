"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import jax
import pytest

# train.py, decode.py and the API cache compiled programs in ~/.cache by
# default (transformer/runtime/compile_cache.py); tests never write there. A test that
# wants a cache passes one (the fixture below, helpers.subprocess_env).
os.environ["TRANSFORMER_COMPILATION_CACHE"] = "off"

# Comparisons against float64 numpy hold to ~1e-5 only if a float32 matmul is
# a float32 matmul: TPUs default to bfloat16 passes and GPUs to TF32. Pinned
# for every in-process test; helpers.subprocess_env passes it to subprocesses.
# (On CPU it changes nothing: XLA's CPU matmuls are always full float32.)
jax.config.update("jax_default_matmul_precision", "highest")

from helpers import CACHE_SETTINGS


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """A persistent XLA compilation cache, one per pytest session (each program
  is compiled once per session, not once per run; the cache changes how long
  a compile takes, never what runs), switched on for the module's in-process
  runs and restored after. Yields its directory, for subprocesses too."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  path = tmp_path_factory.getbasetemp() / "jax_compilation_cache"
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
