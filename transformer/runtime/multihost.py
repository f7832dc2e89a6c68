"""Several processes (hosts), beyond the device mesh: where their files are,
how they find each other, and what they send each other.

Workdirs. `resolve(workdir)` is a workdir as an `etils.epath.Path`: a local
path made absolute, an object-store address (gs://bucket/run, s3://...) kept
as it is (`os.path.abspath` would make it /cwd/gs:/bucket/run). epath reads
and writes both, as orbax does; `write_file` writes whole files to either.

Shared or separate disks. The processes of a multi-host run may all see one
workdir (a shared file system, an object store), or each its own (each
host's local disk; each process may also be given a different --workdir).
`workdirs_shared` finds out which, and the trainer follows:

    shared     process 0 writes what exists once (vocabulary, configs); orbax
               writes each checkpoint together from all processes;
    separate   every process keeps in its own workdir all it needs to resume
               and to decode: the vocabulary (process 0's, sent as bytes), the
               configs and every checkpoint (each process writes the
               replicated train state whole: `Checkpointer(per_process=True)`).

Either way metrics.jsonl, TensorBoard and curves.png are process 0's, and
every process writes its own train log. A mix (some processes see process
0's workdir, others do not) is refused with advice.

Start-up. `cluster_detected()` says whether this process is one of several
of a cluster that `jax.distributed.initialize()` configures by itself (a
Slurm job step of several tasks, an Open MPI job, a Cloud TPU pod slice),
without starting anything; train.py then initializes with no flags.

Work split over processes. `split_across_processes(fn, items)`: each process
applies `fn` to its contiguous share of `items` (`process_share`), and every
process gets all the results back, in order (`allgather_strings`).

Imports nothing from `transformer` but `text_io` (a leaf).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from etils import epath

from transformer.data.text_io import write_atomically
from transformer.runtime import parallel

logger = logging.getLogger(__name__)

# The clusters train.py lets `jax.distributed.initialize()` detect (the
# names of jax._src.clusters' environments): Slurm, Open MPI, Cloud TPU.
AUTO_DETECTED_CLUSTERS = ("slurm", "ompi", "gcetpu", "gketpu")

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_MARKER_PREFIX = ".workdir_check-"


# ----------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------


def is_local(path: str | os.PathLike) -> bool:
  """Whether `path` is on a local (or mounted) file system, not an address
  like gs://bucket/run."""
  return not _URI.match(os.fspath(path))


def resolve(workdir: str | os.PathLike) -> epath.Path:
  """`workdir` as an epath.Path: absolute if local, an address unchanged."""
  text = os.fspath(workdir)
  return epath.Path(os.path.abspath(text) if is_local(text) else text)


def write_file(path: str | os.PathLike, content: bytes | str) -> None:
  """Writes `content` whole: locally through `text_io.write_atomically` (a
  temporary file renamed), elsewhere as one object (object stores replace
  an object whole)."""
  if is_local(path):
    write_atomically(path, content)
    return
  path = epath.Path(os.fspath(path))
  path.parent.mkdir(parents=True, exist_ok=True)
  if isinstance(content, str):
    path.write_text(content)
  else:
    path.write_bytes(content)


# ----------------------------------------------------------------------------
# Start-up
# ----------------------------------------------------------------------------


def cluster_detected() -> tuple[str, int] | None:
  """(cluster name, number of processes) when this process runs in one of
  AUTO_DETECTED_CLUSTERS with more than one process, as JAX's own detection
  (`jax._src.clusters`, what `jax.distributed.initialize()` with no
  arguments uses) sees it; None otherwise (one process: a plain machine, a
  Slurm job step of one task, a single-host TPU VM). Starts nothing, so it
  may run before `jax.distributed.initialize`.
  """
  from jax._src import clusters
  wanted = [env for env in clusters.ClusterEnv._cluster_types
            if env.name in AUTO_DETECTED_CLUSTERS and not env.opt_in_only_method]
  for env in wanted:
    try:
      if not env.is_env_present():
        continue
      count = int(env.get_process_count())
    except Exception as e:  # (a half-set environment: not ours to start)
      logger.debug("Cluster detection (%s) failed: %s", env.name, e)
      return None
    return (env.name, count) if count > 1 else None
  return None


# ----------------------------------------------------------------------------
# Shared or separate workdirs
# ----------------------------------------------------------------------------


class MixedWorkdirs(ValueError):
  """Some processes see process 0's workdir and others do not."""


def start_processes(coordinator_address: str | None, num_processes: int | None,
                    process_id: int | None, *, num_cpu_devices: int | None = None) -> None:
  """Starts JAX's distributed runtime as train.py and decode.py do, before JAX
  starts its backend: from the flags or the environment
  (`parallel.maybe_initialize_distributed`), or, in a Slurm / Open MPI / Cloud
  TPU job of several processes, from what JAX detects (`cluster_detected`;
  num_processes=1 runs this process alone there). ValueError names a setting
  that is missing."""
  cluster = cluster_detected() if num_processes != 1 else None
  if cluster:
    logger.info("A %s job of %d processes: starting JAX's distributed runtime with what it "
                "detects (--num_processes=1 runs this process alone).", *cluster)
  parallel.maybe_initialize_distributed(coordinator_address, num_processes, process_id,
                                        num_cpu_devices=num_cpu_devices,
                                        auto_detect=cluster is not None)


def workdirs_shared(workdir: str | os.PathLike) -> bool:
  """Whether every process sees the same `workdir` as process 0 (True) or
  each has its own (False). True for a single process.

  Process 0 writes a marker with a random name in its workdir, sends the name
  to the others and each looks for it in its own workdir (which must exist);
  process 0 then removes it. Raises MixedWorkdirs when some see it and some
  do not.
  """
  if jax.process_count() == 1:
    return True
  from jax.experimental import multihost_utils
  workdir = resolve(workdir)
  token = np.zeros(17, np.uint8)   # 16 random bytes, then 1 if the marker was written
  marker, error = None, None
  if jax.process_index() == 0:
    token[:16] = np.frombuffer(os.urandom(16), np.uint8)
    marker = workdir / (_MARKER_PREFIX + bytes(token[:16]).hex())
    try:
      marker.write_text("")
      token[16] = 1
    except OSError as e:   # (told to the others before raising: they wait for it)
      error = e
  token = np.asarray(multihost_utils.broadcast_one_to_all(token)).astype(np.uint8)
  if error is not None:
    raise error
  if not token[16]:
    raise RuntimeError("Process 0 could not write in its workdir; see its error.")
  seen = (workdir / (_MARKER_PREFIX + bytes(token[:16]).hex())).exists()
  seen_by = np.asarray(multihost_utils.process_allgather(np.int32(seen))).reshape(-1)
  if marker is not None:
    try:
      marker.unlink()
    except OSError:
      pass
  if seen_by.all():
    return True
  if not seen_by[1:].any():
    logger.info("Every process has a workdir of its own (%s here): each keeps its own "
                "vocabulary, configs and checkpoints.", workdir)
    return False
  sharing = [int(i) for i in np.flatnonzero(seen_by)]
  raise MixedWorkdirs(
      f"Processes {sharing} see the same workdir as process 0 and the others do not "
      f"(this process: {workdir}). Give every process its own workdir (e.g. "
      "--workdir=/local/disk/run_<process id>), or all of them one on a shared disk.")


# ----------------------------------------------------------------------------
# Sending data between processes
# ----------------------------------------------------------------------------


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's `data` in every process (the others pass None)."""
  if jax.process_count() == 1:
    return bytes(data)
  from jax.experimental import multihost_utils
  is_main = jax.process_index() == 0
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data) if is_main else 0)))
  if size == 0:
    return b""
  buffer = np.frombuffer(data, np.uint8) if is_main else np.zeros(size, np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8))


def _allgather_vector(values: np.ndarray, fill: int) -> list[np.ndarray]:
  """Every process's 1-D `values` (of any length; int32 or uint8), in process order."""
  from jax.experimental import multihost_utils
  values = np.asarray(values).reshape(-1)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(values.size))).reshape(-1)
  padded = np.full(max(int(sizes.max()), 1), fill, values.dtype)
  padded[:values.size] = values
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [gathered[i, :int(n)] for i, n in enumerate(sizes)]


def allgather_strings(strings: Sequence[str]) -> list[str]:
  """Every process's `strings`, concatenated in process order, in every
  process (sent as UTF-8 bytes)."""
  if jax.process_count() == 1:
    return list(strings)
  encoded = [s.encode("utf-8") for s in strings]
  lengths = _allgather_vector(np.array([len(b) for b in encoded], np.int32), 0)
  blobs = _allgather_vector(np.frombuffer(b"".join(encoded), np.uint8), 0)
  out = []
  for sizes, blob in zip(lengths, blobs):
    data = blob.astype(np.uint8).tobytes()
    ends = np.cumsum(sizes)
    out += [data[end - size:end].decode("utf-8") for size, end in zip(sizes, ends)]
  return out


def all_processes(flag: bool) -> bool:
  """Whether `flag` holds in every process."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils
  return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).all())


def common_steps(steps: Sequence[int]) -> list[int]:
  """The steps every process has (ascending)."""
  if jax.process_count() == 1:
    return sorted(int(s) for s in steps)
  per_process = _allgather_vector(np.array(sorted(steps), np.int32), -1)
  common = set(int(s) for s in per_process[0])
  for other in per_process[1:]:
    common &= set(int(s) for s in other)
  return sorted(common)


# ----------------------------------------------------------------------------
# Splitting work
# ----------------------------------------------------------------------------


def process_share(n: int, index: int | None = None, count: int | None = None) -> slice:
  """Process `index`'s (default: this one's) contiguous share of n items,
  out of `count` processes: sizes differ by one at most."""
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  return slice(index * n // count, (index + 1) * n // count)


def split_across_processes(fn: Callable[[list], Sequence[str]], items: Sequence,
                           what: str = "items") -> list[str]:
  """`fn(items)` computed in shares: each process applies `fn` (a list of
  items -> as many strings, e.g. translations) to its `process_share`, and
  the results come back to every process in the order of `items`. One
  process: `fn(items)`. Logs how many items this process did."""
  items = list(items)
  if jax.process_count() == 1:
    return list(fn(items))
  mine = items[process_share(len(items))]
  results = list(fn(mine)) if mine else []
  if len(results) != len(mine):
    raise ValueError(f"split_across_processes: {len(results)} results for {len(mine)} {what}.")
  logger.info("Process %d of %d: %d of the %d %s done here.", jax.process_index(),
              jax.process_count(), len(mine), len(items), what)
  return allgather_strings(results)
