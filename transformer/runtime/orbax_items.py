"""How orbax writes and reads this project's checkpoint items: the data
iterator's state as one JSON file per process (`ProcessJsonCheckpointHandler`),
every process its own whole copy when the processes share no disk
(`pytree_handler(per_process=True)`, `manager_options`, `keep_common_steps`),
and the abstract restore targets with their shardings (`abstract_target`).
`checkpoints.Checkpointer` and `averaging` build on these."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from transformer.data import received
from transformer.runtime import multihost, parallel

logger = logging.getLogger(__name__)
# A data pipeline's saved position: grain's iterator state, a few KB (a file
# of 10,000 sentence ids would be ~100 KB); a received checkpoint's is read
# no further than this.
DATA_STATE_LIMIT = 64 << 20


# Per-process JSON item (the data-iterator state)


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
    # (a received workdir's checkpoint, walked already: no link or FIFO in it)
    return json.loads(received.read_bytes(path, root=None, kind="record",
                                          limit=DATA_STATE_LIMIT,
                                          what="the data pipeline's position"))


@ocp.args.register_with_handler(ProcessJsonCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(ProcessJsonCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
  item: Any = None


# Every process its own copy (no shared disk)


class _NoPrimaryHostNotes(logging.Filter):
  """Drops orbax's warning, at every save, that it does not log global sizes
  without a primary host (the setting of `per_process`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "logging disabled for `primary_host=None`" not in record.getMessage()


_NO_PRIMARY_HOST_NOTES = _NoPrimaryHostNotes()


def multiprocessing_options(per_process: bool) -> ocp.options.MultiprocessingOptions:
  """orbax's default (process 0 the primary host, arrays written once for all
  processes), or with `per_process` none (every process writes all)."""
  if not per_process:
    return ocp.options.MultiprocessingOptions()
  logging.getLogger("absl").addFilter(_NO_PRIMARY_HOST_NOTES)
  return ocp.options.MultiprocessingOptions(primary_host=None)


def pytree_handler(per_process: bool):
  """The handler of a pytree of arrays: orbax's StandardCheckpointHandler, or
  with `per_process` a PyTreeCheckpointHandler whose jax.Arrays are written by
  every process from its own shards (replica_id=None), as orbax's emergency
  local checkpoints are; its items are saved with `pytree_save` and restored
  with `pytree_restore`. (Numpy leaves are refused there: orbax writes those
  from process 0 only.)"""
  if not per_process:
    return ocp.StandardCheckpointHandler()
  registry = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(
          primary_host=None, replica_id=None, use_replica_parallel=False)))
  return ocp.PyTreeCheckpointHandler(multiprocessing_options=multiprocessing_options(True),
                                     type_handler_registry=registry)


def pytree_save(tree: Any, per_process: bool):
  return ocp.args.PyTreeSave(tree) if per_process else ocp.args.StandardSave(tree)


def pytree_restore(abstract: Any, per_process: bool):
  if not per_process:
    return ocp.args.StandardRestore(abstract)
  return ocp.args.PyTreeRestore(
      item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def manager_options(per_process: bool) -> dict[str, Any]:
  """CheckpointManagerOptions fields for `per_process` (none otherwise)."""
  if not per_process:
    return {}
  return {"multiprocessing_options": multiprocessing_options(True),
          "enable_per_process_directory_creation": True}


def keep_common_steps(directory: epath.Path) -> list[int]:
  """Removes the steps in `directory` that not every process has (each
  process its own directory); returns the steps kept. Raises ValueError,
  removing nothing, when the processes have steps but none in common (a
  workdir emptied or replaced: its checkpoints are not reproducible)."""
  steps = sorted(ocp.utils.checkpoint_steps(directory)) if directory.exists() else []
  common = multihost.common_steps(steps)
  if not common and not multihost.all_processes(not steps):
    raise ValueError(
        f"The processes' workdirs have no checkpoint step in common (here, {directory}: "
        f"{steps or 'none'}): the workdir of a process lost its checkpoints, and resuming "
        "needs those of every process. Restore that workdir, or train from the start into "
        "new workdirs.")
  for step in sorted(set(steps) - set(common)):
    logger.warning("Removing checkpoint step %d from %s: not every process has it (a run "
                   "stopped while saving); all resume from step %s.", step, directory,
                   max(common) if common else "0")
    (directory / str(step)).rmtree()
  return common


# Targets and shardings


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


def leaf_name(path) -> str:
  """A leaf's key path as orbax names it in its metadata: "opt_state.0.mu.x"."""
  parts = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return ".".join(parts)
