"""This machine's signature on the files it writes that must stay programs.

A compiled decoder cannot be stored as plain data: JAX serializes an
executable with pickle, and loading one "may run arbitrary code"
(`jax.experimental.serialize_executable.deserialize_and_load`). Such files
travel with a workdir (`<workdir>/compiled/`), and a workdir is data that
anyone may hand over (docs/security.md). So each one is sealed: an
HMAC-SHA256 tag over its name and bytes, under a key that only this user on
this machine holds, and nothing is deserialized unless its tag verifies.

The key: 32 random bytes in `$XDG_CACHE_HOME/transformer/signing.key`
(`~/.cache/...`), or the file $TRANSFORMER_SIGNING_KEY names; created on
first use with mode 0600. A key file that others can read or write is not
used (anyone who can read it can forge a tag): nothing is then loaded, and a
warning says how to fix it. Copying the key to another machine of one's own
makes it trust what this one sealed (docs/security.md).

Trust is a key, never a file: a workdir copied from another machine of the
user's own, sealed under that machine's key, is adopted only by naming that
key (`trusted_keys`, `decode.py --trust_compiled=KEY`): a file is sealed
anew here (`reseal`) only if its tag verifies under it. A file's own say-so
(that it starts like a sealed file) is worth nothing: anyone can write that.

A sealed file::

    MAGIC | tag (32 bytes) = HMAC-SHA256(key, name + b"\\0" + payload) | payload

The name (the cache key the file is stored under) is inside the tag, so a
file sealed as one decoder cannot be renamed to stand for another.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from transformer.runtime import errors

logger = logging.getLogger(__name__)

ENV = "TRANSFORMER_SIGNING_KEY"  # the key file's path (tests: one of their own)
KEY_FILE = "signing.key"
KEY_BYTES = 32
MAGIC = b"transformer-sealed-1\n"
TAG_BYTES = hashlib.sha256().digest_size
TRUST_OPTION = "trust_compiled"  # the option that names trusted keys (`trusted_keys`)
KEYRING_SUFFIX = ".key"  # a keyring directory's key files
MAX_KEYRING_ENTRIES = 256  # (a keyring holds one key per machine of the user's)


def key_path() -> Path:
  """Where this user's key is: $TRANSFORMER_SIGNING_KEY, else
  `<$XDG_CACHE_HOME or ~/.cache>/transformer/signing.key`."""
  if os.environ.get(ENV):
    return Path(os.path.expanduser(os.environ[ENV]))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "transformer" / KEY_FILE


def machine_key() -> bytes | None:
  """This user's key (made on first use), or None where there is none to be
  had (a read-only home, a key file others can read: said once)."""
  return _key_at(key_path())


@functools.lru_cache(maxsize=None)
def _key_at(path: Path) -> bytes | None:
  try:
    if not path.exists():
      _create(path)
    info = os.stat(path)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
      logger.warning("The signing key %s can be read or written by others, so compiled "
                     "decoders are neither loaded nor kept (chmod 600 %s to use it).",
                     path, path)
      return None
    key = path.read_bytes()
  except OSError as e:
    logger.warning("No signing key (%s: %s): compiled decoders are compiled afresh, not "
                   "loaded or kept.", path, e.strerror or e)
    return None
  if len(key) != KEY_BYTES:
    logger.warning("The signing key %s is not %d bytes (%d): compiled decoders are neither "
                   "loaded nor kept (remove it: a new one is made).", path, KEY_BYTES, len(key))
    return None
  return key


def _create(path: Path) -> None:
  """Writes a new random key at `path`, mode 0600, whole or not at all: a
  process that loses the race to create it reads the winner's."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(secrets.token_bytes(KEY_BYTES))
      f.flush()
      os.fsync(f.fileno())
    try:
      os.link(tmp, path)  # (fails if another process made it first: theirs stands)
    except FileExistsError:
      pass
  finally:
    tmp.unlink(missing_ok=True)


def _tag(key: bytes, name: str, payload: bytes) -> bytes:
  return hmac.new(key, name.encode() + b"\0" + payload, hashlib.sha256).digest()


def seal(name: str, payload: bytes) -> bytes | None:
  """`payload` as a file sealed under `name` with this machine's key; None
  without a key (then nothing is kept)."""
  key = machine_key()
  return None if key is None else MAGIC + _tag(key, name, payload) + payload


def unseal(name: str, stored: bytes) -> bytes:
  """The payload of `stored` if this machine sealed it under `name`.

  Raises `NotSealedHere` (a ValueError) saying why not: not a sealed file
  (a pickle, random bytes, a truncated file), a tag that does not verify
  (another key, another name, changed bytes), or no key here.
  """
  parts = _split(stored)
  if parts is None:
    raise NotSealedHere("not a sealed file")
  key = machine_key()
  if key is None:
    raise NotSealedHere("no signing key on this machine")
  tag, payload = parts
  if not hmac.compare_digest(tag, _tag(key, name, payload)):
    raise NotSealedHere("sealed under another key, or changed since")
  return payload


def reseal(name: str, stored: bytes, trusted: Sequence[bytes]) -> bytes | None:
  """`stored` sealed anew with this machine's key if its tag verifies under
  one of `trusted` (keys of the user's other machines, `trusted_keys`) and
  `name`: what `--trust_compiled=KEY` does to a workdir's files. None for
  anything else (not a sealed file, another key, changed bytes) and without
  a key here."""
  parts = _split(stored)
  if parts is None:
    return None
  tag, payload = parts
  if not any(hmac.compare_digest(tag, _tag(key, name, payload)) for key in trusted):
    return None
  return seal(name, payload)


def trusted_keys(path: str | os.PathLike) -> list[bytes]:
  """The keys `path` holds: a key file (another machine's 32-byte
  `signing.key`) or a keyring, a directory whose files named `*.key` are
  each one (at most MAX_KEYRING_ENTRIES entries). Only regular files are
  read, no link followed, nothing opened that could block (a FIFO); a key
  file that group or others can read or write, or a keyring they can write,
  is refused: someone else could forge its seals or put their key there. Raises `errors.OptionError` (TRUST_OPTION) whose
  problem is one sentence saying what is wrong."""
  def refuse(problem):
    return errors.OptionError(TRUST_OPTION, os.fspath(path), problem)
  try:
    fd = _open_key(path)
  except OSError as e:
    raise refuse(f"the path {_open_problem(e)}") from None
  try:
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
      return [_read_key(fd, info, "the key file", refuse)]
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
      raise refuse("the keyring can be written by group or others, so someone else could "
                   "have put their key there (chmod go-w it)")
    return _read_keyring(fd, refuse)
  finally:
    os.close(fd)


def _open_key(name: str | os.PathLike, dir_fd: int | None = None) -> int:
  """A descriptor of `name`, never through a link (O_NOFOLLOW) and never
  waiting on a FIFO's writer (O_NONBLOCK)."""
  return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)


def _open_problem(e: OSError) -> str:
  if e.errno == errno.ELOOP:
    return "is a symbolic link, which is not followed (name the key file or keyring itself)"
  if e.errno == errno.ENOENT:
    return ("does not exist (name the signing.key copied from the machine whose "
            "compiled decoders you trust)")
  return f"cannot be opened ({e.strerror or e})"


def _read_key(fd: int, info: os.stat_result, what: str, refuse) -> bytes:
  """The key in the open file `fd` (`info`: its fstat), or `refuse(problem)`
  raised: not a regular file, readable or writable by others, not KEY_BYTES long."""
  if not stat.S_ISREG(info.st_mode):
    raise refuse(f"{what} is not a regular file (a FIFO, a device, a socket or a directory)")
  if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):  # (as this machine's own key)
    raise refuse(f"{what} can be read or written by group or others, so someone else could "
                 "forge its seals or put their key there (chmod 600 it)")
  key = os.read(fd, KEY_BYTES + 1) if info.st_size == KEY_BYTES else b""
  if len(key) != KEY_BYTES:
    raise refuse(f"{what} holds {info.st_size} bytes, not a {KEY_BYTES}-byte signing.key")
  return key


def _read_keyring(fd: int, refuse) -> list[bytes]:
  """The keys of the keyring directory open as `fd`: every entry named
  `*.key`, each read as `_read_key` reads a key file."""
  with os.scandir(fd) as entries:
    names = []
    for entry in entries:
      if len(names) == MAX_KEYRING_ENTRIES:
        raise refuse(f"the keyring has more than {MAX_KEYRING_ENTRIES} entries: it should "
                     f"hold one {KEYRING_SUFFIX} file per machine of yours")
      names.append(entry.name)
  keys = []
  for name in sorted(n for n in names if n.endswith(KEYRING_SUFFIX)):
    try:
      key_fd = _open_key(name, dir_fd=fd)
    except OSError as e:
      raise refuse(f"its {name} {_open_problem(e)}") from None
    try:
      keys.append(_read_key(key_fd, os.fstat(key_fd), f"its {name}", refuse))
    finally:
      os.close(key_fd)
  if not keys:
    raise refuse(f"the keyring holds no {KEYRING_SUFFIX} file (it holds the signing.key "
                 f"of each machine of yours, e.g. as laptop{KEYRING_SUFFIX})")
  return keys


def _split(stored: bytes) -> tuple[bytes, bytes] | None:
  """(tag, payload) of a sealed file; None for anything else."""
  if not stored.startswith(MAGIC) or len(stored) < len(MAGIC) + TAG_BYTES:
    return None
  return stored[len(MAGIC):len(MAGIC) + TAG_BYTES], stored[len(MAGIC) + TAG_BYTES:]


class NotSealedHere(ValueError):
  """A file this machine cannot prove it wrote (`unseal`)."""
