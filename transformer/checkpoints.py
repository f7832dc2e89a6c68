"""Checkpoints: orbax CheckpointManager, exact resume, checkpoint averaging.

Layout inside the workdir::

    <workdir>/checkpoints/                    Checkpointer (keep the last N)
        <step>/                               one finished step (atomic rename)
            state/                            the train-state pytree (StandardSave)
            data_state/process_<i>-of-<n>.json  each process's data-iterator state
            meta/metadata                     JSON: step, time, process_count, ...
            _CHECKPOINT_METADATA, commit_success.txt    (orbax's own)
        <step>.orbax-checkpoint-tmp-<id>/     a save in progress (or killed);
                                              never listed, removed on next start
    <workdir>/checkpoints_averaged/
        <last averaged step>/                 one checkpoint (the newest average)
            params/                           the averaged params pytree
            meta/metadata                     JSON: {"averaged_steps": [...], ...}

Atomicity: orbax writes every step into `<step>.orbax-checkpoint-tmp-<id>` and
renames it to `<step>` only once every item (and every process) has finished;
directories with the tmp suffix are ignored by `all_steps()`/`latest_step()`
and deleted by the next `Checkpointer` (`cleanup_tmp_directories=True`). A
process killed at any moment therefore leaves the last finished step intact
and restorable; a step that already exists is never written again.

A full disk: before each save the Checkpointer checks that the disk has room
for one more checkpoint (the size of the last complete one; from the second
save on) and stops with DiskFullError, writing nothing, when it has not; a
write that still fails for want of space (orbax reports it from its
background threads, as RESOURCE_EXHAUSTED) becomes the same DiskFullError,
the unfinished `<step>.orbax-checkpoint-tmp*` removed. Its message names the
directory, the bytes needed and free, the last complete checkpoint and what
to do.

The train state is any pytree of jax arrays (e.g. {"params", "opt_state",
"step", "rng"}; typed PRNG keys included). Restoring needs a *target*: the
state itself, or its abstract form (`jax.eval_shape` output); leaves that carry
a sharding are restored with it, leaves without one are restored replicated
over `parallel.make_mesh()` (every device of every process).

The data-iterator state is a JSON-able object (for a grain `DatasetIterator`:
`iterator.get_state()` / `iterator.set_state(...)`; a grain `DataLoader`
iterator's state is JSON bytes: pass `json.loads(it.get_state())` and give
back `json.dumps(state).encode()`). Each process stores its
own (`process_<i>-of-<n>.json`, as grain's orbax handler does), so multi-host
data positions resume exactly; restoring with a different number of processes
raises (pass `restore_data_state=False` to start the data afresh instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from transformer import parallel

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
AVERAGED_DIR = "checkpoints_averaged"
STATE_ITEM = "state"
DATA_ITEM = "data_state"
META_ITEM = "meta"
PARAMS_ITEM = "params"
PARAMS_KEY = "params"


# --------------------------------------------------------------------------
# Per-process JSON item (the data-iterator state)
# --------------------------------------------------------------------------


def _process_filename() -> str:
  index, count = parallel.process_info()
  return f"process_{index}-of-{count}.json"


class ProcessJsonCheckpointHandler(ocp.JsonCheckpointHandler):
  """Like `ocp.JsonCheckpointHandler`, but every process writes and reads its
  own file `process_<i>-of-<n>.json` (grain's layout), not only the primary."""

  def __init__(self):
    super().__init__()

  async def _save_fn(self, x, directory):
    (directory / _process_filename()).write_text(x)

  async def async_save(self, directory, item=None, args=None):
    if args is not None:
      item = args.item
    # Serialise now, in the caller's thread: the caller may mutate its dict
    # after save() returns, and a non-JSON-able state should fail loudly here.
    try:
      text = json.dumps(item)
    except TypeError as e:
      raise TypeError(
          "The data-iterator state must be JSON-serialisable (dicts, lists,"
          f" str, int, float, bool, None): {e}"
      ) from e
    return await super().async_save(directory, args=ocp.args.JsonSave(text))

  def restore(self, directory, item=None, args=None):
    del item, args
    path = directory / _process_filename()
    if not path.exists():
      saved = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
      raise FileNotFoundError(
          f"No data-iterator state for this process: {path} does not exist"
          f" (saved: {saved}). Was the checkpoint written with a different"
          " number of processes? Restore with restore_data_state=False to"
          " restart the data pipeline from its beginning."
      )
    return json.loads(path.read_text())


@ocp.args.register_with_handler(ProcessJsonCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(ProcessJsonCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
  item: Any = None


# --------------------------------------------------------------------------
# Targets and shardings
# --------------------------------------------------------------------------


def abstract_target(target: Any, default_sharding: jax.sharding.Sharding | None = None) -> Any:
  """`jax.ShapeDtypeStruct`s with shardings for every array leaf of `target`.

  `target` may hold jax.Arrays (their sharding is kept), numpy arrays or
  ShapeDtypeStructs (e.g. `jax.eval_shape` output; kept if they carry a
  sharding). Leaves without a sharding get `default_sharding`, by default
  replicated over `parallel.make_mesh()`.
  """
  default = [default_sharding]

  def get_default():
    if default[0] is None:
      default[0] = parallel.replicated(parallel.make_mesh())
    return default[0]

  def leaf(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
      sharding = x.sharding if x.sharding is not None else get_default()
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, (np.ndarray, np.generic)):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=get_default())
    return x

  return jax.tree.map(leaf, target)


def _leaf_name(path) -> str:
  """A leaf's key path as orbax names it in its metadata: "opt_state.0.mu.x"."""
  parts = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return ".".join(parts)


# --------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------

# Room asked for beyond the size of the last checkpoint: the next one may
# differ a little (metadata), and metrics are written meanwhile.
SPACE_MARGIN = 0.05


class DiskFullError(OSError):
  """A checkpoint does not fit on its disk: found before writing it, or when
  a write failed with ENOSPC (or EDQUOT). Nothing half-written is left.
  `str(e)` says what did not fit where, the bytes needed and free, the last
  complete checkpoint, and what to do; the numbers are kept as attributes."""

  def __init__(self, directory, what: str, needed: int, free: int, last_step: int | None,
               *, unfinished: Sequence[str] = (), advice: str):
    done = (f"its unfinished {', '.join(unfinished)} was removed" if unfinished
            else "nothing was written")
    last = f"step {last_step}" if last_step is not None else "none"
    if needed > free:
      fit = f"needs about {_size(needed)} in {directory} and {_size(free)} are free"
    else:  # a first checkpoint's size is estimated from its arrays alone
      fit = (f"did not fit in {directory}, where {_size(free)} were free (its arrays "
             f"alone take {_size(needed)}; orbax adds metadata)")
    message = (
        f"The disk is full: {what} {fit}; {done}. The last complete checkpoint is "
        f"{last}. {advice}, "
        f"then run the same command again: training resumes from "
        f"{last if last_step is not None else 'the start'}.")
    super().__init__(errno.ENOSPC, message, str(directory))
    self.message, self.directory = message, str(directory)
    self.needed, self.free, self.last_step = needed, free, last_step

  def __str__(self) -> str:
    return self.message


def _size(num_bytes: int) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.1f} {unit} ({num_bytes:,} bytes)"
  return f"{num_bytes} bytes"


def is_disk_full(error: BaseException) -> bool:
  """Whether `error`, or one it came from, is a full disk (or quota): an
  OSError with ENOSPC / EDQUOT, or tensorstore's RESOURCE_EXHAUSTED text
  naming one (orbax re-raises those from its background threads)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(error)
    if ("No space left on device" in text or "Disk quota exceeded" in text
        or f"os_error_code='{errno.ENOSPC}'" in text):
      return True
    error = error.__cause__ or error.__context__
  return False


def _disk_bytes(path: epath.Path) -> int:
  """The space the files under `path` take on disk (as `du`), 0 if it is gone."""
  total = 0
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      try:
        info = os.lstat(os.path.join(root, name))
      except FileNotFoundError:
        continue
      total += max(info.st_blocks * 512, info.st_size if name in files else 0)
  return total


def _tree_bytes(tree: Any) -> int:
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def _remove_unfinished(directory: epath.Path, *, settle_s: float = 0.2,
                       timeout_s: float = 5.0) -> list[str]:
  """Removes the `<step>.orbax-checkpoint-tmp*` entries of `directory`
  after a failed save; returns their names. tensorstore may still finish
  writes it had started (and recreate their directories) after orbax gave
  up, so this removes until nothing comes back for `settle_s`."""
  def unfinished():
    return sorted(n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n) \
        if os.path.isdir(directory) else []

  removed: set[str] = set()
  deadline = time.monotonic() + timeout_s
  while (names := unfinished()) and time.monotonic() < deadline:
    for name in names:
      path = os.path.join(directory, name)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.remove(path)
    removed.update(names)
    time.sleep(settle_s)
  return sorted(removed)


# --------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------


class Checkpointer:
  """Saves and restores the train state, the data position and metadata.

  Args:
    workdir: the run's directory; checkpoints go to `<workdir>/checkpoints`.
    keep: how many of the newest checkpoints to keep (None: all).
    save_every: `save(step, ...)` writes only when `step % save_every == 0`
      (or `force=True`, or a multi-host preemption notice arrived).
    async_save: write in a background thread. `save()` still copies the arrays
      to host memory before returning, so donating/deleting the state right
      after is safe; the next `save()`, `wait()` and `close()` wait for it.
    read_only: open existing checkpoints without creating or deleting anything
      (e.g. for decoding).
    subdir: directory name under `workdir`.
    check_space: before each save, raise DiskFullError (writing nothing) if
      the disk lacks room for one more checkpoint (module docstring).

  Call `close()` (or use `with Checkpointer(...) as ckpt:`) at the end so the
  last save is finished and old steps are deleted. A save that fails for a
  full disk raises DiskFullError from `save()`, `wait()` or `close()`,
  whichever first learns of it (orbax writes in the background).
  """

  def __init__(
      self,
      workdir: str | os.PathLike,
      *,
      keep: int | None = 5,
      save_every: int = 1,
      async_save: bool = True,
      read_only: bool = False,
      subdir: str = CHECKPOINT_DIR,
      check_space: bool = True,
  ):
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}.")
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}.")
    self.workdir = epath.Path(os.path.abspath(workdir))
    self.directory = self.workdir / subdir
    self.keep = keep
    self.save_every = save_every
    self.check_space = check_space
    self._saving_step: int | None = None   # the last save started
    self._failed = False                   # a save failed: close() only releases
    self._measured: tuple[int, int] | None = None   # (step, its bytes on disk)
    self._state_bytes = 0                  # the arrays of the last state saved
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(save_every),
            policies.PreemptionCheckpointingPolicy(),
        ]),
        preservation_policy=policies.LatestN(keep),  # None keeps all
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        create=not read_only,
    )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            DATA_ITEM: ProcessJsonCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler(),
        },
    )

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps of the finished checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest finished step, or None if there is none."""
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` (without force) would write."""
    return step not in self._manager.all_steps() and self._manager.should_save(step)

  # -- save ------------------------------------------------------------------

  def save(
      self,
      step: int,
      state: Any,
      data_state: Any = None,
      *,
      force: bool = False,
      metadata: dict[str, Any] | None = None,
  ) -> bool:
    """Saves `state` (and this process's `data_state`) as step `step`.

    Writes when `step % save_every == 0` or `force` (or on preemption). A step
    that is already saved is never overwritten (returns False). In a
    multi-process run every process must call this with the same step.

    Args:
      step: the training step the state belongs to.
      state: pytree of jax arrays (replicated or sharded, any dtype).
      data_state: this process's data-iterator state, JSON-able (or None).
      force: write regardless of `save_every` (e.g. the last step).
      metadata: extra JSON-able info stored in the step's `meta` item.

    Returns:
      True if a save was started.
    """
    step = int(step)
    for name, value in (("data_state", data_state), ("metadata", metadata)):
      try:
        json.dumps(value)
      except (TypeError, ValueError) as e:
        raise TypeError(
            f"Checkpointer.save: {name} must be JSON-serialisable (dicts, lists,"
            f" str, int, float, bool, None; not numpy scalars): {e}"
        ) from e
    if step in self._manager.all_steps():
      logger.info("Checkpoint for step %d exists in %s; not saving again.", step, self.directory)
      return False
    meta = {
        "step": step,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "process_count": jax.process_count(),
        "has_data_state": data_state is not None,
    }
    if metadata:
      meta.update(metadata)
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.StandardSave(state),
        DATA_ITEM: ProcessJsonSave({"data_state": data_state}),
        META_ITEM: ocp.args.JsonSave(meta),
    })
    self._state_bytes = _tree_bytes(state)
    if self.check_space and (force or self._manager.should_save(step)):
      self.wait()   # (orbax's save waits for the previous one first anyway)
      self._check_space(step)
    with self._disk_full_as_error():
      saved = self._manager.save(step, args=args, force=force)
    if saved:
      self._saving_step = step
      logger.info("Saving checkpoint for step %d to %s", step, self.directory)
    return saved

  def _check_space(self, step: int) -> None:
    """Raises DiskFullError, before anything is written, if the disk has
    less room than the next checkpoint needs (`_needed_bytes`): once the size
    of one is known (before the first, a full disk is caught when a write
    fails). With several processes, process 0 decides for all."""
    latest = self._finished_step()
    if latest is None:
      return
    needed = self._needed_bytes(latest)
    free = shutil.disk_usage(self.directory).free
    fits = free >= needed
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      fits = bool(multihost_utils.broadcast_one_to_all(np.int32(fits)))
    if not fits:
      raise DiskFullError(self.directory, f"the checkpoint of step {step}", needed, free,
                          latest, advice=self._advice(latest))

  def _finished_step(self) -> int | None:
    """The newest complete step, from the directory itself (not orbax's
    bookkeeping, which may count a save that failed)."""
    steps = ocp.utils.checkpoint_steps(self.directory) if self.directory.exists() else []
    return max(steps) if steps else None

  def _needed_bytes(self, latest: int | None) -> int:
    """The room the next checkpoint needs: the size on disk of the last
    complete one (measured once per step; orbax compresses, so the arrays'
    size is only a guess, used when there is none), plus SPACE_MARGIN."""
    if latest is not None and (self._measured is None or self._measured[0] != latest):
      self._measured = (latest, _disk_bytes(self.directory / str(latest)))
    size = self._measured[1] if latest is not None else self._state_bytes
    return int(size * (1 + SPACE_MARGIN))

  def _advice(self, latest: int | None) -> str:
    """What to do when the disk is full: orbax deletes the oldest checkpoint
    only after the next one is complete, so keeping fewer frees nothing by
    itself; deleting old steps does."""
    if latest is None:
      return "Free space on that disk, or train into a workdir on a larger one"
    keep = f"; keep fewer with config.keep_checkpoints, now {self.keep}" if self.keep else ""
    return (f"Free space on that disk (deleting older steps in {self.directory} helps: "
            f"step {latest} alone is enough to resume{keep})")

  @contextlib.contextmanager
  def _disk_full_as_error(self):
    """Turns orbax's report of a full disk, from whichever call learns of it,
    into DiskFullError, the unfinished checkpoint removed."""
    try:
      yield
    except Exception as e:
      if not is_disk_full(e):
        raise
      self._failed = True
      with contextlib.suppress(Exception):  # (its other threads may still be writing)
        self._manager.close()
      unfinished = _remove_unfinished(self.directory)
      steps = [int(n.split(".")[0]) for n in unfinished if n.split(".")[0].isdigit()]
      latest = self._finished_step()
      step = max(steps, default=self._saving_step)
      raise DiskFullError(self.directory, f"the checkpoint of step {step}",
                          self._needed_bytes(latest), shutil.disk_usage(self.directory).free,
                          latest, unfinished=unfinished, advice=self._advice(latest)) from e

  # -- restore -----------------------------------------------------------------

  def restore(
      self,
      target_state: Any,
      step: int | None = None,
      *,
      restore_data_state: bool = True,
  ) -> tuple[Any, Any]:
    """Restores (state, data_state) of `step` (default: the latest).

    Args:
      target_state: the state's structure, dtypes and shardings: a state of
        jax arrays, or `jax.eval_shape(...)` output whose leaves may carry
        shardings (those without one are restored replicated).
      step: which step; None for the latest.
      restore_data_state: False to skip the data-iterator state (returns None).

    Returns:
      (state, data_state): the state with `target_state`'s structure, placed
      on `target_state`'s shardings; this process's data state (None if none
      was saved).

    Raises:
      FileNotFoundError: no checkpoint (or not that step) in the directory.
      ValueError: the checkpoint does not fit `target_state`.
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No checkpoint to restore in {self.directory}.")
    step = int(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(
          f"No checkpoint for step {step} in {self.directory}; available:"
          f" {self.all_steps()}."
      )
    abstract = abstract_target(target_state)
    self._check_fits(step, abstract)
    items = {STATE_ITEM: ocp.args.StandardRestore(abstract)}
    if restore_data_state:
      items[DATA_ITEM] = ProcessJsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
          f"Could not restore {self.directory / str(step)} into the given"
          f" target state: {e}. Was it written with a different model or"
          " optimizer configuration?"
      ) from e
    data_state = restored[DATA_ITEM]["data_state"] if restore_data_state else None
    return restored[STATE_ITEM], data_state

  def _check_fits(self, step: int, abstract: Any) -> None:
    """Raises ValueError if the shapes saved for `step` (its metadata, one
    small file) are not those of `abstract`, naming the first that differ:
    orbax's own error would come after reading starts, with advice for its
    API and "Event loop is closed" tracebacks from its reader threads."""
    try:
      stored = self._manager.item_metadata(step)[STATE_ITEM].tree
    except Exception:  # (no usable metadata: leave the checks to orbax)
      return
    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "name")
    stored_shapes = {x.name: tuple(x.shape) for x in jax.tree.leaves(stored, is_leaf=is_array)
                     if is_array(x)}
    wanted = {_leaf_name(path): tuple(x.shape)
              for path, x in jax.tree_util.tree_leaves_with_path(abstract)
              if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)}
    if not stored_shapes or not set(wanted) & set(stored_shapes):
      return  # (names not comparable: leave the checks to orbax)
    names = sorted(wanted, key=lambda name: (not name.startswith("params."), name))
    problems = [f"{name} is {stored_shapes[name]} there, {wanted[name]} here"
                for name in names if name in stored_shapes and stored_shapes[name] != wanted[name]]
    problems += [f"{name} is missing there" for name in names if name not in stored_shapes]
    if problems:
      more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
      raise ValueError(
          f"Could not restore {self.directory / str(step)} into the given target state: "
          f"{'; '.join(problems[:3])}{more}. Was it written with a different model or "
          "optimizer configuration?")

  def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved with `step` (default: the latest)."""
    self.wait()
    step = self.latest_step() if step is None else int(step)
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    return dict(self._manager.restore(
        step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM])

  # -- lifecycle ---------------------------------------------------------------

  def wait(self) -> None:
    """Blocks until an in-flight (async) save is finished and committed."""
    if self._failed:
      return
    with self._disk_full_as_error():
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last save, finishes deletions and releases resources.
    After a save failed (DiskFullError raised), only releases them."""
    try:
      self.wait()
    finally:
      if self._failed:   # (orbax would report the same failure again)
        with contextlib.suppress(Exception):
          self._manager.close()
      else:
        self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    # Leaving on an error: close (letting a save in flight finish: it holds
    # good state) without hiding that error behind another, unless the disk
    # is full, which is news the user needs more.
    try:
      self.close()
    except DiskFullError:
      raise
    except Exception as e:
      logger.warning("Closing the checkpoints in %s after %s failed too: %s",
                     self.directory, exc_type.__name__, e, exc_info=True)


# --------------------------------------------------------------------------
# Reading params from a step directory, averaging
# --------------------------------------------------------------------------


def _step_dir(workdir, step: int, subdir: str = CHECKPOINT_DIR) -> epath.Path:
  return epath.Path(os.path.abspath(workdir)) / subdir / str(int(step))


def _restore_params_from_state(path: epath.Path, target_params: Any, params_key: str) -> Any:
  """Restores only `state[params_key]` from a step's `state` item."""
  abstract = {params_key: abstract_target(target_params)}
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args,
                                    partial_restore=True),
    )
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(
        f"Could not read the params ('{params_key}') of {path} into the given"
        f" target: {e}"
    ) from e
  return restored[params_key]


def checkpoint_steps(workdir: str | os.PathLike, subdir: str = CHECKPOINT_DIR) -> list[int]:
  """Finished steps in `<workdir>/<subdir>`, ascending (tmp dirs excluded)."""
  directory = epath.Path(os.path.abspath(workdir)) / subdir
  if not directory.exists():
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


@jax.jit
def _accumulate(acc, x):
  return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, x)


def average_checkpoints(
    workdir: str | os.PathLike,
    target_params: Any,
    *,
    steps: Sequence[int] | None = None,
    num: int = 5,
    params_key: str = PARAMS_KEY,
) -> Any:
  """Element-wise mean of the params of several checkpoints (as the paper did:
  the last 5 for base models, the last 20 for big ones).

  Args:
    workdir: the run's workdir (reads `<workdir>/checkpoints`).
    target_params: structure/dtypes/shardings of the params (concrete or
      abstract; leaves without sharding are replicated).
    steps: which steps; default: the newest `num` finished ones.
    num: how many of the newest steps to average when `steps` is None.
    params_key: the params subtree of the saved state.

  Returns:
    The averaged params, accumulated in float32, cast back to each leaf's
    dtype, with `target_params`' structure and shardings. Which steps were
    used: `checkpoint_steps(workdir)[-num:]` (or `steps`).
  """
  if steps is None:
    available = checkpoint_steps(workdir)
    if not available:
      raise FileNotFoundError(f"No checkpoints to average in {epath.Path(os.path.abspath(workdir)) / CHECKPOINT_DIR}.")
    steps = available[-num:]
  steps = [int(s) for s in steps]
  if not steps:
    raise ValueError("average_checkpoints: no steps given.")
  abstract = abstract_target(target_params)
  acc = None
  for step in steps:
    path = _step_dir(workdir, step) / STATE_ITEM
    if not path.exists():
      raise FileNotFoundError(f"No finished checkpoint {path.parent} to average.")
    params = _restore_params_from_state(path, abstract, params_key)
    if acc is None:
      acc = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32, device=x.sharding), params)
    acc = _accumulate(acc, params)
  n = float(len(steps))
  out = jax.jit(
      lambda a: jax.tree.map(lambda x, t: (x / n).astype(t.dtype), a, abstract),
      out_shardings=jax.tree.map(lambda t: t.sharding, abstract),
  )(acc)
  logger.info("Averaged the params of steps %s in %s", steps, workdir)
  return out


def save_averaged(
    workdir: str | os.PathLike,
    params: Any,
    steps: Sequence[int],
    *,
    metadata: dict[str, Any] | None = None,
) -> epath.Path:
  """Saves averaged params to `<workdir>/checkpoints_averaged/<max(steps)>/`.

  Only the newest averaged checkpoint is kept (the new one is written and
  committed before the old one is deleted). Re-averaging the same steps is a
  no-op; averaging a different set of steps with the same last step replaces
  that checkpoint (the regular checkpoints it was computed from remain).

  Returns:
    The directory of the averaged checkpoint.
  Raises:
    DiskFullError: a write failed for want of space; the unfinished average
      is removed (the checkpoints it was computed from are untouched).
  """
  steps = [int(s) for s in steps]
  if not steps:
    raise ValueError("save_averaged: no steps given.")
  directory = epath.Path(os.path.abspath(workdir)) / AVERAGED_DIR
  step = max(steps)
  manager = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(
          preservation_policy=ocp.checkpoint_managers.LatestN(1),
          enable_async_checkpointing=False,
          cleanup_tmp_directories=True,
      ),
      item_handlers={PARAMS_ITEM: ocp.StandardCheckpointHandler(),
                     META_ITEM: ocp.JsonCheckpointHandler()},
  )
  closed = False
  try:
    if step in manager.all_steps():
      old = manager.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
      if list(old[META_ITEM].get("averaged_steps", [])) == steps:
        logger.info("Averaged checkpoint of steps %s already exists in %s.", steps, directory)
        return directory / str(step)
      manager.delete(step)
    meta = {
        "averaged_steps": steps,
        "num_averaged": len(steps),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    if metadata:
      meta.update(metadata)
    needed = int(_tree_bytes(params) * (1 + SPACE_MARGIN))   # (for the message)
    try:
      manager.save(step, args=ocp.args.Composite(**{
          PARAMS_ITEM: ocp.args.StandardSave(params),
          META_ITEM: ocp.args.JsonSave(meta),
      }), force=True)
      manager.wait_until_finished()
    except Exception as e:
      if not is_disk_full(e):
        raise
      with contextlib.suppress(Exception):  # (its other threads may still be writing)
        manager.close()
      closed = True
      raise _averaged_disk_full(workdir, directory, steps, needed,
                                _remove_unfinished(directory)) from e
  finally:
    if not closed:
      manager.close()
  return directory / str(step)


def _averaged_disk_full(workdir, directory, steps, needed, unfinished=()) -> DiskFullError:
  """DiskFullError for the averaged checkpoint: training itself is complete."""
  latest = max(checkpoint_steps(workdir), default=None)
  return DiskFullError(
      directory, f"the average of steps {list(steps)}", needed,
      shutil.disk_usage(directory).free, latest, unfinished=unfinished,
      advice=(f"Free space on that disk (the training checkpoints in "
              f"{epath.Path(os.path.abspath(workdir)) / CHECKPOINT_DIR} are complete), or "
              "set config.average_last=1 to skip averaging"))


def average_and_save(
    workdir: str | os.PathLike,
    target_params: Any,
    *,
    num: int = 5,
    steps: Sequence[int] | None = None,
    params_key: str = PARAMS_KEY,
) -> tuple[Any, list[int]]:
  """`average_checkpoints` + `save_averaged`; returns (params, steps averaged)."""
  if steps is None:
    steps = checkpoint_steps(workdir)[-num:]
    if not steps:
      raise FileNotFoundError(f"No checkpoints to average in {epath.Path(os.path.abspath(workdir)) / CHECKPOINT_DIR}.")
  steps = [int(s) for s in steps]
  params = average_checkpoints(workdir, target_params, steps=steps, params_key=params_key)
  save_averaged(workdir, params, steps)
  return params, steps


def averaged_info(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """Metadata of the averaged checkpoint ({"averaged_steps": ..., ...}) or None."""
  steps = checkpoint_steps(workdir, AVERAGED_DIR)
  if not steps:
    return None
  path = _step_dir(workdir, steps[-1], AVERAGED_DIR) / META_ITEM / "metadata"
  info = json.loads(path.read_text())
  info["step"] = steps[-1]
  return info


def load_params(
    workdir: str | os.PathLike,
    target_params: Any,
    which: str | int = "auto",
    *,
    params_key: str = PARAMS_KEY,
    with_info: bool = False,
) -> Any:
  """Loads params for decoding.

  Args:
    workdir: the run's workdir.
    target_params: structure/dtypes/shardings (concrete or `jax.eval_shape`
      output; leaves without sharding are restored replicated).
    which: "averaged" (the averaged checkpoint), "latest" (the newest training
      checkpoint), "auto" (averaged if there is one, else latest), or a step.
    params_key: the params subtree of the saved train state.
    with_info: also return a dict describing what was loaded.

  Returns:
    params, or (params, info) with `with_info=True`; info has "kind"
    ("averaged" | "step"), "step", "path" and, for averaged, "averaged_steps".
  """
  workdir = epath.Path(os.path.abspath(workdir))
  if which == "auto":
    which = "averaged" if checkpoint_steps(workdir, AVERAGED_DIR) else "latest"
  if which == "averaged":
    steps = checkpoint_steps(workdir, AVERAGED_DIR)
    if not steps:
      raise FileNotFoundError(
          f"No averaged checkpoint in {workdir / AVERAGED_DIR}; average first"
          " (checkpoints.average_and_save) or load which='latest'."
      )
    path = _step_dir(workdir, steps[-1], AVERAGED_DIR)
    abstract = abstract_target(target_params)
    try:
      params = ocp.StandardCheckpointer().restore(path / PARAMS_ITEM, abstract)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"Could not restore {path / PARAMS_ITEM} into the given target: {e}") from e
    info = {"kind": "averaged", "step": steps[-1], "path": str(path),
            "averaged_steps": averaged_info(workdir)["averaged_steps"]}
  else:
    if which == "latest":
      steps = checkpoint_steps(workdir)
      if not steps:
        raise FileNotFoundError(f"No checkpoint in {workdir / CHECKPOINT_DIR}.")
      step = steps[-1]
    else:
      try:
        step = int(which)
      except (TypeError, ValueError):
        raise ValueError(
            f"which={which!r}: expected 'auto', 'averaged', 'latest' or a step number."
        ) from None
    path = _step_dir(workdir, step)
    if not (path / STATE_ITEM).exists():
      raise FileNotFoundError(
          f"No finished checkpoint {path}; available steps: {checkpoint_steps(workdir)}."
      )
    params = _restore_params_from_state(path / STATE_ITEM, target_params, params_key)
    info = {"kind": "step", "step": step, "path": str(path)}
  logger.info("Loaded params from %s", info["path"])
  return (params, info) if with_info else params
