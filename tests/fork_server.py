"""Runs `python train.py ...` / `python decode.py ...` as processes forked
from one that has imported their libraries already.

A test of a command's options or faults needs a process of its own (its exit
status, its console, its signal handlers, glibc's settings), but not a new
interpreter importing jax, flax, optax and orbax again: most of a failing
command's time (docs/benchmarks.md, "How long the test suite takes"). Here a server process, started with the
test's environment, imports them once; each command is then a `fork` of it
that runs the script as `__main__` with its own argv, working directory and
standard streams, and exits with the script's status, as `python script`
would. Nothing has started JAX's backend (nor any thread) in the server, so
each child starts its devices, XLA flags and compilation cache afresh.

What differs from a new interpreter, so that tests of these do not use it:
the preloaded modules are in `sys.modules` from the start (a test of what a
command imports starts a real process), and a child's start-up time is not a
real start's.

    result = fork_server.run(["train.py", "--workdir=W"], env, cwd=REPO,
                             preload=fork_server.TRAINING)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# What each kind of command imports before its first line runs.
TRAINING = ("absl.app", "ml_collections.config_flags", "transformer.training.loop")
DECODING = ("absl.app", "jax", "orbax.checkpoint")

_MAX_IDLE = 3  # servers kept waiting in a test process (each holds its imports in memory)
_idle: list[tuple[tuple, "_Server"]] = []  # (key, server), the most recently used last
_idle_lock = threading.Lock()


@atexit.register
def _close_all() -> None:
  with _idle_lock:
    while _idle:
      _idle.pop()[1].close()


class _Server:
  """One server process: `preload` imported under `env`, then one child at a time."""

  def __init__(self, env: dict[str, str], preload: tuple[str, ...]):
    self._responses, write_end = os.pipe()
    self._log = tempfile.TemporaryFile()
    self.process = subprocess.Popen(
        [sys.executable, __file__, str(write_end), *preload], stdin=subprocess.PIPE,
        stdout=self._log, stderr=self._log, env=env, pass_fds=(write_end,))
    os.close(write_end)
    self._buffer = b""
    ready = self._read(timeout=120)
    if ready != {"ready": True}:
      self._log.seek(0)
      raise RuntimeError(f"the fork server did not start: {ready}\n"
                         f"{self._log.read().decode(errors='replace')[-3000:]}")

  def _read(self, timeout: float | None):
    """The next JSON line the server writes, or None after `timeout` seconds."""
    while b"\n" not in self._buffer:
      ready, _, _ = select.select([self._responses], [], [], timeout)
      if not ready:
        return None
      chunk = os.read(self._responses, 4096)
      if not chunk:
        return {"server ended": self.process.wait()}
      self._buffer += chunk
    line, self._buffer = self._buffer.split(b"\n", 1)
    return json.loads(line)

  def run(self, argv: list[str], env: dict[str, str], cwd: str, stdin: bytes,
          timeout: float):
    with tempfile.TemporaryDirectory(prefix="forked-") as files:
      paths = {name: os.path.join(files, name) for name in ("stdin", "stdout", "stderr")}
      with open(paths["stdin"], "wb") as f:
        f.write(stdin)
      request = {"argv": argv, "env": dict(env), "cwd": str(cwd), **paths}
      self.process.stdin.write((json.dumps(request) + "\n").encode())
      self.process.stdin.flush()
      pid = self._read(timeout=60)["pid"]
      done = self._read(timeout)
      timed_out = done is None
      if timed_out:
        os.kill(pid, signal.SIGKILL)
        done = self._read(timeout=60)
      with open(paths["stdout"], "rb") as out, open(paths["stderr"], "rb") as err:
        stdout, stderr = out.read(), err.read()
    cmd = [sys.executable, *argv]
    if timed_out:
      raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, done["status"], stdout, stderr)

  def close(self):
    self.process.stdin.close()
    self.process.wait(timeout=60)
    os.close(self._responses)
    self._log.close()


def run(argv: list[str], env: dict[str, str], *, cwd, preload: tuple[str, ...],
        stdin: bytes | str = b"", timeout: float = 600,
        text: bool = False) -> subprocess.CompletedProcess:
  """`subprocess.run([sys.executable, *argv], env=env, cwd=cwd, input=stdin,
  capture_output=True, timeout=timeout, text=text)`, the process forked from a
  server of `env` that imported `preload`. argv[0]: a script's path, or "-c"
  and the code, or "-m" and a module. Raises subprocess.TimeoutExpired (the child killed) as
  `subprocess.run` does."""
  # (pytest names the running test in the environment: not a reason for a server)
  key = (tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")),
         tuple(preload))
  with _idle_lock:  # (an idle server of this key, or a new one: one child per server)
    server = next((s for k, s in reversed(_idle) if k == key), None)
    if server is not None:
      _idle.remove((key, server))
  server = server or _Server(env, tuple(preload))
  if isinstance(stdin, str):
    stdin = stdin.encode()
  try:
    result = server.run(argv, env, cwd, stdin, timeout)
  finally:
    with _idle_lock:
      if server.process.poll() is None:  # (a server that ended is not used again)
        _idle.append((key, server))
      while len(_idle) > _MAX_IDLE:
        _idle.pop(0)[1].close()
  if text:
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
  return result


# -- the server --------------------------------------------------------------


def _child(request: dict, responses: int) -> None:
  """In the forked child: the request's streams, directory and argv, then
  the script as `python` runs it; never returns."""
  import runpy
  import traceback
  os.close(responses)
  written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
  for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", written),
                         (2, "stderr", written)):
    opened = os.open(request[name], mode, 0o600)
    os.dup2(opened, fd)
    os.close(opened)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  argv = request["argv"]
  code = 0
  try:
    if argv[0] == "-c":
      sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
      exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":  # (sys.argv[0] becomes the module's file, as `python -m` makes it)
      sys.argv, sys.path[0] = ["-m", *argv[2:]], os.getcwd()
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
      runpy.run_path(argv[0], run_name="__main__")
  except SystemExit as e:  # (as the interpreter maps it to a status)
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:
    traceback.print_exc()
    code = 1
  # The interpreter's own end: its threads joined, then its exit functions.
  threading._shutdown()
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(code)


def _serve(responses: int, preload: list[str]) -> None:
  import importlib
  for name in preload:
    importlib.import_module(name)
  os.write(responses, b'{"ready": true}\n')
  pending = b""
  while True:
    while b"\n" not in pending:
      chunk = os.read(0, 65536)
      if not chunk:
        return  # (the client closed: done)
      pending += chunk
    line, pending = pending.split(b"\n", 1)
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(request, responses)
    os.write(responses, (json.dumps({"pid": pid}) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    os.write(responses, (json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
             .encode())


if __name__ == "__main__":
  _serve(int(sys.argv[1]), sys.argv[2:])
