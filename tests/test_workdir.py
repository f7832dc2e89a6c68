"""Tests for transformer/runtime/workdir.py: the files of a run directory, the
vocabulary rule, the choice of checkpoint, the lock and the config check (on
hand-made workdirs; loading a trained one is tested in test_api.py and
test_decode_cli.py, a training run meeting the lock and the check in
test_training.py and test_train_cli.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from transformer.runtime import checkpoints
from transformer.runtime import run_lock, workdir
from transformer.model.transformer import TransformerConfig
from transformer.runtime.errors import OptionError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import free_port, run_together, subprocess_env  # noqa: E402

MODEL_CONFIG = TransformerConfig(vocab_size=64, d_model=32, num_heads=2, d_ff=64,
                                 num_encoder_layers=1, num_decoder_layers=1)


def make_workdir(path, *, vocab=True, config=None, steps=(), averaged=()):
  """A workdir as train.py leaves it, with empty stand-ins for the vocabulary
  and the finished checkpoint directories."""
  workdir.save_configs(str(path), config or {"vocab_path": ""}, MODEL_CONFIG)
  if vocab:
    (path / workdir.VOCAB_FILE).write_bytes(b"a vocabulary")
  for subdir, numbers in ((checkpoints.CHECKPOINT_DIR, steps),
                          (checkpoints.AVERAGED_DIR, averaged)):
    for step in numbers:
      os.makedirs(path / subdir / str(step))
  (path / checkpoints.CHECKPOINT_DIR).mkdir(exist_ok=True)
  os.makedirs(path / checkpoints.CHECKPOINT_DIR / "32.orbax-checkpoint-tmp-7")  # unfinished
  return str(path)


def test_configs_round_trip(tmp_path):
  run = make_workdir(tmp_path, config={"vocab_path": "", "seed": 3})
  assert workdir.load_model_config(run) == MODEL_CONFIG
  assert json.loads((tmp_path / workdir.CONFIG_FILE).read_text())["seed"] == 3


def test_missing_or_broken_files_say_what_to_do(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist.*python train.py"):
    workdir.check_files(str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match="model_config.json not found.*train.py"):
    workdir.check_files(str(tmp_path))
  run = make_workdir(tmp_path, vocab=False)
  with pytest.raises(FileNotFoundError, match="vocab.model not found.*train.py"):
    workdir.check_files(run)
  (tmp_path / workdir.MODEL_CONFIG_FILE).write_text('{"d_model": ')
  with pytest.raises(ValueError, match="model_config.json is not a valid model config"):
    workdir.load_model_config(run)


def test_vocabulary_is_the_workdirs_else_the_configs_inside_it(tmp_path):
  inside = tmp_path / "run" / "spm" / "shared.model"
  run = make_workdir(tmp_path / "run", vocab=False, config={"vocab_path": str(inside)})
  with pytest.raises(FileNotFoundError, match=f"nor the config's vocab_path {inside}"):
    workdir.vocab_path(run)
  inside.parent.mkdir()
  inside.write_bytes(b"a vocabulary")
  assert workdir.vocab_path(run) == str(inside)
  own = tmp_path / "run" / workdir.VOCAB_FILE
  own.write_bytes(b"its own")
  assert workdir.vocab_path(run) == str(own)        # the workdir's own comes first


@pytest.mark.parametrize("named", ["outside", "../outside.model", "link/x.model"])
def test_a_config_never_points_the_vocabulary_outside_the_workdir(tmp_path, named):
  """A workdir is data: its config.json does not choose which file of this
  machine is read as a vocabulary (an absolute path, a ../, a link out)."""
  outside = tmp_path / "outside.model"
  outside.write_bytes(b"not the workdir's")
  named = str(outside) if named == "outside" else named
  run = make_workdir(tmp_path / "run", vocab=False, config={"vocab_path": named})
  (tmp_path / "run" / "link").symlink_to(tmp_path)
  with pytest.raises(FileNotFoundError) as error:
    workdir.vocab_path(run)
  message = str(error.value)
  assert "outside the workdir" in message and "cp " in message and "\n" not in message


@pytest.mark.parametrize("which,want", [("auto", "auto"), ("averaged", "averaged"),
                                        ("latest", "latest"), ("12", 12), (12, 12)])
def test_checkpoint_choice(which, want):
  assert workdir.checkpoint_choice(which) == want


@pytest.mark.parametrize("which", ["best", "-3", "", "١٢", -3])
def test_checkpoint_choice_names_the_option(which):
  with pytest.raises(OptionError) as info:
    workdir.checkpoint_choice(which)
  assert info.value.option == "checkpoint" and info.value.value == which


def test_resolve_checkpoint(tmp_path):
  run = make_workdir(tmp_path / "run", steps=[8, 16])
  assert workdir.resolve_checkpoint(run, "auto") == 16      # no average: the latest
  assert workdir.resolve_checkpoint(run, "latest") == 16
  assert workdir.resolve_checkpoint(run, "8") == 8
  with pytest.raises(workdir.CheckpointNotFound) as info:
    workdir.resolve_checkpoint(run, "averaged")
  assert info.value.value == "averaged"
  assert "no averaged checkpoint" in info.value.problem and "latest" in info.value.problem
  with pytest.raises(workdir.CheckpointNotFound, match=r"available steps: \[8, 16\]"):
    workdir.resolve_checkpoint(run, 32)                     # only a temporary one
  averaged = make_workdir(tmp_path / "averaged", steps=[8, 16], averaged=[16])
  assert workdir.resolve_checkpoint(averaged, "auto") == "averaged"
  # Resumed and trained on past its average: "auto" is the newer step, with a note.
  stale = make_workdir(tmp_path / "stale", steps=[8, 16, 24], averaged=[16])
  assert workdir.resolve_checkpoint(stale, "auto") == 24
  assert "older than its latest step 24" in workdir.stale_average_note(stale)
  assert workdir.stale_average_note(averaged) is None
  empty = make_workdir(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no checkpoint in .*python train.py"):
    workdir.resolve_checkpoint(empty, "latest")


# ----------------------------------------------------------------------------
# One run at a time
# ----------------------------------------------------------------------------


def test_a_held_workdir_refuses_a_second_holder_naming_the_first(tmp_path):
  with run_lock.hold(str(tmp_path)):
    holder = json.loads((tmp_path / workdir.LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    # (flock locks an open file, not a process: a second open in this one is refused too)
    with pytest.raises(run_lock.WorkdirLocked) as info:
      with run_lock.hold(str(tmp_path)):
        pass
    message = str(info.value)
    assert str(tmp_path) in message and f"PID {os.getpid()}" in message
    assert socket.gethostname() in message and "--workdir" in message
  assert (tmp_path / workdir.LOCK_FILE).read_text() == ""   # no stale PID left
  with run_lock.hold(str(tmp_path)):                          # released
    pass


HOLDER = """
import sys, time
from transformer.runtime import run_lock
with run_lock.hold(sys.argv[1]):
  print("holding", flush=True)
  time.sleep(120)
"""


def test_the_lock_dies_with_its_process(tmp_path):
  """A holder killed with SIGKILL leaves no stale lock (the file stays, the
  OS lock goes)."""
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=subprocess_env(),
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "holding"
    with pytest.raises(run_lock.WorkdirLocked, match=f"PID {proc.pid} on host"):
      with run_lock.hold(str(tmp_path)):
        pass
  finally:
    proc.kill()
    proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL
  with run_lock.hold(str(tmp_path)):
    pass


# ----------------------------------------------------------------------------
# Config changes on resume
# ----------------------------------------------------------------------------


STORED = {"model": {"d_model": 32, "num_heads": 2}, "data": {"source": "demo"},
          "vocab_size": 128, "batch_size": 16, "num_train_steps": 10, "log_every": 5,
          "warmup_steps": 50}


def test_resumable_fields_may_change_and_are_returned(tmp_path):
  assert workdir.check_config(str(tmp_path), STORED) == []          # a new workdir
  workdir.save_configs(str(tmp_path), STORED, MODEL_CONFIG)
  assert workdir.check_config(str(tmp_path), STORED) == []
  longer = dict(STORED, num_train_steps=20, log_every=1, keep_checkpoints=1)
  assert workdir.check_config(str(tmp_path), longer) == [
      ("keep_checkpoints", workdir._MISSING, 1), ("log_every", 5, 1),
      ("num_train_steps", 10, 20)]


def test_fields_that_must_match_are_all_listed_with_the_ways_out(tmp_path):
  workdir.save_configs(str(tmp_path), STORED, MODEL_CONFIG)
  changed = dict(STORED, model={"d_model": 64, "num_heads": 2}, data={"source": "tsv"},
                 warmup_steps=4000, num_train_steps=20, seed=1)
  with pytest.raises(workdir.ConfigMismatch) as info:
    workdir.check_config(str(tmp_path), changed)
  assert info.value.differences == [("data.source", "demo", "tsv"),
                                    ("model.d_model", 32, 64),
                                    ("seed", workdir._MISSING, 1),
                                    ("warmup_steps", 50, 4000)]
  message = str(info.value)
  for line in ['  model.d_model: 32 -> 64', '  data.source: "demo" -> "tsv"',
               "  warmup_steps: 50 -> 4000", "  seed: (not set) -> 1"]:
    assert line in message.splitlines(), message
  assert str(tmp_path / workdir.CONFIG_FILE) in message
  assert "new --workdir" in message and "drop these overrides" in message
  assert "num_train_steps: " not in message                 # (it may change)


TWO_PROCESS_HOLDER = """
import os, sys
from transformer.runtime import parallel
from transformer.runtime import run_lock
port, process_id, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
parallel.maybe_initialize_distributed(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                      process_id=process_id, initialization_timeout=60)
try:
  with run_lock.hold(directory):
    print("held", flush=True)
except run_lock.WorkdirLocked as e:
  print("refused:", e, flush=True)
parallel.shutdown_distributed()
"""


@pytest.mark.parametrize("held_by_another_run", [False, True])
def test_with_two_processes_process_0_locks_and_both_follow(tmp_path, held_by_another_run):
  """Two JAX processes on localhost (a two-host run): process 0 takes the lock
  and tells process 1 the outcome, so both train, or both stop naming the
  holder (here this test's own process), never one of them alone."""
  port = free_port()
  env = subprocess_env(JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")  # loopback only
  with contextlib.ExitStack() as stack:
    if held_by_another_run:
      stack.enter_context(run_lock.hold(str(tmp_path)))
    outputs = run_together([[sys.executable, "-c", TWO_PROCESS_HOLDER, str(port), str(i),
                             str(tmp_path)] for i in range(2)], env, timeout=120)
  for out in outputs:
    lines = [line for line in out.splitlines() if line.startswith(("held", "refused:"))]
    if held_by_another_run:
      assert len(lines) == 1 and lines[0].startswith("refused:"), out
      assert f"PID {os.getpid()} on host {socket.gethostname()}" in lines[0], out
    else:
      assert lines == ["held"], out


def test_a_trained_workdir_is_read_once_into_a_value(tmp_path, monkeypatch):
  """`workdir.read`: the path resolved once (absolute, from a relative one),
  the model config as model_config.json says, the vocabulary, the checkpoint
  chosen by `choose` (called once, with the resolved path and the parsed
  choice) and the import record; None asks for no checkpoint (nothing
  listed). A missing workdir names itself and what to do."""
  import shutil
  source = Path(__file__).parent / "fixtures" / "workdir_d26a6fb"
  shutil.copytree(source, tmp_path / "run")
  monkeypatch.chdir(tmp_path)
  calls = []

  def choose(path, checkpoint, folders):
    assert [len(f) for f in folders] == [0, 27]  # (no checkpoints/; every entry of the average)
    calls.append((path, checkpoint))
    return 600, "a note"
  model = workdir.read("run", "600", choose=choose)
  assert str(model.path) == str(tmp_path / "run") and model.path.is_absolute()
  assert calls == [(model.path, 600)]
  stored = json.loads((source / "model_config.json").read_text())
  assert model.model_config == TransformerConfig.from_dict(stored)
  assert model.vocab_path == str(tmp_path / "run" / "vocab.model")
  assert (model.checkpoint, model.checkpoint_note, model.imported) == (600, "a note", None)
  listed = workdir.read("run", "auto")  # (the default: the checkpoints listed with orbax)
  assert (listed.checkpoint, listed.checkpoint_note) == ("averaged", None)
  (tmp_path / "run" / workdir.IMPORT_FILE).write_text('{"imported_from": "opus-mt-x"}')
  assert workdir.read("run", None, choose=choose).imported == {"imported_from": "opus-mt-x"}
  assert len(calls) == 1 and workdir.read("run", None).checkpoint is None
  (tmp_path / "run" / workdir.IMPORT_FILE).write_text('["not", "an", "import", "record"]')
  with pytest.raises(ValueError, match="import.json is not an import record"):
    workdir.read("run", None)
  with pytest.raises(FileNotFoundError, match="workdir gone does not exist; train a model"):
    workdir.read("gone")
  with pytest.raises(OptionError, match="checkpoint"):
    workdir.read("run", "newest")
