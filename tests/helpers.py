"""Helpers shared by the tests that start subprocesses (no JAX import here).

Every subprocess gets a clean environment (CPU only, no JAX_/XLA_ settings or
proxies inherited) and a time limit, so a hang fails its test instead of
blocking CI.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import pickle
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every test's XLA programs are compiled with LLVM's optimizations off, in
# this process (conftest.py) and in subprocesses (`subprocess_env`): the
# models are tiny, so compiling is most of a test's time, and -O0 compiles
# 1.3-1.5x faster (three of the slowest tests: 66 -> 50 s, 2-core AVX-512,
# 2026-11-28). The fused loops are emitted by XLA's older LLVM emitters
# rather than its MLIR fusion emitters: half the compile time again (the
# fixture model's beam, greedy and sampling decoders: 8.7-9.1 -> 4.1-5.3 s of
# XLA compiling, the same translations; 2-core AVX-512, 2026-11-29). XLA's HLO
# passes (fusion, layouts, the numerics they decide) still run; matmuls are the
# same library calls. What users run is compiled with the defaults:
# benchmarks/ measure that, and tests/fixtures/workdir_decode_cli (whose exact
# translations a test pins) was trained with them. XLA drops flags
# between releases and stops a process on one it does not know (jaxlib 0.12
# has no fusion-emitter switch), so each is set only where the installed XLA
# knows it (`fast_compile_flags`).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")

# Cache every compilation, however small or quick (the defaults skip those).
CACHE_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


# One JAX compilation cache for every test process and subprocess, kept across
# runs in the user's cache directory (outside the checkout: a clean clone on
# the same machine finds it), in a folder of its own per jaxlib and CPU (XLA
# compiles for the CPU it runs on: a home shared by two machines keeps two).
# The programs are the same from run to run, so a second run reads them back
# instead of compiling them (docs/testing.md). $TRANSFORMER_TEST_CACHE names
# another folder, or "off". The product's own caches of compiled decoders and
# serving copies stay off (conftest.py: TRANSFORMER_DECODER_CACHE=off), so
# that tests exercise the load path a first start takes; the tests of those
# caches give them directories of their own.
TEST_CACHE_ENV = "TRANSFORMER_TEST_CACHE"
TEST_CACHE_MAX_BYTES = 4 << 30  # the least recently used entries beyond it go at each run


def shared_compilation_cache() -> Path | None:
  """The tests' shared compilation cache (above), or None when it is off."""
  chosen = os.environ.get(TEST_CACHE_ENV, "")
  if chosen.strip().lower() in ("off", "none", "0", "false"):
    return None
  if chosen:
    return Path(chosen).expanduser().resolve()
  import jaxlib.version  # (a version string only: no JAX backend starts)
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
  except OSError:
    flags = ""
  import platform
  cpu = hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "transformer" / "tests" / f"jax-{jaxlib.version.__version__}-{cpu}"


@functools.cache
def fast_compile_flags() -> str:
  """Those of FAST_COMPILE_FLAGS this XLA knows, as an XLA_FLAGS string
  (`runtime/xla_flags.known`: a probe process at the first run on a machine,
  its verdict kept in the shared compilation cache's folder)."""
  from transformer.runtime import xla_flags  # (imports JAX; starts no backend)
  return " ".join(xla_flags.known(list(FAST_COMPILE_FLAGS), shared_compilation_cache()))


def subprocess_env(cache_dir=None, *, fast_compile: bool = True, **extra: str) -> dict[str, str]:
  """The environment of a test subprocess: this one's, minus JAX_/XLA_
  settings and proxies (gRPC would route localhost through one), with the
  repository importable, JAX on CPU, XLA at `fast_compile_flags` unless
  `fast_compile` is False (an XLA_FLAGS in `extra` is added to them), and a
  persistent compilation cache in `cache_dir` (default: the tests' shared
  one, `shared_compilation_cache`); `extra` variables last."""
  env = {k: v for k, v in os.environ.items()
         if "proxy" not in k.lower() and not k.startswith(("JAX_", "XLA_"))}
  env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"  # as conftest.py pins it in-process
  cache_dir = shared_compilation_cache() if cache_dir is None else cache_dir
  if cache_dir is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    for name, value in CACHE_SETTINGS.items():
      env[name.upper()] = str(value)
  extra = dict(extra)
  fast = fast_compile_flags() if fast_compile else ""
  env["XLA_FLAGS"] = f"{fast} {extra.pop('XLA_FLAGS', '')}".strip()
  env.update(extra)
  return env


def run_checked(cmd, env, timeout: float,
                preload: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
  """Runs `cmd` in the repository; fails the test on a timeout or a non-zero
  exit, showing the output. With `preload` (and `cmd` a `sys.executable`
  command), the process is forked from a server that imported those modules
  (`fork_server`)."""
  try:
    if preload is not None:
      import fork_server
      assert cmd[0] == sys.executable, cmd
      proc = fork_server.run(list(map(str, cmd[1:])), env, cwd=REPO, preload=preload,
                             text=True, timeout=timeout)
    else:
      proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"timed out after {timeout}s: {cmd}\n{e.stdout}\n{e.stderr}")
  assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
  return proc


def free_port() -> int:
  """A TCP port free on localhost right now (for jax.distributed's coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_together(commands, env, timeout: float, *, check: bool = True) -> list:
  """Runs `commands` at once in the repository (e.g. the processes of one
  multi-process JAX run) and returns their outputs (stdout and stderr). Fails
  the test on a time-out or (with `check`) a non-zero exit, showing the
  output; without `check`, returns (exit status, output) pairs. No process is
  left behind. `env`: one environment for all, or a list, one per command."""
  envs = env if isinstance(env, list) else [env] * len(commands)
  procs = [subprocess.Popen(cmd, env=cmd_env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for cmd, cmd_env in zip(commands, envs)]
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  except subprocess.TimeoutExpired:
    pytest.fail(f"timed out after {timeout}s: {commands}")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  if not check:
    return [(p.returncode, output) for p, output in zip(procs, outputs)]
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, f"{p.args} failed:\n{output[-5000:]}"
  return outputs


def sigterm_one_once_training(commands, envs, workdir: Path, index: int,
                               timeout: float) -> tuple[list[int], list[str]]:
  """Starts `commands` at once in the repository (one process each, with
  `envs`), waits until the run logs a step into `workdir`/metrics.jsonl,
  sends SIGTERM to process `index` alone and returns every process's (exit
  status, output) as two lists. Fails the test if a process ends first or
  nothing is logged within `timeout`; no process is left behind."""
  procs = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for cmd, env in zip(commands, envs)]
  metrics = Path(workdir) / "metrics.jsonl"
  try:
    deadline = time.monotonic() + timeout
    while not metrics.exists() or not metrics.read_text():
      assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
      assert time.monotonic() < deadline, "the processes did not start training"
      time.sleep(0.05)
    procs[index].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs], outputs


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int):
  """A real full disk for a test: a tmpfs of `size_kib` KiB mounted at
  `path` while the context lasts. Mounting needs root (CAP_SYS_ADMIN) on
  Linux; elsewhere the test is skipped (the full-disk tests that inject the
  OS error at the write still run)."""
  path.mkdir(parents=True, exist_ok=True)
  try:
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired) as e:
    pytest.skip(f"cannot mount a small tmpfs here ({e})")
  if proc.returncode != 0:
    pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=30)


class RunsWhenUnpickled:
  """What a hostile workdir plants: a pickle whose loading runs a shell
  command (here one that creates a marker file)."""

  def __init__(self, marker: str):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {shlex.quote(self.marker)}",))


def hostile_pickle(marker: str | os.PathLike) -> bytes:
  """Bytes that create `marker` when unpickled (`test_signing.py` shows they do)."""
  return pickle.dumps(RunsWhenUnpickled(os.fspath(marker)))


# The ways a received workdir's compiled/ may hold what this machine did not write.
HOSTILE_KINDS = ("pickle", "another key", "truncated", "random bytes")


def hostile_file(kind: str, name: str, stored: bytes, marker: str | os.PathLike) -> bytes:
  """`stored` (the file `name` of a workdir's compiled/) replaced as `kind`
  says: the hostile pickle; that pickle sealed as runtime/signing.py seals,
  under another key; `stored` cut in half; random bytes of its size."""
  from transformer.runtime import signing  # (no JAX)
  payload = hostile_pickle(marker)
  if kind == "pickle":
    return payload
  if kind == "another key":
    tag = hmac.new(os.urandom(signing.KEY_BYTES), name.encode() + b"\0" + payload,
                   hashlib.sha256).digest()
    return signing.MAGIC + tag + payload
  if kind == "truncated":
    return stored[:len(stored) // 2]
  assert kind == "random bytes", kind
  return os.urandom(len(stored))


def plant_hostile_files(compiled: Path, kind: str, marker: str | os.PathLike) -> list[str]:
  """Replaces every file in `compiled` (a workdir's compiled/) as
  `hostile_file` says; returns their names."""
  names = sorted(p.name for p in compiled.iterdir())
  for name in names:
    path = compiled / name
    path.write_bytes(hostile_file(kind, name, path.read_bytes(), marker))
  return names


def within_seconds(call, seconds: float = 60.0):
  """`call()`'s result or exception, failing the test if it has not returned
  within `seconds` (a read that never ends: the thread is left behind)."""
  outcome: dict = {}

  def run():
    try:
      outcome["value"] = call()
    except BaseException as e:  # (handed to the test)
      outcome["error"] = e
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    pytest.fail(f"still running after {seconds} s: a read that never ends")
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]
