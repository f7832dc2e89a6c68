"""This machine's seal on the files that must stay programs
(transformer/runtime/signing.py): a key of the user's own, mode 0600, and an
HMAC-SHA256 tag that binds a file's name and bytes, checked against Python's
hmac computed here independently."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import threading

import pytest

from helpers import within_seconds
from transformer.runtime import errors, signing


@pytest.fixture
def key_file(tmp_path, monkeypatch):
  """A key path of this test's own (none there yet); the process's memo of
  keys forgotten before and after."""
  path = tmp_path / "home" / "signing.key"
  monkeypatch.setenv(signing.ENV, str(path))
  signing._key_at.cache_clear()
  yield path
  signing._key_at.cache_clear()


def test_the_key_is_made_once_private_and_kept(key_file):
  key = signing.machine_key()
  assert key_file.read_bytes() == key and len(key) == signing.KEY_BYTES
  assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
  signing._key_at.cache_clear()
  assert signing.machine_key() == key  # (read back, not made again)


def test_the_default_key_lives_in_the_users_cache(monkeypatch, tmp_path):
  monkeypatch.delenv(signing.ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert signing.key_path() == tmp_path / "transformer" / "signing.key"


def test_processes_racing_to_make_the_key_agree(key_file):
  """Threads stand in for processes: each creates the key file where there is
  none; one wins and every one of them reads the winner's."""
  keys, barrier = [], threading.Barrier(8)

  def make():
    barrier.wait()
    signing._create(key_file) if not key_file.exists() else None
    keys.append(key_file.read_bytes())
  threads = [threading.Thread(target=make) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(set(keys)) == 1 and len(keys[0]) == signing.KEY_BYTES
  assert [p.name for p in key_file.parent.iterdir()] == [key_file.name]  # (no leftovers)


def test_the_planted_pickle_of_the_tests_does_run(tmp_path):
  """The premise of every test that plants one (helpers.hostile_pickle): were
  it unpickled, its command would run and leave the marker."""
  import pickle
  from helpers import hostile_pickle
  marker = tmp_path / "ran"
  pickle.loads(hostile_pickle(marker))
  assert marker.exists()


def test_a_sealed_file_is_magic_tag_payload(key_file):
  payload = b"\x80\x04 any bytes"
  sealed = signing.seal("abc.bin", payload)
  key = key_file.read_bytes()
  want = hmac.new(key, b"abc.bin\0" + payload, hashlib.sha256).digest()
  assert sealed == signing.MAGIC + want + payload
  assert signing.unseal("abc.bin", sealed) == payload


@pytest.mark.parametrize("change", ["another name", "another key", "a byte flipped",
                                    "truncated", "not sealed", "empty"])
def test_only_what_this_machine_sealed_under_that_name_unseals(key_file, tmp_path,
                                                               monkeypatch, change):
  payload = b"a compiled decoder" * 10
  sealed = signing.seal("abc.bin", payload)
  name = "abc.bin"
  if change == "another name":
    name = "def.bin"
  elif change == "another key":
    other = os.urandom(signing.KEY_BYTES)
    sealed = signing.MAGIC + hmac.new(other, b"abc.bin\0" + payload,
                                      hashlib.sha256).digest() + payload
  elif change == "a byte flipped":
    sealed = sealed[:-1] + bytes([sealed[-1] ^ 1])
  elif change == "truncated":
    sealed = sealed[:len(sealed) // 2]
  elif change == "not sealed":
    sealed = payload
  else:
    sealed = b""
  with pytest.raises(signing.NotSealedHere):
    signing.unseal(name, sealed)


def _sealed_under(key: bytes, name: str, payload: bytes) -> bytes:
  """`payload` sealed as another machine, whose key is `key`, seals it."""
  tag = hmac.new(key, name.encode() + b"\0" + payload, hashlib.sha256).digest()
  return signing.MAGIC + tag + payload


def test_reseal_moves_only_what_a_trusted_key_sealed(key_file):
  """Issue 68: a file is sealed anew here only if its tag verifies under one
  of the keys the user named, for its own name; never one that merely
  starts like a sealed file (the attack: MAGIC, 32 zero bytes, a pickle)."""
  mine_elsewhere, stranger = os.urandom(signing.KEY_BYTES), os.urandom(signing.KEY_BYTES)
  theirs = _sealed_under(mine_elsewhere, "n", b"p")
  with pytest.raises(signing.NotSealedHere):
    signing.unseal("n", theirs)
  assert signing.unseal("n", signing.reseal("n", theirs, [stranger, mine_elsewhere])) == b"p"
  forged = signing.MAGIC + bytes(signing.TAG_BYTES) + b"a pickle"
  assert signing.reseal("n", forged, [mine_elsewhere, stranger]) is None
  assert signing.reseal("n", theirs, [stranger]) is None  # (another key)
  assert signing.reseal("m", theirs, [mine_elsewhere]) is None  # (another name)
  assert signing.reseal("n", theirs[:-1] + b"q", [mine_elsewhere]) is None  # (changed)
  assert signing.reseal("n", theirs, []) is None
  assert signing.reseal("n", b"a pickle, not a sealed file", [mine_elsewhere]) is None


def _write_key(path, key: bytes | None = None, mode: int = 0o600):
  """A key file at `path` (its directory made), mode `mode`; `key` or random."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(os.urandom(signing.KEY_BYTES) if key is None else key)
  os.chmod(path, mode)
  return path


def test_a_trusted_key_is_a_key_file_or_a_keyring_of_them(tmp_path):
  """A key file gives its key; a keyring directory every `*.key` file's,
  other files ignored."""
  a = os.urandom(signing.KEY_BYTES)
  assert signing.trusted_keys(_write_key(tmp_path / "a" / "signing.key", a)) == [a]
  assert signing.trusted_keys(str(tmp_path / "a" / "signing.key")) == [a]
  ring = tmp_path / "keyring"
  keys = {name: os.urandom(signing.KEY_BYTES)
          for name in ("laptop.key", "colab.key", "server.key")}
  for name, key in keys.items():
    _write_key(ring / name, key)
  (ring / "README").write_text("the keys of my machines")
  (ring / "laptop.key.bak").write_bytes(b"not read")
  assert sorted(signing.trusted_keys(ring)) == sorted(keys.values())


def _make_bad_key(kind: str, tmp_path):
  """A path that `--trust_compiled` must refuse, and words of its sentence."""
  good = _write_key(tmp_path / "elsewhere" / "signing.key")
  path = tmp_path / "trusted.key"
  if kind == "a link out":
    path.symlink_to(good)
    return path, "symbolic link"
  if kind == "a FIFO":
    os.mkfifo(path)
    return path, "not a regular file"
  if kind == "a device":
    return "/dev/zero", "not a regular file"
  if kind in ("short", "long", "empty"):
    size = {"short": signing.KEY_BYTES - 1, "long": 4096, "empty": 0}[kind]
    _write_key(path, os.urandom(size))
    return path, f"holds {size} bytes, not a 32-byte"
  if kind in ("group-writable", "others-writable", "others-readable"):
    _write_key(path, mode={"group-writable": 0o620, "others-writable": 0o602,
                           "others-readable": 0o604}[kind])
    return path, "can be read or written by group or others"
  if kind == "missing":
    return path, "does not exist"
  ring = tmp_path / "keyring"
  _write_key(ring / "laptop.key")
  if kind == "a keyring others can write":
    os.chmod(ring, 0o777)
    return ring, "the keyring can be written by group or others"
  if kind == "a link in a keyring":
    (ring / "server.key").symlink_to(good)
    return ring, "its server.key is a symbolic link"
  if kind == "a FIFO in a keyring":
    os.mkfifo(ring / "server.key")
    return ring, "its server.key is not a regular file"
  if kind == "a short key in a keyring":
    _write_key(ring / "server.key", b"short")
    return ring, "its server.key holds 5 bytes"
  if kind == "a group-writable key in a keyring":
    _write_key(ring / "server.key", mode=0o660)
    return ring, "its server.key can be read or written by group or others"
  if kind == "an empty keyring":
    (ring / "laptop.key").unlink()
    return ring, "holds no .key file"
  assert kind == "a huge keyring", kind
  for i in range(signing.MAX_KEYRING_ENTRIES):
    (ring / f"note{i}").touch()
  return ring, f"more than {signing.MAX_KEYRING_ENTRIES} entries"


BAD_KEYS = ("a link out", "a FIFO", "a device", "short", "long", "empty", "group-writable",
            "others-writable", "others-readable", "missing", "a keyring others can write",
            "a link in a keyring",
            "a FIFO in a keyring", "a short key in a keyring",
            "a group-writable key in a keyring", "an empty keyring", "a huge keyring")


@pytest.mark.parametrize("kind", BAD_KEYS)
def test_a_bad_trusted_key_is_one_sentence_naming_it(tmp_path, kind):
  """Issue 68: what `--trust_compiled` names is read as a key only if it is
  one: a regular file (no link followed, a FIFO never waited on) of exactly
  32 bytes that only its owner can write, or a keyring of such files. Else
  an OptionError: the option, the path and what is wrong, on one line."""
  path, words = _make_bad_key(kind, tmp_path)
  with pytest.raises(errors.OptionError) as raised:
    within_seconds(lambda: signing.trusted_keys(path), 10)  # (a FIFO opened to read would block)
  e = raised.value
  assert (e.option, e.value) == ("trust_compiled", str(path))
  assert words in e.problem and "\n" not in str(e), str(e)
  assert str(e).startswith(f"trust_compiled={path}: ")


def test_a_key_others_can_read_is_not_used(key_file, caplog):
  signing.machine_key()
  os.chmod(key_file, 0o644)
  signing._key_at.cache_clear()
  with caplog.at_level(logging.WARNING):
    assert signing.machine_key() is None
    assert signing.seal("n", b"p") is None
  assert "chmod 600" in caplog.text
  with pytest.raises(signing.NotSealedHere, match="no signing key"):
    signing.unseal("n", signing.MAGIC + bytes(signing.TAG_BYTES) + b"p")


def test_a_key_of_the_wrong_size_is_not_used(key_file, caplog):
  key_file.parent.mkdir(parents=True)
  key_file.write_bytes(b"short")
  os.chmod(key_file, 0o600)
  with caplog.at_level(logging.WARNING):
    assert signing.machine_key() is None
  assert "not 32 bytes" in caplog.text
