"""Room for the next checkpoint: what `checkpoints.Checkpointer` does about disk space.

Before each save, `CheckpointSpace.check` compares the free space with the size
on disk of the last complete checkpoint (from the second save on: the first
tells a checkpoint's size) and raises `disk_space.DiskFullError` before anything
is written. `CheckpointSpace.full_disk_as_error` turns a write that still fails
for want of space, reported by whichever orbax call learns of it, into the same
error, the unfinished checkpoint removed.

The error and the measuring are `disk_space.py`'s, shared with the averaging;
this module adds the Checkpointer's part: which step to measure, which process
decides, and what to advise.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from transformer.runtime import multihost
from transformer.runtime import workdir as workdir_lib
from transformer.runtime.disk_space import (SPACE_MARGIN, DiskFullError, disk_bytes, is_disk_full,
                                            remove_unfinished)


class CheckpointSpace:
  """The disk-space checks of one Checkpointer's directory.

  Args:
    directory: the checkpoints' directory (`<workdir>/checkpoints`).
    keep: the Checkpointer's `keep`, named in the advice.
    per_process: every process writes to its own disk (then each checks its own).
  """

  def __init__(self, directory: epath.Path, keep: int | None, per_process: bool):
    self.directory = directory
    self.keep = keep
    self.per_process = per_process
    self.state_bytes = 0                   # the arrays of the last state saved
    self._measured: tuple[int, int] | None = None   # (step, its bytes on disk)

  def check(self, step: int) -> None:
    """Raises DiskFullError, before anything is written, if the disk has
    less room than the next checkpoint needs (`needed_bytes`): once the size
    of one is known (before the first, a full disk is caught when a write
    fails). With several processes, process 0 decides for all, or with
    `per_process` (each its own disk) every process for its disk. Object
    stores (gs://...) are not checked."""
    latest = self.finished_step()
    if latest is None:
      return
    needed = self.needed_bytes(latest)
    free = shutil.disk_usage(self.directory).free if workdir_lib.is_local(self.directory) else None
    fits = free is None or free >= needed
    if self.per_process:
      fits = multihost.all_processes(fits)
    elif jax.process_count() > 1:
      from jax.experimental import multihost_utils
      fits = bool(multihost_utils.broadcast_one_to_all(np.int32(fits)))
    free = needed if free is None else free
    if not fits:
      raise DiskFullError(self.directory, f"the checkpoint of step {step}", needed, free,
                          latest, advice=self.advice(latest))

  def finished_step(self) -> int | None:
    """The newest complete step, from the directory itself (not orbax's
    bookkeeping, which may count a save that failed)."""
    steps = ocp.utils.checkpoint_steps(self.directory) if self.directory.exists() else []
    return max(steps) if steps else None

  def needed_bytes(self, latest: int | None) -> int:
    """The room the next checkpoint needs: the size on disk of the last
    complete one (measured once per step; orbax compresses, so the arrays'
    size is only a guess, used when there is none), plus SPACE_MARGIN."""
    if latest is not None and (self._measured is None or self._measured[0] != latest):
      self._measured = (latest, disk_bytes(self.directory / str(latest)))
    size = self._measured[1] if latest is not None else self.state_bytes
    return int(size * (1 + SPACE_MARGIN))

  def advice(self, latest: int | None) -> str:
    """What to do when the disk is full: orbax deletes the oldest checkpoint
    only after the next one is complete, so keeping fewer frees nothing by
    itself; deleting old steps does."""
    if latest is None:
      return "Free space on that disk, or train into a workdir on a larger one"
    keep = f"; keep fewer with config.keep_checkpoints, now {self.keep}" if self.keep else ""
    return (f"Free space on that disk (deleting older steps in {self.directory} helps: "
            f"step {latest} alone is enough to resume{keep})")

  @contextlib.contextmanager
  def full_disk_as_error(self, saving_step: int | None, give_up: Callable[[], None]):
    """Turns orbax's report of a full disk, from whichever call learns of it,
    into DiskFullError, the unfinished checkpoint removed. `give_up` runs
    first (the Checkpointer stops its manager, whose threads may still be
    writing); `saving_step` is named when no unfinished step directory is."""
    try:
      yield
    except Exception as e:
      if not is_disk_full(e):
        raise
      give_up()
      unfinished = remove_unfinished(self.directory)
      steps = [int(n.split(".")[0]) for n in unfinished if n.split(".")[0].isdigit()]
      latest = self.finished_step()
      step = max(steps, default=saving_step)
      raise DiskFullError(self.directory, f"the checkpoint of step {step}",
                          self.needed_bytes(latest), shutil.disk_usage(self.directory).free,
                          latest, unfinished=unfinished, advice=self.advice(latest)) from e
