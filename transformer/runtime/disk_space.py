"""A full disk while checkpointing: one clear error, nothing half-written.

Orbax writes a checkpoint from background threads, and a write that fails for
want of space surfaces there as tensorstore's RESOURCE_EXHAUSTED, often more
than once, with tracebacks. `checkpoints.Checkpointer` (through
`checkpoint_space.py`) and the averaging turn it into one `DiskFullError` whose
message names the directory, the bytes needed and free, the last complete
checkpoint and what to do, after `remove_unfinished` has taken away the
half-written `<step>.orbax-checkpoint-tmp*`. Before each save the Checkpointer
also compares the free space with the size on disk of the last complete
checkpoint (`disk_bytes`), so most full disks are found before anything is
written.

A leaf module: no imports from `transformer`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
from etils import epath

# Room asked for beyond the size of the last checkpoint: the next one may
# differ a little (metadata), and metrics are written meanwhile.
SPACE_MARGIN = 0.05


class DiskFullError(OSError):
  """A checkpoint does not fit on its disk: found before writing it, or when
  a write failed with ENOSPC (or EDQUOT). Nothing half-written is left.
  `str(e)` says what did not fit where, the bytes needed and free, the last
  complete checkpoint, and what to do; the numbers are kept as attributes."""

  def __init__(self, directory, what: str, needed: int, free: int, last_step: int | None,
               *, unfinished: Sequence[str] = (), advice: str):
    done = (f"its unfinished {', '.join(unfinished)} was removed" if unfinished
            else "nothing was written")
    last = f"step {last_step}" if last_step is not None else "none"
    if needed > free:
      fit = f"needs about {format_bytes(needed)} in {directory} and {format_bytes(free)} are free"
    else:  # a first checkpoint's size is estimated from its arrays alone
      fit = (f"did not fit in {directory}, where {format_bytes(free)} were free (its arrays "
             f"alone take {format_bytes(needed)}; orbax adds metadata)")
    message = (
        f"The disk is full: {what} {fit}; {done}. The last complete checkpoint is "
        f"{last}. {advice}, "
        f"then run the same command again: training resumes from "
        f"{last if last_step is not None else 'the start'}.")
    super().__init__(errno.ENOSPC, message, str(directory))
    self.message, self.directory = message, str(directory)
    self.needed, self.free, self.last_step = needed, free, last_step

  def __str__(self) -> str:
    return self.message


def format_bytes(num_bytes: int) -> str:
  """"567.7 kB (567,705 bytes)": the size, and the exact count for a user to compare."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.1f} {unit} ({num_bytes:,} bytes)"
  return f"{num_bytes} bytes"


def is_disk_full(error: BaseException) -> bool:
  """Whether `error`, or one it came from, is a full disk (or quota): an
  OSError with ENOSPC / EDQUOT, or tensorstore's RESOURCE_EXHAUSTED text
  naming one (orbax re-raises those from its background threads)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(error)
    if ("No space left on device" in text or "Disk quota exceeded" in text
        or f"os_error_code='{errno.ENOSPC}'" in text):
      return True
    error = error.__cause__ or error.__context__
  return False


def disk_bytes(path: epath.Path) -> int:
  """The space the files under `path` take on disk (as `du`), 0 if it is gone."""
  total = 0
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      try:
        info = os.lstat(os.path.join(root, name))
      except FileNotFoundError:
        continue
      total += max(info.st_blocks * 512, info.st_size if name in files else 0)
  return total


def tree_bytes(tree: Any) -> int:
  """The bytes of a pytree's arrays (what a checkpoint of it holds, before compression)."""
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def remove_unfinished(directory: epath.Path, *, settle_s: float = 0.2,
                       timeout_s: float = 5.0) -> list[str]:
  """Removes the `<step>.orbax-checkpoint-tmp*` entries of `directory`
  after a failed save; returns their names. tensorstore may still finish
  writes it had started (and recreate their directories) after orbax gave
  up, so this removes until nothing comes back for `settle_s`."""
  def unfinished():
    return sorted(n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n) \
        if os.path.isdir(directory) else []

  removed: set[str] = set()
  deadline = time.monotonic() + timeout_s
  while (names := unfinished()) and time.monotonic() < deadline:
    for name in names:
      path = os.path.join(directory, name)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.remove(path)
    removed.update(names)
    time.sleep(settle_s)
  return sorted(removed)
