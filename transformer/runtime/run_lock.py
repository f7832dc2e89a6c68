"""One training run at a time in a workdir: `hold` takes an OS file lock on
<workdir>/train.lock (so that a run killed with SIGKILL leaves no stale lock);
a second run stops at once with `WorkdirLocked`, naming the holder. Readers
(decode.py, the loader) take no lock: they read finished checkpoints only."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat

import jax

from transformer.runtime import multihost
from transformer.runtime import workdir as workdir_lib
from transformer.runtime.workdir import LOCK_FILE

logger = logging.getLogger(__name__)


class WorkdirLocked(RuntimeError):
  """Another training run holds the workdir (`hold`); `holder` is what it
  wrote in the lock file ({"pid", "host", "started"}, {} if unreadable).
  `elsewhere`: this process's workdir is free, another process's is not
  (processes with a workdir each)."""

  def __init__(self, workdir: str, holder: dict, *, elsewhere: bool = False):
    holder = _shown_holder(holder)
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
    if workdir_lib.is_local(workdir):
      try:
        fd = _lock(os.path.join(workdir, LOCK_FILE))
      except (WorkdirLocked, LockFileRefused) as e:
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
  # Never through a symbolic link, never into anything but a plain file: a
  # workdir from elsewhere could hold a train.lock that points at a file of
  # this user's, which the lock would then empty and write.
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise LockFileRefused(path, "is a symbolic link") from None
    raise
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise LockFileRefused(path, "is not a plain file")
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
  """What the holder wrote in the lock file; {} if it has not yet (or cannot be
  read). At most MAX_HOLDER_BYTES are read, never through a symbolic link nor
  from anything but a plain file."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
      if not stat.S_ISREG(os.fstat(fd).st_mode):
        return {}
      holder = json.loads(f.read(MAX_HOLDER_BYTES).decode("utf-8") or "{}")
    return holder if isinstance(holder, dict) else {}
  except (OSError, ValueError):
    return {}


MAX_HOLDER_BYTES = 4096  # {"pid", "host", "started"}: a line of JSON


def _shown_holder(holder: dict) -> dict:
  """The holder's fields as a message may show them: the PID an integer, the
  host and start time short printable strings; anything else left out (the
  lock file may have come with the workdir)."""
  shown = {}
  if isinstance(holder.get("pid"), int) and not isinstance(holder.get("pid"), bool):
    shown["pid"] = holder["pid"]
  for name in ("host", "started"):
    value = holder.get(name)
    if isinstance(value, str) and value.isprintable() and 0 < len(value) <= 100:
      shown[name] = value
  return shown


class LockFileRefused(ValueError):
  """<workdir>/train.lock is a symbolic link or not a plain file: not locked,
  not written (one sentence naming it and what to do)."""

  def __init__(self, path: str, problem: str):
    super().__init__(f"{path} {problem}; a workdir's lock file is a plain file train.py "
                     "creates. Remove it (it holds no data) and train again.")
