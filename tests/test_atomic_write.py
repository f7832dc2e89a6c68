"""Tests for transformer/atomic_write.py: whole files or none."""

from __future__ import annotations

import os
import stat

import pytest

from transformer import atomic_write
from transformer.atomic_write import write_atomically


def test_bytes_and_text_land_whole_with_usual_permissions(tmp_path):
  path = tmp_path / "new" / "dir" / "out.txt"   # directories are created
  write_atomically(path, "große Straße\nline two\n")
  assert path.read_bytes() == "große Straße\nline two\n".encode("utf-8")
  write_atomically(str(path), b"\x00\xffraw")     # replaces the old content
  assert path.read_bytes() == b"\x00\xffraw"
  umask = os.umask(0o022)
  try:
    write_atomically(path, b"x")
  finally:
    os.umask(umask)
  assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not the temp file's 0o600
  assert os.listdir(path.parent) == ["out.txt"]     # no temporary file left


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, error):
  path = tmp_path / "out.txt"
  path.write_text("old")

  def fail(fd):
    raise error

  monkeypatch.setattr(atomic_write.os, "fsync", fail)
  with pytest.raises(type(error)):
    write_atomically(path, "new")
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["out.txt"]
