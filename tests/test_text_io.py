"""Tests for transformer/data/text_io.py: UTF-8 lines in, whole files out."""

from __future__ import annotations

import io
import os
import stat
import sys

import pytest

from transformer.data import text_io
from transformer.data.text_io import NotUtf8Error, TextFileError, write_atomically

# ----------------------------------------------------------------------------
# Reading lines
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("data, lines", [
    (b"", []),
    (b"\n", [""]),                                     # one empty line
    (b"a\nb", ["a", "b"]),                             # the last line needs no newline
    (b"a\nb\n", ["a", "b"]),                           # a final newline starts no line
    (b"a\r\n\r\nb\r\n", ["a", "", "b"]),               # Windows line ends
    (b"a\rb\n", ["a\rb"]),                             # a lone "\r" is text
    ("\ufeffgroße\tStraße\n".encode(), ["große\tStraße"]),  # the byte-order mark goes
    (b"\xef\xbb\xbf", []),
])
def test_split_lines(data, lines):
  assert text_io.split_lines(data, "x.txt") == lines


def test_not_utf8_names_file_line_column_byte_and_fix():
  data = "one\ntwo\nfünf große\n".encode("utf-8").replace("ß".encode(), b"\xdf")
  with pytest.raises(NotUtf8Error) as info:
    text_io.split_lines(data, "in.txt")
  error = info.value
  assert isinstance(error, ValueError)
  assert (error.name, error.line, error.column) == ("in.txt", 3, 9)  # characters, not bytes
  assert str(error) == ("in.txt:3: line 3, column 9: byte 0xdf is not valid UTF-8. Convert "
                        "the text to UTF-8, e.g. `iconv -f latin1 -t utf-8 in.txt`.")
  with pytest.raises(NotUtf8Error, match=r"^<stdin>:1: line 1, column 1: byte 0xff .* pipe it "
                     r"through `iconv -f latin1 -t utf-8`\.$"):
    text_io.split_lines(b"\xef\xbb\xbf\xffa\nb\n", text_io.STDIN)  # (after the mark)
  with pytest.raises(NotUtf8Error, match="line 2, column 2: byte 0xc3"):  # cut short
    text_io.split_lines(b"a\nb\xc3", "cut.txt")


def test_read_lines_from_a_file_or_stdin(tmp_path, monkeypatch):
  path = tmp_path / "in.txt"
  path.write_bytes(b"eins\r\nzwei")
  assert text_io.read_lines(str(path)) == ["eins", "zwei"]
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a\n\xff\n")))
  with pytest.raises(NotUtf8Error, match="^<stdin>:2:"):
    text_io.read_lines(None)


@pytest.mark.parametrize("make, problem", [
    (lambda tmp: tmp / "nope.txt", "file not found; check the path"),
    (lambda tmp: tmp, "is a directory, not a UTF-8 text file"),
])
def test_unreadable_files_name_the_file_and_the_problem(tmp_path, make, problem):
  path = str(make(tmp_path))
  with pytest.raises(TextFileError) as info:
    text_io.read_lines(path)
  assert isinstance(info.value, OSError)
  assert (info.value.path, info.value.problem) == (path, problem)
  assert str(info.value) == f"{path}: {problem}"


# ----------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------


def test_check_writable(tmp_path, monkeypatch):
  text_io.check_writable(str(tmp_path / "out.txt"))  # fine: nothing raised
  with pytest.raises(TextFileError, match="is a directory; give a file name"):
    text_io.check_writable(str(tmp_path))
  with pytest.raises(TextFileError, match=f"directory {tmp_path / 'no'} does not exist"):
    text_io.check_writable(str(tmp_path / "no" / "out.txt"))
  monkeypatch.setattr(text_io.os, "access", lambda path, mode: False)  # (root may write anywhere)
  with pytest.raises(TextFileError, match=f"cannot write in {tmp_path}"):
    text_io.check_writable(str(tmp_path / "out.txt"))


def test_write_lines_to_a_file_and_to_stdout(tmp_path, capsys):
  path = tmp_path / "out.txt"
  text_io.write_lines(["eins", "", "drei"], str(path))
  assert path.read_bytes() == b"eins\n\ndrei\n"
  text_io.write_lines(["a", "b"], None)
  assert capsys.readouterr().out == "a\nb\n"
  text_io.write_lines([], None)
  assert capsys.readouterr().out == ""


def test_write_lines_to_a_pipe_whose_reader_left(monkeypatch):
  read_end, write_end = os.pipe()
  os.close(read_end)  # like `| head` that has exited
  stdout = os.fdopen(write_end, "w")
  monkeypatch.setattr(sys, "stdout", stdout)
  try:
    text_io.write_lines(["a"] * 100_000, None)  # no BrokenPipeError
    stdout.write("more\n")
    stdout.flush()  # and none later: stdout now goes nowhere
  finally:
    stdout.close()


def test_a_failed_write_names_the_file_and_writes_nothing(tmp_path, monkeypatch):
  path = tmp_path / "out.txt"
  path.write_text("old")

  def fail(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(text_io.os, "fsync", fail)
  with pytest.raises(TextFileError) as info:
    text_io.write_lines(["new"], str(path))
  assert info.value.path == str(path)
  assert info.value.problem == "cannot write it (No space left on device); nothing was written"
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["out.txt"]


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


def test_a_writer_function_streams_into_the_file(tmp_path):
  path = tmp_path / "out.bin"
  write_atomically(path, lambda f: [f.write(bytes([k]) * 1000) for k in range(3)])
  assert path.read_bytes() == b"\x00" * 1000 + b"\x01" * 1000 + b"\x02" * 1000
  path.write_text("old")

  def half_then_fail(f):
    f.write(b"half")
    raise OSError(28, "No space left on device")
  with pytest.raises(OSError):
    write_atomically(path, half_then_fail)
  assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.bin"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, error):
  path = tmp_path / "out.txt"
  path.write_text("old")

  def fail(fd):
    raise error

  monkeypatch.setattr(text_io.os, "fsync", fail)
  with pytest.raises(type(error)):
    write_atomically(path, "new")
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["out.txt"]
