"""Checkpoints: orbax CheckpointManager, exact resume (the averaged checkpoint and
loading parameters for decoding are `averaging.py`'s).

Layout inside the workdir::

    <workdir>/checkpoints/                    Checkpointer (keep the last N)
        <step>/                               one finished step (atomic rename)
            state/                            the train-state pytree (StandardSave)
            data_state/process_<i>-of-<n>.json  each process's data-iterator state
            meta/metadata                     JSON: step, time, process_count, ...
            _CHECKPOINT_METADATA, commit_success.txt    (orbax's own)
        <step>.orbax-checkpoint-tmp-<id>/     a save in progress (or killed);
                                              never listed, removed on next start

Atomicity: orbax writes every step into `<step>.orbax-checkpoint-tmp-<id>` and
renames it to `<step>` only once every item (and every process) has finished;
directories with the tmp suffix are ignored by `all_steps()`/`latest_step()`
and deleted by the next `Checkpointer` (`cleanup_tmp_directories=True`). A
process killed at any moment therefore leaves the last finished step intact
and restorable; a step that already exists is never written again.

A full disk: before each save the Checkpointer checks that the disk has room
for one more checkpoint (the size of the last complete one; from the second
save on); a write that still fails for want of space becomes the same
`disk_space.DiskFullError`, the unfinished checkpoint removed
(checkpoint_space.py; the error itself is disk_space.py's).

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

Processes without a shared disk (`per_process=True`; multihost.py says when):
each process writes every checkpoint whole into its own workdir, as if it were
alone (orbax's local-checkpoint setting: no primary host, every array written
from this process's own copy), so that each can resume, average and decode from
its disk. Before anything else the processes keep only the steps they all have
(a step one of them finished and another did not, killed in between, is
removed), so that all resume from the same step. The state must be
replicated: one sharded over the processes (FSDP) would leave each disk only
its own slices, and the trainer refuses that combination at its start.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from transformer.data import received
from transformer.runtime import checkpoint_names
from transformer.runtime import workdir as workdir_lib
from transformer.runtime.checkpoint_space import CheckpointSpace
from transformer.runtime.orbax_items import (ProcessJsonCheckpointHandler, ProcessJsonRestore,
                                             ProcessJsonSave, abstract_target,
                                             keep_common_steps, leaf_name, manager_options,
                                             multiprocessing_options, pytree_handler,
                                             pytree_restore, pytree_save)
from transformer.runtime.disk_space import DiskFullError, tree_bytes

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = checkpoint_names.CHECKPOINT_DIR
AVERAGED_DIR = checkpoint_names.AVERAGED_DIR
STATE_ITEM = "state"
DATA_ITEM = "data_state"
META_ITEM = checkpoint_names.META_ITEM
PARAMS_ITEM = "params"
PARAMS_KEY = "params"


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
    per_process: every process writes its own copy of every checkpoint into
      its own `workdir` (processes without a shared disk; module docstring).
      Ignored for a single process.

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
      per_process: bool = False,
  ):
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}.")
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}.")
    self.workdir = workdir_lib.resolve(workdir)
    self.directory = self.workdir / subdir
    # Orbax reads every file under it and prunes its old steps: a real folder
    # of the workdir, no link or FIFO in it (a workdir may be a received one).
    received.walk(self.directory, root=self.workdir, what="a checkpoint folder")
    self.per_process = per_process and jax.process_count() > 1
    if self.per_process and not read_only:
      keep_common_steps(self.directory)
    self.keep = keep
    self.save_every = save_every
    self.check_space = check_space
    self._saving_step: int | None = None   # the last save started
    self._failed = False                   # a save failed: close() only releases
    self._space = CheckpointSpace(self.directory, keep, self.per_process)
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
        **manager_options(self.per_process),
    )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_handlers={
            STATE_ITEM: pytree_handler(self.per_process),
            DATA_ITEM: ProcessJsonCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler(
                multiprocessing_options=multiprocessing_options(self.per_process)),
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
        STATE_ITEM: pytree_save(state, self.per_process),
        DATA_ITEM: ProcessJsonSave({"data_state": data_state}),
        META_ITEM: ocp.args.JsonSave(meta),
    })
    self._space.state_bytes = tree_bytes(state)
    if self.check_space and (force or self._manager.should_save(step)):
      self.wait()   # (orbax's save waits for the previous one first anyway)
      self._space.check(step)
    with self._space.full_disk_as_error(self._saving_step, self._give_up):
      saved = self._manager.save(step, args=args, force=force)
    if saved:
      self._saving_step = step
      logger.info("Saving checkpoint for step %d to %s", step, self.directory)
    return saved

  def _give_up(self) -> None:
    """After a save failed for a full disk: stop the manager (its other
    threads may still be writing); close() then only releases."""
    self._failed = True
    with contextlib.suppress(Exception):
      self._manager.close()

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
    items = {STATE_ITEM: pytree_restore(abstract, self.per_process)}
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
    wanted = {leaf_name(path): tuple(x.shape)
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
    with self._space.full_disk_as_error(self._saving_step, self._give_up):
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


def restore_params_from_state(path: epath.Path, target_params: Any, params_key: str) -> Any:
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
