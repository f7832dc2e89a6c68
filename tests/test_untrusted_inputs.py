"""What a user receives is data (docs/security.md): hostile files planted in a
workdir, a progress record, prepared shards, an imported Marian model and a
lock file. For each: nothing runs (a pickle or YAML tag whose loading would
create a marker file leaves none), nothing outside the directory is read or
written, and the refusal is one sentence naming the file, not a traceback.

Fast: no training; the workdir is a copy of tests/fixtures/workdir_d26a6fb."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from transformer.data import prepared
from transformer.data import sources as data_sources
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.demo_task import demo_splits
from transformer.decoding import streaming
from transformer.model.config import MAX_SIZES, TransformerConfig
from transformer.runtime import run_lock
from transformer.runtime import workdir as workdir_lib
from helpers import RunsWhenUnpickled, hostile_pickle, within_seconds

REPO = Path(__file__).resolve().parents[1]
FIXTURE_WORKDIR = REPO / "tests" / "fixtures" / "workdir_d26a6fb"


def one_sentence(error: BaseException, names: str | Path) -> str:
  """`error`'s message, checked to be one line that names `names`."""
  message = str(error)
  assert "\n" not in message and "Traceback" not in message, message
  assert str(names) in message, message
  assert len(message) < 1000, message
  return message


@pytest.fixture()
def marker(tmp_path):
  path = tmp_path / "MARKER_code_ran"
  yield path
  assert not path.exists(), "a planted file ran code"


@pytest.fixture()
def workdir(tmp_path):
  copy = tmp_path / "received_workdir"
  shutil.copytree(FIXTURE_WORKDIR, copy)
  return copy


# ----------------------------------------------------------------------------
# The workdir's own records (workdir.py), the vocabulary against the model, logs
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("content", ['["a", "list"]', '"text"', "3"])
def test_a_config_json_that_is_no_object_is_one_sentence(workdir, content):
  (workdir / workdir_lib.CONFIG_FILE).write_text(content)
  with pytest.raises(ValueError) as error:
    workdir_lib.check_config(str(workdir), {"seed": 0})
  one_sentence(error.value, workdir / workdir_lib.CONFIG_FILE)


def test_a_vocabulary_larger_than_the_model_is_named(workdir):
  """A vocab.model with more pieces than the model's embedding has rows would
  give ids past it (NaN or garbage): one sentence naming it instead."""
  from transformer.decoding import loader
  config = json.loads((workdir / workdir_lib.MODEL_CONFIG_FILE).read_text())
  pieces = tokenizer_lib.load_tokenizer(str(workdir / "vocab.model")).vocab_size
  config["vocab_size"] = pieces - 1
  (workdir / workdir_lib.MODEL_CONFIG_FILE).write_text(json.dumps(config))
  with pytest.raises(ValueError) as error:
    loader.load_translator(str(workdir))
  assert "more than the model's vocab_size" in one_sentence(error.value, workdir / "vocab.model")


@pytest.mark.parametrize("document", ['["a", "list"]', '{"format": 1, "marian_pieces": [1, 2]}',
                                      '{"marian_pieces": "abc"}'])
def test_a_hostile_marian_vocabulary_is_one_sentence(workdir, document):
  """A vocab.model that claims to be an imported model's vocabulary (a JSON
  object) but whose pieces are not strings, or a JSON list (then no
  SentencePiece model either)."""
  path = workdir / "vocab.model"
  path.write_text(document)
  with pytest.raises(ValueError) as error:
    tokenizer_lib.load_tokenizer(str(path))
  message = one_sentence(error.value, path)
  assert "not a valid " + ("Marian vocabulary" if document[0] == "{" else "SentencePiece") in message


def test_logs_never_write_through_a_planted_link(workdir, tmp_path, monkeypatch):
  """train.log and metrics.jsonl in a received workdir, made links to a file
  of this machine: neither is written through (the file is untouched)."""
  from transformer.runtime import run_log
  from transformer.training import metrics
  victim = tmp_path / "victim"
  victim.write_text("untouched\n")
  for name in (workdir_lib.LOG_FILE, metrics.METRICS_FILE):
    (workdir / name).symlink_to(victim)
  with run_log.run_log(str(workdir)) as path:
    assert path is None  # (the console only)
  import tensorboardX
  opened = []
  real_writer = tensorboardX.SummaryWriter
  monkeypatch.setattr(tensorboardX, "SummaryWriter",
                      lambda *a, **k: opened.append(1) or real_writer(*a, **k))
  with pytest.raises(OSError):
    metrics.MetricsWriter(str(workdir))
  assert victim.read_text() == "untouched\n"
  # (refused before any event writer opens: none is left for exit to close)
  assert opened == []


# ----------------------------------------------------------------------------
# What a path is: links out, FIFOs, devices, files that never end (received.py)
# ----------------------------------------------------------------------------


def outside_state(folder: Path, workdir: Path) -> dict[str, tuple]:
  """Every entry under `folder` but inside `workdir`: its kind and, for a
  file, the SHA-256 of its bytes (a link: where it leads)."""
  import hashlib
  state = {}
  for path in sorted(folder.rglob("*")):
    if path == workdir or workdir in path.parents:
      continue
    if path.is_symlink():
      state[str(path)] = ("link", os.readlink(path))
    elif path.is_file():
      state[str(path)] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    else:
      state[str(path)] = ("folder",)
  return state


def _copy_outside(workdir: Path, name: str) -> Path:
  """A copy of the workdir's `name` beside the workdir (in the folder that
  holds it), for a link to lead out to."""
  outside = workdir.parent / f"outside_{name}"
  if (workdir / name).is_dir():
    shutil.copytree(workdir / name, outside)
  else:
    shutil.copy(workdir / name, outside)
  return outside


def _replace(path: Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  else:
    path.unlink(missing_ok=True)


def _fifo(workdir, name):
  _replace(workdir / name)
  os.mkfifo(workdir / name)
  return workdir / name, "a FIFO"


def _dev_zero(workdir, name):
  _replace(workdir / name)
  (workdir / name).symlink_to("/dev/zero")
  return workdir / name, "a character device"


def _link_out(workdir, name):
  outside = _copy_outside(workdir, name)
  _replace(workdir / name)
  (workdir / name).symlink_to(outside)
  return workdir / name, "outside"


def _never_ending_config(workdir, name):
  """A model config that is valid JSON padded to 2 MiB (a config is KBs)."""
  path = workdir / name
  path.write_text(path.read_text() + " " * (2 << 20))
  return path, "more than such a file holds"


def _link_inside_checkpoint(workdir, name):
  data = workdir / "checkpoints_averaged" / "600" / "params" / "d"
  victim = next(data.iterdir())
  outside = workdir.parent / "outside_chunk"
  shutil.copy(victim, outside)
  victim.unlink()
  victim.symlink_to(outside)
  return victim, "checkpoints hold none"


def _fifo_inside_checkpoint(workdir, name):
  path = workdir / "checkpoints_averaged" / "600" / "params" / "planted"
  os.mkfifo(path)
  return path, "a FIFO"


def _no_vocabulary_and_a_fifo_config(workdir, name):
  (workdir / "vocab.model").unlink()
  return _fifo(workdir, "config.json")


PLANTS = [
    ("model_config.json", _fifo), ("model_config.json", _dev_zero),
    ("model_config.json", _link_out), ("model_config.json", _never_ending_config),
    ("vocab.model", _dev_zero), ("vocab.model", _link_out), ("vocab.model", _fifo),
    ("import.json", _dev_zero), ("config.json", _no_vocabulary_and_a_fifo_config),
    ("checkpoints_averaged", _link_out), ("checkpoints_averaged", _link_inside_checkpoint),
    ("checkpoints_averaged", _fifo_inside_checkpoint),
]


@pytest.mark.parametrize("name,plant", PLANTS, ids=[f"{n}-{p.__name__.strip('_')}"
                                                     for n, p in PLANTS])
def test_a_planted_link_fifo_or_endless_file_is_one_sentence(workdir, name, plant):
  """A workdir's file replaced by a FIFO (a read that would wait forever), a
  link to /dev/zero (one that never ends), a link out of the workdir (to a
  copy of the very file: only where it lies is wrong), a 2 MiB config, or a
  link or FIFO inside a checkpoint folder (orbax would follow or block on
  it): loading the workdir refuses in one sentence naming the file and what
  it is, within seconds, and nothing outside the workdir changes."""
  from transformer.decoding import loader
  path, what = plant(workdir, name)
  before = outside_state(workdir.parent, workdir)
  with pytest.raises(ValueError) as error:
    within_seconds(lambda: loader.load_translator(str(workdir)))
  message = one_sentence(error.value, path)
  assert what in message, message
  assert outside_state(workdir.parent, workdir) == before


def test_a_link_the_user_allowed_is_followed(workdir, monkeypatch):
  """Checkpoints and a vocabulary linked to another disk on purpose: the
  refusal names the variable that allows it, and once set the workdir
  translates as the clean copy does."""
  from transformer.decoding import loader
  _link_out(workdir, "checkpoints_averaged")
  _link_out(workdir, "vocab.model")
  with pytest.raises(ValueError) as error:
    loader.load_translator(str(workdir))
  hint = f"TRANSFORMER_ALLOW_LINKS={workdir.parent}"
  assert hint in one_sentence(error.value, workdir), str(error.value)
  monkeypatch.setenv("TRANSFORMER_ALLOW_LINKS", str(workdir.parent))
  expected = json.loads((FIXTURE_WORKDIR / "expected.json").read_text())
  translator = loader.load_translator(str(workdir))
  assert translator.translate(expected["inputs"][:3], method="greedy") == expected["greedy"][:3]


def test_a_linked_compiled_folder_is_neither_read_nor_written(workdir, tmp_path_factory,
                                                              monkeypatch, caplog):
  """Issue 68 as it was met: `compiled/` a link to the folder that holds the
  workdir, where a user keeps a large old file (and one named like a cached
  decoder). Decoding keeps no decoder there and prunes nothing there, even
  with the workdir's cache limit at 0 bytes; one line says so, and the
  translations are those of the clean workdir."""
  from transformer.decoding import executable_cache, loader
  cache = tmp_path_factory.mktemp("machine_cache")
  monkeypatch.setenv(executable_cache.MODEL_ENV, "on")
  monkeypatch.delenv(executable_cache.DECODER_CACHE_ENV, raising=False)  # (conftest.py's)
  monkeypatch.setattr(executable_cache, "MAX_MODEL_BYTES", 0)
  import jax
  from helpers import CACHE_SETTINGS
  old = {n: getattr(jax.config, n) for n in ["jax_compilation_cache_dir", *CACHE_SETTINGS]}
  jax.config.update("jax_compilation_cache_dir", str(cache))
  try:
    (workdir.parent / "old_download.iso").write_bytes(os.urandom(1 << 16))
    (workdir.parent / ("0" * 32 + ".bin")).write_bytes(b"the user's own file")
    (workdir / "compiled").symlink_to("..")
    before = outside_state(workdir.parent, workdir)
    expected = json.loads((FIXTURE_WORKDIR / "expected.json").read_text())
    with caplog.at_level(logging.WARNING):
      translator = loader.load_translator(str(workdir))
      out = translator.translate(expected["inputs"][:3], method="greedy")
    assert out == expected["greedy"][:3]
    assert outside_state(workdir.parent, workdir) == before
    said = [r.getMessage() for r in caplog.records if "compiled decoders" in r.getMessage()]
    assert len(said) == 1 and "is a link" in said[0] and "\n" not in said[0], said
    assert list((cache / executable_cache.SUBDIRECTORY).iterdir())  # (the machine's cache: kept)
  finally:
    for name, value in old.items():
      jax.config.update(name, value)


def test_a_linked_checkpoint_folder_is_never_written_or_pruned(workdir, tmp_path):
  """Training in a workdir whose checkpoints/ leads elsewhere: refused before
  orbax writes or prunes there."""
  from transformer.runtime import checkpoints
  elsewhere = tmp_path / "elsewhere"
  (elsewhere / "7").mkdir(parents=True)
  (workdir / "checkpoints").symlink_to(elsewhere)
  with pytest.raises(ValueError) as error:
    checkpoints.Checkpointer(str(workdir), read_only=False)
  assert "is a link" in one_sentence(error.value, workdir / "checkpoints")
  assert [p.name for p in elsewhere.iterdir()] == ["7"]


def test_decode_py_ends_on_a_planted_fifo_in_one_line(workdir, tmp_path):
  """The command as a user meets it: a FIFO where model_config.json should be
  ends decode.py with status 1 and one line naming it (it hung before)."""
  import subprocess
  import sys
  from helpers import subprocess_env
  path, _ = _fifo(workdir, "model_config.json")
  proc = subprocess.run([sys.executable, str(REPO / "decode.py"), f"--workdir={workdir}"],
                        input="one red cat\n", capture_output=True, text=True, timeout=120,
                        env=subprocess_env(), cwd=tmp_path)
  assert proc.returncode == 1, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert str(path) in lines[0] and "a FIFO" in lines[0], lines[0]
  assert proc.stdout == ""


# ----------------------------------------------------------------------------
# model_config.json (TransformerConfig.from_dict), init_from
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("d_model", -32), ("d_model", 0), ("d_model", 1 << 40), ("d_model", "32"),
    ("d_model", 32.0), ("d_model", True), ("d_model", None), ("num_heads", [4]),
    ("vocab_size", MAX_SIZES["vocab_size"] + 1), ("d_ff", -1), ("max_len", 10 ** 12),
    ("num_encoder_layers", 100_000), ("num_decoder_layers", "2"),
    ("dropout_rate", "0.1"), ("dropout_rate", float("nan")), ("layer_norm_epsilon", -1.0),
    ("layer_norm_epsilon", "1e-6"), ("share_embeddings", "yes"), ("remat", 1),
    ("activation", ["relu"]), ("normalization", {"post": 1}), ("pad_id", "0"),
    ("bos_id", 400), ("d_model", "A" * 100_000)])
def test_a_model_config_field_of_the_wrong_type_or_size_is_named(field, value):
  stored = json.loads((FIXTURE_WORKDIR / "model_config.json").read_text())
  with pytest.raises(ValueError) as e:
    TransformerConfig.from_dict({**stored, field: value})
  message = one_sentence(e.value, f"TransformerConfig.{field}=")
  assert len(message) < 300  # (a huge value is shown cut short)


def test_every_shipped_config_and_fixture_stays_valid():
  import importlib.util
  from transformer.training import run_setup
  for path in sorted((REPO / "configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "get_config"):
      config = module.get_config()
      run_setup.model_config_from(config, config.get("vocab_size", 8000))
  stored = json.loads((FIXTURE_WORKDIR / "model_config.json").read_text())
  assert TransformerConfig.from_dict(stored).to_dict().items() >= stored.items()
  with pytest.raises(ValueError, match="must be a mapping"):
    TransformerConfig.from_dict([["d_model", 32]])


@pytest.mark.parametrize("content", [
    '{"d_model": -1}', '{"d_model": 1e300}', '[1, 2, 3]', '"a string"',
    '{"vocab_size": 400, "d_model": "32"}'])
def test_a_hostile_model_config_json_is_one_sentence_naming_it(workdir, content):
  """Read as fine-tuning's init_from reads it (run_setup.load_init_from_config)."""
  import ml_collections
  from transformer.training import run_setup
  stored = json.loads((workdir / "model_config.json").read_text())
  doc = json.loads(content)
  if isinstance(doc, dict):
    doc = {**stored, **doc}
  (workdir / "model_config.json").write_text(json.dumps(doc))
  config = ml_collections.ConfigDict({"init_from": str(workdir)})
  with pytest.raises(ValueError) as e:
    run_setup.load_init_from_config(config)
  one_sentence(e.value, workdir / "model_config.json")


def test_init_from_never_follows_a_vocab_path_out_of_its_workdir(workdir, tmp_path):
  """A received workdir without vocab.model whose config.json names a file of
  this machine: refused, naming both, instead of reading that file."""
  import ml_collections
  from transformer.training import run_setup
  outside = tmp_path / "someone_elses" / "private.model"
  outside.parent.mkdir()
  shutil.move(workdir / "vocab.model", outside)
  stored = json.loads((workdir / "config.json").read_text())
  (workdir / "config.json").write_text(json.dumps({**stored, "vocab_path": str(outside)}))
  config = ml_collections.ConfigDict({"init_from": str(workdir), "vocab_path": ""})
  # (workdir.vocab_path refuses it itself, FileNotFoundError; run_setup checks again)
  with pytest.raises((ValueError, FileNotFoundError)) as e:
    run_setup.vocabulary_file(config)
  one_sentence(e.value, outside)
  with pytest.raises(ValueError) as e:
    run_setup.load_init_from_config(config)
  one_sentence(e.value, outside)
  # Inside the workdir (or its own vocab.model) is read as before.
  inside = workdir / "vocabs" / "v.model"
  inside.parent.mkdir()
  shutil.copy(outside, inside)
  (workdir / "config.json").write_text(json.dumps({**stored, "vocab_path": str(inside)}))
  assert run_setup.vocabulary_file(config) == str(inside)
  shutil.copy(outside, workdir / "vocab.model")
  assert run_setup.vocabulary_file(config) == str(workdir / "vocab.model")


def test_init_from_ignores_pickles_planted_in_the_workdir(workdir, marker):
  """Fine-tuning's start (`loop._start_from`) reads the config, the checkpoint
  (orbax: JSON metadata, tensorstore arrays) and nothing under compiled/."""
  import jax
  from transformer.model import init_params
  from transformer.training import loop
  (workdir / "compiled").mkdir()
  for name in ("params.shapes", "decoder.exe", "x.pkl", "logits.kernel"):
    (workdir / "compiled" / name).write_bytes(hostile_pickle(marker))
  config = workdir_lib.load_model_config(str(workdir))
  target = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  state = loop._start_from(str(workdir), {"params": target})
  assert jax.tree.structure(state["params"]) == jax.tree.structure(target)


# ----------------------------------------------------------------------------
# The streaming-decode progress record
# ----------------------------------------------------------------------------


class _Reversing:
  last_stats: dict = {}

  def translate_hypotheses(self, sentences, **options):
    from transformer.decoding.translator import Hypothesis
    return [[Hypothesis(s[::-1], -1.0, -1.0, len(s))] for s in sentences]


def _decode(tmp_path):
  src, out = tmp_path / "in.txt", tmp_path / "out.txt"
  if not src.exists():
    src.write_text("".join(f"line {i}\n" for i in range(12)))
  return streaming.decode_file(_Reversing(), str(src), str(out), options={"method": "greedy"},
                               run={"workdir": "w"}, window_lines=5)


def _good_record(tmp_path) -> dict:
  """A record of 0 lines done by `_decode`'s very run (so that only the planted
  field differs)."""
  out = tmp_path / "out.txt"
  out.write_bytes(b"previous output\n" * 4)
  run = {"workdir": "w", "options": {"method": "greedy"}, "output_format": "text",
         "input": str(tmp_path / "in.txt")}
  return {"lines_done": 0, "output_bytes": 0, "input_sha256": "e3b0c44298fc1c149afbf4c8996fb"
          "92427ae41e4649b934ca495991b7852b855", "run": run}


@pytest.mark.parametrize("change", [
    {"lines_done": -5}, {"lines_done": "3"}, {"lines_done": 2.5}, {"lines_done": True},
    {"output_bytes": -1}, {"output_bytes": 1 << 70}, {"output_bytes": [0]},
    {"input_sha256": 7}, {"input_sha256": "../../etc/passwd"}, {"run": ["a list"]},
    {"extra": 1}, "list", "pickle", "huge", "not utf-8", "longer than the output"])
def test_a_hostile_progress_record_is_one_sentence_naming_it(tmp_path, marker, change):
  record_path = Path(streaming.progress_path(str(tmp_path / "out.txt")))
  record = _good_record(tmp_path)
  before = (tmp_path / "out.txt").read_bytes()
  if change == "list":
    record_path.write_text(json.dumps([record]))
  elif change == "pickle":
    record_path.write_bytes(hostile_pickle(marker))
  elif change == "huge":
    record_path.write_text(json.dumps({**record, "run": {"x": "y" * (2 << 20)}}))
  elif change == "not utf-8":
    record_path.write_bytes(b"\xff\xfe{}")
  elif change == "longer than the output":  # (a resume would pad the output with zeros)
    record_path.write_text(json.dumps({**record, "output_bytes": 10 ** 12}))
  else:
    record_path.write_text(json.dumps({**record, **change}))
  with pytest.raises(streaming.ResumeMismatch) as e:
    _decode(tmp_path)
  one_sentence(e.value, record_path)
  assert (tmp_path / "out.txt").read_bytes() == before  # neither cut nor extended
  assert record_path.exists()


def test_a_sound_progress_record_still_resumes(tmp_path):
  record_path = Path(streaming.progress_path(str(tmp_path / "out.txt")))
  record_path.write_text(json.dumps(_good_record(tmp_path)))
  stats = _decode(tmp_path)
  assert stats["resumed_at"] == 0 and not record_path.exists()
  assert (tmp_path / "out.txt").read_text().splitlines()[0] == "0 enil"


# ----------------------------------------------------------------------------
# Prepared shards
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocabulary():
  return tokenizer_lib.load_tokenizer(str(FIXTURE_WORKDIR / "vocab.model"))


@pytest.fixture()
def shards(tmp_path, vocabulary):
  pairs = demo_splits(seed=1, num_train=120, num_eval=1, num_test=1)["train"]
  directory = tmp_path / "prepared"
  prepared.prepare(data_sources.stream_pairs(pairs), vocabulary, str(directory),
                   shard_tokens=1500, chunk_pairs=40)
  return directory


def _edit_manifest(directory: Path, edit) -> None:
  path = directory / prepared.MANIFEST
  manifest = json.loads(path.read_text())
  path.write_text(json.dumps(edit(manifest)))


def _set(keys, value):
  def edit(manifest):
    node = manifest
    for key in keys[:-1]:
      node = node[key]
    node[keys[-1]] = value
    return manifest
  return edit


@pytest.mark.parametrize("edit", [
    _set(["shards", 0, "name"], "../../outside"), _set(["shards", 0, "name"], "/etc/passwd"),
    _set(["shards", 1, "name"], "shard-00000"), _set(["dtype"], "|O"),
    _set(["dtype"], "<f8"), _set(["num_examples"], -1), _set(["num_examples"], "120"),
    _set(["shards", 0, "num_examples"], -3), _set(["shards", 0, "source_tokens"], 1 << 60),
    _set(["shards", 0, "target_tokens"], "many"), _set(["shards"], {}),
    _set(["shards"], []), _set(["corpus"], None), _set(["corpus", "files"], [{"path": 3}]),
    _set(["vocab_size"], True), _set(["vocabulary_sha256"], 12),
    lambda manifest: [manifest], lambda manifest: "a string"])
def test_a_hostile_manifest_is_one_sentence_naming_it(shards, vocabulary, edit):
  _edit_manifest(shards, edit)
  with pytest.raises(prepared.PreparedDataError) as e:
    prepared.open_prepared(str(shards), vocabulary)
  one_sentence(e.value, shards / prepared.MANIFEST)


def test_a_pickled_manifest_or_shard_never_runs(shards, vocabulary, marker):
  (shards / "shard-00000.offsets").write_bytes(hostile_pickle(marker))
  with pytest.raises(prepared.PreparedDataError) as e:  # (its size is not the manifest's)
    prepared.open_prepared(str(shards), vocabulary)
  one_sentence(e.value, shards / "shard-00000.offsets")
  (shards / prepared.MANIFEST).write_bytes(hostile_pickle(marker))
  with pytest.raises(prepared.PreparedDataError) as e:
    prepared.open_prepared(str(shards), vocabulary)
  one_sentence(e.value, shards / prepared.MANIFEST)


def test_offsets_or_ids_out_of_range_are_named_when_read(shards, vocabulary):
  corpus = prepared.open_prepared(str(shards), vocabulary)
  sound = [corpus[i] for i in range(len(corpus))]
  offsets = shards / "shard-00000.offsets"
  table = np.fromfile(offsets, "<i8").reshape(-1, 2)
  table[2] = [10 ** 9, -5]  # example 1 ends, example 2 starts, outside the shard
  table.tofile(offsets)
  corpus = prepared.open_prepared(str(shards), vocabulary)
  assert corpus[0]["inputs"].tolist() == sound[0]["inputs"].tolist()
  with pytest.raises(prepared.PreparedDataError) as e:
    corpus[1]
  one_sentence(e.value, offsets)
  inputs = shards / "shard-00001.inputs"
  ids = np.fromfile(inputs, "<u2")
  ids[0] = vocabulary.vocab_size + 7
  ids.tofile(inputs)
  first = int(corpus._starts[1])
  with pytest.raises(prepared.PreparedDataError) as e:
    prepared.open_prepared(str(shards), vocabulary)[first]
  one_sentence(e.value, inputs)


# ----------------------------------------------------------------------------
# The Marian / OPUS-MT importer
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def marian_release(tmp_path_factory):
  pytest.importorskip("safetensors.numpy")
  from test_marian import write_release
  directory, weights, pieces = write_release(tmp_path_factory.mktemp("marian") / "release")
  return directory, weights, pieces


def _release_copy(marian_release, tmp_path) -> Path:
  copy = tmp_path / "release"
  shutil.copytree(marian_release[0], copy)
  return copy


def _hf_copy(marian_release, tmp_path) -> Path:
  from test_marian import write_hf
  directory, weights, pieces = marian_release
  return write_hf(tmp_path / "hf", weights, pieces, directory)


def _refused(model: Path, tmp_path, names, capsys=None):
  """Imports `model`: MarianImportError, one sentence naming `names`, no workdir."""
  from transformer.interop import marian, marian_formats
  with pytest.raises(marian_formats.MarianImportError) as e:
    marian.import_model(str(model), str(tmp_path / "imported"))
  assert not (tmp_path / "imported").exists()
  return one_sentence(e.value, names)


@pytest.mark.parametrize("models", ["/etc/passwd", "../outside.npz", "sub/../../x.npz", 7])
def test_decoder_yml_may_not_name_a_file_outside_the_release(marian_release, tmp_path, models):
  release = _release_copy(marian_release, tmp_path)
  (tmp_path / "outside.npz").write_bytes((release / "model.npz").read_bytes())
  (release / "decoder.yml").write_text(
      f"models:\n  - {json.dumps(models)}\nvocabs:\n  - vocab.yml\n  - vocab.yml\n")
  _refused(release, tmp_path, release / "decoder.yml")


def test_a_pickled_npz_or_a_python_yaml_tag_never_runs(marian_release, tmp_path, marker,
                                                        capsys):
  from transformer.interop import marian
  release = _release_copy(marian_release, tmp_path)
  good_npz = (release / "model.npz").read_bytes()
  (release / "model.npz").write_bytes(hostile_pickle(marker))
  _refused(release, tmp_path, release / "model.npz")
  # The command line: exit status 2 and one line naming the file.
  assert marian.main([f"--model={release}", f"--workdir={tmp_path / 'imported'}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "\n" not in err and str(release / "model.npz") in err
  # An npz holding a pickled object array: not read either.
  weights = dict(np.load(marian_release[0] / "model.npz"))
  np.savez(release / "model.npz", **weights,
           extra=np.array([RunsWhenUnpickled(str(marker))], dtype=object))
  _refused(release, tmp_path, release / "model.npz")
  # YAML tags that would build Python objects (yaml.safe_load refuses them).
  tag = f'!!python/object/apply:os.system ["touch {marker}"]'
  (release / "model.npz").write_bytes(good_npz)
  (release / "decoder.yml").write_text(f"models: {tag}\n")
  _refused(release, tmp_path, release / "decoder.yml")
  (release / "decoder.yml").write_text("models: [model.npz]\nvocabs: [vocab.yml, vocab.yml]\n")
  options = f"type: transformer\ndim-emb: {tag}\n".encode() + b"\0"
  np.savez(release / "model.npz", **{k: v for k, v in weights.items() if k != "special:model.yml"},
           **{"special:model.yml": np.frombuffer(options, np.int8)})
  _refused(release, tmp_path, release / "model.npz")
  (release / "vocab.yml").write_text(f'"</s>": 0\n"<unk>": 1\n"{tag}": 2\n')
  _refused(release, tmp_path, release / "vocab.yml")


IMPORT_PLANTS = [
    ("release", "model.npz", _link_out), ("release", "source.spm", _dev_zero),
    ("release", "vocab.yml", _fifo), ("release", "decoder.yml", _fifo),
    ("release", "target.spm", _link_out), ("hf", "model.safetensors", _link_out),
    ("hf", "vocab.json", _fifo), ("hf", "config.json", _dev_zero)]


@pytest.mark.parametrize("kind,name,plant", IMPORT_PLANTS,
                         ids=[f"{k}-{n}-{p.__name__.strip('_')}" for k, n, p in IMPORT_PLANTS])
def test_an_imported_file_that_is_a_link_out_or_a_fifo_is_one_sentence(
    marian_release, tmp_path, kind, name, plant):
  """An imported model's files (a Marian-NMT release's, a Hugging Face
  folder's) are read through the one reader: a link out of its folder (to a
  copy of the very file) or to /dev/zero, or a FIFO, is refused in one
  sentence naming it; nothing hangs, and no workdir is made."""
  from transformer.interop import marian
  model = (_release_copy if kind == "release" else _hf_copy)(marian_release, tmp_path)
  path, what = plant(model, name)
  with pytest.raises(ValueError) as e:
    within_seconds(lambda: marian.import_model(str(model), str(tmp_path / "imported")))
  assert what in one_sentence(e.value, path)
  assert not (tmp_path / "imported").exists()


def _only_type(stored):
  return "type: transformer\n"


def _a_list(stored):
  return "[1, 2]\n"


def _negative_width(stored):
  return stored.replace(f"dim-emb: {16}", "dim-emb: -16")


def _huge_width(stored):
  return stored.replace(f"dim-emb: {16}", "dim-emb: 1000000000")


def _width_a_string(stored):
  return stored.replace(f"dim-emb: {16}", "dim-emb: sixteen")


@pytest.mark.parametrize("change", [_only_type, _a_list, _negative_width, _huge_width,
                                    _width_a_string])
def test_absurd_release_options_are_named(marian_release, tmp_path, change):
  release = _release_copy(marian_release, tmp_path)
  weights = dict(np.load(release / "model.npz"))
  stored = bytes(weights["special:model.yml"].astype(np.uint8)).rstrip(b"\0").decode()
  assert "dim-emb: 16" in stored
  weights["special:model.yml"] = np.frombuffer(change(stored).encode() + b"\0", np.int8)
  np.savez(release / "model.npz", **weights)
  _refused(release, tmp_path, release / "model.npz")


@pytest.mark.parametrize("change", [
    {"d_model": 1 << 40}, {"d_model": "16"}, {"d_model": -16}, {"encoder_layers": 10 ** 6},
    {"encoder_ffn_dim": None}, {"dropout": "lots"}, "list", "no d_model"])
def test_a_hostile_hugging_face_config_is_named(marian_release, tmp_path, change):
  hf = _hf_copy(marian_release, tmp_path)
  config = json.loads((hf / "config.json").read_text())
  if change == "list":
    config = [config]
  elif change == "no d_model":
    del config["d_model"]
  else:
    config.update(change)
  (hf / "config.json").write_text(json.dumps(config))
  _refused(hf, tmp_path, hf / "config.json")


def test_hostile_hugging_face_weights_are_named(marian_release, tmp_path, marker):
  from safetensors.numpy import load_file, save_file
  hf = _hf_copy(marian_release, tmp_path)
  tensors = load_file(str(hf / "model.safetensors"))
  (hf / "model.safetensors").write_bytes(hostile_pickle(marker))
  _refused(hf, tmp_path, hf / "model.safetensors")
  (hf / "model.safetensors").write_bytes(os.urandom(4096))
  _refused(hf, tmp_path, hf / "model.safetensors")
  # A position table of another width, a matrix of another shape.
  save_file({**tensors, "model.encoder.embed_positions.weight": np.zeros((512, 3), np.float32)},
            str(hf / "model.safetensors"))
  _refused(hf, tmp_path, hf / "model.safetensors")
  name = "model.encoder.layers.0.self_attn.q_proj.weight"
  save_file({**tensors, name: np.zeros((5, 3), np.float32)}, str(hf / "model.safetensors"))
  _refused(hf, tmp_path, hf)
  vocab = json.loads((hf / "vocab.json").read_text())
  (hf / "vocab.json").write_text(json.dumps(list(vocab)))
  _refused(hf, tmp_path, hf / "vocab.json")


# ----------------------------------------------------------------------------
# The run lock
# ----------------------------------------------------------------------------


def test_a_lock_file_that_is_a_link_or_no_file_is_refused_untouched(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  target = tmp_path / "w"
  target.mkdir()
  (target / workdir_lib.LOCK_FILE).symlink_to(victim)
  with pytest.raises(ValueError) as e:
    with run_lock.hold(str(target)):
      pass
  one_sentence(e.value, target / workdir_lib.LOCK_FILE)
  assert victim.read_text() == "precious"
  (target / workdir_lib.LOCK_FILE).unlink()
  os.mkfifo(target / workdir_lib.LOCK_FILE)  # (opening it to read or write would block)
  with pytest.raises(ValueError, match="not a plain file"):
    with run_lock.hold(str(target)):
      pass


def test_a_hostile_holder_record_is_shown_short_and_printable(tmp_path):
  target = tmp_path / "w"
  target.mkdir()
  lock = target / workdir_lib.LOCK_FILE
  with run_lock.hold(str(target)):
    with open(lock, "r+") as f:  # what a planted or edited lock file could say
      f.write(json.dumps({"pid": "\x1b[2J" * 1000, "host": "\x1b]0;owned\x07",
                          "started": "y" * 100_000}))
    with pytest.raises(run_lock.WorkdirLocked) as e:
      with run_lock.hold(str(target)):
        pass
  message = one_sentence(e.value, target)
  assert "\x1b" not in message and "PID ? on host ?" in message
  assert lock.read_text() == ""  # (emptied at the end, as before)
