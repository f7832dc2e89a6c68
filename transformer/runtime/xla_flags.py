"""$XLA_FLAGS checked against the XLA that is installed, before XLA reads them.

XLA reads $XLA_FLAGS when JAX starts its first backend, and stops the whole
process on a flag it does not know ("Unknown flag in XLA_FLAGS: ...", exit
status 1, nothing else said), and XLA removes flags from one release to the
next (`--xla_cpu_use_fusion_emitters`, known to jaxlib 0.10, is gone in
0.12). A flag set for another JAX would so end a training run or a decode at
its first computation with a line from XLA's C++ logging. Here the flags are
tried first in a short process of their own (`import jax; jax.devices('cpu')`,
about 2 s), and an unknown one is said in one sentence that names it
(`check_environment`, called by train.py and decode.py before JAX starts).

The verdict depends only on the flags and the installed jaxlib, so it is kept
(`<directory>/xla_flags/<hash>.json`, the compilation cache's directory) and a
later start with the same flags runs no probe. `known` picks, from flags a
caller would like (the tests' faster compile settings), those this XLA knows.

Nothing here imports JAX: the check must run before JAX's backend starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ENV = "XLA_FLAGS"
SUBDIRECTORY = "xla_flags"
PROBE = "import jax; jax.devices('cpu')"
PROBE_SECONDS = 300  # (a cold start of JAX on a loaded 2-core machine: seconds)
# What XLA prints before it stops (xla/parse_flags_from_env.cc): the first
# flag it does not know, or one whose value it cannot parse.
_REJECTED = re.compile(r"(?:Unknown flags? in XLA_FLAGS|Couldn't parse[^:\n]*XLA_FLAGS[^:\n]*):\s*(\S+)")


class UnknownXlaFlag(ValueError):
  """$XLA_FLAGS names a flag the installed XLA does not know."""


def _jaxlib_version() -> str:
  import jaxlib.version  # (a version string: no backend starts)
  return jaxlib.version.__version__


def rejected_flag(flags: str, directory: str | os.PathLike | None = None) -> str | None:
  """The first of `flags` (an XLA_FLAGS string) that the installed XLA
  rejects, or None when it takes them all (or the probe could not tell: a
  probe that fails for another reason is not a verdict on the flags). With a
  `directory`, the verdict is read from and kept in its `xla_flags/`."""
  flags = " ".join(shlex.split(flags))
  if not flags:
    return None
  key = hashlib.sha256(f"{_jaxlib_version()}\n{sys.platform}\n{flags}".encode()).hexdigest()[:32]
  kept = Path(directory) / SUBDIRECTORY / f"{key}.json" if directory else None
  if kept is not None:
    try:
      with open(kept, "rb") as f:
        return json.loads(f.read(4096))["rejected"]
    except (OSError, ValueError, KeyError, TypeError):
      pass  # (none kept yet, or unreadable: probe again)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update({ENV: flags, "JAX_PLATFORMS": "cpu"})
  try:
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                           text=True, errors="replace", timeout=PROBE_SECONDS)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if probe.returncode == 0:
    rejected = None
  else:
    match = _REJECTED.search(probe.stderr)
    if match is None:
      return None
    rejected = match.group(1)
  if kept is not None:
    try:
      kept.parent.mkdir(parents=True, exist_ok=True)
      temporary = kept.with_suffix(f".{os.getpid()}.tmp")
      temporary.write_text(json.dumps({"flags": flags, "rejected": rejected}))
      os.replace(temporary, kept)
    except OSError:
      pass  # (a read-only cache: the next start probes again)
  return rejected


def known(wanted: list[str], directory: str | os.PathLike | None = None) -> list[str]:
  """Those of the `wanted` flags (e.g. "--xla_backend_optimization_level=0")
  that the installed XLA knows, in their order."""
  flags = list(wanted)
  while flags:
    rejected = rejected_flag(" ".join(flags), directory)
    if rejected is None or rejected not in flags:
      return flags
    flags.remove(rejected)
  return flags


def check_environment(directory: str | os.PathLike | None = None) -> None:
  """Raises UnknownXlaFlag, in one sentence, when $XLA_FLAGS names a flag the
  installed XLA does not know (XLA would end the process at its first
  computation). Call it before anything starts JAX's backend."""
  flags = os.environ.get(ENV, "")
  try:
    rejected = rejected_flag(flags, directory)
  except ValueError as e:  # (unbalanced quotes)
    raise UnknownXlaFlag(f"$XLA_FLAGS ({flags!r}) cannot be read: {e}.") from None
  if rejected is not None:
    raise UnknownXlaFlag(
        f"$XLA_FLAGS sets {rejected}, which this XLA (jaxlib {_jaxlib_version()}) does not "
        f"know or cannot parse; remove it from XLA_FLAGS (XLA would otherwise stop the "
        f"process at its first computation).")
