"""Several processes (hosts), beyond the device mesh: where their files are,
how they find each other, and what they send each other.

Workdirs: their paths (`resolve`, `is_local`, `write_file`) are
`workdir.py`'s, the one door into a workdir.

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
0's workdir, others do not) is refused with advice. A network disk slow to
show a new file is asked again (config.shared_workdir="auto"), or declared
("yes" / "no").

Start-up. `cluster_detected()` says whether this process is one of several
of a cluster that `jax.distributed.initialize()` configures by itself (a
Slurm job step of several tasks, an Open MPI job, a Cloud TPU pod slice),
without starting anything; train.py then initializes with no flags. It reads
what the launchers document (Slurm's and Open MPI's environment variables,
GKE's TPU variables, a TPU VM's devices), not JAX's private cluster classes.

Work split over processes. `split_across_processes(fn, items)`: each process
computes its share of the work on `items` (e.g. every count-th decoding
batch), and every process gets all the results back, in order
(`allgather_strings`).

Imports nothing from `transformer` but `parallel` and `workdir` (its paths).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from etils import epath

from transformer.runtime import parallel
from transformer.runtime.workdir import resolve

logger = logging.getLogger(__name__)

# The clusters train.py lets `jax.distributed.initialize()` detect
# (`cluster_detected`): Slurm, Open MPI, Cloud TPU on GKE, a Cloud TPU VM.
AUTO_DETECTED_CLUSTERS = ("slurm", "ompi", "gketpu", "tpuvm")

_MARKER_PREFIX = ".workdir_check-"


# ----------------------------------------------------------------------------
# Start-up
# ----------------------------------------------------------------------------


def cluster_detected() -> tuple[str, int | None] | None:
  """(cluster name, number of processes) when this process is one of several
  that a launcher started and that `jax.distributed.initialize()` with no
  arguments configures by itself; None otherwise (one process: a plain
  machine, a Slurm job step of one task, an `sbatch` script outside `srun`).
  Starts nothing, so it may run before `jax.distributed.initialize`. Read
  from what each launcher documents, in the order JAX tries them:

    ompi    `mpirun`: OMPI_MCA_orte_hnp_uri set; OMPI_COMM_WORLD_SIZE processes.
    slurm   a job step (`srun`): SLURM_JOB_ID, SLURM_STEP_NODELIST,
            SLURM_PROCID and SLURM_LOCALID set; SLURM_NTASKS processes.
    gketpu  a TPU slice on GKE (a TPU machine, `_on_a_tpu_vm`, with
            TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES set): one process
            per host named, times MEGASCALE_NUM_SLICES.
    tpuvm   another Cloud TPU VM: its hosts are listed only in the VM's
            metadata, which JAX reads, so the count is None; on a
            single-host VM JAX starts a runtime of one process.

  A variable that is set but not a number (a half-set environment) gives
  None, logged at debug level.
  """
  env = os.environ
  try:
    if "OMPI_MCA_orte_hnp_uri" in env:
      found = ("ompi", int(env["OMPI_COMM_WORLD_SIZE"]))
    elif all(name in env for name in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                      "SLURM_PROCID", "SLURM_LOCALID")):
      found = ("slurm", int(env["SLURM_NTASKS"]))
    elif not _on_a_tpu_vm():
      return None
    elif env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES"):
      hosts = (env.get("TPU_PROCESS_ADDRESSES") or env["TPU_WORKER_HOSTNAMES"]).split(",")
      found = ("gketpu", len(hosts) * int(env.get("MEGASCALE_NUM_SLICES") or 1))
    else:
      return ("tpuvm", None)
  except (KeyError, ValueError) as e:  # (a half-set environment: not ours to start)
    logger.debug("Cluster detection failed: %r", e)
    return None
  return found if found[1] > 1 else None


def _on_a_tpu_vm() -> bool:
  """Whether this machine is a Cloud TPU VM: libtpu installed and TPU chips
  attached (/dev/accel* up to v4, /dev/vfio/<n> from v5)."""
  if importlib.util.find_spec("libtpu") is None:
    return False
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


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
    name, count = cluster
    logger.info("%s: starting JAX's distributed runtime with what it detects "
                "(--num_processes=1 runs this process alone).",
                f"A {name} job of {count} processes" if count else "A Cloud TPU VM")
  parallel.maybe_initialize_distributed(coordinator_address, num_processes, process_id,
                                        num_cpu_devices=num_cpu_devices,
                                        auto_detect=cluster is not None)


SHARED_WORKDIR_CHOICES = ("auto", "yes", "no")


def workdirs_shared(workdir: str | os.PathLike, declared: str = "auto", *, tries: int = 3,
                    pause_seconds: float = 0.5) -> bool:
  """Whether every process sees the same `workdir` as process 0 (True) or
  each has its own (False). True for a single process.

  `declared` ("yes" / "no", config.shared_workdir) says so, and nothing is
  checked. "auto" finds out: process 0 writes a marker with a random name in
  its workdir, sends the name to the others and each looks for it in its own
  workdir (which must exist); process 0 then removes it. Every process seeing
  it means shared at once. A network file system may not show a new file to
  another host at once (NFS caches attributes and failed lookups for up to a
  minute), so an answer short of that is asked `tries` times, each with a
  fresh name (a failed lookup is cached by name), after a pause that grows
  (`pause_seconds`, twice that, ...) and a barrier (the next name's
  broadcast). No other process ever seeing a marker means separate. Raises
  MixedWorkdirs, naming the option, when some processes see one and others
  do not (a mix of disks, or a disk too slow to tell).
  """
  if declared not in SHARED_WORKDIR_CHOICES:
    raise ValueError(f"config.shared_workdir={declared!r} must be one of "
                     f"{SHARED_WORKDIR_CHOICES}.")
  if jax.process_count() == 1:
    return True
  if declared != "auto":
    logger.info("config.shared_workdir=%s: the processes %s one workdir (not checked).",
                declared, "share" if declared == "yes" else "do not share")
    return declared == "yes"
  workdir = resolve(workdir)
  ever_seen = np.zeros(jax.process_count(), bool)
  for attempt in range(tries):
    if attempt:
      time.sleep(pause_seconds * attempt)
    seen_by = _marker_seen_by(workdir)
    if seen_by.all():
      if attempt:
        logger.info("Every process sees %s (after %d tries): one shared workdir.",
                    workdir, attempt + 1)
      return True
    ever_seen |= seen_by
  if not ever_seen[1:].any():
    logger.info("Every process has a workdir of its own (%s here): each keeps its own "
                "vocabulary, configs and checkpoints.", workdir)
    return False
  sharing = [int(i) for i in np.flatnonzero(ever_seen)]
  raise MixedWorkdirs(
      f"Processes {sharing} saw process 0's marker file in the workdir and the others did "
      f"not, in {tries} tries (this process: {workdir}). Give every process its own "
      "workdir (e.g. --workdir=/local/disk/run_<process id>) or all of them one on a shared "
      "disk; if they do share it and the disk is slow to show new files (NFS attribute "
      "caching), say so with --config.shared_workdir=yes (or =no for a workdir each).")


def _marker_seen_by(workdir: epath.Path) -> np.ndarray:
  """One look: process 0 writes a marker of a fresh random name in its
  workdir, every process looks for it in its own (`_sees`), process 0
  removes it. [process_count] bools, the same on every process."""
  from jax.experimental import multihost_utils
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
  seen = _sees(workdir / (_MARKER_PREFIX + bytes(token[:16]).hex()))
  seen_by = np.asarray(multihost_utils.process_allgather(np.int32(seen))).reshape(-1)
  if marker is not None:
    try:
      marker.unlink()
    except OSError:
      pass
  return seen_by.astype(bool)


def _sees(path: epath.Path) -> bool:
  """Whether this process sees the file `path` (a test fakes a stale cache here)."""
  return path.exists()


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


def split_across_processes(fn: Callable[[list, tuple[int, int]], Sequence[str | None]],
                           items: Sequence, what: str = "items") -> list[str]:
  """`fn` computed in shares, the results in every process: each process
  calls `fn(items, (its index, process count))`, which returns a string per
  item for the items of that share of the work and None for the others
  (`Translator.translate(share=...)`: every process forms the same batches
  and decodes every count-th one, so an item's result is what one process
  alone gives, bit for bit); each item must get its string in exactly one
  process. One process: `fn(items, (0, 1))`. Logs how many items this
  process did."""
  items = list(items)
  index, count = jax.process_index(), jax.process_count()
  results = list(fn(items, (index, count)))
  if len(results) != len(items):
    raise ValueError(f"split_across_processes: {len(results)} results for {len(items)} {what}.")
  if count == 1:
    return results
  mine = [k for k, result in enumerate(results) if result is not None]
  logger.info("Process %d of %d: %d of the %d %s done here.", index, count, len(mine),
              len(items), what)
  positions = allgather_strings([str(k) for k in mine])
  strings = allgather_strings([results[k] for k in mine])
  merged: list[str | None] = [None] * len(items)
  for k, string in zip(positions, strings):
    merged[int(k)] = string
  missing = [k for k, string in enumerate(merged) if string is None]
  if missing or len(positions) != len(items):
    raise ValueError(f"split_across_processes: {len(positions)} results from the processes "
                     f"for {len(items)} {what} (none for item {missing[:1]}).")
  return merged