"""The parameters alone: the average of the last N checkpoints, as the paper
does (base: 5, big: 20), written as a checkpoint of its own, and loading
parameters, averaged or of one step, for decoding.

    <workdir>/checkpoints_averaged/
        <last averaged step>/       one checkpoint (the newest average)
            params/                 the averaged params pytree
            meta/metadata           JSON: {"averaged_steps": [...], ...}

The training checkpoints themselves (train state, data position, resume) are
`checkpoints.py`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from transformer.data import received
from transformer.runtime import workdir as workdir_lib
from transformer.runtime.checkpoint_names import averaged_info, checkpoint_steps, step_dir
from transformer.runtime.checkpoints import (AVERAGED_DIR, CHECKPOINT_DIR, META_ITEM, PARAMS_ITEM,
                                             PARAMS_KEY, STATE_ITEM, restore_params_from_state)
from transformer.runtime.orbax_items import (abstract_target, manager_options,
                                             multiprocessing_options, pytree_handler,
                                             pytree_save)
from transformer.runtime.disk_space import (SPACE_MARGIN, DiskFullError, is_disk_full,
                                    remove_unfinished, tree_bytes)

logger = logging.getLogger(__name__)


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
      directory = workdir_lib.resolve(workdir) / CHECKPOINT_DIR
      raise FileNotFoundError(f"No checkpoints to average in {directory}.")
    steps = available[-num:]
  steps = [int(s) for s in steps]
  if not steps:
    raise ValueError("average_checkpoints: no steps given.")
  abstract = abstract_target(target_params)
  acc = None
  for step in steps:
    path = step_dir(workdir, step) / STATE_ITEM
    if not path.exists():
      raise FileNotFoundError(f"No finished checkpoint {path.parent} to average.")
    params = restore_params_from_state(path, abstract, params_key)
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
    per_process: bool = False,
) -> epath.Path:
  """Saves averaged params to `<workdir>/checkpoints_averaged/<max(steps)>/`
  (with `per_process`, every process into its own workdir: see
  `checkpoints.Checkpointer`).

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
  directory = workdir_lib.resolve(workdir) / AVERAGED_DIR
  received.check_directory(directory, root=workdir_lib.resolve(workdir),
                           what="the averaged checkpoint's folder")  # (orbax prunes it)
  step = max(steps)
  per_process = per_process and jax.process_count() > 1
  manager = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(
          preservation_policy=ocp.checkpoint_managers.LatestN(1),
          enable_async_checkpointing=False,
          cleanup_tmp_directories=True,
          **manager_options(per_process),
      ),
      item_handlers={PARAMS_ITEM: pytree_handler(per_process),
                     META_ITEM: ocp.JsonCheckpointHandler(
                         multiprocessing_options=multiprocessing_options(per_process))},
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
    needed = int(tree_bytes(params) * (1 + SPACE_MARGIN))   # (for the message)
    try:
      manager.save(step, args=ocp.args.Composite(**{
          PARAMS_ITEM: pytree_save(params, per_process),
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
                                remove_unfinished(directory)) from e
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
              f"{workdir_lib.resolve(workdir) / CHECKPOINT_DIR} are complete), or "
              "set config.average_last=1 to skip averaging"))


def average_and_save(
    workdir: str | os.PathLike,
    target_params: Any,
    *,
    num: int = 5,
    steps: Sequence[int] | None = None,
    params_key: str = PARAMS_KEY,
    per_process: bool = False,
) -> tuple[Any, list[int]]:
  """`average_checkpoints` + `save_averaged` (`per_process`: see there);
  returns (params, steps averaged)."""
  if steps is None:
    steps = checkpoint_steps(workdir)[-num:]
    if not steps:
      directory = workdir_lib.resolve(workdir) / CHECKPOINT_DIR
      raise FileNotFoundError(f"No checkpoints to average in {directory}.")
  steps = [int(s) for s in steps]
  params = average_checkpoints(workdir, target_params, steps=steps, params_key=params_key)
  save_averaged(workdir, params, steps, per_process=per_process)
  return params, steps


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
    workdir: the run's workdir, resolved (`workdir.read`'s `Workdir.path`).
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
  workdir = epath.Path(workdir)  # (resolved already: the door's `Workdir.path`)
  if which == "auto":
    which = "averaged" if checkpoint_steps(workdir, AVERAGED_DIR) else "latest"
  if which == "averaged":
    steps = checkpoint_steps(workdir, AVERAGED_DIR)
    if not steps:
      raise FileNotFoundError(
          f"No averaged checkpoint in {workdir / AVERAGED_DIR}; average first"
          " (averaging.average_and_save) or load which='latest'."
      )
    path = step_dir(workdir, steps[-1], AVERAGED_DIR)
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
    path = step_dir(workdir, step)
    if not (path / STATE_ITEM).exists():
      raise FileNotFoundError(
          f"No finished checkpoint {path}; available steps: {checkpoint_steps(workdir)}."
      )
    params = restore_params_from_state(path / STATE_ITEM, target_params, params_key)
    info = {"kind": "step", "step": step, "path": str(path)}
  logger.info("Loaded params from %s", info["path"])
  return (params, info) if with_info else params
