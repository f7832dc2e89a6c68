"""Files written whole or not at all: a temporary file, then a rename.

Every file the project writes for a reader to trust (the workdir's configs and
vocabulary, decode.py's output, plots) goes through `write_atomically`: the
content goes to a temporary file in the target's directory, is flushed to disk
and renamed over the target. A rename within one file system is atomic, so a
reader (or a run killed half-way) sees the old file or the new one, never half
of one, and a failed write leaves no temporary file behind.

A leaf module (no imports from `transformer`), so that `tokenizer.py` and
`plotting.py` can use it as well as `workdir.py`, which imports them.
"""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str | os.PathLike, content: bytes | str) -> None:
  """Writes `content` (bytes, or text written as UTF-8 with "\\n" line ends)
  to `path`, creating its directory if needed.

  The file gets the usual permissions (0o666 less the umask), as `open()`
  would give it, not the 0o600 of a temporary file. Raises OSError if the
  directory cannot be written; `path` is then untouched.
  """
  path = os.fspath(path)
  data = content.encode("utf-8") if isinstance(content, str) else content
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.tmp-")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _umask() -> int:
  """The process's umask (reading it means setting it: set it back at once)."""
  mask = os.umask(0)
  os.umask(mask)
  return mask
