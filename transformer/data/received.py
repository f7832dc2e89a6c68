"""One reader for received files: a workdir, an imported model, a record.

A workdir is data that anyone may hand over (docs/security.md), and what a
path *is* matters as much as what its file holds. A file read through here
is opened only if:

  * it lies inside the folder it belongs to (`root`: the workdir, the
    imported model's folder), links resolved. A link that leads out is
    refused, unless the folder it leads into is one the user allowed
    ($TRANSFORMER_ALLOW_LINKS, e.g. their own checkpoints linked to another
    disk on purpose); the refusal says so;
  * it is a regular file (`fstat`): never a FIFO (a read that never ends) or a
    device (`/dev/zero`: a read that never ends either);
  * it holds at most the size its kind can have (`LIMITS`), checked before it
    is read, and the read itself stops there.

Anything else is one sentence naming the file and what it is (`RefusedFile`,
a ValueError). Folders the code writes into or prunes (`compiled/`, the
checkpoint folders) are checked with `check_directory`, and a folder whose
every file a library reads (orbax's checkpoints) with `walk`: bounded, links
and special files refused.

Addresses (gs://bucket/run) have no links or FIFOs; their files are read
through etils.epath with the same size limit.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import stat
from typing import BinaryIO
from etils import epath

KIB, MIB = 1 << 10, 1 << 20
# What a file of each kind can hold. A config or record is a few hundred
# bytes to a few KB; a SentencePiece model of a 64k vocabulary is ~1.5 MB
# (an imported Marian vocabulary, two models and a piece table, ~4 MB).
LIMITS = {
    "config": 1 * MIB,  # model_config.json, config.json, an HF config.json
    "record": 1 * MIB,  # import.json, decoding.json, a checkpoint's metadata
    "vocabulary": 64 * MIB,  # vocab.model, source.spm, vocab.json, a Marian .yml
    "key": 4 * KIB,  # a signing key
}
MAX_TREE_ENTRIES = 100_000  # a checkpoint folder: files and folders walked at most
ALLOW_ENV = "TRANSFORMER_ALLOW_LINKS"  # folders (os.pathsep-separated) links may lead into


class RefusedFile(ValueError):
  """A received file that is not read: `str(e)` is one sentence naming it."""


_ADDRESS = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_address(path: str | os.PathLike) -> bool:
  """Whether `path` is an address such as gs://bucket/run, not a path on a
  local (or mounted) file system."""
  return bool(_ADDRESS.match(os.fspath(path)))


def allowed_folders() -> list[str]:
  """The folders that links in a received folder may lead into
  ($TRANSFORMER_ALLOW_LINKS), resolved."""
  return [os.path.realpath(os.path.expanduser(p))
          for p in os.environ.get(ALLOW_ENV, "").split(os.pathsep) if p.strip()]


def _folder_of(target: str) -> str:
  """The folder to allow for a link to `target`: itself if it is one, else
  the folder that holds it."""
  return target if os.path.isdir(target) else os.path.dirname(target)


def _within(path: str, folder: str) -> bool:
  return os.path.commonpath([path, folder]) == folder


def _resolve_inside(path: str, root: str | os.PathLike | None, what: str) -> str:
  """`path` with its links resolved, checked to lie inside `root` (or inside
  a folder the user allowed). No check without a `root` (a path the user
  named themselves)."""
  real = os.path.realpath(path)
  if real != os.path.abspath(path):  # (a link: say first what it leads to, if no file)
    try:
      mode = os.stat(real).st_mode
    except OSError:
      mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
      raise RefusedFile(f"{path} ({what}) is a link to {real}, {_kind(mode)}, not a regular "
                        "file: not read")
  if root is None:
    return real
  top = os.path.realpath(os.fspath(root))
  if _within(real, top) or any(_within(real, folder) for folder in allowed_folders()):
    return real
  raise RefusedFile(
      f"{path} ({what}) leads to {real}, outside {os.fspath(root)}: a received folder's "
      f"files are read only inside it (if you linked it there yourself, allow that folder: "
      f"{ALLOW_ENV}={_folder_of(real)})")


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                     (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                     (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
    if test(mode):
      return name
  return "not a regular file"


def _limit(kind: str, limit: int | None) -> int:
  return LIMITS[kind] if limit is None else limit


def open_file(path: str | os.PathLike, *, root: str | os.PathLike | None, kind: str,
              what: str | None = None, limit: int | None = None) -> BinaryIO:
  """The received file `path` opened for reading, once checked: inside
  `root` (links resolved), a regular file, of at most the size of its `kind`
  (`LIMITS`; or `limit` bytes; kind "weights": no limit here, since the
  caller bounds every array by the model's config before reading it).
  `what` names it in sentences (default: `kind`).

  Raises FileNotFoundError where there is no such file, and `RefusedFile`
  for a link out of `root`, anything but a regular file, or a file over the
  limit.
  """
  path, what = os.fspath(path), what or kind
  limit = None if kind == "weights" and limit is None else _limit(kind, limit)
  if is_address(path):  # (no links, FIFOs or devices there; `read_bytes` stops at the limit)
    return epath.Path(path).open("rb")
  real = _resolve_inside(path, root, what)
  try:  # (O_NONBLOCK: opening a FIFO for reading never waits for a writer)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} not found") from None
  except OSError as e:
    raise RefusedFile(f"{path} ({what}) cannot be opened ({e.strerror or e})") from None
  f = os.fdopen(fd, "rb")
  info = os.fstat(f.fileno())
  if not stat.S_ISREG(info.st_mode):
    f.close()
    raise RefusedFile(f"{path} ({what}) is {_kind(info.st_mode)}, not a regular file: "
                      "not read")
  if limit is not None and info.st_size > limit:
    f.close()
    raise _too_large(path, what, info.st_size, limit)
  return f


def read_bytes(path: str | os.PathLike, *, root: str | os.PathLike | None, kind: str,
               what: str | None = None, limit: int | None = None) -> bytes:
  """The bytes of the received file `path` (`open_file` says what is
  checked); the read itself stops at the limit (a file that grows)."""
  limit = _limit(kind, limit)
  with open_file(path, root=root, kind=kind, what=what, limit=limit) as f:
    try:  # (not `limit` + 1: read() allocates what it is asked for, then shrinks)
      size = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):  # (an object store's file)
      size = limit
    data = f.read(min(size, limit) + 1)
    if len(data) == size + 1 and size < limit:  # (it grew while read: read to the limit)
      data += f.read(limit - size)
  if len(data) > limit:
    raise RefusedFile(f"{os.fspath(path)} ({what or kind}) holds more than {_size(limit)}, "
                      "more than such a file holds: not read")
  return data


def _too_large(path: str, what: str, size: int, limit: int) -> RefusedFile:
  return RefusedFile(f"{path} ({what}) holds {_size(size)}, more than such a file holds "
                     f"({_size(limit)} at most): not read")


def read_text(path: str | os.PathLike, **kwargs) -> str:
  """`read_bytes`, decoded as UTF-8 (a bad byte is one sentence)."""
  data = read_bytes(path, **kwargs)
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise RefusedFile(f"{os.fspath(path)} is not UTF-8 text (byte {e.start}): not read") from None


def exists(path: str | os.PathLike) -> bool:
  """Whether there is anything at `path`: a file, a folder, a link (even one
  that leads nowhere: reading it says what it is)."""
  path = os.fspath(path)
  if is_address(path):
    return epath.Path(path).exists()
  return os.path.lexists(path)


def check_directory(path: str | os.PathLike, *, root: str | os.PathLike,
                    what: str) -> bool:
  """Whether `path`, a folder the code writes into or prunes, is there.
  False where there is nothing (the caller makes it); True for a real folder
  inside `root`. Raises `RefusedFile` for a link (even one that leads inside:
  writing through it would write elsewhere), a file, or anything else."""
  path = os.fspath(path)
  if is_address(path):
    return epath.Path(path).exists()
  try:
    info = os.lstat(path)
  except FileNotFoundError:
    return False
  if stat.S_ISLNK(info.st_mode):
    target = os.path.realpath(path)
    inside_allowed = any(_within(target, folder) for folder in allowed_folders())
    if inside_allowed and os.path.isdir(target):
      return True
    raise RefusedFile(
        f"{path} ({what}) is a link to {target}; a folder this program writes into must be "
        f"a real folder inside {os.fspath(root)} (if you linked it yourself, allow that "
        f"folder: {ALLOW_ENV}={_folder_of(target)})")
  if not stat.S_ISDIR(info.st_mode):
    raise RefusedFile(f"{path} ({what}) is {_kind(info.st_mode)}, not a folder")
  _resolve_inside(path, root, what)  # (the workdir's own parents may be links: fine)
  return True


@dataclasses.dataclass(frozen=True)
class Entry:
  """One file or folder under a walked folder, as `os.lstat` saw it."""
  relative: str  # its path under the folder walked
  is_dir: bool
  size: int
  mtime_ns: int
  ctime_ns: int  # (no tool sets it: `tar` and `cp -p` keep the others)
  inode: int
  device: int


def walk(top: str | os.PathLike, *, root: str | os.PathLike, what: str,
         max_entries: int = MAX_TREE_ENTRIES) -> list[Entry]:
  """Every folder and file under `top` (itself included, sorted), for a
  folder whose files a library reads on its own (orbax's checkpoints): []
  where there is no `top`. Links are refused, even inside (a link in a
  checkpoint is none that orbax wrote), unless they lead into a folder the
  user allowed; so are FIFOs, devices and sockets, and more than
  `max_entries` entries.

  Raises `RefusedFile` naming the entry and what it is.
  """
  top = os.fspath(top)
  if is_address(top) or not check_directory(top, root=root, what=what):
    return []  # (an object store holds no links, FIFOs or devices)
  entries: list[Entry] = []
  pending = [top]
  while pending:
    folder = pending.pop()
    try:
      with os.scandir(folder) as listing:
        names = sorted(listing, key=lambda e: e.name)
      top_info = os.lstat(folder) if folder == top else None
    except FileNotFoundError:  # (removed while walked: a save in progress, say)
      continue
    for entry in [None, *names]:
      if entry is None and top_info is None:
        continue  # (a folder is recorded by its parent)
      path = folder if entry is None else entry.path
      try:
        info = top_info if entry is None else os.lstat(path)
      except FileNotFoundError:
        continue
      if stat.S_ISLNK(info.st_mode):
        target = os.path.realpath(path)
        if not any(_within(target, f) for f in allowed_folders()):
          raise RefusedFile(
              f"{path} ({what}) is a link to {target}; checkpoints hold none (if you linked "
              f"it yourself, allow that folder: {ALLOW_ENV}={_folder_of(target)})")
        try:
          info = os.stat(path)
        except FileNotFoundError:
          continue
      if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
        raise RefusedFile(f"{path} ({what}) is {_kind(info.st_mode)}, not a file a "
                          "checkpoint holds: not read")
      entries.append(Entry(os.path.relpath(path, top), stat.S_ISDIR(info.st_mode),
                           info.st_size, info.st_mtime_ns, info.st_ctime_ns,
                           info.st_ino, info.st_dev))
      if len(entries) > max_entries:
        raise RefusedFile(f"{top} ({what}) holds more than {max_entries:,} files and "
                          "folders, more than a checkpoint has: not read")
      if entry is not None and stat.S_ISDIR(info.st_mode):
        pending.append(path)
  return sorted(entries, key=lambda e: e.relative)


def _size(n: int) -> str:
  for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n} bytes"
