"""Compile once, not every run: JAX's persistent compilation cache, on by default.

Compiling the training step and the decoders takes seconds to tens of seconds
(17.7 s of a 41 s decode of 1,000 lines on a 2-core CPU); the compiled
programs depend only on the model's shapes and the code, so they are written
to a cache directory and read back by the next run with the same shapes.

Where the cache lives, in order:

  * `enable(directory)`: train.py / decode.py `--compilation_cache=DIR`;
  * $TRANSFORMER_COMPILATION_CACHE;
  * $XDG_CACHE_HOME/transformer/jax, or ~/.cache/transformer/jax.

`--compilation_cache=off` (or the variable set to "off") turns it off. A cache
directory JAX was given already (`jax.config.update("jax_compilation_cache_dir",
...)`, $JAX_COMPILATION_CACHE_DIR) is left as it is: the user chose it.
`transformer.train` and `transformer.load_translator` call `enable()` too, so
notebooks get it without asking.

JAX never removes an entry, and every change of the code, of jax or of the
shapes writes new ones (100 MB in a day of development on one machine), so
`enable()` keeps JAX's entries (the directory's own `*-cache` files; its
subdirectories are the decoders' and the serving copies', bounded by their
modules) under MAX_JAX_BYTES: the least recently used go first
(`prune_least_recently_used`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import jax

ENV = "TRANSFORMER_COMPILATION_CACHE"
OFF = ("off", "none", "0", "false", "")
# Every program is worth caching: on a 2-core CPU even a 0.5 s compile of a
# small decoder is a large share of decoding a few lines.
MIN_COMPILE_SECONDS = 0.0
MAX_JAX_BYTES = 1 << 30  # JAX's entries beyond this: the least recently used go
JAX_ENTRY = re.compile(r".+-cache")  # how JAX names an entry (its lru_cache.py): only those are pruned

logger = logging.getLogger(__name__)


def default_directory() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "transformer", "jax")


def chosen_directory(directory: str | None = None) -> str | None:
  """The directory `enable(directory)` would use (None: the cache off),
  changing nothing."""
  current = jax.config.jax_compilation_cache_dir
  if current and directory is None:
    return current
  choice = directory if directory is not None else os.environ.get(ENV, default_directory())
  if choice.strip().lower() in OFF:
    return None
  return os.path.abspath(os.path.expanduser(choice))


def enable(directory: str | None = None) -> str | None:
  """Turns the persistent compilation cache on (see the module docstring for
  where). Returns the directory used, or None when it is off. Safe to call
  more than once; a directory JAX already has is kept."""
  current = jax.config.jax_compilation_cache_dir
  choice = chosen_directory(directory)
  if choice is None or choice == current:
    return choice
  try:
    os.makedirs(choice, exist_ok=True)
  except OSError as e:  # a read-only home, say: run without the cache, say so
    logger.warning("Compilation cache off: cannot create %s (%s).", choice, e.strerror or e)
    return None
  jax.config.update("jax_compilation_cache_dir", choice)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  # JAX decides whether to use a cache at its first compile; ask it again.
  from jax.experimental.compilation_cache import compilation_cache
  compilation_cache.reset_cache()
  try:
    prune_least_recently_used(Path(choice), MAX_JAX_BYTES, names=JAX_ENTRY)
  except OSError as e:  # (a read-only cache: used as it is)
    logger.warning("Could not prune the compilation cache %s (%s).", choice, e)
  return choice


def prune_least_recently_used(where: Path, max_bytes: int, *, names: re.Pattern,
                              keep: Path | None = None) -> None:
  """Removes the least recently used files directly in `where` (not in its
  subdirectories) whose whole names match `names` (the names the cache
  itself writes) until they take `max_bytes` at most; never `keep`, nor any
  other file (a directory a user named, or one a received workdir planted,
  may hold anything). Used means read or written: the later of a file's
  access and modification times (a read updates the access time at least
  once a day, Linux's `relatime`). Names starting with "." (writes in
  progress) are left alone."""
  files = []
  for entry in os.scandir(where):
    if (entry.is_file(follow_symlinks=False) and not entry.name.startswith(".")
        and names.fullmatch(entry.name)):
      stat = entry.stat()
      files.append((max(stat.st_atime_ns, stat.st_mtime_ns), stat.st_size, Path(entry.path)))
  total = sum(size for _, size, _ in files)
  for _, size, path in sorted(files):
    if total <= max_bytes:
      break
    if path != keep:
      path.unlink(missing_ok=True)
      total -= size
