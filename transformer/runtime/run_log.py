"""The run's log: <workdir>/train.log, appended run after run, with every log
record of the run and, when a run dies, its full traceback (the console gets
one line; this file is what a bug report needs)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

import jax

from transformer.data import text_io
from transformer.runtime import preemption
from transformer.runtime import workdir as workdir_lib
from transformer.runtime.workdir import LOG_FILE

logger = logging.getLogger(__name__)


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
  if not workdir_lib.is_local(path):  # (an object store cannot append)
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
  except preemption.Preempted as e:
    handler.note(logging.WARNING, f"run stopped: {e}")
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

  def _open(self):
    """The log opened as `text_io.open_for_append` does: never through a
    link that a received workdir planted."""
    return text_io.open_for_append(self.baseFilename)

  def note(self, level: int, message: str, exc_info=None) -> None:
    """Writes `message` to this file only (not to the console's handlers)."""
    self.handle(logging.makeLogRecord({
        "name": __name__, "levelno": level, "levelname": logging.getLevelName(level),
        "msg": message, "exc_info": exc_info}))
