"""The small JSON records a workdir may hold besides its configs, read as
data (docs/security.md): a record of the wrong type or out of range is one
sentence naming the file, never a traceback and never a value used anyway.

    <workdir>/import.json     where an imported model came from (IMPORT_FILE;
                              written by `interop.marian`)
    <workdir>/decoding.json   the beam search length penalty its training run
                              tested it with, where not the paper's
                              (DECODING_FILE; `training/length_choice.py`):
                              decode.py's and the API's default for this workdir
"""

from __future__ import annotations

import json
import math

from etils import epath

from transformer.data import received

IMPORT_FILE = "import.json"
DECODING_FILE = "decoding.json"
# What decoding.json may set, and the range a writer of ours writes: beam
# search's length penalty alpha (the paper's 0.6; GNMT searched 0-1).
DECODING_FIELDS = {"length_penalty": (0.0, 5.0)}


def _read_object(path: epath.Path, what: str, writer: str) -> dict | None:
  """The JSON object in `path`, None where there is no file."""
  if not received.exists(path):
    return None
  document = received.read_bytes(path, root=path.parent, kind="record", what=what)
  try:
    record = json.loads(document)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e}); it is written by {writer}, do not "
                     "edit it") from None
  if not isinstance(record, dict):
    raise ValueError(f"{path} is not {what} (a JSON object is expected, not "
                     f"{type(record).__name__}); it is written by {writer}, do not edit it")
  return record


def read_import(workdir: epath.Path) -> dict | None:
  """import.json of the resolved `workdir`, or None where it has none."""
  return _read_object(workdir / IMPORT_FILE, "an import record", "the importer")


def read_decoding(workdir: epath.Path) -> dict[str, float]:
  """The settings decoding.json of the resolved `workdir` holds
  (`DECODING_FIELDS`, e.g. {"length_penalty": 1.0}); {} where it has none."""
  path = workdir / DECODING_FILE
  record = _read_object(path, "a decoding record", "train.py") or {}
  settings = {}
  for name, (low, high) in DECODING_FIELDS.items():
    if name not in record:
      continue
    value = record[name]
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value) or not low <= value <= high):
      raise ValueError(f"{path}: {name} is {value!r}, not a number in [{low}, {high}]; it is "
                       "written by train.py, do not edit it (delete it for the defaults)")
    settings[name] = float(value)
  return settings


def decoding_record(settings: dict[str, float], **measured) -> bytes:
  """decoding.json's bytes: `settings` (DECODING_FIELDS) and what chose them."""
  unknown = set(settings) - set(DECODING_FIELDS)
  if unknown:
    raise ValueError(f"not decoding settings: {sorted(unknown)}")
  return json.dumps(dict(settings, **measured), indent=2).encode()
