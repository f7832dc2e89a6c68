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

from transformer.runtime import signing


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


def test_reseal_moves_a_file_under_this_key(key_file):
  other = os.urandom(signing.KEY_BYTES)
  theirs = signing.MAGIC + hmac.new(other, b"n\0p", hashlib.sha256).digest() + b"p"
  with pytest.raises(signing.NotSealedHere):
    signing.unseal("n", theirs)
  assert signing.unseal("n", signing.reseal("n", theirs)) == b"p"
  assert signing.reseal("n", b"a pickle, not a sealed file") is None


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
