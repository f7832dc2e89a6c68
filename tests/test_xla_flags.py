"""$XLA_FLAGS tried against the installed XLA before it reads them
(transformer/runtime/xla_flags.py). The probes are real processes: XLA itself
says which flags it knows."""

from __future__ import annotations

import subprocess

import pytest

from transformer.runtime import xla_flags

UNKNOWN = "--xla_no_such_flag_anywhere=1"
KNOWN = "--xla_backend_optimization_level=0"  # (an XLA flag in every jaxlib this project allows)


def test_the_probe_names_the_flag_xla_does_not_know_and_passes_one_it_knows(tmp_path):
  assert xla_flags.rejected_flag(f"{KNOWN} {UNKNOWN}", tmp_path) == UNKNOWN
  assert xla_flags.rejected_flag(KNOWN, tmp_path) is None
  assert xla_flags.rejected_flag("", tmp_path) is None
  assert xla_flags.known([UNKNOWN, KNOWN, "--xla_neither_this_one=0"], tmp_path) == [KNOWN]


def test_a_verdict_is_kept_so_the_same_flags_run_no_second_probe(tmp_path, monkeypatch):
  assert xla_flags.rejected_flag(f"{UNKNOWN}  {KNOWN}", tmp_path) == UNKNOWN
  kept = list((tmp_path / xla_flags.SUBDIRECTORY).iterdir())
  assert len(kept) == 1

  def no_probe(*args, **kwargs):
    raise AssertionError("probed again")

  monkeypatch.setattr(subprocess, "run", no_probe)
  assert xla_flags.rejected_flag(f"{UNKNOWN} {KNOWN}", tmp_path) == UNKNOWN  # (spacing aside)
  # A kept verdict is read, not trusted to be well formed: a broken one is probed again.
  kept[0].write_bytes(b"\x00 not json")
  with pytest.raises(AssertionError, match="probed again"):
    xla_flags.rejected_flag(f"{UNKNOWN} {KNOWN}", tmp_path)


def test_a_probe_that_fails_for_another_reason_is_no_verdict(tmp_path, monkeypatch):
  failed = subprocess.CompletedProcess([], 1, "", "Segmentation fault (core dumped)\n")
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
  assert xla_flags.rejected_flag(UNKNOWN, tmp_path) is None
  assert not (tmp_path / xla_flags.SUBDIRECTORY).exists()  # (nothing kept: asked again next time)


def test_check_environment_says_the_flag_in_one_sentence(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"{KNOWN} {UNKNOWN}")
  with pytest.raises(xla_flags.UnknownXlaFlag) as raised:
    xla_flags.check_environment(tmp_path)
  message = str(raised.value)
  assert message.startswith(f"$XLA_FLAGS sets {UNKNOWN}, which this XLA (jaxlib ")
  assert "remove it from XLA_FLAGS" in message and "\n" not in message
  monkeypatch.setenv("XLA_FLAGS", KNOWN)
  xla_flags.check_environment(tmp_path)  # (no error)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to='unbalanced")
  with pytest.raises(xla_flags.UnknownXlaFlag, match="cannot be read"):
    xla_flags.check_environment(tmp_path)
