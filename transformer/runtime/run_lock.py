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

import jax

from transformer.runtime import multihost
from transformer.runtime.workdir import LOCK_FILE

logger = logging.getLogger(__name__)


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
