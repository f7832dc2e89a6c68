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

A sealed file::

    MAGIC | tag (32 bytes) = HMAC-SHA256(key, name + b"\\0" + payload) | payload

The name (the cache key the file is stored under) is inside the tag, so a
file sealed as one decoder cannot be renamed to stand for another.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "TRANSFORMER_SIGNING_KEY"  # the key file's path (tests: one of their own)
KEY_FILE = "signing.key"
KEY_BYTES = 32
MAGIC = b"transformer-sealed-1\n"
TAG_BYTES = hashlib.sha256().digest_size


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


def reseal(name: str, stored: bytes) -> bytes | None:
  """`stored` (a sealed file, under any key) sealed anew with this machine's
  key: what `--trust_compiled` does to a workdir's files. None when
  `stored` is not a sealed file or there is no key."""
  parts = _split(stored)
  return None if parts is None else seal(name, parts[1])


def _split(stored: bytes) -> tuple[bytes, bytes] | None:
  """(tag, payload) of a sealed file; None for anything else."""
  if not stored.startswith(MAGIC) or len(stored) < len(MAGIC) + TAG_BYTES:
    return None
  return stored[len(MAGIC):len(MAGIC) + TAG_BYTES], stored[len(MAGIC) + TAG_BYTES:]


class NotSealedHere(ValueError):
  """A file this machine cannot prove it wrote (`unseal`)."""
