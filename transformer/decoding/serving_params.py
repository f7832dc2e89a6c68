"""What a decode listed and restored, kept for the next decode of the same
workdir: a start that finds it neither lists nor restores the checkpoints
with orbax, nor imports orbax at all.

Why: a warm `decode.py` of 1,000 lines (the small-corpus model, 2-core CPU,
2026-11-26) spent 0.19 s importing orbax and 0.19-0.20 s restoring the
averaged parameters with it, a third of its start; reading this copy back
takes a few hundredths of a second.

What is kept, in `<compilation cache>/serving_params/`, one pair of files per
workdir (the older pair replaced, so never more than one copy of a model;
the pairs of workdirs that no longer exist are removed whenever a copy is
written):
  * `<name>.json`: which checkpoint each choice seen ("auto", "averaged",
    "latest", a step) named (`resolve`: `workdir.resolve_checkpoint` and the
    stale-average note);
  * `<name>.npz`: the parameters last restored, the checkpoint they came
    from and the load's info (`load`).
Both under the fingerprint of the workdir's checkpoint directories when they
were made: every file and directory under `checkpoints/` and
`checkpoints_averaged/`, with its size, modification time, inode, device and
change time (no copy keeps the last three: a model unpacked over the same
path with the same sizes and times is not served the old copy). Orbax's listing
and restore read nothing else (step directories, their commit files, the
arrays), so while the fingerprint is unchanged what is kept is exactly what
they would give. A new step, a new average, a save in progress, a removed or
rewritten file: each changes it, and that decode lists and restores with
orbax and keeps the result anew.

No copy is written where it would leave less than 1 GiB, or 4 times its own
size, free: the same disk may hold the next checkpoint of a training run of
the model (its parameters and Adam's two moments: 3 times the copy). (A
share of the disk, a tenth before, refused a 6 MB copy on a 250 GB disk with
24 GB free.)

Off with the compilation cache (`--compilation_cache=off`), and where it could
not stand for orbax: a workdir that is not a local path (listing gs://...
costs more than it saves), several processes, and parameters sharded over
the devices (FSDP: each device restores its own slices; the loader's choice).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import jax
import numpy as np
from etils import epath

from transformer.data.text_io import write_atomically
from transformer.decoding import executable_cache
from transformer.runtime.disk_space import tree_bytes
from transformer.runtime import workdir as workdir_lib

logger = logging.getLogger(__name__)

SUBDIRECTORY = "serving_params"
FORMAT = 1  # bump when what a file holds changes
MIN_FREE_BYTES = 1 << 30  # what a copy must leave free on the cache's disk, ...
MIN_FREE_COPIES = 4  # ... and this many times its size (`_room_for`)
_META = "__meta__"  # the npz entry that holds the JSON description


def directory() -> Path | None:
  """`serving_params/` in the compilation cache's directory, or None when that
  cache is off."""
  return executable_cache.directory(SUBDIRECTORY)


def applies(workdir: str | os.PathLike) -> bool:
  """Whether a copy can stand for the listing and restore (module docstring;
  the loader leaves FSDP-sharded parameters to orbax)."""
  return (directory() is not None and workdir_lib.is_local(os.fspath(workdir))
          and jax.process_count() == 1)


def fingerprint(workdir: str | os.PathLike, folders=None) -> str:
  """SHA-256 of every entry under the workdir's checkpoint directories
  (`folders`, their walk by `workdir.check_checkpoint_folders`, walked here
  if not given: no links, FIFOs or devices, a bounded number): its path,
  whether it is a directory, its size and modification time, and what no
  copy can carry over: its inode, device and change time. (`tar` and
  `cp -p` keep sizes and modification times: another model unpacked over
  the same path would match those.)"""
  if folders is None:
    folders = workdir_lib.check_checkpoint_folders(epath.Path(os.path.abspath(workdir)))
  digest = hashlib.sha256()
  for folder in folders:
    for entry in folder:
      digest.update(f"{entry.relative} {entry.is_dir} {entry.size} {entry.mtime_ns} "
                    f"{entry.ctime_ns} {entry.inode} {entry.device}\n".encode())
    digest.update(b"--\n")
  return digest.hexdigest()


def _path(workdir: str | os.PathLike, suffix: str) -> Path:
  name = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:32]
  return directory() / f"{name}{suffix}"


def resolve(workdir: str | os.PathLike, checkpoint: str | int, folders=None
            ) -> tuple[str | int, str | None]:
  """`workdir.list_checkpoint(workdir, checkpoint)`: as recorded when the
  checkpoint directories of the (resolved) `workdir` last had their present
  fingerprint (of `folders`, their walk, if given), else listed with orbax
  (and recorded). `workdir.read`'s `choose` for decoding. Raises what
  `resolve_checkpoint` raises."""
  checkpoint = workdir_lib.checkpoint_choice(checkpoint)
  if not applies(workdir):
    return workdir_lib.list_checkpoint(workdir, checkpoint)
  path, now = _path(workdir, ".json"), fingerprint(workdir, folders)
  try:
    record = json.loads(path.read_text())
    if record["format"] != FORMAT or record["fingerprint"] != now:
      record = None
    elif str(checkpoint) in record["resolved"]:
      which, note = record["resolved"][str(checkpoint)]
      return which, note
  except (OSError, ValueError, KeyError, TypeError):  # (unreadable: listed anew)
    record = None
  record = record or {"format": FORMAT, "fingerprint": now, "workdir": os.path.abspath(workdir),
                      "resolved": {}}
  which, note = workdir_lib.list_checkpoint(workdir, checkpoint)
  record["resolved"][str(checkpoint)] = [which, note]
  _write(path, lambda f: f.write(json.dumps(record).encode()))
  return which, note


def _describe(tree: Any) -> dict:
  """The structure, shapes and dtypes of a pytree (`target`'s or a copy's)."""
  leaves, treedef = jax.tree.flatten(tree)
  return {"tree": str(treedef),
          "leaves": [[list(x.shape), np.dtype(x.dtype).name] for x in leaves]}


def load(model: workdir_lib.Workdir, target: Any, restore: Callable[[], tuple[Any, dict]]
         ) -> tuple[Any, dict]:
  """(params, info): `restore()`'s (params restored with orbax from the
  checkpoint `model.checkpoint` chose, "averaged" or a step, into `target`,
  and the load's info), or the same as numpy arrays read from the copy kept
  when the checkpoint directories last had their present fingerprint. A
  restore leaves a copy for the next load; a file that does not read is
  restored and written anew."""
  workdir, which = model.path, model.checkpoint
  if not applies(workdir):
    return restore()
  # (taken before a restore, see below: when the checkpoint was chosen)
  path, now = _path(workdir, ".npz"), fingerprint(workdir, model.checkpoint_folders)
  if path.exists():
    try:
      with np.load(path, allow_pickle=False) as stored:
        meta = json.loads(str(stored[_META]))
        if (meta["format"] == FORMAT and meta["fingerprint"] == now
            and meta["which"] == which and meta["shapes"] == _describe(target)):
          # Stored as bytes: np.save writes bfloat16 as an opaque void type.
          leaves = [stored[f"leaf_{i}"].view(np.dtype(dtype)).reshape(shape)
                    for i, (shape, dtype) in enumerate(meta["shapes"]["leaves"])]
          return jax.tree.unflatten(jax.tree.structure(target), leaves), meta["info"]
    except Exception as e:  # (a truncated or foreign file: restore and write it again)
      logger.warning("Serving copy %s did not load (%s: %s); restoring the checkpoint.",
                     path, type(e).__name__, e)
  params, info = restore()
  if not _room_for(tree_bytes(params)):
    return params, info
  # Kept under the fingerprint taken before the restore: a checkpoint written
  # meanwhile makes the copy stale (restored again next time), never wrong.
  meta = {"format": FORMAT, "fingerprint": now, "which": which, "workdir": str(workdir),
          "shapes": _describe(params), "info": info}
  arrays = {f"leaf_{i}": np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            for i, x in enumerate(jax.tree.leaves(params))}
  _write(path, lambda f: np.savez(f, **{_META: np.array(json.dumps(meta))}, **arrays))
  _forget_removed_workdirs()
  return params, info


def _room_for(size: int) -> bool:
  """Whether a copy of `size` bytes leaves the disk of the cache at least
  MIN_FREE_BYTES and MIN_FREE_COPIES x `size` free: a copy is a convenience,
  and the same disk may hold a training run's next checkpoint of the model
  (3 x its parameters with Adam). Says so when not."""
  where = directory()
  try:
    where.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(where)
  except OSError:
    return False
  if usage.free - size >= max(MIN_FREE_BYTES, MIN_FREE_COPIES * size):
    return True
  logger.info("No serving copy of the parameters kept: %.1f GB would leave %.1f GB free "
              "on the disk of %s.", size / 1e9, (usage.free - size) / 1e9, where)
  return False


def _forget_removed_workdirs() -> None:
  """Removes the files kept for workdirs that no longer exist (a model's
  copy is as large as the model; a deleted run should not leave one)."""
  for record_path in directory().glob("*.json"):
    try:
      gone = not os.path.isdir(json.loads(record_path.read_text())["workdir"])
    except (OSError, ValueError, KeyError, TypeError):  # (unreadable: made anew when used)
      gone = True
    if gone:
      for path in (record_path, record_path.with_suffix(".npz")):
        path.unlink(missing_ok=True)


def _write(path: Path, write: Callable[[BinaryIO], None]) -> None:
  """`text_io.write_atomically` (a reader never sees half a file); a disk that
  refuses it is noted and skipped: decoding goes on."""
  try:
    write_atomically(path, write)
  except OSError as e:
    logger.warning("Could not keep the serving copy %s (%s: %s).", path,
                   type(e).__name__, e)
