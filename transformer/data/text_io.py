"""Text files in and out: UTF-8 lines read with errors that say where and what
to do; files written whole or not at all.

Reading. `read_lines` (a file, or standard input) and `split_lines` (bytes) are
how the project reads text, training corpora (`data.py`) and sentences to
translate (decode.py) alike, so that both accept the same files: UTF-8, a
byte-order mark ignored, "\\n" or "\\r\\n" line ends, a last line without a
newline counted, a final newline not starting another line. A file that
cannot be read raises `TextFileError` (an OSError) naming it and the problem;
bytes that are not UTF-8 raise `NotUtf8Error` (a ValueError) naming the file,
the line and column and how to convert the file.

Writing. Every file the project writes for a reader to trust (the workdir's
configs and vocabulary, decode.py's output, plots) goes through
`write_atomically`: the content goes to a temporary file in the target's
directory, is flushed to disk and renamed over the target. A rename within one
file system is atomic, so a reader (or a run killed half-way) sees the old file
or the new one, never half of one, and a failed write leaves no temporary file
behind. `write_lines` writes one line per item that way, or to standard output.

A leaf module (no imports from `transformer`), so that `tokenizer.py` and
`plotting.py` can use it as well as `data.py` and `workdir.py`.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

STDIN = "<stdin>"  # the name of standard input in messages
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: not part of the text


class TextFileError(OSError):
  """A text file that cannot be read or written. `str(e)` reads "path:
  problem"; `path` and `problem` are kept apart so that a command line can
  name its flag instead (decode.py: "--input=path: problem")."""

  def __init__(self, path: str, problem: str):
    super().__init__(f"{path}: {problem}")
    self.path, self.problem = path, problem


class NotUtf8Error(ValueError):
  """Bytes of a text input that are not UTF-8. `str(e)` names the input, the
  1-based line and column (in characters, as an editor counts them), the
  byte, and the fix; `name`, `line` and `column` are kept as attributes."""

  def __init__(self, name: str, data: bytes, start: int, first_line: int = 1):
    line_start = data.rfind(b"\n", 0, start) + 1
    self.name = name
    self.line = data.count(b"\n", 0, start) + first_line
    # The bytes before `start` are valid UTF-8: the first bad byte is at `start`.
    self.column = len(data[line_start:start].decode("utf-8")) + 1
    convert = ("pipe it through `iconv -f latin1 -t utf-8`" if name == STDIN
               else f"`iconv -f latin1 -t utf-8 {name}`")
    super().__init__(
        f"{name}:{self.line}: line {self.line}, column {self.column}: byte "
        f"0x{data[start]:02x} is not valid UTF-8. Convert the text to UTF-8, e.g. {convert}.")


def split_lines(data: bytes, name: str) -> list[str]:
  """UTF-8 bytes -> lines without their "\\n" or "\\r\\n" ends (see the module
  docstring for the rules). Raises NotUtf8Error naming `name`."""
  if data.startswith(_BOM):
    data = data[len(_BOM):]
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise NotUtf8Error(name, data, e.start) from None
  if not text:
    return []
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path: str | None) -> list[str]:
  """The lines of the UTF-8 file `path` (None: standard input).

  Raises TextFileError (no such file, a directory, unreadable) or
  NotUtf8Error; both name the file.
  """
  if path is None:
    return split_lines(sys.stdin.buffer.read(), STDIN)
  with _open_input(path) as f:
    try:
      data = f.read()
    except OSError as e:
      raise TextFileError(path, f"cannot read it ({e.strerror or e})") from None
  return split_lines(data, path)


def _open_input(path: str):
  """`path` opened for reading bytes; TextFileError saying why it cannot be."""
  try:
    return open(path, "rb")
  except FileNotFoundError:
    raise TextFileError(path, "file not found; check the path") from None
  except IsADirectoryError:
    raise TextFileError(path, "is a directory, not a UTF-8 text file") from None
  except OSError as e:
    raise TextFileError(path, f"cannot read it ({e.strerror or e})") from None


def iter_lines(path: str | None) -> Iterator[tuple[bytes, str]]:
  """The lines of the UTF-8 file `path` (None: standard input) one at a time,
  as (the raw bytes read for it, its text), by the rules of `split_lines`:
  memory does not grow with the file. TextFileError if it cannot be opened;
  NotUtf8Error naming the line when one is reached that is not UTF-8 (the
  lines before it have been given)."""
  name = STDIN if path is None else path
  stream = sys.stdin.buffer if path is None else _open_input(path)
  try:
    for number, raw in enumerate(stream, start=1):
      data = raw[len(_BOM):] if number == 1 and raw.startswith(_BOM) else raw
      try:
        text = data.decode("utf-8")
      except UnicodeDecodeError as e:
        raise NotUtf8Error(name, data, e.start, first_line=number) from None
      if text.endswith("\n"):
        text = text[:-1]
      yield raw, text[:-1] if text.endswith("\r") else text
  finally:
    if path is not None:
      stream.close()


def check_readable(path: str) -> None:
  """Raises TextFileError if `path` cannot be read as a file (missing, a
  directory, no permission): before a model is loaded for it."""
  if os.path.isdir(path):
    raise TextFileError(path, "is a directory, not a UTF-8 text file")
  if not os.path.exists(path):
    raise TextFileError(path, "file not found; check the path")
  if not os.access(path, os.R_OK):
    raise TextFileError(path, "cannot read it (permission denied)")


def check_writable(path: str) -> None:
  """Raises TextFileError if no file can be written at `path` (a directory is
  there, its directory is missing, or not writable): a cheap check before
  long work whose result would otherwise be lost."""
  if os.path.isdir(path):
    raise TextFileError(path, "is a directory; give a file name")
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise TextFileError(path, f"directory {directory} does not exist")
  if not os.access(directory, os.W_OK):
    raise TextFileError(path, f"cannot write in {directory}")


def write_lines(lines: Sequence[str], path: str | None) -> None:
  """Writes each item and a "\\n": to the file `path` atomically, or (None) to
  standard output at once, where a reader that leaves early (`| head`) is not
  an error. Raises TextFileError if the file cannot be written (it is then
  untouched)."""
  text = "".join(line + "\n" for line in lines)
  if path is None:
    try:
      sys.stdout.write(text)
      sys.stdout.flush()
    except BrokenPipeError:  # the reader left: send the rest (and Python's final flush) nowhere
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, sys.stdout.fileno())
    return
  try:
    write_atomically(path, text)
  except OSError as e:
    raise TextFileError(path, f"cannot write it ({e.strerror or e}); nothing was written") from None


def write_atomically(path: str | os.PathLike,
                     content: bytes | str | Callable[[BinaryIO], None]) -> None:
  """Writes `content` (bytes, text written as UTF-8 with "\\n" line ends, or
  a function that writes into the open binary file: a large file without a
  copy of it in memory) to `path`, creating its directory if needed.

  The file gets the usual permissions (0o666 less the umask), as `open()`
  would give it, not the 0o600 of a temporary file. Raises OSError if the
  directory cannot be written; `path` is then untouched.
  """
  path = os.fspath(path)
  data = content.encode("utf-8") if isinstance(content, str) else content
  write = data if callable(data) else lambda f: f.write(data)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.tmp-")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def open_for_append(path: str | os.PathLike):
  """`path` opened to append UTF-8 text (created if missing), never through
  a symbolic link and only if it is a regular file: a log in a workdir that
  someone else handed over must not write wherever a planted link points.
  Raises OSError otherwise (ELOOP for a link)."""
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise OSError(f"{path} is not a regular file")
  return open(fd, "a", encoding="utf-8")


def _umask() -> int:
  """The process's umask (reading it means setting it: set it back at once)."""
  mask = os.umask(0)
  os.umask(mask)
  return mask
