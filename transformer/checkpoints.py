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

import dataclasses
import datetime
import json
import logging
import os
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

  Call `close()` (or use `with Checkpointer(...) as ckpt:`) at the end so the
  last save is finished and old steps are deleted.
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
  ):
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}.")
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}.")
    self.workdir = epath.Path(os.path.abspath(workdir))
    self.directory = self.workdir / subdir
    self.keep = keep
    self.save_every = save_every
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
    saved = self._manager.save(step, args=args, force=force)
    if saved:
      logger.info("Saving checkpoint for step %d to %s", step, self.directory)
    return saved

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
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last save, finishes deletions and releases resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


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
    manager.save(step, args=ocp.args.Composite(**{
        PARAMS_ITEM: ocp.args.StandardSave(params),
        META_ITEM: ocp.args.JsonSave(meta),
    }), force=True)
    manager.wait_until_finished()
  finally:
    manager.close()
  return directory / str(step)


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
