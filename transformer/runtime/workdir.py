"""What a run directory (the workdir) holds: its files, its configs, the vocabulary
rule, the resume check and which checkpoint a name means. (The lock is in
`run_lock.py`, the run's log in `run_log.py`, the loader in `decoding/loader.py`.)

train.py writes, and decode.py, the Python API (`transformer.load_translator`)
and the notebook read::

    <workdir>/config.json            the full training config (CONFIG_FILE)
    <workdir>/model_config.json      the TransformerConfig (MODEL_CONFIG_FILE)
    <workdir>/vocab.model            the SentencePiece vocabulary (VOCAB_FILE)
    <workdir>/checkpoints/           orbax checkpoints (checkpoint_names.CHECKPOINT_DIR)
    <workdir>/checkpoints_averaged/  the average of the last ones (checkpoint_names.AVERAGED_DIR)
    <workdir>/metrics.jsonl, tensorboard/   metrics (see metrics.py)
    <workdir>/decoding.json, import.json   small records (workdir_records.py)
    <workdir>/train.lock             held by the run training here (LOCK_FILE)
    <workdir>/train.log              that run's log and the traceback of a fatal
                                     error, appended run after run (LOG_FILE)

A model imported from Marian / OPUS-MT (`transformer.interop.marian`) is a
workdir too: model_config.json, vocab.model (then Marian's two SentencePiece
models and piece table in one JSON document), its parameters as the averaged
checkpoint, and import.json (IMPORT_FILE), which train.py refuses to train in
(fine-tune from it into a new workdir: --config.init_from).

The vocabulary rule: <workdir>/vocab.model, which train.py always writes (a copy
of config.vocab_path when that is set, so that the workdir alone is enough to
decode); a workdir without it (one whose vocab.model was deleted, or written
before train.py made that copy) falls back to the vocab_path in its config.json.

Which checkpoint: "auto" (the averaged one unless a later step was saved after it, else the latest),
"averaged", "latest", or a step number; `resolve_checkpoint` turns that into
"averaged" or a step, or an error that says what is missing and what to do.

Read once, through one door: `read` turns a trained workdir into a `Workdir`
value, checking what it reads (a workdir is data: docs/security.md). The
loader, the serving copy and fine-tuning take that value; the layers below
(checkpoint listing, averaging, restore) take its resolved path only.

Every file written here is written whole or not at all (`write_file`).
Workdirs may be local paths or addresses such as gs://bucket/run: files are
read and written through `etils.epath` (`resolve`), as orbax does;
the lock and the run's log, which need a local file system, are skipped
elsewhere, with a note.

One run at a time: `hold` locks the workdir for a training run (an OS file
lock on train.lock, so that a run killed with SIGKILL leaves no stale lock);
a second run stops at once, naming the holder. Readers (decode.py, the
loader) take no lock: they read finished checkpoints only.

A resumed run keeps what its checkpoints were trained with: `check_config`
compares the config with the workdir's config.json before anything is
loaded; only RESUMABLE_FIELDS may change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
from collections.abc import Callable

from etils import epath

from transformer.data import received
from transformer.data.text_io import write_atomically
from transformer.model.config import TransformerConfig
from transformer.runtime import checkpoint_names, workdir_records
from transformer.runtime.errors import OptionError

CONFIG_FILE = "config.json"
MODEL_CONFIG_FILE = "model_config.json"
VOCAB_FILE = "vocab.model"
LOCK_FILE = "train.lock"
LOG_FILE = "train.log"
IMPORT_FILE = workdir_records.IMPORT_FILE
CHECKPOINT_CHOICES = ("auto", "averaged", "latest")  # or a step number

# The config fields a run may change when it resumes a workdir. None of them
# enters a training step, so a resumed run still ends with the parameters of
# an uninterrupted one: how long to train (num_train_steps; the learning rate
# does not depend on it), what is measured and logged, and when and how many
# checkpoints are kept and averaged; data.tfds_data_dir says where TFDS keeps
# its prepared files, not which data; shared_workdir, whether the processes
# share the workdir (found out anew at every start when "auto"). Every other field must match
# (`check_config`): model.* (the parameters' shapes and what they compute),
# data.* and vocab_* (which sentences, which pieces), batch_size, max_length,
# pack, grad_accum_steps and seed (which batches in which order: the data
# position saved in a checkpoint means nothing in another pipeline), and the
# update rule (warmup_steps, learning_rate_scale, adam_*, label_smoothing,
# grad_clip_norm); so does any field not listed here, new ones included.
RESUMABLE_FIELDS = (
    "num_train_steps", "train_minutes", "test_report", "test_decode_method",
    "data.test_path", "data.test_src", "data.test_tgt", "data.tfds_test_split",
    "log_every", "eval_every", "eval_batch_size", "num_eval_examples",
    "num_bleu_examples", "eval_decode_method", "eval_beam_size",
    "checkpoint_every", "keep_checkpoints", "average_last", "keep_average", "budget_eval_minutes",
    "data.tfds_data_dir", "state_sharding", "shared_workdir",
    "init_from",  # (read at step 0 only; a resumed run continues from its own checkpoint)
    "data.prepared", "data.prepared_dir",  # the same batches from the text or its shards
    "data.workers",  # (the data position records its worker count: another is refused then)
)

logger = logging.getLogger(__name__)


class CheckpointNotFound(FileNotFoundError):
  """The checkpoint asked for is not in the workdir. `str(e)` reads
  "checkpoint=<which>: <problem>"; `option`, `value` and `problem` are kept
  apart, as in `errors.OptionError`, so that a command line can name its
  flag instead (decode.py: "--checkpoint=<which>: ...")."""

  def __init__(self, value, problem: str):
    super().__init__(f"checkpoint={value}: {problem}")
    self.option, self.value, self.problem = "checkpoint", value, problem


# ----------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------


def is_local(path: str | os.PathLike) -> bool:
  """Whether `path` is on a local (or mounted) file system, not an address
  like gs://bucket/run."""
  return not received.is_address(path)


def resolve(workdir: str | os.PathLike) -> epath.Path:
  """`workdir` as an epath.Path: absolute if local, an address unchanged
  (`os.path.abspath` would make gs://bucket/run /cwd/gs:/bucket/run)."""
  text = os.fspath(workdir)
  return epath.Path(os.path.abspath(text) if is_local(text) else text)


def write_file(path: str | os.PathLike, content: bytes | str) -> None:
  """Writes `content` whole: locally through `text_io.write_atomically` (a
  temporary file renamed), elsewhere as one object (object stores replace
  an object whole)."""
  if is_local(path):
    write_atomically(path, content)
    return
  path = epath.Path(os.fspath(path))
  path.parent.mkdir(parents=True, exist_ok=True)
  if isinstance(content, str):
    path.write_text(content)
  else:
    path.write_bytes(content)


def _train_hint(workdir: str) -> str:
  return f"train a model first: python train.py --workdir={workdir}"


# ----------------------------------------------------------------------------
# Configs and vocabulary
# ----------------------------------------------------------------------------


def save_configs(workdir: str, config: dict, model_config: TransformerConfig) -> None:
  """Writes config.json (the training config, as a dict) and model_config.json."""
  for name, value in ((CONFIG_FILE, config), (MODEL_CONFIG_FILE, model_config.to_dict())):
    write_file(os.path.join(workdir, name), json.dumps(value, indent=2, sort_keys=True))


def load_model_config(workdir: str) -> TransformerConfig:
  """The TransformerConfig saved in `workdir`.

  Raises:
    FileNotFoundError: no model_config.json (not a workdir written by train.py).
    ValueError: it is not a valid model config (edited by hand, truncated).
  """
  path = _model_config_path(workdir)
  document = received.read_text(path, root=workdir, kind="config", what="the model config")
  try:
    return TransformerConfig.from_dict(json.loads(document))
  except (ValueError, TypeError, AttributeError) as e:
    raise ValueError(f"{path} is not a valid model config ({e}); it is written by "
                     "train.py, do not edit it") from None


def _model_config_path(workdir: str) -> str:
  """<workdir>/model_config.json, or FileNotFoundError if it is not there."""
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  if not received.exists(path):
    raise FileNotFoundError(f"{path} not found: {workdir} is not a workdir written by "
                            f"train.py; {_train_hint(workdir)}")
  return path


def vocab_path(workdir: str | os.PathLike) -> str:
  """The workdir's vocabulary file (the rule is in the module docstring). A
  vocab_path in config.json is followed only inside the workdir (a workdir
  is data: it does not choose which of this machine's files are read).

  Raises FileNotFoundError naming what is missing and what to do.
  """
  workdir = os.fspath(workdir)
  path = os.path.join(workdir, VOCAB_FILE)
  if received.exists(path):  # (a link or a FIFO too: reading it says what it is)
    return path
  configured, config_path = "", os.path.join(workdir, CONFIG_FILE)
  if received.exists(config_path):
    document = received.read_bytes(config_path, root=workdir, kind="config")
    try:
      configured = json.loads(document).get("vocab_path") or ""
    except (ValueError, AttributeError):  # (no JSON object: no vocab_path in it)
      pass
  if not isinstance(configured, str):
    configured = ""
  if configured and not _inside(workdir, configured):
    raise FileNotFoundError(
        f"{path} not found, and {os.path.join(workdir, CONFIG_FILE)} names the vocabulary "
        f"{configured}, outside the workdir, which is not read from a workdir's record: "
        f"copy it in (cp {configured} {path})")
  if configured and epath.Path(configured).exists():
    return configured
  also = f" (nor the config's vocab_path {configured})" if configured else ""
  raise FileNotFoundError(f"{path} not found{also}: the vocabulary is missing; "
                          f"{_train_hint(workdir)} (it writes {VOCAB_FILE} first)")


def _inside(workdir: str, path: str) -> bool:
  """Whether `path` (relative paths: to the workdir) lies inside `workdir`,
  links followed; an address (gs://...) only under the workdir's own."""
  if not is_local(workdir) or not is_local(path):  # (.. resolved in the address too)
    return posixpath.normpath(path).startswith(posixpath.normpath(workdir) + "/")
  top = os.path.realpath(workdir)
  return os.path.commonpath([top, os.path.realpath(os.path.join(workdir, path))]) == top


def check_files(workdir: str) -> None:
  """Checks that `workdir` holds a model config and a vocabulary, without
  loading anything (decode.py calls it before reading its input).

  Raises FileNotFoundError naming the first thing missing and what to do.
  """
  if not epath.Path(workdir).is_dir():
    raise FileNotFoundError(f"workdir {workdir} does not exist; {_train_hint(workdir)}")
  _model_config_path(workdir)
  vocab_path(workdir)


# ----------------------------------------------------------------------------
# Config changes on resume
# ----------------------------------------------------------------------------


class ConfigMismatch(ValueError):
  """The config differs from the workdir's config.json in fields that must
  match (`check_config`); `differences` lists (field, stored, requested)."""

  def __init__(self, workdir: str, differences: list[tuple[str, object, object]]):
    lines = "\n".join(f"  {name}: {_show(stored)} -> {_show(requested)}"
                      for name, stored, requested in differences)
    super().__init__(
        f"{workdir} was trained with another config ({os.path.join(workdir, CONFIG_FILE)}): "
        f"its checkpoints resume only with the same model, vocabulary, data, batches and "
        f"optimizer, and these fields differ (stored -> requested):\n{lines}\n"
        f"Either train into a new --workdir, or drop these overrides to resume {workdir} "
        f"as it was. (Only {', '.join(RESUMABLE_FIELDS)} may change on resume.)")
    self.workdir, self.differences = workdir, differences


_MISSING = object()


def _show(value) -> str:
  return "(not set)" if value is _MISSING else json.dumps(value)


def check_config(workdir: str, config: dict) -> list[tuple[str, object, object]]:
  """Compares `config` (this run's, as a dict) with the workdir's config.json
  before anything is loaded, restored or compiled: it reads one JSON file.

  Returns the fields that differ and may (RESUMABLE_FIELDS), as (field,
  stored, requested); [] for a new workdir.
  Raises ConfigMismatch listing every other differing field.
  """
  imported = os.path.join(workdir, IMPORT_FILE)
  if epath.Path(imported).exists():
    raise ValueError(f"{workdir} holds an imported model ({imported}); training in it would "
                     "replace its parameters. Fine-tune it into a new workdir: python "
                     f"train.py --workdir=<new> --config.init_from={workdir}")
  path = os.path.join(workdir, CONFIG_FILE)
  if not received.exists(path):
    return []
  document = received.read_bytes(path, root=workdir, kind="config", what="the run's config")
  try:
    stored = json.loads(document)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e}); it is written by train.py, do not "
                     "edit it (move it away to start this workdir's config afresh)") from None
  if not isinstance(stored, dict):
    raise ValueError(f"{path} is not a config (a JSON object is expected, not "
                     f"{type(stored).__name__}); it is written by train.py, do not edit it "
                     "(move it away to start this workdir's config afresh)")
  stored = _flatten(stored)
  requested = _flatten(json.loads(json.dumps(config)))  # tuples -> lists, as stored
  changed = [(name, stored.get(name, _MISSING), requested.get(name, _MISSING))
             for name in sorted(set(stored) | set(requested))
             if stored.get(name, _MISSING) != requested.get(name, _MISSING)]
  refused = [c for c in changed if c[0] not in RESUMABLE_FIELDS]
  if refused:
    raise ConfigMismatch(workdir, refused)
  return changed


def _flatten(tree: dict, prefix: str = "") -> dict:
  """{"model": {"d_model": 64}} -> {"model.d_model": 64}."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


# ----------------------------------------------------------------------------
# Which checkpoint
# ----------------------------------------------------------------------------


def checkpoint_choice(which: str | int) -> str | int:
  """`which` as "auto", "averaged", "latest" or a step (int); a step may be
  given as a string of digits (a command-line flag).

  Raises OptionError for anything else.
  """
  if isinstance(which, str) and which.isascii() and which.isdigit():
    return int(which)
  if which in CHECKPOINT_CHOICES or (isinstance(which, int) and which >= 0):
    return which
  raise OptionError("checkpoint", which, "choose auto, averaged, latest or a step number")


def stale_average_note(workdir: str | os.PathLike,
                       listing: checkpoint_names.Listing | None = None) -> str | None:
  """One line when the workdir's averaged checkpoint is older than its latest
  step (a finished run resumed to train further, then stopped before its new
  average): "auto" then takes the latest step. None otherwise. `listing`:
  the workdir's (`checkpoint_names.listing`), else listed here."""
  listing = listing or checkpoint_names.listing(workdir)
  steps, averaged_up_to = listing.steps, listing.averaged_up_to
  if averaged_up_to is None or not steps or averaged_up_to >= steps[-1]:
    return None
  return (f"note: the averaged checkpoint of {workdir} (steps up to {averaged_up_to}) is "
          f"older than its latest step {steps[-1]}: decoding step {steps[-1]} "
          "(--checkpoint=averaged takes the average anyway)")


def resolve_checkpoint(workdir: str | os.PathLike, which: str | int = "auto",
                       listing: checkpoint_names.Listing | None = None) -> str | int:
  """The checkpoint `which` names in `workdir`: "averaged" or a step number.
  "auto": the averaged checkpoint when it is at least as new as the latest
  step, else the latest step (`stale_average_note` says why). `listing`: as
  `stale_average_note`'s.

  Reads directory listings and the averaged checkpoint's metadata (no arrays).
  Raises:
    OptionError: `which` is not a checkpoint choice (`checkpoint_choice`).
    CheckpointNotFound: the averaged checkpoint or that step is not there.
    FileNotFoundError: there is no checkpoint at all.
  """
  which = checkpoint_choice(which)
  listing = listing or checkpoint_names.listing(workdir)
  ckpt_dir = os.path.join(workdir, checkpoint_names.CHECKPOINT_DIR)
  averaged_dir = os.path.join(workdir, checkpoint_names.AVERAGED_DIR)
  has_averaged = bool(listing.averaged)
  if which == "auto":
    which = ("averaged" if has_averaged and not stale_average_note(workdir, listing)
             else "latest")
  if which == "averaged":
    if not has_averaged:
      raise CheckpointNotFound(
          which, f"no averaged checkpoint in {averaged_dir} (train.py writes one at the "
          "end when --config.average_last > 1); use checkpoint=latest or a step number")
    return "averaged"
  steps = listing.steps
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {ckpt_dir}: {_train_hint(workdir)} (it "
                            "saves every --config.checkpoint_every steps and at the end)")
  if which == "latest":
    return steps[-1]
  if which not in steps:
    raise CheckpointNotFound(which, f"no checkpoint for step {which} in {ckpt_dir}; "
                             f"available steps: {steps} (or use checkpoint=auto)")
  return which


# ----------------------------------------------------------------------------
# A trained workdir, read once
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workdir:
  """A trained workdir as `read` found it, handed down instead of its path."""
  path: epath.Path  # resolved: absolute where local, an address (gs://...) as given
  model_config: TransformerConfig
  vocab_path: str  # the vocabulary rule's answer (module docstring)
  checkpoint: str | int | None  # "averaged" or a step; None where none was asked for
  checkpoint_note: str | None  # why "auto" chose the latest step over a stale average
  imported: dict | None  # import.json: where an imported model came from
  decoding: dict[str, float] = dataclasses.field(default_factory=dict)  # decoding.json ({}: none)
  # The checkpoint folders as `check_checkpoint_folders` walked them when the
  # checkpoint was chosen (None: not walked; the serving copy walks them then).
  checkpoint_folders: tuple | None = None


def check_checkpoint_folders(path: epath.Path) -> tuple[tuple[received.Entry, ...], ...]:
  """The entries of the resolved workdir's two checkpoint folders
  (`received.walk`): real folders inside it, holding only folders and
  regular files, none of them a link (orbax, which reads them, would follow
  it) and a bounded number. Raises `received.RefusedFile` naming what is not."""
  return tuple(tuple(received.walk(path / name, root=path, what="a checkpoint folder"))
               for name in (checkpoint_names.CHECKPOINT_DIR, checkpoint_names.AVERAGED_DIR))


def list_checkpoint(path: epath.Path, checkpoint: str | int, folders=None
                    ) -> tuple[str | int, str | None]:
  """(`resolve_checkpoint`'s answer, `stale_average_note`'s for "auto", else
  None), from the checkpoint directories' listings (orbax) of the resolved
  `path` (`folders`, their walk, is not needed here)."""
  listing = checkpoint_names.listing(path)
  which = resolve_checkpoint(path, checkpoint, listing)
  return which, (checkpoint == "auto" and stale_average_note(path, listing)) or None


def read(workdir: str | os.PathLike, checkpoint: str | int | None = "auto", *,
         choose: Callable[[epath.Path, str | int, tuple], tuple[str | int, str | None]]
         = list_checkpoint) -> Workdir:
  """`workdir` read once, the one door: its path resolved (`resolve`), its
  files checked, its model config and vocabulary found, `checkpoint`
  ("auto", "averaged", "latest", a step; None: none) chosen by
  `choose(path, choice, folders)`, `folders` the checkpoint folders' walk
  (`check_checkpoint_folders`; default: listing the checkpoints; the
  decoding loader's keeps what it listed: `serving_params.resolve`), and import.json
  read if there is one. A record of the wrong type or an absurd size is one
  sentence naming the file. Nothing is restored.

  Raises:
    FileNotFoundError (CheckpointNotFound among them) naming what is missing
    and what to do; ValueError for a file that cannot be read; OptionError for
    a `checkpoint` that is no choice.
  """
  check_files(os.fspath(workdir))  # (its messages name the workdir as the caller did)
  path = resolve(workdir)
  model_config = load_model_config(path)
  which, note, folders = None, None, None
  if checkpoint is not None:  # (orbax reads them on its own: checked before it does)
    folders = check_checkpoint_folders(path)
    which, note = choose(path, checkpoint_choice(checkpoint), folders)
  return Workdir(path=path, model_config=model_config, vocab_path=vocab_path(path),
                 checkpoint=which, checkpoint_note=note,
                 imported=workdir_records.read_import(path),
                 decoding=workdir_records.read_decoding(path), checkpoint_folders=folders)
