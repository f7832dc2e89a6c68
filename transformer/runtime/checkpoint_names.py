"""Where a workdir keeps its checkpoints, apart from the orbax code that writes
and reads them (`checkpoints.py`, `averaging.py`): their directories, the
finished steps in them and the averaged checkpoint's record. What needs only
these (the fingerprint of `decoding/serving_params.py`, `workdir.read`'s
choice of a checkpoint) imports orbax only to list steps, and neither the
writers nor the restore (0.2 s of a decode's start).

Every function here takes a workdir's path resolved already
(`workdir.resolve`, the door's `Workdir.path`): nothing below the door
resolves or interprets a workdir again."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath

from transformer.data import received

CHECKPOINT_DIR = "checkpoints"  # <workdir>/checkpoints/<step>/: the training checkpoints
AVERAGED_DIR = "checkpoints_averaged"  # <workdir>/checkpoints_averaged/<step>/: their average
META_ITEM = "meta"  # <step>/meta/metadata: a checkpoint's JSON record


def step_dir(workdir: str | os.PathLike, step: int, subdir: str = CHECKPOINT_DIR
             ) -> epath.Path:
  """`<workdir>/<subdir>/<step>`."""
  return epath.Path(workdir) / subdir / str(int(step))


def checkpoint_steps(workdir: str | os.PathLike, subdir: str = CHECKPOINT_DIR) -> list[int]:
  """Finished steps in `<workdir>/<subdir>`, ascending (orbax's tmp dirs of
  saves in progress excluded)."""
  import orbax.checkpoint as ocp  # (listing only: see the module docstring)
  directory = epath.Path(workdir) / subdir
  if not directory.exists():
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


def averaged_info(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """Metadata of the averaged checkpoint ({"averaged_steps": ..., ...}) or None.
  `workdir`: resolved already. Raises ValueError, in one sentence naming the
  file, where the record is not what `save_averaged` writes (a workdir is data:
  docs/security.md)."""
  steps = checkpoint_steps(workdir, AVERAGED_DIR)
  if not steps:
    return None
  path = step_dir(workdir, steps[-1], AVERAGED_DIR) / META_ITEM / "metadata"
  try:
    info = json.loads(received.read_bytes(path, root=workdir, kind="record",
                                          what="the averaged checkpoint's record"))
  except received.RefusedFile:  # (its own sentence)
    raise
  except (OSError, ValueError) as e:
    raise ValueError(f"{path} cannot be read ({e}); it is written by train.py when it "
                     "averages, do not edit it") from None
  averaged = info.get("averaged_steps") if isinstance(info, dict) else None
  if (not isinstance(averaged, list) or not averaged
      or not all(type(s) is int and 0 <= s <= steps[-1] for s in averaged)):
    raise ValueError(f"{path} is not an averaged checkpoint's record (its averaged_steps must "
                     f"be a list of steps up to {steps[-1]}); it is written by train.py when "
                     "it averages, do not edit it")
  info["step"] = steps[-1]
  return info


@dataclasses.dataclass(frozen=True)
class Listing:
  """What a workdir's checkpoint directories hold (`listing`)."""
  steps: list[int]  # the finished training checkpoints
  averaged: list[int]  # the averaged checkpoint's step (one at most)
  averaged_up_to: int | None  # the last step that average covers (None: no average)


def listing(workdir: str | os.PathLike) -> Listing:
  """The finished steps, the averaged checkpoint and the last step it covers
  (its record's averaged_steps; where that record does not read, the step it
  is filed under), listed once."""
  steps = checkpoint_steps(workdir)
  averaged = checkpoint_steps(workdir, AVERAGED_DIR)
  averaged_up_to = None
  if averaged:
    try:
      averaged_up_to = max(averaged_info(workdir)["averaged_steps"])
    except (ValueError, TypeError):  # (an absurd record; None: removed meanwhile)
      averaged_up_to = averaged[-1]
  return Listing(steps, averaged, averaged_up_to)
