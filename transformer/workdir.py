"""What a run directory (the workdir) holds, and how to load a translator from it.

train.py writes, and decode.py, the Python API (`transformer.load_translator`)
and the notebook read::

    <workdir>/config.json            the full training config (CONFIG_FILE)
    <workdir>/model_config.json      the TransformerConfig (MODEL_CONFIG_FILE)
    <workdir>/vocab.model            the SentencePiece vocabulary (VOCAB_FILE)
    <workdir>/checkpoints/           orbax checkpoints (checkpoints.CHECKPOINT_DIR)
    <workdir>/checkpoints_averaged/  the average of the last ones (checkpoints.AVERAGED_DIR)
    <workdir>/metrics.jsonl, tensorboard/   metrics (see metrics.py)
    <workdir>/train.lock             held by the run training here (LOCK_FILE)
    <workdir>/train.log              that run's log and the traceback of a fatal
                                     error, appended run after run (LOG_FILE)

The vocabulary rule: <workdir>/vocab.model, which train.py always writes (a copy
of config.vocab_path when that is set, so that the workdir alone is enough to
decode); a workdir without it (one whose vocab.model was deleted, or written
before train.py made that copy) falls back to the vocab_path in its config.json.

Which checkpoint: "auto" (the averaged one if there is one, else the latest),
"averaged", "latest", or a step number; `resolve_checkpoint` turns that into
"averaged" or a step, or an error that says what is missing and what to do.

Every file written here is written whole or not at all (`multihost.write_file`).
Workdirs may be local paths or addresses such as gs://bucket/run: files are
read and written through `etils.epath` (`multihost.resolve`), as orbax does;
the lock and the run's log, which need a local file system, are skipped
elsewhere, with a note.

One run at a time: `hold` locks the workdir for a training run (an OS file
lock on train.lock, so that a run killed with SIGKILL leaves no stale lock);
a second run stops at once, naming the holder. Readers (decode.py, the
loader) take no lock: they read finished checkpoints only.

A resumed run keeps what its checkpoints were trained with: `check_config`
compares the config with the workdir's config.json before anything is
loaded; only RESUMABLE_FIELDS may change.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import logging
import os
import socket
import sys

import jax
from etils import epath

from transformer import averaging, checkpoints, multihost
from transformer.model import TransformerConfig, init_params
from transformer.tokenizer import load_tokenizer
from transformer.translation import OptionError, Translator

CONFIG_FILE = "config.json"
MODEL_CONFIG_FILE = "model_config.json"
VOCAB_FILE = "vocab.model"
LOCK_FILE = "train.lock"
LOG_FILE = "train.log"
CHECKPOINT_CHOICES = ("auto", "averaged", "latest")  # or a step number

# The config fields a run may change when it resumes a workdir. None of them
# enters a training step, so a resumed run still ends with the parameters of
# an uninterrupted one: how long to train (num_train_steps; the learning rate
# does not depend on it), what is measured and logged, and when and how many
# checkpoints are kept and averaged; data.tfds_data_dir says where TFDS keeps
# its prepared files, not which data. Every other field must match
# (`check_config`): model.* (the parameters' shapes and what they compute),
# data.* and vocab_* (which sentences, which pieces), batch_size, max_length,
# pack, grad_accum_steps and seed (which batches in which order: the data
# position saved in a checkpoint means nothing in another pipeline), and the
# update rule (warmup_steps, learning_rate_scale, adam_*, label_smoothing,
# grad_clip_norm); so does any field not listed here, new ones included.
RESUMABLE_FIELDS = (
    "num_train_steps", "train_minutes", "test_report", "test_decode_method",
    "data.test_path", "data.test_src", "data.test_tgt", "data.tfds_test_split",
    "log_every", "eval_every", "eval_batch_size", "num_eval_examples",
    "num_bleu_examples", "eval_decode_method", "eval_beam_size",
    "checkpoint_every", "keep_checkpoints", "average_last",
    "data.tfds_data_dir", "state_sharding",
)

logger = logging.getLogger(__name__)


class CheckpointNotFound(FileNotFoundError):
  """The checkpoint asked for is not in the workdir. `str(e)` reads
  "checkpoint=<which>: <problem>"; `option`, `value` and `problem` are kept
  apart, as in `translation.OptionError`, so that a command line can name its
  flag instead (decode.py: "--checkpoint=<which>: ...")."""

  def __init__(self, value, problem: str):
    super().__init__(f"checkpoint={value}: {problem}")
    self.option, self.value, self.problem = "checkpoint", value, problem


def _train_hint(workdir: str) -> str:
  return f"train a model first: python train.py --workdir={workdir}"


# ----------------------------------------------------------------------------
# Configs and vocabulary
# ----------------------------------------------------------------------------


def save_configs(workdir: str, config: dict, model_config: TransformerConfig) -> None:
  """Writes config.json (the training config, as a dict) and model_config.json."""
  for name, value in ((CONFIG_FILE, config), (MODEL_CONFIG_FILE, model_config.to_dict())):
    multihost.write_file(os.path.join(workdir, name),
                         json.dumps(value, indent=2, sort_keys=True))


def load_model_config(workdir: str) -> TransformerConfig:
  """The TransformerConfig saved in `workdir`.

  Raises:
    FileNotFoundError: no model_config.json (not a workdir written by train.py).
    ValueError: it is not a valid model config (edited by hand, truncated).
  """
  path = _model_config_path(workdir)
  try:
    return TransformerConfig.from_dict(json.loads(epath.Path(path).read_text()))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{path} is not a valid model config ({e}); it is written by "
                     "train.py, do not edit it") from None


def _model_config_path(workdir: str) -> str:
  """<workdir>/model_config.json, or FileNotFoundError if it is not there."""
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"{path} not found: {workdir} is not a workdir written by "
                            f"train.py; {_train_hint(workdir)}")
  return path


def vocab_path(workdir: str) -> str:
  """The workdir's vocabulary file (the rule is in the module docstring).

  Raises FileNotFoundError naming what is missing and what to do.
  """
  path = os.path.join(workdir, VOCAB_FILE)
  if epath.Path(path).exists():
    return path
  configured = ""
  try:
    configured = json.loads(
        epath.Path(os.path.join(workdir, CONFIG_FILE)).read_text()).get("vocab_path") or ""
  except (OSError, ValueError):
    pass
  if configured and os.path.exists(configured):
    return configured
  also = f" (nor the config's vocab_path {configured})" if configured else ""
  raise FileNotFoundError(f"{path} not found{also}: the vocabulary is missing; "
                          f"{_train_hint(workdir)} (it writes {VOCAB_FILE} first)")


def check_files(workdir: str) -> None:
  """Checks that `workdir` holds a model config and a vocabulary, without
  loading anything (decode.py calls it before reading its input).

  Raises FileNotFoundError naming the first thing missing and what to do.
  """
  if not epath.Path(workdir).is_dir():
    raise FileNotFoundError(f"workdir {workdir} does not exist; {_train_hint(workdir)}")
  _model_config_path(workdir)
  vocab_path(workdir)


# ----------------------------------------------------------------------------
# One run at a time
# ----------------------------------------------------------------------------


class WorkdirLocked(RuntimeError):
  """Another training run holds the workdir (`hold`); `holder` is what it
  wrote in the lock file ({"pid", "host", "started"}, {} if unreadable).
  `elsewhere`: this process's workdir is free, another process's is not
  (processes with a workdir each)."""

  def __init__(self, workdir: str, holder: dict, *, elsewhere: bool = False):
    who = (f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}"
           + (f", started {holder['started']}" if holder.get("started") else ""))
    if elsewhere:
      problem = ("the workdir of another process of this run is in use by another training "
                 f"run (that process's error names it; {workdir}, this process's, is free)")
    else:
      problem = f"workdir {workdir} is in use by another training run ({who})"
    super().__init__(
        f"{problem}. Wait for it to "
        "finish or stop it, or train into another --workdir. (decode.py may read a "
        "workdir while it trains.)")
    self.workdir, self.holder = workdir, holder


@contextlib.contextmanager
def hold(workdir: str, *, shared: bool = True):
  """Holds `workdir` for one training run: the first thing a run does there,
  before it writes anything.

  On the local file system this is an OS lock (`fcntl.flock`) on
  <workdir>/train.lock, which holds the holder's PID, host and start time
  for the message a second run prints; the OS drops the lock when its
  process ends, however it ends, so a run killed with SIGKILL leaves no stale
  lock and the lock file itself is never deleted (deleting it would let two
  runs lock two different files). With several processes (hosts) sharing
  the workdir, process 0 locks it; with a workdir each (`shared=False`,
  `multihost.workdirs_shared`) each locks its own; all stop if one cannot. A
  file system without locks (some network or FUSE mounts) gets a warning and
  no lock; an object store (gs://...) a note and no lock.

  Raises WorkdirLocked naming the holder.
  """
  fd = None
  refused = None
  if jax.process_index() == 0 or not shared:
    if multihost.is_local(workdir):
      try:
        fd = _lock(os.path.join(workdir, LOCK_FILE))
      except WorkdirLocked as e:
        refused = e
    else:
      logger.info("%s is not on a local file system: it cannot be locked; make sure no "
                  "other run trains in it.", workdir)
  if jax.process_count() > 1 and shared:
    import numpy as np
    from jax.experimental import multihost_utils
    locked = bool(multihost_utils.broadcast_one_to_all(np.int32(refused is None)))
    if not locked and refused is None:  # (process 0 could not lock it)
      refused = WorkdirLocked(workdir, _lock_holder(os.path.join(workdir, LOCK_FILE)))
  elif jax.process_count() > 1:
    if not multihost.all_processes(refused is None) and refused is None:
      refused = WorkdirLocked(workdir, {}, elsewhere=True)
  if refused is not None:
    _unlock(fd)
    raise refused
  try:
    yield
  finally:
    if fd is not None:
      _unlock(fd)


def _lock(path: str) -> int | None:
  """The open, locked lock file (its descriptor), its content this process's
  PID, host and time; None where the file system has no locks."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise WorkdirLocked(os.path.dirname(path), _lock_holder(path)) from None
    logger.warning("Cannot lock %s (%s): make sure no other run trains in this workdir.",
                   path, e)
    return None
  holder = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
  os.ftruncate(fd, 0)
  os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
  return fd


def _unlock(fd: int | None) -> None:
  if fd is None:
    return
  os.ftruncate(fd, 0)  # (no stale PID for a reader to trust)
  fcntl.flock(fd, fcntl.LOCK_UN)
  os.close(fd)


def _lock_holder(path: str) -> dict:
  """What the holder wrote in the lock file; {} if it has not yet (or cannot be read)."""
  try:
    with open(path) as f:
      holder = json.loads(f.read() or "{}")
    return holder if isinstance(holder, dict) else {}
  except (OSError, ValueError):
    return {}


# ----------------------------------------------------------------------------
# Config changes on resume
# ----------------------------------------------------------------------------


class ConfigMismatch(ValueError):
  """The config differs from the workdir's config.json in fields that must
  match (`check_config`); `differences` lists (field, stored, requested)."""

  def __init__(self, workdir: str, differences: list[tuple[str, object, object]]):
    lines = "\n".join(f"  {name}: {_show(stored)} -> {_show(requested)}"
                      for name, stored, requested in differences)
    super().__init__(
        f"{workdir} was trained with another config ({os.path.join(workdir, CONFIG_FILE)}): "
        f"its checkpoints resume only with the same model, vocabulary, data, batches and "
        f"optimizer, and these fields differ (stored -> requested):\n{lines}\n"
        f"Either train into a new --workdir, or drop these overrides to resume {workdir} "
        f"as it was. (Only {', '.join(RESUMABLE_FIELDS)} may change on resume.)")
    self.workdir, self.differences = workdir, differences


_MISSING = object()


def _show(value) -> str:
  return "(not set)" if value is _MISSING else json.dumps(value)


def check_config(workdir: str, config: dict) -> list[tuple[str, object, object]]:
  """Compares `config` (this run's, as a dict) with the workdir's config.json
  before anything is loaded, restored or compiled: it reads one JSON file.

  Returns the fields that differ and may (RESUMABLE_FIELDS), as (field,
  stored, requested); [] for a new workdir.
  Raises ConfigMismatch listing every other differing field.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  if not epath.Path(path).exists():
    return []
  try:
    stored = _flatten(json.loads(epath.Path(path).read_text()))
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e}); it is written by train.py, do not "
                     "edit it (move it away to start this workdir's config afresh)") from None
  requested = _flatten(json.loads(json.dumps(config)))  # tuples -> lists, as stored
  changed = [(name, stored.get(name, _MISSING), requested.get(name, _MISSING))
             for name in sorted(set(stored) | set(requested))
             if stored.get(name, _MISSING) != requested.get(name, _MISSING)]
  refused = [c for c in changed if c[0] not in RESUMABLE_FIELDS]
  if refused:
    raise ConfigMismatch(workdir, refused)
  return changed


def _flatten(tree: dict, prefix: str = "") -> dict:
  """{"model": {"d_model": 64}} -> {"model.d_model": 64}."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


# ----------------------------------------------------------------------------
# The run's log
# ----------------------------------------------------------------------------


def log_path(workdir: str) -> str:
  """<workdir>/train.log (process 0), train.process_<i>.log (the others)."""
  index = jax.process_index()
  name = LOG_FILE if index == 0 else f"{os.path.splitext(LOG_FILE)[0]}.process_{index}.log"
  return os.path.join(workdir, name)


@contextlib.contextmanager
def run_log(workdir: str):
  """Appends the run's log records to `log_path(workdir)` while it lasts (all
  that reach the root logger at the loggers' levels: train.py's INFO lines,
  libraries' warnings and errors with their tracebacks) and, when the run
  ends with an exception, its full traceback: a fatal error's console message
  is one line, and this file is what a bug report needs. Best effort: a line
  that cannot be written (a full disk) is dropped, not reported.

  Exceptions Python cannot raise anywhere ("unraisable": after orbax gives up
  on a failed save, tensorstore's late callbacks find its event loop closed
  and print "RuntimeError: Event loop is closed" tracebacks) go here too,
  not to the console, while the run lasts."""
  path = log_path(workdir)
  if not multihost.is_local(path):  # (an object store cannot append)
    logger.info("The run's log is not written to %s (not a local file system); "
                "logging to the console only.", path)
    yield None
    return
  try:
    handler = _QuietFileHandler(path, encoding="utf-8")
  except OSError as e:
    logger.warning("Cannot write the run's log %s (%s); logging to the console only.", path, e)
    yield None
    return
  handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
  root = logging.getLogger()
  root.addHandler(handler)
  handler.note(logging.INFO, f"run started: PID {os.getpid()} on {socket.gethostname()}: "
               f"{' '.join(sys.argv)}")
  unraisable_hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: handler.note(
      logging.WARNING, f"{unraisable.err_msg or 'Exception ignored'} in {unraisable.object!r} "
      "(a late callback in a library's thread)",
      exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
  try:
    yield path
    handler.note(logging.INFO, "run finished")
  except KeyboardInterrupt:
    handler.note(logging.WARNING, "run interrupted (KeyboardInterrupt)")
    raise
  except BaseException as e:
    handler.note(logging.ERROR, f"run stopped by {type(e).__name__}: {e}",
                 exc_info=(type(e), e, e.__traceback__))
    raise
  finally:
    sys.unraisablehook = unraisable_hook
    root.removeHandler(handler)
    handler.close()


class _QuietFileHandler(logging.FileHandler):
  """A FileHandler that drops what it cannot write instead of printing a
  "--- Logging error ---" traceback to the console (on a full disk, say)."""

  def handleError(self, record):
    del record

  def note(self, level: int, message: str, exc_info=None) -> None:
    """Writes `message` to this file only (not to the console's handlers)."""
    self.handle(logging.makeLogRecord({
        "name": __name__, "levelno": level, "levelname": logging.getLevelName(level),
        "msg": message, "exc_info": exc_info}))


# ----------------------------------------------------------------------------
# Which checkpoint
# ----------------------------------------------------------------------------


def checkpoint_choice(which: str | int) -> str | int:
  """`which` as "auto", "averaged", "latest" or a step (int); a step may be
  given as a string of digits (a command-line flag).

  Raises OptionError for anything else.
  """
  if isinstance(which, str) and which.isascii() and which.isdigit():
    return int(which)
  if which in CHECKPOINT_CHOICES or (isinstance(which, int) and which >= 0):
    return which
  raise OptionError("checkpoint", which, "choose auto, averaged, latest or a step number")


def resolve_checkpoint(workdir: str, which: str | int = "auto") -> str | int:
  """The checkpoint `which` names in `workdir`: "averaged" or a step number.

  Reads only directory listings (nothing is loaded).
  Raises:
    OptionError: `which` is not a checkpoint choice (`checkpoint_choice`).
    CheckpointNotFound: the averaged checkpoint or that step is not there.
    FileNotFoundError: there is no checkpoint at all.
  """
  which = checkpoint_choice(which)
  ckpt_dir = os.path.join(workdir, checkpoints.CHECKPOINT_DIR)
  averaged_dir = os.path.join(workdir, checkpoints.AVERAGED_DIR)
  has_averaged = bool(checkpoints.checkpoint_steps(workdir, checkpoints.AVERAGED_DIR))
  if which == "auto":
    which = "averaged" if has_averaged else "latest"
  if which == "averaged":
    if not has_averaged:
      raise CheckpointNotFound(
          which, f"no averaged checkpoint in {averaged_dir} (train.py writes one at the "
          "end when --config.average_last > 1); use checkpoint=latest or a step number")
    return "averaged"
  steps = checkpoints.checkpoint_steps(workdir)
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {ckpt_dir}: {_train_hint(workdir)} (it "
                            "saves every --config.checkpoint_every steps and at the end)")
  if which == "latest":
    return steps[-1]
  if which not in steps:
    raise CheckpointNotFound(which, f"no checkpoint for step {which} in {ckpt_dir}; "
                             f"available steps: {steps} (or use checkpoint=auto)")
  return which


# ----------------------------------------------------------------------------
# The one loader
# ----------------------------------------------------------------------------


def load_translator(workdir: str, checkpoint: str | int = "auto", *,
                    with_info: bool = False):
  """A Translator for a workdir written by train.py.

  Args:
    workdir: holds model_config.json, the vocabulary and checkpoints.
    checkpoint: "auto" (the averaged checkpoint if any, else the latest),
      "averaged", "latest", or a step number.
    with_info: also return what was loaded: `averaging.load_params`' info
      ("kind": "averaged" | "step", "step", "path", and "averaged_steps").
  Returns:
    The Translator, or (Translator, info) with `with_info=True`.
  Raises:
    FileNotFoundError (CheckpointNotFound among them) naming what is missing
    and what to do; ValueError for files that cannot be read (OptionError for
    a `checkpoint` that is no choice).
  """
  check_files(workdir)
  which = resolve_checkpoint(workdir, checkpoint)
  workdir = str(multihost.resolve(workdir))  # orbax restores only from absolute paths
  model_config = load_model_config(workdir)
  tokenizer = load_tokenizer(vocab_path(workdir))
  target = jax.eval_shape(functools.partial(init_params, model_config), jax.random.key(0))
  try:
    params, info = averaging.load_params(workdir, target, which=which, with_info=True)
  except FileNotFoundError as e:  # (a checkpoint deleted since it was listed)
    raise FileNotFoundError(f"cannot load the parameters: {e}") from e
  except ValueError as e:
    raise ValueError(f"cannot load the parameters: {e}") from e
  translator = Translator(model_config, params, tokenizer)
  return (translator, info) if with_info else translator
