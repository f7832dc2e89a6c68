"""Compiled decoders kept on disk (transformer/decoding/executable_cache.py): a
later Translator loads them instead of tracing and compiling, translates the
same, and never runs a decoder whose code, model or shape differs."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

import helpers
from helpers import CACHE_SETTINGS
from transformer.decoding import executable_cache, loader
from transformer.decoding import decoders as decoders_lib
from transformer.model import transformer as model_lib

# JAX's compilation cache off unless a test gives one of its own, and the
# decoders kept whenever it is on, as in a user's process (conftest.py).
pytestmark = pytest.mark.usefixtures("caches_of_their_own")

FIXTURE_WORKDIR = Path(__file__).resolve().parent / "fixtures" / "workdir_d26a6fb"
SENTENCES = ["one red cat", "three hundred and two blue birds and seven green frogs",
             "", "a cat"]


@pytest.fixture
def cache_dir(tmp_path):
  """A compilation cache of this test's own (the decoders' home) that keeps
  every program however quickly it compiles, as decode.py's does; restored after."""
  names = ["jax_compilation_cache_dir", *CACHE_SETTINGS]
  old = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  for name, value in CACHE_SETTINGS.items():
    jax.config.update(name, value)
  cc.reset_cache()
  yield tmp_path / "cache" / executable_cache.SUBDIRECTORY
  for name, value in old.items():
    jax.config.update(name, value)
  cc.reset_cache()


def _translate(**options):
  """SENTENCES in two batches (of 2) of two lengths: two decoders (buckets
  of their own: shared, so few inputs would all go to the longer one)."""
  translator = loader.load_translator(str(FIXTURE_WORKDIR))
  translator.policy.share_buckets = False
  out = translator.translate(SENTENCES, batch_size=2, **options)
  return out, translator.last_stats


def _never_trace(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError("a decoder was traced")
  monkeypatch.setattr(decoders_lib.Decoders, "program", fail)


def test_a_new_translator_loads_the_decoders_and_translates_the_same(cache_dir,
                                                                     monkeypatch):
  first, stats = _translate(method="beam")
  stored = sorted(cache_dir.iterdir())
  assert stats["decoders_loaded"] == 0
  assert len(list(cache_dir.glob("*.bin"))) == 2  # two batch shapes
  assert len(list(cache_dir.glob("*.shapes"))) == 1  # the parameters' shapes
  _never_trace(monkeypatch)
  monkeypatch.setattr(model_lib, "init_params", lambda *a: pytest.fail("the model was traced"))
  monkeypatch.setattr(decoders_lib.Decoders, "_logits_kernel_program",
                      lambda self: pytest.fail("the output projection was traced"))
  second, stats = _translate(method="beam")
  assert second == first and stats["decoders_loaded"] == 2
  assert sorted(cache_dir.iterdir()) == stored


def test_a_new_translator_loads_the_scorers_and_scores_the_same(cache_dir, monkeypatch):
  """`Translator.score`'s programs are kept as the decoders are: a second
  Translator traces none of them."""
  targets = ["eine rote Katze", "dreihundertzwei blaue Vögel und sieben grüne Frösche", "",
             "eine Katze"]

  def score():
    translator = loader.load_translator(str(FIXTURE_WORKDIR))
    scores = translator.score(SENTENCES, targets, batch_size=2, alignment=True)
    return scores, translator.last_stats

  first, stats = score()
  assert stats["decoders_loaded"] == 0 and len(list(cache_dir.glob("*.bin"))) == 2
  monkeypatch.setattr(decoders_lib.Decoders, "score_program",
                      lambda self, alignment: pytest.fail("a scorer was traced"))
  second, stats = score()
  assert second == first and stats["decoders_loaded"] == 2


def test_the_decoders_travel_with_the_workdir(cache_dir, tmp_path, monkeypatch):
  """A Translator loaded from a workdir also keeps its compiled decoders (and
  the parameter shapes and the logits kernel) in `<workdir>/compiled/`; a
  copy of the workdir on a machine whose cache is empty (another cache
  directory) loads them from there, traces nothing and translates the same;
  a decoder found only in the machine's cache is copied into a workdir that
  lacks it; with the cache off nothing is written there."""
  import shutil
  monkeypatch.setenv(executable_cache.MODEL_ENV, "on")
  workdir = tmp_path / "run"
  shutil.copytree(FIXTURE_WORKDIR, workdir)
  translator = loader.load_translator(str(workdir))
  translator.policy.share_buckets = False
  first = translator.translate(SENTENCES, batch_size=2, method="greedy")
  kept = sorted(p.name for p in (workdir / executable_cache.MODEL_SUBDIRECTORY).iterdir())
  assert sorted(p.name for p in cache_dir.iterdir()) == kept  # (the same keys)
  assert [name.rsplit(".", 1)[1] for name in kept].count("bin") == 2
  assert {name.rsplit(".", 1)[1] for name in kept} == {"bin", "shapes", "logits_kernel"}

  copy = tmp_path / "elsewhere"
  shutil.copytree(workdir, copy)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "empty_cache"))
  _never_trace(monkeypatch)
  monkeypatch.setattr(model_lib, "init_params", lambda *a: pytest.fail("the model was traced"))
  translator = loader.load_translator(str(copy))
  translator.policy.share_buckets = False
  assert translator.translate(SENTENCES, batch_size=2, method="greedy") == first
  assert translator.last_stats["decoders_loaded"] == 2

  # Found in the machine's cache only (the first one's): the workdir gets a copy.
  shutil.rmtree(copy / executable_cache.MODEL_SUBDIRECTORY)
  jax.config.update("jax_compilation_cache_dir", str(cache_dir.parent))
  translator = loader.load_translator(str(copy))
  translator.policy.share_buckets = False
  translator.translate(SENTENCES, batch_size=2, method="greedy")
  assert sorted(p.name for p in (copy / executable_cache.MODEL_SUBDIRECTORY).iterdir()) == kept
  # The cache off, or $TRANSFORMER_WORKDIR_DECODERS=off: the workdir is not written.
  shutil.rmtree(copy / executable_cache.MODEL_SUBDIRECTORY)
  monkeypatch.undo()
  monkeypatch.setenv(executable_cache.MODEL_ENV, "off")
  loader.load_translator(str(copy)).translate(SENTENCES[:1], method="greedy")
  monkeypatch.setenv(executable_cache.MODEL_ENV, "on")
  jax.config.update("jax_compilation_cache_dir", None)
  loader.load_translator(str(copy)).translate(SENTENCES[:1], method="greedy")
  assert not (copy / executable_cache.MODEL_SUBDIRECTORY).exists()


def _translate_workdir(workdir, **load_options):
  translator = loader.load_translator(str(workdir), **load_options)
  translator.policy.share_buckets = False
  out = translator.translate(SENTENCES, batch_size=2, method="greedy")
  return out, translator.last_stats


@pytest.fixture(scope="module")
def sealed_workdir(tmp_path_factory):
  """A copy of the fixture workdir whose compiled/ holds this machine's
  decoders, the parameters' shapes and the logits kernel (every suffix the
  cache writes), and its clean translations: made once per module."""
  import shutil
  names = ["jax_compilation_cache_dir", *CACHE_SETTINGS]
  old = {name: getattr(jax.config, name) for name in names}
  old_env = os.environ.get(executable_cache.MODEL_ENV)
  base = tmp_path_factory.mktemp("sealed")
  jax.config.update("jax_compilation_cache_dir", str(base / "cache"))
  for name, value in CACHE_SETTINGS.items():
    jax.config.update(name, value)
  cc.reset_cache()
  os.environ[executable_cache.MODEL_ENV] = "on"
  try:
    workdir = base / "run"
    shutil.copytree(FIXTURE_WORKDIR, workdir)
    clean, _ = _translate_workdir(workdir)
  finally:
    os.environ.pop(executable_cache.MODEL_ENV)
    if old_env is not None:
      os.environ[executable_cache.MODEL_ENV] = old_env
    for name, value in old.items():
      jax.config.update(name, value)
    cc.reset_cache()
  compiled = workdir / executable_cache.MODEL_SUBDIRECTORY
  assert {p.suffix for p in compiled.iterdir()} == {".bin", ".shapes", ".logits_kernel"}
  return workdir, clean


@pytest.fixture
def received_workdir(sealed_workdir, cache_dir, tmp_path, monkeypatch):
  """A copy of `sealed_workdir` on a machine with an empty cache (another
  cache directory) where nothing has been refused yet; its clean translations."""
  import shutil
  workdir = tmp_path / "received"
  shutil.copytree(sealed_workdir[0], workdir)
  monkeypatch.setenv(executable_cache.MODEL_ENV, "on")
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "empty_cache"))
  monkeypatch.setattr(executable_cache, "_refused_in", set())
  return workdir, sealed_workdir[1]


@pytest.mark.parametrize("kind", helpers.HOSTILE_KINDS)
def test_a_received_workdir_runs_nothing_it_carries(received_workdir, tmp_path, caplog, kind):
  """Issue 59: every file of compiled/ replaced by a pickle that runs a shell
  command, by that pickle sealed under another key, by half of itself or by
  random bytes: nothing is unpickled (the command never ran), one line names
  the workdir, the translations are the clean workdir's, and what was
  compiled afresh is stored sealed with this machine's key (the next load
  loads it all)."""
  from transformer.runtime import signing
  workdir, clean = received_workdir
  compiled = workdir / executable_cache.MODEL_SUBDIRECTORY
  marker = tmp_path / "the planted command ran"
  names = helpers.plant_hostile_files(compiled, kind, marker)
  with caplog.at_level(logging.WARNING):
    got, stats = _translate_workdir(workdir)
  assert not marker.exists()
  assert got == clean and stats["decoders_loaded"] == 0
  said = [r.getMessage() for r in caplog.records if "cannot prove" in r.getMessage()]
  assert len(said) == 1 and str(workdir) in said[0] and "\n" not in said[0], caplog.text
  assert sorted(p.name for p in compiled.iterdir()) == names
  for name in names:
    signing.unseal(name, (compiled / name).read_bytes())  # (raises if not sealed here)
  again, stats = _translate_workdir(workdir)
  assert again == clean and stats["decoders_loaded"] == 2


@pytest.fixture
def machine_b(received_workdir, tmp_path, monkeypatch):
  """The received workdir on machine B: another signing key (made on first
  use) and an empty cache. The workdir was compiled on machine A, this
  process's own key (conftest.py): returns A's key file, what a user names
  with --trust_compiled."""
  from transformer.runtime import signing
  a_key = signing.key_path()
  assert a_key.is_file()  # (the sealed workdir was compiled under it)
  monkeypatch.setenv(signing.ENV, str(tmp_path / "machine_b" / "signing.key"))
  return a_key


def _recording_trust(monkeypatch) -> list[int]:
  """How many files each `executable_cache.trust` sealed anew, in a list."""
  counts, trust = [], executable_cache.trust

  def recording(*args, **kwargs):
    counts.append(trust(*args, **kwargs))
    return counts[-1]
  monkeypatch.setattr(executable_cache, "trust", recording)
  return counts


def test_trust_compiled_adopts_what_the_named_key_sealed(received_workdir, machine_b, tmp_path,
                                                         monkeypatch):
  """Issue 68: a copy of one's own workdir compiled on machine A, on machine B
  (another key, an empty cache): compiled afresh by default; with
  trust_compiled=A's key file, or a keyring that holds it among others, its
  files are sealed anew with B's key and loaded, tracing nothing; later
  loads need no flag; naming B's own key reseals nothing."""
  import shutil
  from transformer.runtime import signing
  workdir, clean = received_workdir
  a_key = machine_b
  compiled = workdir / executable_cache.MODEL_SUBDIRECTORY
  names = sorted(p.name for p in compiled.iterdir())
  copies = {name: tmp_path / name for name in ("untrusted", "keyring")}
  for copy in copies.values():
    shutil.copytree(workdir, copy)
  _, stats = _translate_workdir(copies["untrusted"])
  assert stats["decoders_loaded"] == 0

  counts = _recording_trust(monkeypatch)
  _never_trace(monkeypatch)
  monkeypatch.setattr(model_lib, "init_params", lambda *a: pytest.fail("the model was traced"))
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "another_empty_cache"))
  got, stats = _translate_workdir(workdir, trust_compiled=str(a_key))
  assert got == clean and stats["decoders_loaded"] == 2 and counts == [len(names)]
  for name in names:  # (sealed with B's key now: raises if not)
    signing.unseal(name, (compiled / name).read_bytes())
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "a_third_empty_cache"))
  got, stats = _translate_workdir(workdir)  # (no flag: sealed here now)
  assert got == clean and stats["decoders_loaded"] == 2

  keyring = tmp_path / "keyring_dir"
  keyring.mkdir()
  for machine in ("laptop", "server"):
    (keyring / f"{machine}.key").write_bytes(os.urandom(signing.KEY_BYTES))
  shutil.copy(a_key, keyring / "colab.key")
  for path in keyring.iterdir():
    path.chmod(0o600)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "a_fourth_empty_cache"))
  got, stats = _translate_workdir(copies["keyring"], trust_compiled=keyring)
  assert got == clean and stats["decoders_loaded"] == 2 and counts[-1] == len(names)

  got, stats = _translate_workdir(workdir, trust_compiled=signing.key_path())  # (B's own)
  assert got == clean and stats["decoders_loaded"] == 2 and counts[-1] == 0


@pytest.mark.parametrize("kind", ["a forged seal", "a third key's seal", "pickle"])
def test_trust_compiled_reseals_nothing_the_named_key_did_not_seal(received_workdir, machine_b,
                                                                   tmp_path, monkeypatch,
                                                                   caplog, kind):
  """Issue 68's attack: every file of compiled/ made MAGIC + 32 zero bytes + a
  pickle that runs a shell command (or that pickle sealed under a third key
  C, or the bare pickle), decoded with trust_compiled=A's key: nothing is
  sealed anew, the command never runs, one line names the workdir, the
  translations are the clean workdir's."""
  from transformer.runtime import signing
  workdir, clean = received_workdir
  compiled = workdir / executable_cache.MODEL_SUBDIRECTORY
  marker = tmp_path / "the planted command ran"
  c_key = os.urandom(signing.KEY_BYTES)
  for path in compiled.iterdir():
    payload = helpers.hostile_pickle(marker)
    tag = {"a forged seal": bytes(signing.TAG_BYTES), "pickle": None,
           "a third key's seal": signing._tag(c_key, path.name, payload)}[kind]
    path.write_bytes(payload if tag is None else signing.MAGIC + tag + payload)
  counts = _recording_trust(monkeypatch)
  with caplog.at_level(logging.WARNING):
    got, stats = _translate_workdir(workdir, trust_compiled=str(machine_b))
  assert not marker.exists() and counts == [0]
  assert got == clean and stats["decoders_loaded"] == 0
  said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(said) == 1 and str(workdir) in said[0] and "\n" not in said[0], caplog.text
  assert "--trust_compiled=<that machine's signing.key>" in said[0]


def test_trust_compiled_names_a_key_never_a_switch(tmp_path):
  """The old switch (True) trusted any file that looked sealed: refused with
  a sentence saying what to name; off is None, False or ""; a path that
  holds no key is refused before anything is loaded."""
  from transformer.runtime import errors
  with pytest.raises(errors.OptionError, match="name the key file .* whose seals you trust"):
    loader.load_translator(str(FIXTURE_WORKDIR), trust_compiled=True)
  assert loader.trusted_keys(None) == loader.trusted_keys(False) == loader.trusted_keys("") == []
  os.mkfifo(tmp_path / "fifo.key")
  with pytest.raises(errors.OptionError, match="not a regular file"):
    loader.load_translator(str(tmp_path / "no workdir here"),
                           trust_compiled=tmp_path / "fifo.key")


def test_a_planted_link_or_fifo_is_not_followed(received_workdir, tmp_path):
  """compiled/ entries that are not regular files (a link to a file of this
  machine, a FIFO that would block a read) are neither read nor loaded."""
  workdir, clean = received_workdir
  compiled = workdir / executable_cache.MODEL_SUBDIRECTORY
  outside = tmp_path / "outside"
  outside.write_bytes(b"a file elsewhere")
  for i, path in enumerate(sorted(compiled.iterdir())):
    path.unlink()
    if i % 2:
      path.symlink_to(outside)
    else:
      os.mkfifo(path)
  got, stats = _translate_workdir(workdir)
  assert got == clean and stats["decoders_loaded"] == 0
  assert outside.read_bytes() == b"a file elsewhere"


def test_training_leaves_the_first_decode_warm(cache_dir, tmp_path, monkeypatch):
  """Training's test translation plans as decode.py does and keeps its
  decoders, the parameters' shapes and the logits kernel in
  `<workdir>/compiled/`: the first decode.py of the test sources after it, on
  a machine whose cache is empty (another cache directory), loads every
  decoder, traces nothing, and writes the report's translations (at the
  length penalty the run chose on validation, its decoding.json)."""
  import train_worker
  from transformer.data import sources
  from transformer.decoding import command
  from transformer.training import loop as training
  monkeypatch.setenv(executable_cache.MODEL_ENV, "on")
  workdir = tmp_path / "run"
  config = train_worker.tiny_config(dict(num_train_steps=20, eval_every=20,
                                         checkpoint_every=20, test_report=True,
                                         num_bleu_examples=8,
                                         length_penalty_candidates=(0.6, 1.0)))
  training.train_and_evaluate(config, str(workdir), quiet=True)
  # The length penalty chosen on validation: the test's, and decode.py's below.
  record = json.loads((workdir / "decoding.json").read_text())
  assert record["length_penalty"] in (0.6, 1.0) and set(record["validation"]) == {"0.6", "1"}
  compiled = workdir / executable_cache.MODEL_SUBDIRECTORY
  assert {p.suffix for p in compiled.iterdir()} == {".bin", ".shapes", ".logits_kernel"}

  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "empty_cache"))
  _never_trace(monkeypatch)
  monkeypatch.setattr(model_lib, "init_params", lambda *a: pytest.fail("the model was traced"))
  loads = []  # (whether each decoder and the logits kernel was loaded)
  load_or_compile = executable_cache.load_or_compile

  def recording(*args, **kwargs):
    value, loaded = load_or_compile(*args, **kwargs)
    loads.append(loaded)
    return value, loaded
  monkeypatch.setattr(executable_cache, "load_or_compile", recording)
  source = tmp_path / "test.src"
  source.write_text("".join(s + "\n" for s, _ in sources.load_split(config.data, "test")))
  command.decode(command.Request(workdir=str(workdir), input_path=str(source),
                                 output_path=str(tmp_path / "out.txt"), quiet=True))
  assert loads and all(loads)  # (every decoder and the logits kernel: loaded)
  assert (tmp_path / "out.txt").read_text() == (workdir / "test_translations.txt").read_text()


def test_decoders_are_prepared_side_by_side_and_translate_the_same(monkeypatch):
  """The decoders one call needs (here two batch shapes) are compiled in
  threads of their own, one per core (`Decoders.prepare_all`); with one
  core, one after the other: the same translations."""
  import threading
  threads = []
  prepare = decoders_lib.Decoders.prepare

  def recording(self, shape, inputs):
    threads.append(threading.current_thread().name)
    return prepare(self, shape, inputs)

  monkeypatch.setattr(decoders_lib.Decoders, "prepare", recording)
  monkeypatch.setattr(decoders_lib, "available_cores", lambda: 2)
  side_by_side, _ = _translate(method="greedy")
  assert len(threads) == 2 and all(name.startswith("compile") for name in threads)
  threads.clear()
  monkeypatch.setattr(decoders_lib, "available_cores", lambda: 1)
  one_by_one, _ = _translate(method="greedy")
  assert threads == [threading.main_thread().name] * 2
  assert one_by_one == side_by_side


@pytest.mark.slow  # (15-25 s on 2 cores: `python -m pytest -m slow`)
def test_other_code_or_options_are_other_decoders(cache_dir, monkeypatch):
  _translate(method="greedy")
  stored = set(cache_dir.glob("*.bin"))
  _, stats = _translate(method="greedy", max_len=20)  # another program
  assert stats["decoders_loaded"] == 0 and len(set(cache_dir.glob("*.bin")) - stored) == 2
  monkeypatch.setattr(executable_cache, "source_hash", lambda: "the code changed")
  _, stats = _translate(method="greedy")
  assert stats["decoders_loaded"] == 0


def test_a_decoder_is_kept_under_the_jax_and_jaxlib_that_compiled_it(monkeypatch):
  """A serialized executable promises nothing to another JAX (the pin allows
  0.10 through 0.12): its file name changes with either version, so a workdir
  compiled under one is compiled again, once, under another, never loaded."""
  import jaxlib
  parts = {"decoder": "greedy", "shapes": "(8, 16)"}
  here = executable_cache.key(parts)
  assert executable_cache.key(dict(parts)) == here  # (the same process: the same name)
  monkeypatch.setattr(jaxlib, "__version__", "0.12.0.1" if jaxlib.__version__ != "0.12.0.1"
                      else "0.10.2")
  other_jaxlib = executable_cache.key(parts)
  monkeypatch.undo()
  monkeypatch.setattr(jax, "__version__", "0.11.2")
  other_jax = executable_cache.key(parts)
  assert len({here, other_jaxlib, other_jax}) == 3


def test_a_file_that_does_not_load_is_compiled_again(cache_dir, caplog):
  """... and kept again whole, although JAX's persistent cache now holds the
  program (a decoder read from there would not serialize whole)."""
  first, _ = _translate(method="greedy")
  for path in cache_dir.glob("*.bin"):
    path.write_bytes(path.read_bytes()[:100])  # truncated
  hits = executable_cache._persistent_cache_hits
  with caplog.at_level(logging.WARNING):
    second, stats = _translate(method="greedy")
  assert second == first and stats["decoders_loaded"] == 0
  assert "cannot prove it wrote" in caplog.text  # (a truncated file is not sealed whole)
  assert executable_cache._persistent_cache_hits > hits  # (the premise)
  third, stats = _translate(method="greedy")  # written again, whole: it runs
  assert third == first and stats["decoders_loaded"] == 2


def test_off_with_the_compilation_cache():
  assert not jax.config.jax_compilation_cache_dir  # (tests run with it off: conftest.py)
  assert executable_cache.directory() is None
  compiled, loaded = executable_cache.load_or_compile({}, lambda: "compiled")
  assert (compiled, loaded) == ("compiled", False)
  shapes = executable_cache.load_or_eval_shape({}, lambda: jax.numpy.zeros((2, 3)))
  assert shapes.shape == (2, 3)


def test_shapes_are_traced_once_and_equal_eval_shape(cache_dir, caplog):
  """load_or_eval_shape: jax.eval_shape's tree (structure, shapes, dtypes),
  traced at the first call only; another key traces again; a file that does
  not load is traced again and replaced."""
  import jax.numpy as jnp
  calls = []

  def fn(x):
    calls.append(1)
    return {"w": jnp.zeros((x.shape[0], 3), jnp.bfloat16), "b": [x.sum(), x[:2]]}

  x = jnp.ones((5,), jnp.float32)
  want = jax.eval_shape(fn, x)
  calls.clear()
  fresh = lambda: functools.partial(fn)  # (a new function: JAX keeps traces per function)
  for _ in range(2):
    got = executable_cache.load_or_eval_shape({"model": "a"}, fresh(), x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [(l.shape, l.dtype) for l in jax.tree.leaves(got)] == [
        (l.shape, l.dtype) for l in jax.tree.leaves(want)]
  assert len(calls) == 1
  executable_cache.load_or_eval_shape({"model": "b"}, fresh(), x)
  assert len(calls) == 2
  for path in cache_dir.glob("*.shapes"):
    path.write_bytes(path.read_bytes()[:10])
  with caplog.at_level(logging.WARNING):
    got = executable_cache.load_or_eval_shape({"model": "a"}, fresh(), x)
  assert "cannot prove it wrote" in caplog.text and len(calls) == 3
  assert jax.tree.structure(got) == jax.tree.structure(want)


def test_a_start_that_finds_everything_on_disk_traces_nothing(tmp_path):
  """In processes of their own (this one has imported flax already): the
  first load of a Translator traces the model (flax imported), the second
  finds the parameters' shapes, the output projection's program and the
  decoder on disk, so it never imports flax (nor orbax: the parameters come
  from their serving copy), and translates the same."""
  script = "\n".join([
      "import collections, shutil, sys",
      # A disk with room for the serving copy, whatever the machine's has free
      # (a nearly full disk keeps none, by design: serving_params._room_for).
      "usage = collections.namedtuple('usage', 'total used free')",
      "shutil.disk_usage = lambda path: usage(100 << 30, 50 << 30, 50 << 30)",
      "from transformer.runtime import compile_cache",
      f"compile_cache.enable({str(tmp_path / 'cache')!r})",
      "from transformer.decoding import loader",
      f"translator = loader.load_translator({str(FIXTURE_WORKDIR)!r})",
      "print(translator.translate(['one red cat'], method='greedy')[0])",
      "print(translator.last_stats['decoders_loaded'], 'flax' in sys.modules,",
      "      'orbax.checkpoint' in sys.modules)",
  ])
  runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300) for _ in range(2)]
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  (first_text, first_state), (second_text, second_state) = (
      run.stdout.strip().splitlines()[-2:] for run in runs)
  assert first_state == "0 True True"  # traced and restored: nothing on disk yet
  # Its one decoder loaded, flax never imported, nor orbax (the parameters
  # read from their serving copy: serving_params.py).
  assert second_state == "1 False False"
  assert second_text == first_text
  assert sorted(p.suffix for p in (tmp_path / "cache" / "decoders").iterdir()) == [
      ".bin", ".logits_kernel", ".shapes"]


def test_the_least_recently_used_files_go_beyond_max_bytes(cache_dir, monkeypatch):
  """Each new file removes the least recently used files beyond MAX_BYTES
  (by modification time; a load touches its file), never itself, and only
  files named as the cache names them: a file of any other name stays,
  however old (the directory may be one a received workdir planted)."""
  import jax.numpy as jnp
  used = executable_cache.load_or_eval_shape({"f": "used"}, lambda: jnp.zeros(3))
  (path_used,) = cache_dir.glob("*.shapes")
  old = {}
  for age in (1, 2, 3):  # three stale files of 1,000 bytes, 100-300 s old
    old[age] = cache_dir / f"{age:032x}.bin"
    old[age].write_bytes(b"x" * 1000)
    os.utime(old[age], (time.time() - 100 * age,) * 2)
  foreign = cache_dir / "holiday_photos.bin"  # the oldest, not the cache's
  foreign.write_bytes(b"y" * 1000)
  os.utime(foreign, (time.time() - 5000,) * 2)
  os.utime(path_used, (time.time() - 1000,) * 2)  # the oldest of all ...
  assert executable_cache.load_or_eval_shape({"f": "used"}, lambda: 1 / 0) == used  # ... used now
  sizes = {p.name: p.stat().st_size for p in cache_dir.iterdir() if p != foreign}
  monkeypatch.setattr(executable_cache, "MAX_BYTES", sum(sizes.values()) - 1500)
  executable_cache.load_or_eval_shape({"f": "new"}, lambda: jnp.zeros(4))
  left = {p.name for p in cache_dir.iterdir()}
  # The new file pushed the total over by 1,500 bytes + its own size: the
  # oldest stale files go first, the recently used one and the new one stay.
  new = [name for name in left if name.endswith(".shapes") and name != path_used.name]
  assert path_used.name in left and len(new) == 1
  assert not old[3].exists() and not old[2].exists()
  assert foreign.read_bytes() == b"y" * 1000
  assert (sum(p.stat().st_size for p in cache_dir.iterdir() if p != foreign)
          <= executable_cache.MAX_BYTES)


def test_a_read_only_cache_still_loads(cache_dir, monkeypatch):
  """Marking a loaded file used may fail (a cache shared read-only): the
  file is loaded all the same, not made again."""
  import jax.numpy as jnp
  shapes = executable_cache.load_or_eval_shape({"f": "ro"}, lambda: jnp.zeros(5))

  def refuse(*args, **kwargs):
    raise PermissionError("read-only file system")
  monkeypatch.setattr(executable_cache.os, "utime", refuse)
  assert executable_cache.load_or_eval_shape({"f": "ro"}, lambda: 1 / 0) == shapes


@pytest.mark.parametrize("line,flags", [
    ("flags\t\t: fpu sse2 avx512f avx512_bf16", {"fpu", "sse2", "avx512f", "avx512_bf16"}),
    ("Features\t: fp asimd bf16", {"fp", "asimd", "bf16"}),   # (aarch64)
    ("", set()),                                             # (no /proc/cpuinfo)
])
def test_host_cpu_flags_are_the_words_of_cpuinfos_flags_line(monkeypatch, line, flags):
  monkeypatch.setattr(executable_cache, "_cpu_flags_line", lambda: line)
  assert executable_cache.host_cpu_flags() == flags
