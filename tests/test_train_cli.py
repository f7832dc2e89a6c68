"""Tests for `python train.py`: a tiny run end to end, bad options, and the
faults a user meets (a second run on a held workdir, a changed config, a
checkpoint that does not fit, an unexpected error, a full disk), each ending
with one line on the console and the traceback in <workdir>/train.log.

Each case is a process of its own with a time limit, forked from one that
imported train.py's libraries (`fork_server`). Successful runs share the
session's persistent XLA compilation cache with tests/test_training.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import fork_server  # noqa: E402
import train_worker  # noqa: E402  (no JAX import)
from helpers import shared_compilation_cache, small_disk, subprocess_env  # noqa: E402

TIMEOUT_S = 240


def env_for(cache_dir=None) -> dict[str, str]:
  """`helpers.subprocess_env`'s: XLA at FAST_COMPILE_FLAGS (compiling is most
  of a short run), matmuls pinned to "highest" as in test_training.py (the
  same programs: one compile for both), and the tests' shared compilation
  cache unless `cache_dir` names another."""
  return subprocess_env(cache_dir)


def train_py(args, env, timeout=TIMEOUT_S) -> subprocess.CompletedProcess:
  """`python train.py *args` as a process of its own, forked from one that
  imported train.py's libraries already (`fork_server`: 3.5 s of imports
  each, most of a failing run's time)."""
  cmd = ["train.py", *args]
  try:
    return fork_server.run(cmd, env, cwd=REPO, preload=fork_server.TRAINING, text=True,
                           timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"timed out after {timeout}s: {cmd}\n{e.stdout}\n{e.stderr}")


def tiny_flags(**overrides) -> list[str]:
  values = dict(train_worker.TINY_OVERRIDES)
  values.update(overrides)
  return [f"--config.{k}={v}" for k, v in values.items()]


def cache_dir(tmp_path_factory) -> Path:
  """The tests' shared compilation cache (helpers.shared_compilation_cache),
  or one for this run where that is off."""
  return (shared_compilation_cache()
          or tmp_path_factory.getbasetemp() / "jax_compilation_cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 20-step run of the tiny model: (workdir, the finished process)."""
  workdir = tmp_path_factory.mktemp("cli") / "run"
  proc = train_py([f"--workdir={workdir}", "--quiet",
                   *tiny_flags(num_train_steps=20, num_bleu_examples=4, test_report=True)],
                  env_for(cache_dir(tmp_path_factory)))
  return workdir, proc


def test_train_py_trains_and_prints_bleu_and_samples(trained):
  workdir, proc = trained
  assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
  out = proc.stdout
  assert f"Trained 20 steps into {workdir}" in out, out
  summary = next(line for line in out.splitlines() if line.startswith("validation:"))
  assert "loss" in summary and "token accuracy" in summary and "BLEU" in summary \
      and "exact match" in summary, summary
  # One "source / -> translation / (reference: ...)" triple per BLEU example.
  assert out.count("\n    -> ") == 4, out
  assert out.count("(reference: ") == 4, out
  assert "python decode.py --workdir=" in out
  # The report: MFU, the test split (the demo's: 8 pairs in the tiny config), chrF.
  assert re.search(r"^speed: [\d,]+ target tokens/s, MFU \d+%", out, re.M), out
  assert "chrF" in summary
  test_line = next(line for line in out.splitlines() if line.startswith("test ("))
  assert test_line.startswith("test (8 sentences, beam): BLEU "), test_line
  assert f"translations in {workdir}/test_translations.txt" in test_line
  # The overrides reached the run.
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["d_model"] == 32 and saved["num_train_steps"] == 20
  assert saved["num_bleu_examples"] == 4
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  final = [r for r in records if r["split"] == "eval"][-1]
  assert final["step"] == 20 and 0.0 <= final["bleu"] <= 100.0
  assert 0.0 <= final["exact_match"] <= 1.0


CHEAP = ["--config.data.demo_num_train=300", "--config.vocab_size=128"]


@pytest.mark.parametrize("args, expected", [
    (["--config.model.d_model=30", "--config.model.num_heads=4"], ["d_model=30", "num_heads=4"]),
    (["--config.data.source=nope"], ["config.data.source", "nope"]),
    (["--config.model.bogus=1"], ["--config.model.bogus", "'bogus'"]),
    (["--config.num_train_step=5"], ["--config.num_train_step", "num_train_steps"]),
    (["--config=configs/default.py", "--config.model.bogus.deeper=1"],
     ["--config.model.bogus.deeper"]),
    (["--config.num_train_steps=0"], ["config.num_train_steps=0"]),
    (["--config.batch_size=lots"], ["--config.batch_size"]),
], ids=["heads_do_not_divide_d_model", "unknown_source", "unknown_model_field",
        "misspelt_field", "unknown_field_with_config_file", "zero_steps", "not_a_number"])
def test_bad_options_exit_with_a_one_line_error(args, expected, tmp_path):
  proc = train_py([f"--workdir={tmp_path / 'run'}", "--quiet", *args, *CHEAP], env_for())
  assert proc.returncode != 0, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith(("error:", "FATAL"))]
  assert len(errors) == 1, proc.stderr
  for text in expected:
    assert text in errors[0], errors[0]
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_xla_flag_this_xla_lacks_is_one_line_before_anything_is_written(tmp_path):
  """XLA would stop the process at its first computation, in its own C++ log
  (runtime/xla_flags.py); train.py says it first, in one line, exit status 2."""
  env = env_for()
  env["XLA_FLAGS"] += " --xla_no_such_flag_anywhere=1"
  proc = train_py([f"--workdir={tmp_path / 'run'}", "--quiet", *CHEAP], env)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("error: $XLA_FLAGS sets --xla_no_such_flag_anywhere=1, which "
                             "this XLA"), proc.stderr
  assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------
# Faults a user meets: one clear line each, nothing lost
# ----------------------------------------------------------------------------


def one_error_line(proc) -> str:
  """The process failed with exactly one "error:" line on the console and no
  traceback (of its own or of a library's threads); that line."""
  assert proc.returncode == 1, proc.stdout + proc.stderr[-5000:]
  for noise in ("Traceback", "Event loop is closed", "strict=False", "RESOURCE_EXHAUSTED"):
    assert noise not in proc.stderr, proc.stderr[-5000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, proc.stderr[-5000:]
  return errors[0]


def copy_of(trained, tmp_path) -> Path:
  workdir, proc = trained
  assert proc.returncode == 0, proc.stderr[-5000:]
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  return copy


def test_a_second_run_on_a_held_workdir_stops_at_once(tmp_path):
  """Two runs on one workdir: the second stops before writing anything,
  naming the holder (here this test process, holding the lock)."""
  from transformer.runtime import run_lock, workdir as workdir_lib
  workdir = tmp_path / "run"
  workdir.mkdir()
  with run_lock.hold(str(workdir)):
    proc = train_py([f"--workdir={workdir}", "--quiet", *tiny_flags()], env_for())
  error = one_error_line(proc)
  assert f"workdir {workdir} is in use by another training run" in error
  assert f"PID {os.getpid()} on host {socket.gethostname()}" in error
  assert [p.name for p in workdir.iterdir()] == [workdir_lib.LOCK_FILE]


def test_a_changed_config_stops_with_the_differences_and_the_ways_out(trained, tmp_path):
  workdir = copy_of(trained, tmp_path)
  before = (workdir / "config.json").read_text()
  proc = train_py([f"--workdir={workdir}", "--quiet",
                   *tiny_flags(num_train_steps=30, num_bleu_examples=4,
                               **{"model.d_model": 64, "vocab_size": 100})], env_for())
  one_error_line(proc)
  message = proc.stderr[proc.stderr.index("error:"):]
  assert "  model.d_model: 32 -> 64\n" in message and "  vocab_size: 128 -> 100\n" in message
  assert "num_train_steps: " not in message                     # (it may change)
  assert "new --workdir" in message and "drop these overrides" in message
  assert (workdir / "config.json").read_text() == before        # nothing written


def test_a_checkpoint_that_does_not_fit_is_one_line(trained, tmp_path):
  """A config.json that passes the check but checkpoints of another shape
  (a workdir edited by hand, say): one line naming the arrays, no orbax
  advice, no tracebacks of its threads; the traceback in train.log."""
  workdir = copy_of(trained, tmp_path)
  config = json.loads((workdir / "config.json").read_text())
  config["model"]["d_model"] = 64
  (workdir / "config.json").write_text(json.dumps(config))
  proc = train_py([f"--workdir={workdir}", "--quiet",
                   *tiny_flags(num_train_steps=20, num_bleu_examples=4, **{"model.d_model": 64})],
                  env_for())
  error = one_error_line(proc)
  assert f"Could not restore {workdir}/checkpoints/20" in error, error
  assert "params.decoder.layers_0.cross_attention.key.bias is (2, 16) there, (2, 32) here" \
      in error, error
  log = (workdir / "train.log").read_text()
  assert "run stopped by ValueError" in log and "Traceback" in log


FAIL_AFTER_A_SAVE = """
import runpy, sys
from transformer.runtime import checkpoints
save = checkpoints.Checkpointer.save
def save_then_fail(self, *args, **kwargs):
  if save(self, *args, **kwargs):
    raise RuntimeError("injected while a save is in flight")
  return False
checkpoints.Checkpointer.save = save_then_fail
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_an_unexpected_error_is_one_line_and_its_traceback_is_in_the_log(tmp_path_factory,
                                                                          tmp_path):
  """A bug (here injected right after a checkpoint save started): one line
  saying where the traceback is; the save in flight still completes."""
  workdir = tmp_path / "run"
  cmd = ["-c", FAIL_AFTER_A_SAVE, f"--workdir={workdir}", "--quiet",
         *tiny_flags(num_train_steps=10, checkpoint_every=5)]
  proc = fork_server.run(cmd, env_for(cache_dir(tmp_path_factory)), cwd=REPO,
                         preload=fork_server.TRAINING, text=True, timeout=TIMEOUT_S)
  error = one_error_line(proc)
  assert error == (f"error: RuntimeError: injected while a save is in flight; the full "
                   f"traceback is in {workdir}/train.log (include it in a bug report)")
  log = (workdir / "train.log").read_text()
  assert "Traceback" in log and "RuntimeError: injected while a save is in flight" in log
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["5"]


def test_a_workdir_that_cannot_be_made_is_one_line_naming_it(tmp_path):
  """A user's mistake, not a bug: the path and the reason, no bug-report advice."""
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  proc = train_py([f"--workdir={blocker}/run", "--quiet", *tiny_flags()], env_for())
  error = one_error_line(proc)
  assert error == (f"error: {blocker}/run: Not a directory; check the path and its "
                   f"permissions (--workdir={blocker}/run)")


FAIL_BEFORE_THE_WORKDIR = """
import runpy, sys
from transformer.training import loop as training
def fail(*args, **kwargs):
  raise RuntimeError("injected before the workdir exists")
training.train_and_evaluate = fail
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_bug_before_the_run_has_a_log_prints_its_traceback(tmp_path):
  """With no train.log to hold it, the traceback of a bug goes to the console
  (above the one error line), so that nothing a bug report needs is lost."""
  workdir = tmp_path / "run"
  proc = fork_server.run(["-c", FAIL_BEFORE_THE_WORKDIR, f"--workdir={workdir}", "--quiet"],
                         env_for(), cwd=REPO, preload=fork_server.TRAINING, text=True,
                         timeout=TIMEOUT_S)
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" in proc.stderr and "in fail" in proc.stderr, proc.stderr
  assert proc.stderr.rstrip().splitlines()[-1] == (
      "error: RuntimeError: injected before the workdir exists (include it in a bug report)")
  assert not workdir.exists()


@pytest.mark.parametrize("disk_kib, room_for_one", [(1600, True), (600, False)],
                         ids=["caught_before_writing", "caught_when_a_write_fails"])
def test_a_full_disk_is_one_message(disk_kib, room_for_one, tmp_path_factory, tmp_path):
  """On a small tmpfs (the vocabulary takes ~240 kB, a checkpoint 500-750 kB
  on disk, which varies from run to run): with room for one or two
  checkpoints, the next is refused before it is written; with room for none,
  the first fails in orbax's threads. Either way one message: where, the
  bytes needed and free, the last complete checkpoint, what to do; nothing
  half-written left."""
  with small_disk(tmp_path / "disk", disk_kib) as disk:
    workdir = disk / "run"
    proc = train_py([f"--workdir={workdir}", "--quiet",
                     *tiny_flags(num_train_steps=40, checkpoint_every=5)],
                    env_for(cache_dir(tmp_path_factory)))
    error = one_error_line(proc)
    refused = re.match(r"error: The disk is full: the checkpoint of step (\d+) ", error)
    assert refused, error
    refused_step = int(refused.group(1))
    assert (re.search(rf"needs about [^;]* in {workdir}/checkpoints and [^;]* are free; ", error)
            or re.search(rf"did not fit in {workdir}/checkpoints, where [^;]* were free", error)), \
        error
    names = sorted((p.name for p in (workdir / "checkpoints").iterdir()), key=int)
    if room_for_one:
      last_step = refused_step - 5
      assert last_step >= 5, error
      assert "nothing was written" in error
      assert f"The last complete checkpoint is step {last_step}." in error
      assert "keep fewer with config.keep_checkpoints, now 3" in error
      assert names == [str(s) for s in range(5, last_step + 1, 5)][-3:]
    else:
      assert refused_step == 5, error
      assert f"its unfinished {refused_step}.orbax-checkpoint-tmp was removed" in error
      assert "The last complete checkpoint is none." in error
      assert names == []
    assert "run stopped by DiskFullError" in (workdir / "train.log").read_text()
