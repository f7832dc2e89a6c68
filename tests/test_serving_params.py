"""The serving copy (transformer/decoding/serving_params.py): a second load of a
workdir reads the parameters and the checkpoint choice an earlier load kept,
exactly what orbax restores, without orbax; any change to the checkpoints
(a new average, a touched file) sends the load back to orbax."""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from etils import epath
from jax.experimental.compilation_cache import compilation_cache as cc

from helpers import CACHE_SETTINGS
from transformer.decoding import executable_cache, loader, serving_params
from transformer.model import init_params
from transformer.runtime import averaging, workdir as workdir_lib

# JAX's compilation cache off unless a test gives one of its own, and the
# decoders kept whenever it is on, as in a user's process (conftest.py).
pytestmark = pytest.mark.usefixtures("caches_of_their_own")

FIXTURE_WORKDIR = Path(__file__).resolve().parent / "fixtures" / "workdir_d26a6fb"
DiskUsage = collections.namedtuple("DiskUsage", "total used free")  # shutil.disk_usage's


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """A compilation cache of this test's own, on a disk with room for a copy
  (whatever the machine's disk has free: a nearly full one keeps no copy, by
  design); restored after."""
  monkeypatch.setattr(serving_params.shutil, "disk_usage",
                      lambda path: DiskUsage(100 << 30, 50 << 30, 50 << 30))
  names = ["jax_compilation_cache_dir", *CACHE_SETTINGS]
  old = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  cc.reset_cache()
  yield tmp_path / "cache" / serving_params.SUBDIRECTORY
  for name, value in old.items():
    jax.config.update(name, value)
  cc.reset_cache()


@pytest.fixture
def workdir(tmp_path):
  """A copy of the fixture workdir (its checkpoints are changed here)."""
  path = tmp_path / "run"
  shutil.copytree(FIXTURE_WORKDIR, path)
  return str(path)


@pytest.fixture
def restores(monkeypatch):
  """The list of checkpoints restored with orbax (`averaging.load_params`)."""
  calls = []
  original = averaging.load_params

  def counted(workdir, target, which="auto", **kwargs):
    calls.append(which)
    return original(workdir, target, which=which, **kwargs)
  monkeypatch.setattr(averaging, "load_params", counted)
  return calls


def orbax_params(workdir):
  """The averaged parameters as orbax restores them, as numpy arrays."""
  config = workdir_lib.load_model_config(workdir)
  target = jax.eval_shape(lambda rng: init_params(config, rng), jax.random.key(0))
  return jax.tree.map(np.asarray, averaging.load_params(workdir, target, which="averaged"))


def assert_same_arrays(got, expected):
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), b)


def test_a_second_load_reads_the_copy_not_orbax(cache, workdir, restores):
  expected = orbax_params(workdir)
  restores.clear()
  first, first_info = loader.load_translator(workdir, with_info=True)
  assert restores == ["averaged"]
  assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".npz"]
  second, second_info = loader.load_translator(workdir, with_info=True)
  assert restores == ["averaged"]  # no second restore
  assert second_info == first_info == {"kind": "averaged", "step": 600,
                                       "path": os.path.join(workdir, "checkpoints_averaged",
                                                            "600"),
                                       "averaged_steps": first_info["averaged_steps"]}
  assert_same_arrays(first.params, expected)
  assert_same_arrays(second.params, expected)
  assert second.translate(["one red cat"]) == first.translate(["one red cat"])


def test_a_new_average_is_restored_with_orbax(cache, workdir, restores):
  loader.load_translator(workdir)
  doubled = jax.tree.map(lambda x: 2 * x, orbax_params(workdir))
  averaging.save_averaged(workdir, doubled, steps=[650, 700])  # replaces step 600's
  restores.clear()
  assert serving_params.resolve(workdir, "auto") == ("averaged", None)
  translator, info = loader.load_translator(workdir, with_info=True)
  assert restores == ["averaged"] and info["step"] == 700
  assert_same_arrays(translator.params, doubled)
  translator = loader.load_translator(workdir)  # and kept for the next load
  assert restores == ["averaged"]
  assert_same_arrays(translator.params, doubled)


def test_any_touched_checkpoint_file_sends_the_load_back_to_orbax(cache, workdir, restores):
  loader.load_translator(workdir)
  params_dir = Path(workdir) / "checkpoints_averaged" / "600" / "params"
  some_file = next(p for p in sorted(params_dir.rglob("*")) if p.is_file())
  stat = some_file.stat()
  os.utime(some_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # same size, newer
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"]
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"]


def _keep_times(path: Path, edit) -> None:
  """`edit(path)`, then `path`'s access and modification times as they were
  (what `tar` and `cp -p` do)."""
  stat = path.stat()
  edit(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_model_swapped_under_the_same_sizes_and_times_is_restored(cache, workdir,
                                                                    restores):
  """Another model unpacked over the same path keeps names, sizes and
  modification times (`tar`, `cp -p`); the copy is not served for it: the
  fingerprint holds what no copy keeps (inode, device, change time)."""
  averaged = Path(workdir) / "checkpoints_averaged"
  loader.load_translator(workdir)
  assert restores == ["averaged"]
  # Unpacked anew over the same path: every file and folder with its times.
  unpacked = Path(workdir).parent / "unpacked"
  shutil.copytree(averaged, unpacked, copy_function=shutil.copy2)
  shutil.rmtree(averaged)
  shutil.copytree(unpacked, averaged, copy_function=shutil.copy2)
  for source in [unpacked, *sorted(unpacked.rglob("*"))]:  # (folders' times too)
    stat = source.stat()
    os.utime(averaged / source.relative_to(unpacked), ns=(stat.st_atime_ns, stat.st_mtime_ns))
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"]
  # One file's bytes changed in place, its size and times kept.
  record = averaged / "600" / "commit_success.txt"
  _keep_times(record, lambda p: p.write_bytes(p.read_bytes()[::-1]))
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged", "averaged"]
  loader.load_translator(workdir)  # (and the copy made then serves the next load)
  assert restores == ["averaged", "averaged", "averaged"]


def test_a_link_or_fifo_in_a_checkpoint_folder_is_refused(cache, workdir, tmp_path):
  """The fingerprint's walk is the checkpoint folders' check: a link (even
  one inside the workdir) or a FIFO there is one sentence, and nothing is
  served or restored."""
  params = Path(workdir) / "checkpoints_averaged" / "600" / "params"
  (params / "extra").symlink_to(params / "manifest.ocdbt")
  with pytest.raises(ValueError, match="is a link to .*checkpoints hold none"):
    loader.load_translator(workdir)
  (params / "extra").unlink()
  os.mkfifo(params / "extra")
  with pytest.raises(ValueError, match="is a FIFO"):
    serving_params.fingerprint(workdir)


def test_the_recorded_choice_follows_the_checkpoints(cache, workdir):
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):  # no training steps
    serving_params.resolve(workdir, "latest")
  assert serving_params.resolve(workdir, "auto") == ("averaged", None)
  shutil.rmtree(Path(workdir) / "checkpoints_averaged")
  with pytest.raises(workdir_lib.CheckpointNotFound):
    serving_params.resolve(workdir, "averaged")
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):  # not the record's answer
    serving_params.resolve(workdir, "auto")


def test_a_file_that_does_not_read_is_restored_and_written_again(cache, workdir, restores,
                                                                 caplog):
  expected = orbax_params(workdir)
  restores.clear()
  loader.load_translator(workdir)
  copy = next(cache.glob("*.npz"))
  copy.write_bytes(copy.read_bytes()[:1000])
  with caplog.at_level(logging.WARNING):
    translator = loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"] and "did not load" in caplog.text
  assert_same_arrays(translator.params, expected)
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"]  # the copy written again


def test_bfloat16_and_other_dtypes_come_back_as_they_went(cache, tmp_path):
  workdir = str(tmp_path / "any")
  os.makedirs(os.path.join(workdir, "checkpoints_averaged", "1"))
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
            "b": np.arange(4, dtype=np.int32), "s": np.float32(1.5)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  made = []

  def restore():
    made.append(1)
    return params, {"kind": "averaged"}
  model = workdir_lib.Workdir(path=epath.Path(workdir), model_config=None, vocab_path="",
                              checkpoint="averaged", checkpoint_note=None, imported=None)
  serving_params.load(model, target, restore)
  got, info = serving_params.load(model, target, restore)
  assert made == [1] and info == {"kind": "averaged"}
  assert_same_arrays(got, jax.tree.map(np.asarray, params))
  other = dict(target, b=jax.ShapeDtypeStruct((5,), np.int32))  # another model: not this copy
  serving_params.load(model, other, restore)
  assert made == [1, 1]


def test_off_with_the_compilation_cache(workdir, restores):
  assert executable_cache.directory() is None  # (tests run with the cache off)
  loader.load_translator(workdir)
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"]


def test_the_copies_of_removed_workdirs_are_removed(cache, workdir, tmp_path):
  other = str(tmp_path / "other")
  shutil.copytree(workdir, other)
  loader.load_translator(workdir)
  loader.load_translator(other)
  assert len(list(cache.glob("*.npz"))) == len(list(cache.glob("*.json"))) == 2
  shutil.rmtree(other)
  loader.load_translator(workdir)  # nothing written: the copies stay
  assert len(list(cache.glob("*.npz"))) == 2
  os.utime(Path(workdir) / "checkpoints_averaged" / "600" / "commit_success.txt")
  loader.load_translator(workdir)  # restored and written anew: the other's pair goes
  assert [p.suffix for p in sorted(cache.iterdir())] == [".json", ".npz"]
  kept = json.loads(next(cache.glob("*.json")).read_text())
  assert kept["workdir"] == workdir


@pytest.mark.parametrize("bound", ["bytes", "copies"])
def test_no_copy_that_would_nearly_fill_the_disk(cache, workdir, restores, monkeypatch, bound):
  """A copy is kept only where it leaves MIN_FREE_BYTES and MIN_FREE_COPIES
  times its size free: each bound tested at its edge, where it is the larger."""
  total = 100 << 30
  size = sum(np.asarray(x).nbytes for x in jax.tree.leaves(orbax_params(workdir)))
  if bound == "copies":  # (the fixture's model is small: 1 GiB would be the larger)
    monkeypatch.setattr(serving_params, "MIN_FREE_BYTES", 1)
    needed = 4 * size
  else:
    needed = 1 << 30
  restores.clear()
  free = size + needed - 1  # one byte short
  monkeypatch.setattr(serving_params.shutil, "disk_usage",
                      lambda path: DiskUsage(total, total - free, free))
  loader.load_translator(workdir)
  loader.load_translator(workdir)
  assert restores == ["averaged", "averaged"] and not list(cache.glob("*.npz"))
  free += 1  # exactly enough left: kept
  loader.load_translator(workdir)
  loader.load_translator(workdir)
  assert restores == ["averaged"] * 3 and len(list(cache.glob("*.npz"))) == 1
